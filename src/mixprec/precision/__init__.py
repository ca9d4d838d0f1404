"""Precision: every line of a mode's behaviour. The policy a job trains under (policy.py: weights,
autocast, master weights, loss scale, and the primitives train/step.py calls where a mode decides),
what a mode decides besides (modes.py: its dtypes, emulation, hazards, TF32 flags, notes, the MFU
peak kind, the compile refusal), its checkpoint state (state.py), the fp16/bf16 emulation on fp32
kernels (emulation.py), float8 and MXFP8 Linear layers (fp8.py, mxfp8.py) and each mode as FSDP's
MixedPrecisionPolicy (fsdp.py)."""
