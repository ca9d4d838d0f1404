"""Optimizers, the piecewise-linear learning-rate schedule, fastai 1.0's one-cycle (cosine lr and
momentum), and the plateau rule of the language models."""
from __future__ import annotations

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..config import FUSED_SGD_SHARDED, ConfigError, OptimizerConfig, ScheduleConfig
from ..precision.modes import resolve_impl, rounds_stochastically


def impl_kwargs(impl: str, params: list, name: str) -> dict:
    """optimizer.impl as torch.optim's flags. auto: fused where every parameter is a floating-point
    CUDA tensor (SGD, Adam and AdamW all have fused CUDA kernels for fp32, fp16 and bf16), foreach
    elsewhere; fused, foreach and loop (a Python loop over the parameters: foreach=False) as asked.
    A fused step under GradScaler takes the scale and the found-inf flag on the device
    (torch/amp/grad_scaler.py: `_step_supports_amp_scaling`). FSDP's parameters are DTensors, and
    DTensor has a rule for fused Adam and AdamW but none for fused SGD (its first step would raise
    NotImplementedError): over DTensors auto gives foreach SGD, and fused SGD is refused."""
    tensors = flat_params(params)
    no_fused = name == "sgd" and any(isinstance(p, DTensor) for p in tensors)
    if no_fused and impl == "fused":
        raise ConfigError(FUSED_SGD_SHARDED)
    on_cuda = bool(tensors) and all(p.is_cuda and p.is_floating_point() for p in tensors)
    impl = resolve_impl(impl, on_cuda and not no_fused)
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


# optimizer.decay=auto: what each model family's own recipe decays. The GPT decays its matmul and
# embedding weights only (nanoGPT's configure_optimizers: `p.dim() >= 2`; GPT-2, minGPT and the
# usual transformer recipes alike); the image models and the RNN language models keep their
# articles' rule, weight decay on every parameter (fastai 1.0's bn_wd=True, Page's ladder, PyTorch's
# word_language_model has none).
DECAY_AUTO = {"gpt": "matrices"}


def decay_mode(decay: str, arch: str) -> str:
    """optimizer.decay with auto resolved for the model: 'all' or 'matrices' (no decay on 1-D
    tensors)."""
    return DECAY_AUTO.get(arch, "all") if decay == "auto" else decay


def param_groups(
    model: torch.nn.Module,
    model_params: list,
    stepped: list,
    cfg: OptimizerConfig,
    arch: str,
    bn_bias_lr: float = 1.0,
) -> tuple[list[dict], dict]:
    """The optimizer's parameter groups and what summary.json records of them. `stepped[i]` is what
    the optimizer steps for model_params[i] (the parameter, or its fp32 master copy).
    optimizer.decay=matrices (the GPT's auto): tensors of fewer than 2 dimensions (biases,
    LayerNorm/BatchNorm gains and shifts) get weight decay 0, the matmul and embedding weights
    optimizer.weight_decay. trick.bn_bias_lr != 1: BatchNorm biases at lr * factor and their weight
    decay divided by it (Page's step 7). Groups: decayed, not decayed, BatchNorm biases."""
    mode = decay_mode(cfg.decay, arch)
    names = {id(p): n for n, p in model.named_parameters()}
    bn_biases = set()
    if bn_bias_lr != 1.0:
        bn_biases = {
            id(m.bias)
            for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        }
    split: dict[str, list] = {"decay": [], "no_decay": [], "bn_bias": []}
    for p, s in zip(model_params, stepped):
        kind = (
            "bn_bias"
            if id(p) in bn_biases
            else "decay"
            if mode == "all" or p.dim() >= 2
            else "no_decay"
        )
        split[kind].append((names.get(id(p), "?"), s))
    settings = {
        "decay": {},
        "no_decay": {"weight_decay": 0.0},
        "bn_bias": {
            "lr": cfg.lr * bn_bias_lr,
            "weight_decay": (cfg.weight_decay if mode == "all" else 0.0) / bn_bias_lr,
        },
    }
    groups, record = [], []
    for kind, members in split.items():
        if not members:
            continue
        groups.append({"params": [s for _, s in members], **settings[kind]})
        record.append(
            {
                "kind": kind,
                "weight_decay": settings[kind].get("weight_decay", cfg.weight_decay),
                "lr": settings[kind].get("lr", cfg.lr),
                "tensors": len(members),
                "numel": sum(s.numel() for _, s in members),
                **({"names": [n for n, _ in members]} if kind != "decay" else {}),
            }
        )
    return groups, {"decay": mode, "groups": record}


