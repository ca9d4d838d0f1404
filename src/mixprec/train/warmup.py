"""Everything a job runs before the training clock apart from compilation itself: Page's untimed
prewarm steps on throwaway copies, and the random batches, their losses (the step's forwards,
step.py, on a random batch) and the shapes to warm, built once for both warm-ups: prewarm's
throwaway steps (one batch of the training shape) and compile's warm-up (compile.py: every training
and evaluation shape the compiled model will see).

Prewarm, untimed warm-up steps before the training clock: Page's rule (cifar10-fast dawn.py@55be9b98
lines 28-33 and new_dawn.py:51-57 run `warmup_cudnn` on random batches before `Timer(...)` starts;
bag_of_tricks.ipynb cell 27 on one training batch), so cuDNN's autotuning (`cudnn.benchmark`), lazy
CUDA initialisation and the allocator's growth are not timed.

`prewarm(...)` runs N full training steps (forward, backward, unscale and optimizer step) on random
inputs of the training batch's shape, through a throwaway deep copy of the model, the precision
policy (loss scaler, master weights) and a fresh optimizer of the same kind over the copied
parameters. The run itself is left exactly as it was: its model, optimizer, scaler and loader are
not touched (the loader is not advanced), and every RNG the step could draw from (python, numpy,
torch CPU and the accelerator's) is saved and restored. Page's warm-up ran forward and backward
only, on the real model (so his BatchNorm running statistics saw the random batches); this one also
warms the optimizer step and leaves the real model untouched. `prewarm_lm` does the same for a
language model (a window of random tokens, the hidden state from zeros). `trainer.prewarm_steps:
auto` is 3 on an accelerator and 0 on a CPU (TrainerConfig.prewarm_for). Compilation
(trainer.compile) is warmed separately, on the real compiled module (train/compile.py), and timed as
compile_time_s.

Memory: the copies are freed when `run_prewarm` returns, and the job then calls `reset_peak` once
prewarm and the compile warm-up are done (train/parts.py's compile_and_warm), so that the device's
peak (peak_memory_mb, hardware.memory_metrics) counts the run's own tensors, not the throwaway copy
of model, optimizer and master weights (nor the warm-up's batches). On a CPU the peak is the
process's peak RSS, reset at the job's start and here (Linux's VmHWM; elsewhere ru_maxrss, which
cannot be reset and then includes them and the earlier jobs of the process).
"""
from __future__ import annotations

import copy
import functools
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.hardware import flatten_rnns, fork_rng, reset_memory_peak, synchronize
from .compile import Warmup
from .step import backward_and_step, forward, image_forward, lm_forward


