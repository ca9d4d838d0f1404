"""Precision modes under FSDP2 (trainer.strategy=fsdp): each mode as a `MixedPrecisionPolicy`.

FSDP keeps every parameter as an fp32 shard (a DTensor): those shards are the master weights, the
optimizer steps them and its state is sharded alike. Before each unit's forward FSDP all-gathers
the shards and casts them to `param_dtype`, the mode's low dtype; after backward it reduce-scatters
the gradients in `reduce_dtype` (precision.reduce_dtype; float32 unless set) and hands each rank its
shard of them in fp32. So a mode maps to:

  fp32, tf32, o0            param_dtype None (no cast), no loss scale
  amp_bf16                  param_dtype bfloat16
  amp, o1, o2               param_dtype float16, dynamic loss scale (ShardedGradScaler)
  apex_fp16, fastai_fp16    param_dtype float16, their static loss scale
  fp8                       param_dtype bfloat16, torchao's float8 Linear layers with the FP8
                            all-gather of their weights (tensorwise recipe)

Autocast is off under FSDP (as in torchtitan, whose maybe_enable_amp leaves mixed precision to
fully_shard): param_dtype already gives each matmul low-precision weights and activations, and
autocast on top would cast them again, op by op, and run its fp32 ops (norms, softmax) on weights
that FSDP has already rounded. What differs from the one-process autocast mode is what autocast
would have kept in fp32: under FSDP the activations between units are in the low dtype too
(docs/fsdp.md). The root unit returns fp32 outputs (output_dtype) so the loss is computed in fp32,
as autocast computes it. Modes without fp32 masters (half, o3, bf16) and the other combinations
FSDP cannot express are refused by the schema (config.Config.check_strategy).

BatchNorm under a mode with keep_bn_fp32 (`fp32_affine`): each BatchNorm stays in the unit that
holds it (its ResNet stage, or the root), so every mode has fp32's units, collectives and, compiled,
graphs. FSDP casts its weight and bias to param_dtype with the rest of the unit, and the layer reads
them back in fp32: it computes in fp32 (the low-dtype input upcast inside the kernel, as autocast's
BatchNorm does) against fp32 running statistics (FSDP never casts buffers), and returns the input's
dtype. The numeric consequence: its gains and shifts are param_dtype-rounded copies of the fp32
masters (bf16 keeps 8 significant bits, fp16 11), and their gradients are rounded to param_dtype
before the reduction in reduce_dtype, as every other weight of the unit. So a sharded
bf16/fp16 run no longer repeats its one-process run bit for bit (measured on the CPU, docs/fsdp.md:
ResNet-18 amp_bf16, 20 steps, losses apart by at most 0.015, against 0.022 between one-process
bf16 and fp32). Two layouts that keep the weights fp32 were rejected: a BatchNorm as an fp32
unit of its own (what this module did before: bit-identical to one process, but ResNet-50 in 58
units against fp32's 5, two collectives each a step, and its dynamo-disabled hooks broke a
compiled stage's graph at every BatchNorm); its weights as fully_shard's ignored_params
(plain tensors among DTensors) break the loss scaler's unscale, the foreach optimizers and
clip_grad_norm_ ("mixed torch.Tensor and DTensor") and would need a collective of the job's own.
precision.keep_bn_fp32=false under FSDP is refused (config.Config.check_strategy): FSDP would hand
the layer low-dtype weights against its fp32 running statistics.

The loss scaler of the fp16 modes is torch's ShardedGradScaler: each rank unscales only its shard
of the gradients, and ShardedGradScaler all-reduces the found-inf flag, so that every rank skips
the same steps (GradScaler would let a rank whose shard is finite step while another skips).
"""
from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch import nn

from ..config import PrecisionConfig
from . import fp8
from .modes import DTYPES, low_dtype
from .policy import PrecisionPolicy, plain_fp32


def param_dtype(cfg: PrecisionConfig) -> torch.dtype | None:
    """The dtype FSDP computes in (None: the parameters' fp32): the mode's low dtype."""
    low = low_dtype(cfg)
    return None if low is None else DTYPES[low]


def reduce_dtype(cfg: PrecisionConfig) -> torch.dtype:
    """The dtype gradients are reduced in across ranks: precision.reduce_dtype, float32 if null."""
    return DTYPES[cfg.reduce_dtype or "float32"]


def dtypes(cfg: PrecisionConfig) -> dict:
    """What a sharded job's summary says of its precision: the dtype FSDP all-gathers and computes
    in, and the one it reduces gradients in (names such as "bfloat16")."""
    compute = param_dtype(cfg) or torch.float32
    return {"param_dtype": str(compute).removeprefix("torch."),
            "reduce_dtype": str(reduce_dtype(cfg)).removeprefix("torch.")}


def batchnorm_note(cfg: PrecisionConfig) -> str:
    """What a sharded job's summary says of its BatchNorms (FP32Affine): fp32 arithmetic, but
    weight and bias are gathered with their unit, so rounded to its dtype (one process: not)."""
    dtype = str(param_dtype(cfg) or torch.float32).removeprefix("torch.")
    return (f"fp32 compute and running statistics; weight and bias gathered in {dtype} with their "
            "unit (rounded), then read in fp32")


