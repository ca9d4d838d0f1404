"""What runs around the jobs: the reproduction plan (plan.py, plan.yaml, plan_cpu.yaml) and its
run (reproduce.py, with folder.py, sweeps.py, calibrate.py, state.py, estimate.py: the logic of
scripts/reproduce.py), and the replay of a divergence under probe=ranges (replay.py)."""
