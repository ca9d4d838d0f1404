"""precision=fp8: torchao's float8 training (torchao.float8) on a model's Linear layers, the rest
under bf16 autocast.

convert() swaps each eligible nn.Linear for torchao's Float8Linear (convert_to_float8_training): its
weights stay fp32 parameters (the optimizer and model_fp32.pt see plain fp32 weights); each matmul
of forward and backward casts its operands to float8 with dynamic scales (the recipe: `tensorwise`,
one scale per tensor, e4m3 for inputs and weights, e5m2 for gradients; `rowwise`, one power-of-2
scale per row, e4m3 throughout), multiplies, and returns bf16. Left in bf16 (listed in the summary):
the output head when it is tied to the embedding (logits are the most range-hungry matmul;
torchtitan leaves `output` out by default), and any Linear with a dimension not divisible by 16,
which torch._scaled_mm cannot take.

Where the device has no FP8 tensor cores (a CPU; CUDA before compute capability 8.9) torchao's own
emulation runs instead (Float8LinearConfig.emulate): the same quantisation to float8 with the same
scales, then the dequantised operands multiplied in fp32 and the result rounded to bf16. The loss is
FP8's loss; the time is not an FP8 time, and the job says `fp8_emulated: true`. (torch 2.14's CPU
torch._scaled_mm does run Float8Linear's forward and backward without emulation, but as a reference
kernel that is slower still: docs/transformer_fp8.md.)
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ..config import ConfigError
from ..runtime.hardware import capability
from . import emulation, mxfp8

FP8_CAPABILITY = (8, 9)   # Ada / Hopper and later: FP8 tensor cores
FP8_INSTALL = 'pip install -e ".[fp8]"'


def require_torchao():
    """torchao.float8 and its Float8Linear (precision=fp8), or a ConfigError whose one line says
    what to install (modes.check_installed asks before any work)."""
    # torchao 0.18's import warns about an Enum registration
    quiet = logging.getLogger("torch.utils._pytree")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        # lazy: torchao is optional (the fp8 extra) and only precision=fp8 needs it
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise ConfigError(
            f"precision=fp8 needs torchao (float8 training), which is not importable here ({e}); "
            f"install it with: {FP8_INSTALL}"
        ) from None
    finally:
        quiet.setLevel(level)
    return float8, Float8Linear


def emulation_reason(device: torch.device) -> str | None:
    """Why this device cannot run FP8 matmuls natively, or None when it can."""
    # CUDA-only branch (docs/gpus.md): torchao's float8 matmuls are CUDA kernels
    if device.type != "cuda":
        return f"{device.type}: no FP8 tensor cores"
    major, minor = capability(device)
    if (major, minor) < FP8_CAPABILITY:
        return f"compute capability {major}.{minor} < 8.9: no FP8 tensor cores"
    return None


def convert(model: nn.Module, recipe: str, device: torch.device, fsdp: bool = False) -> dict:
    """Swap the model's eligible Linear layers for Float8Linear (MXFP8Linear for the mxfp8 recipe:
    mxfp8.convert) in place; returns what the summary records. fsdp (trainer.strategy=fsdp):
    FSDP2 all-gathers their weights in float8, cast with the scales precomputed after each
    optimizer step (precompute_scales); torchao has it for the tensorwise recipe only."""
    if recipe == "mxfp8":
        return mxfp8.convert(model, device)
    float8, Float8Linear = require_torchao()
    why = emulation_reason(device)
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(recipe),
        emulate=why is not None,
        # tokens per step need not be a multiple of 16
        pad_inner_dim=why is None,
        enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise",
    )
    kept = mxfp8.kept_in_bf16(model)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, name: name not in kept
    )
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    for name in converted:
        model.get_submodule(name).register_forward_pre_hook(_autocast_input)
    return {"recipe": recipe, "fp8_emulated": why is not None, "emulation_reason": why,
            "float8_layers": converted, "bf16_layers": kept,
            **({"fsdp_float8_all_gather": config.enable_fsdp_float8_all_gather} if fsdp else {})}


def inductor_options(recipe: str | None) -> dict:
    """What inductor is told wherever it compiles a float8 model of `recipe` (one process, DDP,
    FSDP's units): the rowwise and MXFP8 recipes with emulate_precision_casts, so that its fused
    kernels round the intermediate low-precision casts as eager does (torchtitan's float8
    converter sets it for rowwise, for pytorch/pytorch#150859; rowwise on the CPU: gradients 3.3e-2
    from eager without it, 0 with it, tests/unit/train/test_compile.py); nothing for the others."""
    return {"emulate_precision_casts": True} if recipe in ("rowwise", "mxfp8") else {}


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step under FSDP's FP8 all-gather: every float8 weight's scale for the
    next all-gather, computed at once for all of them (one all-reduce of their amaxes), as torchao
    intends (torchao.float8.precompute_float8_dynamic_scale_for_fsdp)."""
    float8, _ = require_torchao()
    float8.precompute_float8_dynamic_scale_for_fsdp(model)


def _autocast_input(module: nn.Module, args: tuple):
    """Float8Linear casts its input to the autocast dtype only under CUDA autocast (torchao 0.18);
    this does the same under any device's autocast, so that the emulation quantises the bf16
    activations a GPU would."""
    x, device = args[0], args[0].device.type
    dtype = emulation.autocast_dtype(device)   # the real autocast's, or the emulated one's
    if dtype is not None and x.is_floating_point():
        return (x.to(dtype), *args[1:])
    return None