class EagerStep:
    """torchao's step, run eagerly: torchao compiles its one-parameter step (torch.compile,
    fullgraph) for every parameter shape, which on a CPU costs tens of seconds of C++ compilation
    per job and cannot trace the emulated fp16/bf16 tensors (precision/emulation.py). The same
    function (torchao.optim.adam.single_param_adam) runs op by op instead, with the arguments
    torchao's _AdamBase.step gives it: the same arithmetic, the quantized states' own ops, the
    same stochastic rounding."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_one(group, p)
        return loss

    def step_one(self, group: dict, p: torch.Tensor) -> None:
        """One parameter's step: its state made on first use (torchao's _new_buffer: quantized
        where the tensor is large enough), then torchao's single_param_adam."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(p, True)
            state["exp_avg_sq"] = self._new_buffer(p, False)
        state["step"] += 1
        sr = rounds_stochastically(self.bf16_stochastic_round, p.dtype)
        from torchao.optim.adam import single_param_adam   # lazy: torchao is the fp8 extra

        single_param_adam(
            p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"], None,
            group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"],
            group["eps"], self.is_adamw, sr,
        )


# optimizer=adamw8bit, adamw4bit, adamw_fp8: torchao's AdamW with both moments quantized in blocks
# of one scale (8-bit: dynamic-tree codes, 256 per block; 4-bit: 128 per block; FP8: e4m3, 256 per
# block); tensors under 4096 elements (or of a size no block divides) keep fp32 moments, as
# bitsandbytes does. torchao rather than bitsandbytes: torchao is already a dependency (fp8.py),
# its states are tensor subclasses that run on a CPU and under FSDP2's DTensors, bitsandbytes needs
# its own CUDA library.
TORCHAO_ADAMW = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw_fp8": "AdamWFp8",
                 "adamw_sr": "_AdamW"}


def torchao_class(key: str, on_cuda: bool) -> type:
    """torchao's optimizer class for `key` (TORCHAO_ADAMW), or its EagerStep twin off CUDA; a
    ConfigError in one line without torchao (an optional dependency: the fp8 extra)."""
    try:
        import torchao.optim   # lazy: torchao is the fp8 extra
    except ImportError as e:
        raise ConfigError(f"optimizer {key}: torchao is not installed ({e}); "
                          'pip install -e ".[fp8]"') from None
    cls = getattr(torchao.optim, TORCHAO_ADAMW[key])
    return cls if on_cuda else type(f"Eager{cls.__name__}", (EagerStep, cls), {})


# the tensor subclass each low-bit optimizer keeps its moments in (torchao.optim's modules)
TORCHAO_STATES = {"adamw8bit": ("subclass_8bit", "OptimState8bit"),
                  "adamw4bit": ("subclass_4bit", "OptimState4bit"),
                  "adamw_fp8": ("subclass_fp8", "OptimStateFp8")}


def saved_state_classes(name: str) -> list[type]:
    """The classes optimizer `name`'s state dict pickles that torch.load(weights_only=True) must be
    told of: torchao's quantized moments. torchao allows them in the weights-only unpickler as a
    side effect of importing torchao.optim, which a resumed job has not done when it reads its
    checkpoint (it builds the optimizer after), so the reader names them (checkpoint.read). Empty
    for the other optimizers (no import: torchao's takes seconds) and without torchao (the load
    then names the class it lacks)."""
    if name not in TORCHAO_STATES:
        return []
    try:
        import torchao.optim   # lazy: torchao is the fp8 extra
    except ImportError:
        return []
    module, cls = TORCHAO_STATES[name]
    return [getattr(getattr(torchao.optim, module), cls)]


