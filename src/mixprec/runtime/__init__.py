"""The process a job runs in: the device and its flags (hardware.py), the process group and its
ranks (dist.py), stop signals (signals.py), the GPU busy meter (busy.py), logging (logs.py), the
versions recorded (versions.py) and Hydra's resolvers for device defaults and job folder names
(defaults.py, jobdirs.py)."""