def image_loss(net, policy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A random batch's plain cross-entropy (no label smoothing, the mean)."""
    return image_forward(net, x, y, policy)[0]


def image_infer(net, policy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The evaluation forward (compile's warm-up of the evaluation shapes)."""
    return forward(net, x, policy)


def lm_loss(net, policy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A window's loss from a fresh hidden state."""
    return lm_forward(net, x, y, net.init_hidden(x.size(1)), policy)[0]


@dataclass
class ImageBatch:
    """Random images of the training layout and labels, `size` of them."""
    image_shape: tuple
    num_classes: int
    channels_last: bool = False

    def __call__(self, size: int, gen: torch.Generator, device: torch.device) -> tuple:
        x = torch.rand(size, *self.image_shape, device=device, generator=gen)
        x = x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
        return x, torch.randint(0, self.num_classes, (size,), device=device, generator=gen)


@dataclass
class TokenBatch:
    """A window of random tokens, shape (rows, columns), and its targets."""
    vocab_size: int

    def __call__(self, shape: tuple, gen: torch.Generator, device: torch.device) -> tuple:
        rows, columns = shape
        x = torch.randint(0, self.vocab_size, (rows + 1, columns), device=device, generator=gen)
        return x[:-1], x[1:]


def image_warmup(batch: int, eval_batch: int, test_size: int, image_shape: tuple, num_classes: int,
                 channels_last: bool = False, bn_eval: bool = False,
                 evaluates: bool = True) -> Warmup:
    """An image job's shapes: the training batch (the training loaders drop a last partial batch),
    the evaluation batch and the test set's last, partial, one. evaluates=False (an EMA job, which
    evaluates the EMA's own, uncompiled copy): no evaluation shape, so no graph is compiled that no
    call would use."""
    eval_shapes = split_shapes(test_size, eval_batch) if evaluates else []
    return Warmup([batch], eval_shapes, ImageBatch(image_shape, num_classes, channels_last),
                  image_loss, image_infer, bn_eval)


def split_shapes(n: int, size: int) -> list[int]:
    """The lengths of the slices of n things cut into `size`s: `size` (or n if fewer), then any
    remainder."""
    return [min(n, size)] + ([n % size] if n > size and n % size else [])


def lm_warmup(train_rows: int, columns: int, eval_rows: list[int], eval_columns: int, bptt: int,
              vocab_size: int) -> Warmup:
    """A language model's windows: bptt rows and the last window's (a batchified stream of `rows`
    rows has rows - 1 targets per column), in training (train_rows x columns) and in evaluation
    (each split's rows)."""
    train = [(r, columns) for r in split_shapes(train_rows - 1, bptt)]
    evals = sorted(
        {(r, eval_columns) for rows in eval_rows for r in split_shapes(rows - 1, bptt)},
        reverse=True,
    )
    return Warmup(train, evals, TokenBatch(vocab_size), lm_loss, lm_loss)


def prewarm(
    model: torch.nn.Module,
    policy,
    optimizer: torch.optim.Optimizer,
    steps: int,
    batch_size: int,
    image_shape: tuple,
    num_classes: int,
    channels_last: bool = False,
    grad_clip: float | None = None,
) -> float:
    """An image job's prewarm: `steps` untimed training steps on copies; the seconds they took (0.0
    when steps == 0)."""
    batch = functools.partial(ImageBatch(image_shape, num_classes, channels_last), batch_size)
    return run_prewarm(model, policy, optimizer, steps, batch, image_loss, grad_clip)


def prewarm_lm(
    model: torch.nn.Module,
    policy,
    optimizer: torch.optim.Optimizer,
    steps: int,
    bptt: int,
    columns: int,
    vocab_size: int,
    grad_clip: float | None = None,
) -> float:
    """A language model's prewarm: `steps` windows of random tokens, the hidden state from zeros."""
    batch = functools.partial(TokenBatch(vocab_size), (bptt, columns))
    return run_prewarm(model, policy, optimizer, steps, batch, lm_loss, grad_clip)


def run_prewarm(
    model, policy, optimizer, steps: int, batch, loss, grad_clip: float | None
) -> float:
    """`steps` steps of `loss(net, pol, *batch(generator, device))` on copies of model, policy and
    optimizer."""
    if steps <= 0:
        return 0.0
    device = policy.device
    synchronize(device)
    start = time.perf_counter()
    py_state, np_state = random.getstate(), np.random.get_state()
    with fork_rng(device):
        memo: dict = {}
        # one memo: the copied policy holds the copied weights
        net, pol = copy.deepcopy((model, policy), memo)
        # the copy's RNN weights are separate tensors: cuDNN would compact them every call
        flatten_rnns(net)
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [memo[id(p)] for p in g["params"]],
            }
            for g in optimizer.param_groups
        ]
        # fused=True as the constructor's flag too (the groups carry it): only then does
        # GradScaler hand the step its scale and found-inf flag on the device, as the job's
        fused = {"fused": True} if optimizer.defaults.get("fused") else {}
        opt = type(optimizer)(groups, **fused)
        x, y = batch(torch.Generator(device=device).manual_seed(0), device)
        net.train()
        for _ in range(steps):
            backward_and_step(loss(net, pol, x, y), pol, opt, grad_clip)
            opt.zero_grad(set_to_none=True)
        synchronize(device)
        # the copies go now (reset_peak then forgets their memory)
        del net, pol, opt, groups, memo, x, y
    random.setstate(py_state)
    np.random.set_state(np_state)
    return time.perf_counter() - start


def reset_peak(device: torch.device) -> None:
    """Start the device's memory peak afresh (after prewarm's copies are freed and compilation is
    done): the peak from here is that of what is allocated now and of the run (on a CPU the peak
    RSS, where the kernel can reset it: hardware.reset_memory_peak)."""
    reset_memory_peak(device)
