"""trainer.compile: the training model through torch.compile, compiled before the clock starts.

`compile_model(net, mode)` wraps the module the loop trains (the DDP wrapper under several ranks) in
torch.compile with the chosen mode: `default` (inductor), `max-autotune` (inductor, Triton kernels autotuned,
CUDA graphs), `reduce-overhead` (inductor with CUDA graphs). The engine calls it inside the precision policy's
autocast, so autocast is part of the compiled graph: dynamo traces the forward under the ambient autocast state
and guards on it (a change of state recompiles). The compiled module shares its parameters and buffers with the
model: optimizer, EMA, checkpoints and the saved weights use the plain model and see the same tensors.

`warm_compile(...)` compiles now, outside the training clock, and returns the seconds it took (recorded as
`compile_time_s`, apart from `train_time_s`): forward and backward passes of the compiled module on a random
batch of the training shape, in training mode, after which every parameter, buffer (BatchNorm statistics) and
gradient is put back as it was and the torch RNGs are restored, so the run trains exactly as an uncompiled one
would (within inductor's rounding). Evaluation (eval mode, another graph) compiles at the first evaluation,
which is timed apart from training anyway.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from .hardware import synchronize
from .tricks import cross_entropy


def compile_model(net: nn.Module, mode: str) -> nn.Module:
    return net if mode == "none" else torch.compile(net, mode=mode)


def warm_compile(net: nn.Module, policy, batch_size: int, image_shape: tuple, num_classes: int, mode: str,
                 channels_last: bool = False, bn_eval: bool = False) -> float:
    """Compile `net`'s training forward and backward on a random batch; leave its state as it was."""
    if mode == "none":
        return 0.0
    from .models import set_bn_eval

    device = policy.device
    synchronize(device)
    start = time.perf_counter()
    saved = {k: v.detach().clone() for k, v in net.state_dict().items()}
    accelerator = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=accelerator):
        x = torch.rand(batch_size, *image_shape, device=device)
        x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        y = torch.randint(0, num_classes, (batch_size,), device=device)
        net.train()
        if bn_eval:
            set_bn_eval(net)
        for _ in range(3 if mode == "reduce-overhead" else 1):   # CUDA graphs are recorded on a later call
            with policy.autocast():
                out = net(policy.cast_input(x))
            cross_entropy(out, y).float().backward()
        with torch.no_grad():
            for k, v in net.state_dict().items():
                v.copy_(saved[k])
        for p in net.parameters():
            p.grad = None
    synchronize(device)
    return time.perf_counter() - start
