"""What serves the scripts of scripts/, around the jobs: the reproduction plan (plan.py, plan.yaml,
plan_cpu.yaml) and its run (reproduce.py, with folder.py, sweeps.py, calibrate.py, state.py,
estimate.py: the logic of scripts/reproduce.py), what every script shares with train.py (cli.py: the
config composed from conf/, a user's mistake in one line), a monotone search (search.py:
max_batch.py's largest batch) and the evaluation of a finished job's saved weights (evaluate.py:
scripts/evaluate.py)."""
