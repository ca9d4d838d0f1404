"""Engine: the training and evaluation loops, the training clock, and the non-finite policy.

What is timed: `TrainClock` measures training only (forward, backward, step, and the on-device batch
preparation, as DAWNBench counts it); evaluation is timed separately and never included. Every clock reading
synchronizes the device first, so queued GPU work is always counted. Steady-state throughput leaves out the
first `trainer.warmup_steps` steps (cuDNN autotuning, allocator growth, lazy init); the summary says so.
Host syncs in the loop: one per `trainer.log_every` steps for the loss/weight check (plus the one GradScaler
itself makes each step when a dynamic loss scale is on, and one per step under on_nonfinite=skip).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .config import TrainerConfig
from .hardware import synchronize
from .models import set_bn_eval
from .precision import PrecisionPolicy


class TrainClock:
    """Accumulates training time; each start/stop/mark synchronizes the device before reading the clock."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = 0.0        # all training time, warm-up included
        self.steady = 0.0       # training time after the warm-up mark
        self._t0 = None
        self._warm = None

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def mark_warm(self) -> None:
        synchronize(self.device)
        self._warm = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        now = time.perf_counter()
        elapsed = now - self._t0
        self.total += elapsed
        if self._warm is not None:
            self.steady += now - max(self._t0, self._warm)
        return elapsed


@dataclass
class Window:
    """Per-step values kept on the device between host syncs."""
    first_step: int = 1
    losses: list = field(default_factory=list)
    correct: list = field(default_factory=list)
    samples: int = 0
    t0: float = field(default_factory=time.perf_counter)


