"""What number formats do to training: the fp16/bf16 emulation at fp32 speed (emulation.py), FP8 through torchao
(fp8.py), and the numerics probe that measures ranges, underflow and overflow layer by layer (probe.py, with its
arithmetic in probe_stats.py)."""
