"""The training step on one screen: forward under autocast, the loss, the scaled backward, then the
optimizer step (unscale, clip, step, update the loss scale) and zero_grad.

Every job runs it: an image job's step (images.ImageSteps), a language model's bptt window
(lm.LMSteps), prewarm's throwaway steps and scripts/benchmark.py's cells; compile's warm-up runs its
losses. What each call does in each precision mode is the policy's (precision/policy.py): autocast()
picks the autocast dtype (or CUDA's policy, emulated), cast_input the weights' dtype, backward
scales the loss, step unscales (into the fp32 masters under master weights), clips, steps and
updates the scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.rnnlm import repackage_hidden
from ..precision.policy import Deferred, PrecisionPolicy
from .tricks import cross_entropy


def forward(model, x: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    with policy.autocast():
        return model(policy.cast_input(x))


def image_loss(net, policy: PrecisionPolicy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A random batch's plain cross-entropy: what prewarm and compile's warm-up step."""
    return cross_entropy(forward(net, x, policy), y)


def image_infer(net, policy: PrecisionPolicy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The evaluation forward (compile's warm-up of the evaluation shapes)."""
    return forward(net, x, policy)


def lm_forward(model, x: torch.Tensor, y: torch.Tensor, hidden, policy: PrecisionPolicy):
    """One bptt window: the hidden state cut from the previous window's graph, the forward under the
    policy's recurrent autocast, and the mean cross-entropy per token in fp32. Returns (loss,
    logits, next hidden state)."""
    hidden = repackage_hidden(hidden)
    with policy.recurrent_autocast():
        out, hidden = model(x, hidden)
    loss = F.cross_entropy(out.float().view(-1, out.size(-1)), y.reshape(-1))
    return loss, out, hidden


def lm_loss(net, policy: PrecisionPolicy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A window's loss from a fresh hidden state: what prewarm and compile's warm-up step."""
    return lm_forward(net, x, y, net.init_hidden(x.size(1)), policy)[0]


def backward_and_step(loss: torch.Tensor, policy: PrecisionPolicy, optimizer, grad_clip,
                      defer: bool = False, after_backward=lambda: None) -> bool | Deferred:
    """The scaled backward, then unscale, clip, step and update; True when the loss scaler skipped
    the step (a Deferred: a fused step's outcome, still on the device)."""
    policy.backward(loss)   # scaler.scale(loss).backward()
    after_backward()
    return policy.step(optimizer, grad_clip, defer=defer)


def train_step(loss: torch.Tensor, loop, state, replay=None) -> None:
    """One batch's backward and optimizer step, then zero_grad. Under on_nonfinite=skip a non-finite
    loss skips both (all ranks alike); under a dynamic loss scale that check is GradScaler's own, so
    no second sync is made. replay: the step's forward again, for the probe's attribution of a
    non-finite value (loop.probe, numerics/probe.py)."""
    policy, tr, probe, step = loop.policy, loop.trainer, loop.probe, state.step + 1
    nonfinite = tr.on_nonfinite == "skip" and not policy.skips_overflow
    if nonfinite and loop.ranks.any(not torch.isfinite(loss)):
        if state.nonfinite is None:
            seen = (f"loss {loss.item()} (step skipped)", probe.on_nonfinite(step, replay))
            what = "; ".join(filter(None, seen))
            state.nonfinite = {"step": step, "what": what, "policy": "skip"}
    else:
        defer = probe.defers_skips and loop.window is not None
        probed = lambda: probe.after_backward(step, loss, policy, replay)
        skipped = backward_and_step(loss, policy, loop.optimizer, tr.grad_clip, defer, probed)
        if isinstance(skipped, Deferred):   # a fused step: its flag and scale wait for the flush
            loop.window.deferred.append((step, skipped))
        else:
            probe.after_step(step, policy, skipped)
            state.skipped += skipped
            if policy.scale_value is not None:
                state.scale_min = min(state.scale_min, policy.scale_value)
                state.scale_max = max(state.scale_max, policy.scale_value)
    loop.optimizer.zero_grad(set_to_none=True)
