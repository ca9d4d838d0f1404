"""The training step on one screen, as nanoGPT's amp step (train.py: forward under autocast, the
loss, scaler.scale(loss).backward(), unscale_, clip, step, update, zero_grad). Where a precision
mode decides, the line calls its policy (precision/policy.py): autocast and the input's cast, the
loss scaler (GradScaler, apex's static scale or a pass-through), the fp32 masters' gradients in and
weights out (master weights), the clip of still-scaled gradients (apex --fp16) and whether the step
was skipped, with the host's copy of the scale (a fused step's flag stays on the device: Deferred).

Every job runs it: an image batch (image_steps.ImageSteps), a language model's bptt window
(lm_steps.LMSteps), prewarm's throwaway steps and scripts/benchmark.py's cells; compile's warm-up
runs the forwards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.rnnlm import repackage_hidden
from ..precision.policy import Deferred, clip_scaled_model_grads_
from .tricks import cross_entropy


def forward(model, x: torch.Tensor, policy) -> torch.Tensor:
    with policy.autocast():
        return model(policy.cast_input(x))


def image_forward(model, x, y, policy, label_smoothing: float = 0.0, summed: bool = False):
    """An image batch: the forward and the loss (tricks.py: label smoothing, Page's sum over the
    batch). Returns (loss, logits)."""
    out = forward(model, x, policy)
    return cross_entropy(out, y, label_smoothing, summed), out


def lm_forward(model, x, y, hidden, policy):
    """One bptt window: the hidden state cut from the last window's graph, the forward under the
    recurrent autocast, the mean cross-entropy per token in fp32. Returns (loss, logits, hidden)."""
    hidden = repackage_hidden(hidden)
    with policy.recurrent_autocast():
        out, hidden = model(x, hidden)
    return F.cross_entropy(out.float().view(-1, out.size(-1)), y.reshape(-1)), out, hidden


def backward_and_step(loss, policy, optimizer, grad_clip=None, defer=False,
                      after_backward=lambda: None) -> bool | Deferred:
    """The scaled backward and the optimizer step; True when the loss scaler skipped it (defer: a
    fused step's flag as a Deferred, unread). The caller zeroes the gradients."""
    scaler, clip = policy.scaler, grad_clip is not None
    scaler.scale(loss).backward()
    after_backward()                                # the probe's gradient ranges
    if clip and policy.clips_scaled:                # apex --fp16: fp16 grads, still scaled
        clip_scaled_model_grads_(policy.model_params, grad_clip)
    policy.grads_to_masters()                       # master weights: the grads, in fp32
    scaler.unscale_(optimizer)
    if clip and not policy.clips_scaled:
        torch.nn.utils.clip_grad_norm_(policy.stepped_params(), grad_clip)
    policy.watch(optimizer)                         # did scaler.step call optimizer.step?
    scaler.step(optimizer)                          # GradScaler's found-inf check: one sync
    scaler.update()
    policy.masters_to_model()                       # master weights: back into the model
    return policy.skipped(defer)                    # and the host's scale follows update()


def train_step(loss: torch.Tensor, loop, state, replay=None) -> None:
    """One batch's backward and optimizer step, then zero_grad. Under on_nonfinite=skip a non-finite
    loss skips both (all ranks alike; under a dynamic loss scale GradScaler's own check does it).
    replay: the step's forward again, for the probe's attribution (numerics/probe.py)."""
    policy, tr, probe, step = loop.policy, loop.trainer, loop.probe, state.step + 1
    nonfinite = tr.on_nonfinite == "skip" and not policy.skips_overflow
    if nonfinite and loop.ranks.any(not torch.isfinite(loss)):
        if state.nonfinite is None:
            seen = (f"loss {loss.item()} (step skipped)", probe.on_nonfinite(step, replay))
            state.nonfinite = {"step": step, "what": "; ".join(filter(None, seen)),
                               "policy": "skip"}
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
