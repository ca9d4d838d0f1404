"""Training: the step on one screen (step.py), the loop every job runs (loop.py), the image and
language-model steps (image_steps.py, lm_steps.py), the one builder of model, policy and optimizer
(build.py), a job's parts (parts.py), prewarm and compilation before the clock (warmup.py,
compile.py), optimizers and schedules (optim.py), the tricks (tricks.py), checkpoints
(checkpoint.py), the model for several ranks (parallel.py: DDP replicas or FSDP2 shards) and the
replay of a divergence under probe=ranges (replay.py)."""
