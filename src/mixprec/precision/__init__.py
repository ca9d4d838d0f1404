"""Precision: every line of a mode's behaviour. The policy a job trains under (policy.py: weights,
autocast, master weights, loss scale, the step's unscale/clip/step/update), what a mode decides
besides (modes.py: its dtypes, emulation, hazards, TF32 flags, notes, the MFU peak kind, the compile
refusal), its checkpoint state (state.py), the fp16/bf16 emulation on fp32 kernels (emulation.py)
and float8 Linear layers (fp8.py)."""