def evaluate(model, batches, policy: PrecisionPolicy) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over every sample of `batches` (no label smoothing)."""
    model.eval()
    loss_sum = torch.zeros((), device=policy.device, dtype=torch.float64)
    correct = torch.zeros((), device=policy.device, dtype=torch.int64)
    n = 0
    with torch.no_grad(), policy.autocast():
        for x, y in batches:
            out = model(policy.cast_input(x)).float()
            loss_sum += F.cross_entropy(out, y, reduction="sum")
            correct += (out.argmax(1) == y).sum()
            n += len(y)
    model.train()
    return loss_sum.item() / n, correct.item() / n


def all_finite(tensors) -> bool:
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def train_step(loss: torch.Tensor, policy: PrecisionPolicy, optimizer, trainer: TrainerConfig, state: dict) -> None:
    """Backward and optimizer step (unscale, clip, step: PrecisionPolicy.step) for one batch's loss, then
    zero_grad. Under on_nonfinite=skip a non-finite loss skips backward and update (the window check counts it)."""
    if trainer.on_nonfinite == "skip" and not torch.isfinite(loss):
        if state["nonfinite"] is None:
            state["nonfinite"] = {"step": state["step"] + 1, "what": f"loss {loss.item()} (step skipped)",
                                  "policy": "skip"}
    else:
        policy.backward(loss)
        state["skipped"] += policy.step(optimizer, trainer.grad_clip)
        if policy.scale_value is not None:
            state["scale_min"] = min(state["scale_min"], policy.scale_value)
            state["scale_max"] = max(state["scale_max"], policy.scale_value)
    optimizer.zero_grad(set_to_none=True)


def check_window(window: Window, state: dict, policy: PrecisionPolicy, trainer: TrainerConfig) -> tuple[float, str | None]:
    """The non-finite check, one host sync: the window's losses, then the stepped weights. Returns the mean of
    the finite losses and what went non-finite (None when all is finite); counts it and records the first."""
    losses = torch.stack(window.losses).float().cpu()
    finite = torch.isfinite(losses)
    bad_step = what = None
    if not finite.all():
        bad_step = window.first_step + int((~finite).nonzero()[0])
        what = f"loss became {losses[~finite][0].item()} at step {bad_step}"
        state["nonfinite_steps"] += int((~finite).sum())
    elif not all_finite(policy.stepped_params()):
        bad_step = state["step"]
        what = f"weights became non-finite by step {bad_step} (checked every {trainer.log_every} steps)"
        state["nonfinite_steps"] += 1
    if bad_step is not None and state["nonfinite"] is None:
        state["nonfinite"] = {"step": bad_step, "what": what, "policy": trainer.on_nonfinite}
    return (losses[finite].mean().item() if finite.any() else math.nan), what


def train(model, policy: PrecisionPolicy, optimizer, schedule, train_batches, test_batches,
          trainer: TrainerConfig, *, label_smoothing: float = 0.0, bn_eval: bool = False,
          log=lambda row: None, progress: bool = True) -> dict:
    device = policy.device
    clock = TrainClock(device)
    steps_per_epoch = len(train_batches)
    total_steps = trainer.epochs * steps_per_epoch
    if trainer.max_steps is not None:
        total_steps = min(total_steps, trainer.max_steps)
    state = {"step": 0, "samples": 0, "skipped": 0, "nonfinite_steps": 0, "nonfinite": None, "steady_samples": 0,
             "scale_min": policy.scale_value, "scale_max": policy.scale_value}
    epochs, best_acc, time_to_target, epochs_to_target = [], None, None, None
    status, reason = "completed", None
    test_loss = test_acc = None

    def flush(window: Window, epoch: int) -> bool:
        """Sync once: check the window's losses and the weights; log a row. False = stop the run."""
        nonlocal status, reason
        loss, what = check_window(window, state, policy, trainer)
        elapsed = time.perf_counter() - window.t0
        row = {"kind": "train", "step": state["step"], "epoch": epoch + 1, "loss": loss,
               "acc": torch.stack(window.correct).sum().item() / max(window.samples, 1),
               "lr": optimizer.param_groups[0]["lr"], "loss_scale": policy.scale_value,
               "samples_per_s": window.samples / elapsed if elapsed > 0 else None}
        log(row)
        if what is not None and trainer.on_nonfinite == "stop":
            status, reason = "diverged", what
            return False
        return True

    running = True
    for epoch in range(trainer.epochs):
        if not running or state["step"] >= total_steps:
            break
        model.train()
        if bn_eval:
            set_bn_eval(model)
        bar = tqdm(total=min(steps_per_epoch, total_steps - state["step"]), desc=f"epoch {epoch + 1}/{trainer.epochs}",
                   disable=not progress, leave=False, dynamic_ncols=True)
        window = Window(first_step=state["step"] + 1)
        clock.start()
        for i, (x, y) in enumerate(train_batches):
            with policy.autocast():
                out = model(policy.cast_input(x))
            loss = F.cross_entropy(out.float(), y, label_smoothing=label_smoothing)
            train_step(loss, policy, optimizer, trainer, state)
            schedule.step()
            state["step"] += 1
            state["samples"] += len(y)
            if state["step"] > trainer.warmup_steps:
                state["steady_samples"] += len(y)
            window.losses.append(loss.detach())
            window.correct.append((out.detach().argmax(1) == y).sum())
            window.samples += len(y)
            bar.update(1)
            if state["step"] == trainer.warmup_steps:
                clock.mark_warm()
            last = i + 1 == steps_per_epoch or state["step"] >= total_steps
            if state["step"] % trainer.log_every == 0 or last:
                running = flush(window, epoch)
                bar.set_postfix(loss=f"{window.losses[-1].float().item():.3f}",
                                samples_s=f"{window.samples / max(time.perf_counter() - window.t0, 1e-9):.0f}")
                window = Window(first_step=state["step"] + 1)
            if not running or state["step"] >= total_steps:
                break
        epoch_time = clock.stop()
        bar.close()
        record = {"kind": "epoch", "epoch": epoch + 1, "step": state["step"], "epoch_time_s": epoch_time,
                  "train_time_s": clock.total, "lr": optimizer.param_groups[0]["lr"]}
        if running:
            t_eval = time.perf_counter()
            test_loss, test_acc = evaluate(model, test_batches, policy)
            record.update(test_loss=test_loss, test_acc=test_acc, eval_time_s=time.perf_counter() - t_eval)
            best_acc = test_acc if best_acc is None else max(best_acc, test_acc)
            if trainer.target_acc is not None and time_to_target is None and test_acc >= trainer.target_acc:
                time_to_target, epochs_to_target = clock.total, epoch + 1
        epochs.append(record)
        log(record)

    steady = clock.steady > 0 and state["steady_samples"] > 0
    return {
        "status": status,
        "reason": reason,
        "nonfinite": state["nonfinite"],
        "metrics": {
            "epochs": state["step"] / steps_per_epoch,
            "steps": state["step"],
            "steps_per_epoch": steps_per_epoch,
            "skipped_steps": state["skipped"],
            "nonfinite_steps": state["nonfinite_steps"],
            "final_test_acc": test_acc if status == "completed" else None,
            "final_test_loss": test_loss if status == "completed" else None,
            "best_test_acc": best_acc,
            "train_time_s": clock.total,
            "epoch_times_s": [e["epoch_time_s"] for e in epochs],
            "eval_time_s": sum(e.get("eval_time_s", 0.0) for e in epochs),
            "throughput": (state["steady_samples"] / clock.steady) if steady else state["samples"] / clock.total,
            "throughput_includes_warmup": not steady,
            "warmup_steps": trainer.warmup_steps,
            "time_to_target_s": time_to_target,
            "epochs_to_target": epochs_to_target,
            "target_acc": trainer.target_acc,
            "loss_scale": None if policy.scale_value is None else
            {"min": state["scale_min"], "max": state["scale_max"], "final": policy.scale_value},
        },
        "epochs": epochs,
    }
