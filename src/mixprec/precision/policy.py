"""Precision policy: every precision mode of conf/precision in a few plain lines.

A mode is four decisions, each made once here:
  1. the dtype the model's weights live in (param_dtype), with BatchNorm optionally kept in fp32;
  2. whether the forward runs under torch.autocast, and to which dtype;
  3. whether the optimizer steps fp32 master copies (apex O2) that are copied back into the
     low-precision model;
  4. how the loss is scaled: torch.amp.GradScaler (dynamic), a static factor (apex --loss-scale N),
     or none.
With precision.fp8_recipe (precision=fp8) prepare_model also swaps the Linear layers for torchao's
float8 ones (precision/fp8.py); what it converted is self.fp8, for the job's summary.
The job calls prepare_model and optimizer_params once (train/build.py); the step (train/step.py)
calls autocast() and cast_input, then around the loss scaler's own calls (scaler.scale(loss),
unscale_, step, update) the small primitives where a mode decides: grads_to_masters,
clips_scaled, stepped_params (what is clipped), watch, masters_to_model and skipped. Where the
device is not CUDA (precision.emulate=auto), an fp16/bf16 mode runs emulated
(precision/emulation.py): the job runs under emulation.numerics(), so the same four decisions make
Emulated tensors that round as a GPU's kernels store, and autocast() applies CUDA autocast's policy
instead of the device's.

Host syncs: the step adds none to GradScaler's own (the found-inf check before the optimizer step,
torch/amp/grad_scaler.py:371). A fused optimizer (optimizer.impl=fused; auto on CUDA) takes the
scale and the found-inf flag on the device and skips itself there, so GradScaler makes no sync;
`skipped(defer=True)` then leaves the flag on the device too: it returns it, with a copy of the
scale after the update, as `Deferred`, and the loop reads both at its log flush with the losses
(loop.flush: one sync), where `settle_scale` gives the host its copy. So a steady fused amp step
makes no sync; a non-fused one makes GradScaler's. With defer=False (the probe's ranges mode, which
attributes each skipped step as it happens) the flag is read at once. Whether a non-fused check
skipped the step is seen by an optimizer step hook, and the scale after update() is followed on the
host by the same `torch._amp_update_scale_` GradScaler runs on the device (grad_scaler.py:549), so
`scale_value` never reads the device's scale (GradScaler.get_scale() syncs).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import NamedTuple

import torch
from torch import nn

from . import emulation, fp8
from ..config import PrecisionConfig
from ..runtime.hardware import flatten_rnns
from .modes import DTYPES, emulates


class Deferred(NamedTuple):
    """A fused step's outcome left on the device: its found-inf flag (1.0: skipped) and the scale
    after update()."""
    skipped: torch.Tensor
    scale: torch.Tensor


class StaticScaler:
    """apex-style static loss scale: multiply the loss by S, divide the gradients by S before the
    step. Like apex's static scaler it never skips a step: an overflow reaches the weights (and the
    NaN policy)."""

    def __init__(self, scale: float):
        self.value = float(scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for (group,) in by_dtype(grads):
            torch._foreach_mul_(group, 1.0 / self.value)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass

    def get_scale(self) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"scale": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["scale"])


def clip_scaled_model_grads_(params: list[torch.Tensor], max_norm: float) -> None:
    """apex word_language_model main.py@28bdc04e:173-185 (--fp16): backward of the loss times the
    static scale, then clip_grad_norm(model.parameters(), args.clip) on the fp16 model's gradients,
    still scaled, so the threshold applies to the scaled norm (0.25 at scale S clips the true
    gradients at 0.25 / S); only then are they copied to the fp32 masters and divided by S. PyTorch
    1.0's clip_grad_norm_: each gradient's 2-norm in its own dtype (p.grad.data.norm(2), fp16 for an
    fp16 model), their squares summed in higher precision (Python floats there, fp32 here: no host
    sync, no float64 on devices without it), coefficient max_norm / (total + 1e-6) applied in place
    where below 1, in the gradient's dtype."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    # one per gradient, in its dtype (fp16 norms of fp16 gradients)
    norms = torch._foreach_norm(grads)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)