def compiles_step(cfg: OptimizerConfig, device: torch.device) -> bool:
    """Whether the optimizer's step goes through torch.compile: torchao's AdamW on CUDA compiles
    its single_param_adam per parameter shape (at the first steps, whatever trainer.compile says);
    elsewhere it runs eagerly (EagerStep)."""
    return device.type == "cuda" and (cfg.low_bit or cfg.stochastic_round)


def torchao_adamw(cfg: OptimizerConfig, params: list, on_cuda: bool) -> torch.optim.Optimizer:
    """torchao's AdamW for optimizer=adamw8bit/adamw4bit/adamw_fp8 or optimizer.stochastic_round
    (its plain AdamW with bf16_stochastic_round); compiled on CUDA (torchao's way), eager
    elsewhere (EagerStep)."""
    key = "adamw_sr" if cfg.stochastic_round else cfg.name
    cls = torchao_class(key, on_cuda)
    extra = {"bf16_stochastic_round": True} if cfg.stochastic_round else {}
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
               weight_decay=cfg.weight_decay, **extra)


def flat_params(params: list) -> list:
    """The tensors of `params` (tensors or param groups)."""
    if params and isinstance(params[0], dict):
        return [p for g in params for p in g["params"]]
    return list(params)


def build_optimizer(cfg: OptimizerConfig, params: list) -> torch.optim.Optimizer:
    """The optimizer of `cfg` over `params` (tensors or param groups), in the implementation
    optimizer.impl picks; torchao's AdamW for the low-bit states and stochastic rounding."""
    if cfg.low_bit or cfg.stochastic_round:
        return torchao_adamw(cfg, params, all(p.is_cuda for p in flat_params(params)))
    try:
        optimizer = _build(cfg, params, impl_kwargs(cfg.impl, params, cfg.name))
    except RuntimeError as e:  # fused=True on parameters its kernels do not take
        raise ConfigError(
            f"optimizer.impl={cfg.impl}: {str(e).splitlines()[0]}; use optimizer.impl=auto or "
            "foreach"
        ) from None
    if isinstance(optimizer, torch.optim.SGD):
        zero_fused_momentum_buffers(optimizer)
    return optimizer


def zero_fused_momentum_buffers(optimizer: torch.optim.SGD) -> None:
    """Give fused SGD's momentum buffers zeros before its first step. Without them torch's
    _fused_sgd makes them with torch.empty_like and sets them on its first step only; a step
    GradScaler skips (found_inf: the kernel returns early) leaves them as allocated, and every later
    step treats that garbage as momentum. From zeros, the first step's buffer is momentum * 0 + grad
    = grad, bit for bit what the first-step kernel stores (dampening is 0: not an option here), so
    fused keeps its speed and a skipped first step changes nothing."""
    for group in optimizer.param_groups:
        if not group.get("fused") or group["momentum"] == 0:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _build(cfg: OptimizerConfig, params: list, impl: dict) -> torch.optim.Optimizer:
    # The optimizer's state takes the dtype of the tensors it steps: fp16 under precision=half (the
    # fp16-Adam pitfall), fp32 under master weights.
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, **impl)
    # adamw is fastai 1.0's default optimizer when betas are (0.9, 0.99):
    # opt_func=AdamW=partial(optim.Adam, betas=(0.9,0.99)) (torch_core.py:63) wrapped in
    # OptimWrapper(true_wd=True, bn_wd=True) (basic_train.py:137-141), whose step multiplies every
    # trainable weight, BatchNorm's included, by 1 - wd * lr before Adam's step (callback.py:38-47):
    # exactly torch.optim.AdamW's decoupled weight decay.
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **impl,
    )


