"""What runs around the jobs: the reproduction plan (plan.py, plan.yaml, plan_cpu.yaml) and the
replay of a divergence under probe=ranges (replay.py)."""