def mixed_precision(cfg: PrecisionConfig, root: bool = False) -> MixedPrecisionPolicy:
    """The MixedPrecisionPolicy of one FSDP unit; the root's returns fp32 outputs (the loss in
    fp32)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype(cfg), reduce_dtype=reduce_dtype(cfg),
                                output_dtype=torch.float32 if root else None)


def compile_options(cfg: PrecisionConfig) -> dict:
    """Inductor's settings for the mode's compiled units (train/parallel.compile_units): fp8's
    rowwise recipe emulates the precision casts (fp8.inductor_options)."""
    return fp8.inductor_options(cfg.fp8_recipe)


def keeps_fp32(cfg: PrecisionConfig, module: nn.Module) -> bool:
    """Whether `module` is a BatchNorm the mode keeps in fp32 (it reads its weights in fp32 inside
    its unit: fp32_affine)."""
    return (cfg.keep_bn_fp32 and param_dtype(cfg) is not None
            and isinstance(module, nn.modules.batchnorm._BatchNorm))


class FP32Affine:
    """A BatchNorm's weight and bias read in fp32 (a mixin before the layer's class): inside its
    unit's forward FSDP registers them cast to param_dtype, and the layer's own forward (any
    BatchNorm's: torch's, the ghost BatchNorm's) then gets fp32 copies of them, through which
    autograd sends their gradients back to FSDP's. The parameters themselves are unchanged:
    outside a forward they are FSDP's fp32 shards, which `.float()` returns as they are."""

    @property
    def weight(self) -> torch.Tensor | None:
        """The gain in fp32 (autograd sends its gradient to the registered parameter)."""
        return upcast(self._parameters["weight"])

    @property
    def bias(self) -> torch.Tensor | None:
        """The shift in fp32 (autograd sends its gradient to the registered parameter)."""
        return upcast(self._parameters["bias"])


def upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` in fp32 (itself when it is already; None stays None)."""
    return None if t is None else t.float()


_FP32_CLASSES: dict[type, type] = {}


def fp32_affine(module: nn.Module) -> None:
    """Make the BatchNorm `module` read its weight and bias in fp32 (FP32Affine), in place: its
    class becomes FP32<its class> (as fully_shard makes FSDP<class>), so that its state dict, its
    parameters and its forward stay its own."""
    cls = type(module)
    if isinstance(module, FP32Affine):
        return
    if cls not in _FP32_CLASSES:
        _FP32_CLASSES[cls] = type(f"FP32{cls.__name__}", (FP32Affine, cls), {})
    module.__class__ = _FP32_CLASSES[cls]


class ShardedPolicy(PrecisionPolicy):
    """The precision policy of a sharded job: the weights stay fp32 (FSDP's shards; it casts them,
    see above), no autocast, no input cast, no separate masters, ShardedGradScaler for a dynamic
    loss scale, and fp8's float8 Linear layers with FP8 all-gather."""
    sharded = True

    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        super().__init__(cfg, device)
        self.emulated = False
        self.compute_dtype = param_dtype(cfg)
        self.param_dtype = torch.float32
        self.autocast_dtype = None
        if cfg.loss_scale == "dynamic":
            self.scaler = ShardedGradScaler(device.type, init_scale=cfg.init_scale,
                                            growth_interval=cfg.growth_interval)
            self.scale_value = self.scaler.get_scale()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.cfg.fp8_recipe is not None:
            self.fp8 = fp8.convert(model, self.cfg.fp8_recipe, self.device, fsdp=True)
        return model

    def optimizer_params(self, model: nn.Module) -> list[torch.Tensor]:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        return self.model_params

    def fp32_state_dict(self, model: nn.Module) -> dict:
        """The whole model's weights in fp32 on the CPU, gathered from every rank's shards: a
        collective that every rank calls; rank 0 gets the weights, the others an empty dict. Plain
        tensors (policy.plain_fp32): a float8 Linear's weight under FP8 all-gather is torchao's
        subclass."""
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {k: plain_fp32(v) for k, v in full.items()}


def after_steps(model: nn.Module, optimizer: torch.optim.Optimizer, fp8_info: dict | None) -> None:
    """Under FP8 all-gather: the float8 weights' scales precomputed after every optimizer step
    (an optimizer step hook: a step the loss scaler skips leaves the weights, and so the scales,
    as they were)."""
    if fp8_info and fp8_info.get("fsdp_float8_all_gather"):
        optimizer.register_step_post_hook(lambda *_: fp8.precompute_scales(model))


def after_load(model: nn.Module) -> None:
    """After a sharded checkpoint's weights are loaded (a resume): under FP8 all-gather, the float8
    weights' scales computed from the loaded weights, as the step before the checkpoint computed
    them. The scales are in no state dict: without this the first all-gather after a resume casts
    with the scales of the weights the model was built with (set by DCP's optimizer-state
    initialisation step). Every rank calls it (one all-reduce); nothing without torchao's float8."""
    if "torchao.float8" in sys.modules:   # a float8 layer exists only once torchao's is imported
        fp8.precompute_scales(model)
