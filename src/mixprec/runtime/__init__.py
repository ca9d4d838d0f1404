"""The process a job runs in: the device and its flags (hardware.py), DDP ranks (dist.py), stop
signals (signals.py), the GPU busy meter (busy.py), logging (logs.py), the versions recorded
(versions.py), Hydra's resolvers for device defaults and job folder names (defaults.py, jobdirs.py),
and a monotone search (search.py)."""