def build_schedule(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """LambdaLR multiplying optimizer.lr by the piecewise-linear curve through (knots, values),
    knots being fractions of total_steps. Stepped once per optimizer step.
    schedule=plateau: PyTorch's word_language_model rule instead, stepped once per epoch with the
    validation loss (`schedule.step(valid_loss)`): the lr is divided by cfg.factor after every epoch
    whose validation loss is not below the best so far (ReduceLROnPlateau, patience 0, threshold 0),
    however small it already is (eps 0: the example's `lr /= 4.0` has no floor, where PyTorch's
    default eps would stop dividing)."""
    if cfg.name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=1 / cfg.factor, patience=0, threshold=0.0, eps=0.0
        )
    if cfg.name == "fastai_onecycle":
        return FastaiOneCycle(
            optimizer, total_steps, cfg.div_factor, cfg.pct_start, cfg.final_div, tuple(cfg.moms)
        )
    knots = np.asarray(cfg.knots, dtype=np.float64) * max(total_steps, 1)
    values = np.asarray(cfg.values, dtype=np.float64)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: float(np.interp(step, knots, values))
    )


def annealing_cos(start: float, end: float, pct: float) -> float:
    """fastai 1.0's annealing_cos (callback.py:308-311): cosine from start (pct 0) to end (pct
    1)."""
    return end + (start - end) / 2 * (np.cos(np.pi * pct) + 1)


def fastai_onecycle_values(
    step: int,
    total_steps: int,
    lr_max: float,
    div_factor: float,
    pct_start: float,
    final_div: float,
    moms: tuple,
) -> tuple[float, float]:
    """(lr, momentum) for the optimizer step after `step` steps, as fastai 1.0.42's
    OneCycleScheduler sets them (one_cycle.py:21-43): phase 1, a1 = int(n * pct_start) steps, lr
    lr_max/div -> lr_max and momentum moms[0] -> moms[1]; phase 2, the other n - a1 steps, lr lr_max
    -> lr_max/div/final_div and momentum moms[1] -> moms[0]; both cosine. fastai's Stepper counts
    from 1 after each batch, so step k of a phase gets pct k / n_phase."""
    a1 = int(total_steps * pct_start)
    a2 = total_steps - a1
    low = lr_max / div_factor
    if step < a1:
        pct = step / max(1, a1)
        return annealing_cos(low, lr_max, pct), annealing_cos(moms[0], moms[1], pct)
    pct = min(1.0, (step - a1) / max(1, a2))
    return annealing_cos(lr_max, low / final_div, pct), annealing_cos(moms[1], moms[0], pct)


class FastaiOneCycle:
    """fastai's fit_one_cycle as a per-step schedule: sets each param group's lr (its initial lr is
    taken as the max lr, so group multipliers are kept) and momentum: Adam/AdamW's beta1 (fastai's
    OptimWrapper.mom sets betas[0], callback.py:69-75), or SGD's momentum.
    state_dict/load_state_dict carry the step count (checkpoints)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        div_factor: float,
        pct_start: float,
        final_div: float,
        moms: tuple,
    ):
        self.optimizer, self.total_steps = optimizer, max(total_steps, 1)
        self.args = (div_factor, pct_start, final_div, moms)
        self.max_lrs = [g.setdefault("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        for group, lr_max in zip(self.optimizer.param_groups, self.max_lrs):
            lr, mom = fastai_onecycle_values(self.last_step, self.total_steps, lr_max, *self.args)
            if isinstance(group["lr"], torch.Tensor):   # torchao's optimizers keep lr a tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
            if "betas" in group:
                group["betas"] = (mom, group["betas"][1])
            elif "momentum" in group:
                group["momentum"] = mom

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "max_lrs": list(self.max_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.last_step, self.max_lrs = state["last_step"], list(state["max_lrs"])
        self._apply()