def plain_fp32(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t`'s values as a plain torch.Tensor, in fp32 when it is floating point: what
    model_fp32.pt holds, which torch.load(weights_only=True) reads without the package of a tensor
    subclass (torchao's float8 weight under FSDP's float8 all-gather would stay one through
    .to(); copying into a plain tensor unwraps it)."""
    out = torch.empty(t.shape, dtype=torch.float32 if t.is_floating_point() else t.dtype)
    out.copy_(t.detach())
    return out


def by_dtype(*lists: list[torch.Tensor]) -> list[list[list[torch.Tensor]]]:
    """Parallel tensor lists cut into groups whose first-list tensors share one device and dtype, so
    that each foreach call sees one dtype per list, as GradScaler groups its gradients
    (torch/amp/grad_scaler.py:262). A CUDA foreach fast path may take one dtype for a whole list;
    the CPU runs per tensor and cannot show the difference (tests/unit/precision/test_precision.py
    checks the grouping, tests/gpu/test_gpu.py the values on a GPU)."""
    groups = defaultdict(lambda: [[] for _ in lists])
    for tensors in zip(*lists):
        for group, t in zip(groups[tensors[0].device, tensors[0].dtype], tensors):
            group.append(t)
    return list(groups.values())


class PrecisionPolicy:
    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.emulated = emulates(cfg, device)
        self.param_dtype = DTYPES[cfg.param_dtype]
        self.autocast_dtype = DTYPES[cfg.autocast_dtype] if cfg.autocast_dtype else None
        if cfg.loss_scale == "dynamic":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale,
                                               growth_interval=cfg.growth_interval)
        elif cfg.loss_scale == "none":
            self.scaler = torch.amp.GradScaler(device.type, enabled=False)  # a pass-through
        else:
            self.scaler = StaticScaler(cfg.loss_scale)
        self.model_params: list[nn.Parameter] = []
        self.master_params: list[torch.Tensor] | None = None
        # no sync: the initial scale
        self.scale_value = self.scaler.get_scale() if cfg.scaled else None
        # set by the optimizer's step hook (watch): still False after scaler.step = skipped
        self._stepped = False
        self._hooked: set = set()
        # a fused step's found-inf flag (on the device), see skipped()
        self._found_inf: torch.Tensor | None = None
        # what prepare_model converted to float8 (precision=fp8), for the summary
        self.fp8: dict | None = None

    @property
    def skips_overflow(self) -> bool:
        """A dynamic loss scale: GradScaler skips a step whose gradients are not finite (its
        found-inf check)."""
        return self.cfg.loss_scale == "dynamic"

    @property
    def scale_value(self) -> float | None:
        """The loss scale after the last step, followed on the host (None without loss scaling)."""
        return None if self._host is None else self._host[0].item()

    @scale_value.setter
    # at start, and on resume (precision/state.py)
    def scale_value(self, value: float | None) -> None:
        self._host = None if value is None else self._shadow(value)

    def _shadow(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU copies of GradScaler's scale and growth tracker (one sync to read the tracker: on
        resume only)."""
        state = self.scaler.state_dict() if self.cfg.loss_scale == "dynamic" else {}
        return torch.tensor([float(scale)]), torch.tensor(
            [state.get("_growth_tracker", 0)], dtype=torch.int32
        )

    # -- 1. weights --------------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.param_dtype != torch.float32:
            model.to(self.param_dtype)
            if self.cfg.keep_bn_fp32:
                for m in model.modules():
                    if isinstance(m, nn.modules.batchnorm._BatchNorm):
                        m.float()
        if self.cfg.fp8_recipe is not None:
            self.fp8 = fp8.convert(model, self.cfg.fp8_recipe, self.device)
        # a recurrent language model (models/rnnlm.py) is told where its recurrent layers run
        if hasattr(model, "rnn_outside_autocast"):
            model.rnn_outside_autocast = self.rnn_outside_autocast
        # cuDNN's one chunk, whatever the dtype change left (runtime/hardware.py)
        flatten_rnns(model)
        return model

    def compile_options(self) -> dict:
        """Inductor's settings for the mode's compiled model (fp8.inductor_options): the same in
        one process, under DDP and in FSDP's units (precision/fsdp.compile_options)."""
        return fp8.inductor_options(self.cfg.fp8_recipe)

    @property
    def rnn_outside_autocast(self) -> bool:
        """Whether a recurrent model runs its recurrent layers outside autocast, in their weights'
        dtype: under CUDA autocast to bf16, real or emulated. There autocast sends every RNN to
        cuDNN in fp16 whatever the autocast dtype (aten/src/ATen/cudnn/AutocastRNN.cpp casts input,
        hidden state and flat weights to half), which would be fp16 with no loss scale; outside it
        the RNN runs in fp32 and the label's bf16 holds for the rest (the decoder)."""
        cuda_policy = self.emulated or self.device.type == "cuda"
        return self.autocast_dtype == torch.bfloat16 and cuda_policy

    # -- 3. what the optimizer steps ---------------------------------------------------------------
    def optimizer_params(self, model: nn.Module) -> list[torch.Tensor]:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        if not self.cfg.master_weights:
            return self.model_params
        self.master_params = [
            p.detach().float().clone().requires_grad_(True) for p in self.model_params
        ]
        return self.master_params

    # -- 2. forward --------------------------------------------------------------------------------
    def autocast(self):
        if self.emulated and self.autocast_dtype is not None:
            return emulation.autocast(self.autocast_dtype)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    @contextlib.contextmanager
    def recurrent_autocast(self):
        """autocast() for a recurrent model, with oneDNN off under CPU autocast. On CUDA, autocast
        runs cuDNN's RNN (every kind) in fp16 (aten/src/ATen/cudnn/AutocastRNN.cpp casts input,
        hidden state and flat weights). On a CPU it sends nn.LSTM to oneDNN's fp16/bf16 LSTM, which
        fails on CPUs without AVX512-BF16/AMX ("could not create a primitive descriptor for the LSTM
        forward propagation primitive"); with oneDNN off nn.LSTM runs PyTorch's own kernel in fp32
        (autocast leaves it there), nn.GRU is not on CPU autocast's list (fp32) and nn.RNN runs in
        the autocast dtype. Low-precision weights (half, o2, bf16) need none of this: the RNN runs
        in their dtype."""
        if self.device.type != "cpu" or self.autocast_dtype is None:
            with self.autocast():
                yield
            return
        was = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            with self.autocast():
                yield
        finally:
            torch.backends.mkldnn.enabled = was

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs of a low-precision model must match its weights (autocast modes take fp32
        inputs)."""
        return (
            x.to(self.param_dtype)
            if x.is_floating_point() and self.param_dtype != torch.float32
            else x
        )

    # -- 4. the step's lines where the mode decides (train/step.py calls them in order) ------------
    @property
    def clips_scaled(self) -> bool:
        """apex's --fp16 clip: the model's gradients, still scaled (clip_scaled_model_grads_)."""
        return self.cfg.clip_scaled_model_grads

    def grads_to_masters(self) -> None:
        """Under master weights, after the backward: the model's gradients in fp32 on the masters,
        the model's own dropped (they are the optimizer's from here)."""
        if self.master_params is not None:
            for master, p in zip(self.master_params, self.model_params):
                master.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Before scaler.step: an optimizer step hook (registered once) tells `skipped` whether
        scaler.step called optimizer.step, and hands it a fused step's found-inf flag."""
        if id(optimizer) not in self._hooked:
            optimizer.register_step_post_hook(self._saw_step)
            self._hooked.add(id(optimizer))
        self._stepped = False

    def masters_to_model(self) -> None:
        """Under master weights, after the step: the fp32 masters back into the model's weights,
        rounded to their dtype (one foreach copy per dtype)."""
        if self.master_params is not None:
            with torch.no_grad():
                for model_group, master_group in by_dtype(self.model_params, self.master_params):
                    torch._foreach_copy_(model_group, master_group)

    def skipped(self, defer: bool = False) -> bool | Deferred:
        """After scaler.update: True when the step was skipped (an overflow under a dynamic loss
        scale: GradScaler skips the step and halves the scale), the host's copy of the scale
        updated alike. defer: a fused step's outcome is returned on the device (Deferred), unread,
        instead of a bool; the loop settles it at its flush (settle_scale)."""
        skipped, found_inf, self._found_inf = not self._stepped, self._found_inf, None
        if found_inf is not None:
            # a fused step is always called: it took GradScaler's found-inf flag on the device and
            # skipped itself there (GradScaler then makes no sync of its own); read at once, it is
            # this step's one host sync
            if defer:
                return Deferred(
                    found_inf.detach().reshape(1).float(),
                    self.scaler._scale.detach().reshape(1).clone(),
                )
            skipped = bool(found_inf)
        if self._host is not None and self.cfg.loss_scale == "dynamic":
            s = self.scaler
            torch._amp_update_scale_(
                *self._host,
                torch.tensor([float(skipped)]),
                s.get_growth_factor(),
                s.get_backoff_factor(),
                s.get_growth_interval(),
            )
        return skipped

    def settle_scale(self, scale: float) -> None:
        """The host copy of the scale, from the device's as read at a flush (deferred fused
        steps)."""
        self._host[0].fill_(scale)

    def _saw_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True
        # set by GradScaler.step for a fused step only
        self._found_inf = getattr(optimizer, "found_inf", None)

    def stepped_params(self) -> list[torch.Tensor]:
        return self.master_params if self.master_params is not None else self.model_params

    def fp32_state_dict(self, model: nn.Module) -> dict:
        """The model's weights in fp32 whatever the training precision (apex's promise for
        checkpoints), as CPU copies, so that model_fp32.pt loads on any machine (torch.load puts
        tensors back on the device they were saved from); for the model this policy trains under
        master weights, the fp32 masters rather than the rounded fp16 copies (another model, e.g. an
        EMA copy, is simply cast)."""
        state = {k: plain_fp32(v) for k, v in model.state_dict().items()}
        # a shared (tied) parameter has several names, and the state dict an entry for each
        names = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        if self.master_params is not None and all(id(p) in names for p in self.model_params):
            for p, master in zip(self.model_params, self.master_params):
                for n in names[id(p)]:
                    state[n] = plain_fp32(master)
        return state
