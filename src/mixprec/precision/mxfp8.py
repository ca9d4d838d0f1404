"""precision=mxfp8: block-scaled FP8 (the OCP MX format that NVIDIA Blackwell's tensor cores run,
and torchtitan trains with there) through torchao's MXFP8 Linear layers, the rest under bf16
autocast.

convert() swaps each eligible nn.Linear for torchao's MXFP8Linear
(torchao.prototype.moe_training.mxfp8_linear, torchao 0.18; the recipe torchao calls mxfp8_rceil):
its weight stays an fp32 parameter; each of the three matmuls of forward and backward casts both
operands to MXFP8 along its reduction dimension: blocks of 32 elements, one shared power-of-two
scale per block (E8M0, 2^ceil(log2(amax / 448)): the RCEIL rule of cuBLAS's block quantisation),
elements in float8_e4m3fn (gradients too), then multiplies and returns bf16. The weight is cast to
the activations' dtype (bf16) first, as the bf16 weights torchtitan's FSDP hands the layer are.
Left in bf16 (listed in the summary): the output head when tied to the embedding, and any Linear
with a dimension not divisible by 32 (a block must not straddle a row: torchao does not pad).
The tokens of a step need not be a multiple of 32: _forward pads them with zeros (the weight
gradient's blocks run along them; zeros change no block's scale), which torchao does not.
config.Config.check_mxfp8 refuses what it cannot do (FSDP) in one line.

Where the GPU has no MXFP8 tensor cores (a CPU; CUDA before compute capability 10.0, i.e. before
Blackwell) torchao's emulated path runs (KernelPreference.EMULATED): the same PyTorch casts to
MXFP8 (its torch kernels, not Triton or CUDA ones), then both operands dequantised to bf16 and
multiplied there. The loss is MXFP8's; the time is not, and the job says `fp8_emulated: true`.
"""
from __future__ import annotations

import logging
import types

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ConfigError
from ..runtime.hardware import capability
from . import emulation

MX_CAPABILITY = (10, 0)   # Blackwell: MXFP8 tensor cores (tcgen05 block-scaled MMA)
BLOCK = 32                # elements per shared E8M0 scale
log = logging.getLogger(__name__)
INSTALL = 'pip install -e ".[fp8]"'


def require_torchao():
    """torchao's MXFP8Linear, its kernel preference and scale rule, or a ConfigError whose one
    line says what to install (modes.check_installed asks before any work)."""
    quiet = logging.getLogger("torch.utils._pytree")   # torchao 0.18 warns about its Enums
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        # lazy: torchao is optional (the fp8 extra) and only precision=mxfp8 needs this
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as e:
        raise ConfigError(
            f"precision=mxfp8 needs torchao's MXFP8 training (torchao.prototype.moe_training, "
            f"torchao 0.18), which is not importable here ({e}); install it with: {INSTALL}"
        ) from None
    finally:
        quiet.setLevel(level)
    return MXFP8Linear, KernelPreference, ScaleCalculationMode


def emulation_reason(device: torch.device) -> str | None:
    """Why this device cannot run MXFP8 matmuls natively, or None when it can."""
    # CUDA-only branch (docs/gpus.md): torchao's MXFP8 kernels are sm_100 CUDA kernels
    if device.type != "cuda" or torch.version.hip is not None:
        return f"{device.type}: no MXFP8 tensor cores"
    major, minor = capability(device)
    if (major, minor) < MX_CAPABILITY:
        return f"compute capability {major}.{minor} < 10.0 (Blackwell): no MXFP8 tensor cores"
    return None


def kept_in_bf16(model: nn.Module, multiple: int = 16,
                 why: str = "torch._scaled_mm") -> dict[str, str]:
    """The Linear layers left out of float8 (fp8.py: multiple 16) or MXFP8 (multiple 32, its
    blocks), by name, with the reason: a head tied to the embedding, a dimension `multiple` does
    not divide."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    kept = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if id(m.weight) in embeddings:
            kept[name] = "output head tied to the embedding"
        elif m.in_features % multiple or m.out_features % multiple:
            kept[name] = (
                f"{m.in_features}x{m.out_features}: a dimension not divisible by {multiple} "
                f"({why})"
            )
    return kept


def convert(model: nn.Module, device: torch.device) -> dict:
    """Swap the model's eligible Linear layers for torchao's MXFP8Linear in place (the same
    parameters, so the optimizer and model_fp32.pt see plain fp32 weights); returns what the
    summary records (the keys of fp8.convert's, for the records and the report)."""
    MXFP8Linear, KernelPreference, ScaleCalculationMode = require_torchao()
    why = emulation_reason(device)
    preference = KernelPreference.EMULATED if why is not None else KernelPreference.AUTO
    kept = kept_in_bf16(model, BLOCK, "MX blocks")
    converted = []
    for name, m in list(model.named_modules()):
        if type(m) is not nn.Linear or name in kept:
            continue
        mx = MXFP8Linear(m.in_features, m.out_features, bias=m.bias is not None,
                         device="meta", kernel_preference=preference,
                         scale_calculation_mode=ScaleCalculationMode.RCEIL)
        mx.weight, mx.bias = m.weight, m.bias
        mx.forward = types.MethodType(_forward, mx)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, mx)
        converted.append(name)
    if why is not None:
        log.info(f"mixprec: note: precision=mxfp8 emulated ({why}): torchao's emulated path casts "
                 "to MXFP8 in PyTorch and multiplies in bf16: the loss is MXFP8's, the time is not")
    return {"recipe": "mxfp8", "block": BLOCK, "scale": "e8m0 (rceil)",
            "fp8_emulated": why is not None, "emulation_reason": why,
            "float8_layers": converted, "bf16_layers": kept}


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    """MXFP8Linear.forward with its operands in the activations' dtype: the input cast as autocast
    would (torchao casts it under no autocast), the fp32 weight cast to it (torchao's emulated
    matmul needs both operands of one dtype; under torchtitan's FSDP the weight arrives in bf16
    alike), then torchao's MXFP8 matmul (forward and both gradients) and the bias. The rows (tokens)
    are padded with zeros to a multiple of 32, which torchao does not do: the weight gradient's
    blocks run along them, and zeros change no block's amax, so the result is the unpadded MX
    product's (an epoch's last, shorter bptt window; any batch size)."""
    # lazy: torchao is optional; require_torchao has imported it by now
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    dtype = emulation.autocast_dtype(x.device.type)   # the real autocast's or the emulated one's
    if dtype is not None:
        x = x.to(dtype)
    rows = x.shape[:-1].numel()
    flat = x.reshape(rows, x.shape[-1])
    if rows % BLOCK:   # a copy of the input: only where the rows need it
        flat = F.pad(flat, (0, 0, 0, -rows % BLOCK))
    out = _to_mxfp8_then_scaled_mm(
        flat, self.weight.to(x.dtype), kernel_preference=self.kernel_preference,
        scale_calculation_mode=self.scale_calculation_mode, wgrad_with_hp=self.wgrad_with_hp)
    out = out[:rows].reshape(*x.shape[:-1], out.shape[-1])
    return out if self.bias is None else out + self.bias.to(out.dtype)
