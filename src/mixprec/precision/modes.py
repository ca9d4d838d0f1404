"""What a precision mode decides besides the policy's four decisions (policy.py): the packages it
needs installed, its dtypes, whether its fp16/bf16 arithmetic is emulated, the hazards its optimizer
meets, the TF32 flags and the notes on what a device cannot give it, the peak its math runs at
(MFU), the refusal to compile an emulated mode, and the notes a job says about it."""
from __future__ import annotations

import logging

import torch

from ..config import ConfigError, OptimizerConfig, PrecisionConfig, TrainerConfig
from ..runtime import hardware
from . import fp8, mxfp8

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The modes of conf/precision/ in the order tables and plots list them, each plot colour following
# its place (report/plots.py): fp32 first (the baseline), torch's modes, apex's opt levels, fp8, the
# articles' modes. A mode not named here is listed after them, by name, in a colour of its own.
MODES = ("fp32", "tf32", "amp", "amp_bf16", "half", "bf16", "o0", "o1", "o2", "o3", "fp8", "mxfp8",
         "fastai_fp16", "apex_fp16", "apex_fp16_2018")


def check_installed(cfg: PrecisionConfig) -> None:
    """What the mode needs from this installation, asked before any work (config.validate checks
    the values, which need no package): precision=fp8's torchao (mxfp8's, its MXFP8 layers). A
    missing one: one ConfigError line saying what to install."""
    if cfg.fp8_recipe == "mxfp8":
        mxfp8.require_torchao()
    elif cfg.fp8_recipe is not None:
        fp8.require_torchao()


def low_dtype(cfg: PrecisionConfig) -> str | None:
    """The mode's fp16/bf16 dtype (its autocast dtype, else its weights'), None for fp32 and
    tf32."""
    return cfg.autocast_dtype or (cfg.param_dtype if cfg.param_dtype != "float32" else None)


def emulates(cfg: PrecisionConfig, device: torch.device, sharded: bool = False) -> bool:
    """Whether the job's fp16/bf16 arithmetic is emulated on fp32 kernels (precision.emulate; auto:
    wherever the device is not CUDA, whose kernels the emulation reproduces). Under precision=fp8 it
    is the bf16 part that is emulated; the float8 matmuls are torchao's (its own emulation without
    FP8 tensor cores). Never under FSDP (sharded): its casts make real fp16/bf16 tensors
    (precision/fsdp.py)."""
    if low_dtype(cfg) is None or sharded:
        return False
    return device.type != "cuda" if cfg.emulate == "auto" else bool(cfg.emulate)


def arithmetic(cfg: PrecisionConfig, device: torch.device, emulated: bool) -> str:
    """What the mode's arithmetic is on this device (summary["arithmetic"]): "emulated" (fp16/bf16
    rounding on fp32 kernels: emulates), "plain_fp32" (a mode whose only difference from fp32 is
    TF32, on a device without it: a CPU, a GPU that is not an NVIDIA one of compute capability 8.0
    or newer; its math is fp32's, so its time against fp32's is noise and no speed-up), else
    "native"."""
    if emulated:
        return "emulated"
    if cfg.tf32 and low_dtype(cfg) is None and cfg.fp8_recipe is None and not has_tf32(device):
        return "plain_fp32"
    return "native"


def has_tf32(device: torch.device) -> bool:
    """TF32 tensor cores: an NVIDIA GPU (CUDA, not ROCm) of compute capability 8.0 or newer."""
    cap = hardware.capability(device)
    return device.type == "cuda" and torch.version.hip is None and cap is not None and cap >= (8, 0)


def rounds_stochastically(stochastic_round: bool, dtype: torch.dtype) -> bool:
    """Whether optimizer.stochastic_round rounds this stepped tensor: torchao's rounding is from
    fp32 to bfloat16, so a weight of another dtype (an fp32 one) is stepped as torchao's AdamW
    steps it without (its _AdamBase.step's own test)."""
    return stochastic_round and dtype is torch.bfloat16


def resolve_impl(impl: str, on_cuda: bool) -> str:
    """optimizer.impl with auto resolved: fused when the stepped tensors are floating-point CUDA
    tensors."""
    return ("fused" if on_cuda else "foreach") if impl == "auto" else impl


def hazards(
    precision: PrecisionConfig, optimizer: OptimizerConfig, device_type: str = "cpu"
) -> list[str]:
    """Known ways a precision + optimizer combination breaks, found from the config before training.
    Adam's eps: foreach and for-loop Adam add it in the stepped dtype; fused Adam
    (optimizer.impl=fused, auto on CUDA) computes in fp32 and rounds once, so the hazard is not one
    there."""
    found = []
    stepped = "float32" if precision.master_weights else precision.param_dtype
    fused = resolve_impl(optimizer.impl, device_type == "cuda") == "fused"
    if optimizer.name in ("adam", "adamw") and stepped != "float32" and not fused:
        dt = DTYPES[stepped]
        if torch.tensor(optimizer.eps, dtype=dt).item() == 0.0:
            # the smallest subnormal: 2^-24 for fp16
            tiniest = torch.finfo(dt).tiny * torch.finfo(dt).eps
            found.append(
                f"optimizer.eps={optimizer.eps:g} rounds to 0 in {stepped} (smallest subnormal "
                f"{tiniest:.3g}): where Adam's second moment underflows to 0 its update is 0/0 = "
                f"NaN (foreach and for-loop Adam add eps in {stepped}; fused Adam computes in "
                "fp32); keep the optimizer state in fp32 (amp, o2) or raise eps (1e-4 works in "
                "fp16)"
            )
    return found


def configure(
    device: torch.device, trainer: TrainerConfig, precision: PrecisionConfig, seed: int
) -> list[str]:
    """The job's global flags (hardware.configure: seeds, determinism, cuDNN, the current device),
    then the precision's TF32 flags; returns (and says) the notes on what this device cannot
    honour (through logging: the job's train.log keeps them, ranks other than 0 stay quiet; a
    warning, so that a script without the job's logging set-up still shows them)."""
    notes = hardware.configure(device, trainer, seed)
    torch.backends.cuda.matmul.allow_tf32 = precision.tf32
    torch.backends.cudnn.allow_tf32 = precision.tf32
    if device.type != "cpu":
        notes += precision_notes(precision, hardware.capability(device))
    for note in notes:
        log.warning(f"mixprec: note: {note}")
    return notes


def precision_notes(precision: PrecisionConfig, cap: tuple[int, int] | None) -> list[str]:
    """What a pre-Ampere NVIDIA GPU (capability < 8.0) does not give this precision: no bf16 tensor
    cores (torch/cuda/__init__.py:244, is_bf16_supported: major >= 8, else emulation), no TF32."""
    if cap is None or cap >= (8, 0):
        return []
    notes = []
    if "bfloat16" in (precision.autocast_dtype, precision.param_dtype):
        notes.append(
            f"precision={precision.name}: bfloat16 has no tensor-core support below compute "
            f"capability 8.0 (this GPU: {cap[0]}.{cap[1]}); it runs emulated, slower than fp32: "
            "use amp (fp16) here"
        )
    if precision.tf32:
        notes.append(
            f"precision={precision.name}: TF32 needs compute capability 8.0 or newer (this GPU: "
            f"{cap[0]}.{cap[1]}): the math is plain fp32"
        )
    return notes


def peak_kind(precision: PrecisionConfig) -> str:
    """Which peak a precision's main math runs at: the tensor-core dtype, or fp32/tf32."""
    low = low_dtype(precision)
    if low == "float16":
        return "fp16"
    if low == "bfloat16":
        return "bf16"
    return "tf32" if precision.tf32 else "fp32"


def refuse_emulated_compile(precision: PrecisionConfig, compile_mode: str, emulated: bool) -> None:
    """Emulated fp16/bf16 runs eagerly (its tensors are a dispatch mode's): compiling it is
    refused."""
    if emulated and compile_mode != "none":
        raise ConfigError(
            f"trainer.compile={compile_mode}: emulated {low_dtype(precision)} (precision.emulate) "
            "runs eagerly; use trainer.compile=none, or precision.emulate=false for the native "
            "kernels"
        )


def say_notes(precision: PrecisionConfig, device: torch.device, emulated: bool) -> None:
    """The job's note on what its times mean in this mode: emulated, or a CPU's slow reference
    kernels."""
    low = low_dtype(precision)
    if emulated:
        log.info(
            f"mixprec: note: {low} emulated on fp32 kernels with CUDA's rounding and autocast "
            "policy (precision.emulate): its losses and accuracies are a GPU's, its timings are "
            "fp32 timings"
        )
    elif device.type == "cpu" and low in ("float16", "bfloat16"):
        log.info(
            f"mixprec: note: {low} on a CPU without native support (AVX512-FP16/AMX) runs "
            "PyTorch's slow reference kernels, often 10-50x slower than fp32: CPU timings say "
            "nothing about GPUs"
        )
