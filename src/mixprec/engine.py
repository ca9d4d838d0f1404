"""Engine: the training and evaluation loops, the training clock, and the non-finite policy.

What is timed: `TrainClock` measures training only (forward, backward, step, and the on-device batch
preparation, as DAWNBench counts it); evaluation is timed separately and never included. Every clock reading
synchronizes the device first, so queued GPU work is always counted. Steady-state throughput leaves out the
first `trainer.warmup_steps` steps (cuDNN autotuning, allocator growth, lazy init); the summary says so.
Host syncs in the loop: one per `trainer.log_every` steps for the loss/weight check (plus the one GradScaler
itself makes each step when a dynamic loss scale is on, and one per step under on_nonfinite=skip).

Checkpoints (src/mixprec/checkpoint.py writes them): `checkpoint(loop)` is called with the loop's own state at each
epoch end (except the last) and when `stop()` returns a reason (SIGTERM/SIGINT): then mid-epoch, after the
current step. `resume=loop` continues from such a state: the epoch's data order is replayed from its start and
the done batches skipped. After a resume the first `warmup_steps` steps are excluded from throughput again.

Under DDP (`ranks`, src/mixprec/dist.py) each rank trains on its slice of every global batch: the logged loss and
accuracy are summed over the ranks at each host sync (so every rank takes the same stop decision), samples are
counted for the global batch (throughput = global samples/s), and the clock waits for every rank (a barrier
after each device sync). Evaluation: every rank evaluates the whole test set (the weights are the same on all
ranks, so the numbers are; no communication, and the wall time is that of one rank alone).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .config import TrainerConfig
from .dist import SINGLE, Ranks
from .hardware import synchronize
from .models import set_bn_eval
from .precision import PrecisionPolicy
from .probe import Attribution
from .tricks import cross_entropy, tta_logits

# GradScaler skips optimizer.step() on an overflow by design, and the schedule still advances (the torch.amp
# recipe); PyTorch's warning about a scheduler step before an optimizer step says nothing useful then.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")


class TrainClock:
    """Accumulates training time; each start/stop/mark synchronizes the device before reading the clock."""

    def __init__(self, device: torch.device, barrier=lambda: None):
        self.device = device
        self.barrier = barrier  # under DDP: the clock reads after every rank is done
        self.total = 0.0        # all training time, warm-up included
        self.steady = 0.0       # training time after the warm-up mark
        self._t0 = None
        self._warm = None

    def start(self) -> None:
        synchronize(self.device)
        self.barrier()
        self._t0 = time.perf_counter()

    def mark_warm(self) -> None:
        synchronize(self.device)
        self.barrier()
        self._warm = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        self.barrier()
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


def evaluate(model, batches, policy: PrecisionPolicy, tta: bool = False) -> tuple[float, float, float | None]:
    """Mean cross-entropy and accuracy over every sample of `batches` (no label smoothing), and with tta the
    accuracy of the mean logits of each image and its mirror (None without)."""
    model.eval()
    loss_sum = torch.zeros((), device=policy.device, dtype=torch.float64)
    correct = torch.zeros((), device=policy.device, dtype=torch.int64)
    correct_tta = torch.zeros_like(correct)
    n = 0
    with torch.no_grad(), policy.autocast():
        for x, y in batches:
            x = policy.cast_input(x)
            out, out_tta = tta_logits(model, x) if tta else (model(x).float(), None)
            loss_sum += F.cross_entropy(out, y, reduction="sum")
            correct += (out.argmax(1) == y).sum()
            if tta:
                correct_tta += (out_tta.argmax(1) == y).sum()
            n += len(y)
    model.train()
    return loss_sum.item() / n, correct.item() / n, correct_tta.item() / n if tta else None


def forward(model, x: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    with policy.autocast():
        return model(policy.cast_input(x))


def data_state(batches) -> dict | None:
    """The loader's data-order state (None for a loader that cannot save it: a resume then draws a new order)."""
    return batches.state_dict() if hasattr(batches, "state_dict") else None


def all_finite(tensors) -> bool:
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def train_step(loss: torch.Tensor, policy: PrecisionPolicy, optimizer, trainer: TrainerConfig, state: dict,
               ranks: Ranks = SINGLE, probe: Attribution | None = None, replay=None) -> None:
    """Backward and optimizer step (unscale, clip, step: PrecisionPolicy.step) for one batch's loss, then
    zero_grad. Under on_nonfinite=skip a non-finite loss skips backward and update (the window check counts it);
    under several ranks, all skip alike. probe: the numerics probe's calls (probe.py); replay: the step's forward
    again, for its attribution of a non-finite value."""
    step, probe = state["step"] + 1, probe or Attribution()
    if trainer.on_nonfinite == "skip" and ranks.any(not torch.isfinite(loss)):
        if state["nonfinite"] is None:
            state["nonfinite"] = {"step": step, "what": f"loss {loss.item()} (step skipped)", "policy": "skip"}
            state["nonfinite"]["what"] += "; " + probe.on_nonfinite(step, replay)
    else:
        policy.backward(loss)
        probe.after_backward(step, loss, policy, replay)
        skipped = policy.step(optimizer, trainer.grad_clip)
        probe.after_step(step, policy, skipped)
        state["skipped"] += skipped
        if policy.scale_value is not None:
            state["scale_min"] = min(state["scale_min"], policy.scale_value)
            state["scale_max"] = max(state["scale_max"], policy.scale_value)
    optimizer.zero_grad(set_to_none=True)


def check_window(window: Window, state: dict, policy: PrecisionPolicy, trainer: TrainerConfig,
                 ranks: Ranks = SINGLE, probe: Attribution | None = None) -> tuple[float, str | None]:
    """The non-finite check, one host sync: the window's losses (averaged over ranks: the global batches'), then
    the stepped weights. Returns the mean of the finite losses and what went non-finite (None when all is
    finite); counts it and records the first, with the probe's first non-finite module."""
    losses = (ranks.sum_(torch.stack(window.losses).float()) / ranks.world).cpu()
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
        what = "; ".join(filter(None, (what, probe and probe.on_nonfinite(bad_step))))
        state["nonfinite"] = {"step": bad_step, "what": what, "policy": trainer.on_nonfinite}
    return (losses[finite].mean().item() if finite.any() else math.nan), what


def loop_metrics(state: dict, steps_per_epoch: int, clock: TrainClock, epochs: list, trainer: TrainerConfig,
                 policy: PrecisionPolicy, setup_time_s: float = 0.0) -> dict:
    """The metrics every training loop reports (image and language model): steps, timing, throughput (steady
    state when there is one, warm-up excluded; setup time never counted in it), the loss-scale range."""
    steady = clock.steady > 0 and state["steady_samples"] > 0
    return {
        "epochs": state["step"] / steps_per_epoch,
        "steps": state["step"],
        "steps_per_epoch": steps_per_epoch,
        "skipped_steps": state["skipped"],
        "nonfinite_steps": state["nonfinite_steps"],
        "train_time_s": clock.total,
        "epoch_times_s": [e["epoch_time_s"] for e in epochs],
        "eval_time_s": sum(e.get("eval_time_s", 0.0) for e in epochs),
        "throughput": (state["steady_samples"] / clock.steady) if steady else
        state["samples"] / (clock.total - setup_time_s),
        "throughput_includes_warmup": not steady,
        "warmup_steps": trainer.warmup_steps,
        "loss_scale": None if policy.scale_value is None else
        {"min": state["scale_min"], "max": state["scale_max"], "final": policy.scale_value},
    }


def train(model, policy: PrecisionPolicy, optimizer, schedule, train_batches, test_batches,
          trainer: TrainerConfig, *, label_smoothing: float = 0.0, loss_sum: bool = False, ema=None,
          tta: bool = False, setup_time_s: float = 0.0, bn_eval: bool = False, log=lambda row: None,
          progress: bool = True, resume: dict | None = None, checkpoint=None, stop=lambda: None,
          ranks: Ranks = SINGLE, probe: Attribution | None = None) -> dict:
    """ema: a tricks.EMA, updated after every optimizer step (training time) and evaluated instead of the model.
    tta: test accuracy (and time to target) from flip test-time augmentation; the final evaluation reports the
    accuracy with and without it in any case. setup_time_s: preparation done before the loop that counts as
    training (DAWNBench: preprocessing is included), e.g. fitting the whitening filters. bn_eval: BatchNorm layers
    stay in eval mode while training. resume/checkpoint/stop: see checkpoint.py; ranks: see dist.py."""
    device = policy.device
    probe = probe or Attribution()
    inner = getattr(model, "module", model)   # the probe replays a batch on one rank alone: not through DDP
    clock = TrainClock(device, ranks.barrier)
    clock.total = setup_time_s
    steps_per_epoch = len(train_batches)
    total_steps = trainer.epochs * steps_per_epoch
    if trainer.max_steps is not None:
        total_steps = min(total_steps, trainer.max_steps)
    state = {"step": 0, "samples": 0, "skipped": 0, "nonfinite_steps": 0, "nonfinite": None, "steady_samples": 0,
             "scale_min": policy.scale_value, "scale_max": policy.scale_value}
    epochs, best_acc, time_to_target, epochs_to_target = [], None, None, None
    status, reason = "completed", None
    test_loss = test_acc = acc_plain = acc_tta = None
    start_epoch, skip, carried, saved_window = 0, 0, 0.0, None   # where a resumed run picks up
    if resume is not None:
        state.update(resume["state"])
        epochs = list(resume["epochs"])
        best_acc, time_to_target, epochs_to_target, test_loss, test_acc = resume["accumulators"]
        clock.total, clock.steady = resume["clock"]
        start_epoch, skip, carried, saved_window = resume["epoch"], resume["batch"], resume["epoch_time"], resume["window"]
        if resume["data"] is not None:
            train_batches.load_state_dict(resume["data"])
    warm_at = state["step"] + trainer.warmup_steps   # warm-up is excluded again in a resumed process

    def snapshot(next_epoch: int, batch: int = 0, data=None, epoch_time: float = 0.0, window=None) -> dict:
        """The loop's state: resuming from it continues at batch `batch` of epoch `next_epoch` (0-based)."""
        return {"state": dict(state), "epochs": list(epochs), "clock": (clock.total, clock.steady),
                "accumulators": (best_acc, time_to_target, epochs_to_target, test_loss, test_acc),
                "epoch": next_epoch, "batch": batch, "steps_per_epoch": steps_per_epoch, "epoch_time": epoch_time,
                "data": data_state(train_batches) if data is None else data,
                "window": None if window is None else {"first_step": window.first_step, "losses": window.losses,
                                                       "correct": window.correct, "samples": window.samples,
                                                       "elapsed": time.perf_counter() - window.t0}}

    def flush(window: Window, epoch: int) -> bool:
        """Sync once: check the window's losses and the weights; log a row. False = stop the run."""
        nonlocal status, reason
        loss, what = check_window(window, state, policy, trainer, ranks, probe)
        elapsed = time.perf_counter() - window.t0
        row = {"kind": "train", "step": state["step"], "epoch": epoch + 1, "loss": loss,
               "acc": ranks.sum_(torch.stack(window.correct).sum()).item() / max(window.samples, 1),
               "lr": optimizer.param_groups[0]["lr"], "loss_scale": policy.scale_value,
               "samples_per_s": window.samples / elapsed if elapsed > 0 else None}
        log(row)
        if what is not None and trainer.on_nonfinite == "stop":
            status, reason = "diverged", what
            return False
        return True

    running = True
    for epoch in range(start_epoch, trainer.epochs):
        if not running or state["step"] >= total_steps:
            break
        model.train()
        if bn_eval:
            set_bn_eval(model)
        bar = tqdm(total=min(steps_per_epoch, total_steps - state["step"]), desc=f"epoch {epoch + 1}/{trainer.epochs}",
                   disable=not progress, leave=False, dynamic_ncols=True)
        window = Window(first_step=state["step"] + 1)
        if saved_window is not None:   # resumed mid-epoch
            bar.update(skip)
            w = saved_window
            window = Window(w["first_step"], [t.to(device) for t in w["losses"]], [t.to(device) for t in w["correct"]],
                            w["samples"], time.perf_counter() - w["elapsed"])
        data_at_start = data_state(train_batches)
        clock.start()
        for i, (x, y) in enumerate(train_batches):
            if i < skip:   # resumed mid-epoch: replay this epoch's data order up to the checkpoint, untimed
                if i + 1 == skip:
                    clock.start()
                continue
            probe.before_step(state["step"] + 1, policy)
            out = forward(model, x, policy)
            loss = cross_entropy(out, y, label_smoothing, summed=loss_sum)
            train_step(loss, policy, optimizer, trainer, state, ranks, probe, lambda: forward(inner, x, policy))
            if ema is not None:
                ema.update(model)
            schedule.step()
            state["step"] += 1
            n = len(y) * ranks.world   # the global batch
            state["samples"] += n
            if state["step"] > warm_at:
                state["steady_samples"] += n
            window.losses.append(loss.detach() / len(y) if loss_sum else loss.detach())
            window.correct.append((out.detach().argmax(1) == y).sum())
            window.samples += n
            bar.update(1)
            if state["step"] == warm_at:
                clock.mark_warm()
            last = i + 1 == steps_per_epoch or state["step"] >= total_steps
            if state["step"] % trainer.log_every == 0 or last:
                running = flush(window, epoch)
                bar.set_postfix(loss=f"{window.losses[-1].float().item():.3f}",
                                samples_s=f"{window.samples / max(time.perf_counter() - window.t0, 1e-9):.0f}")
                window = Window(first_step=state["step"] + 1)
            if not running or state["step"] >= total_steps:
                break
            why = stop()
            if why:
                status, reason, running = "interrupted", f"{why} after step {state['step']}", False
                break
        epoch_time = carried + clock.stop()
        bar.close()
        if status == "interrupted":
            if checkpoint is not None:
                checkpoint(snapshot(epoch, i + 1, data_at_start, epoch_time, window))
            break
        skip, carried, saved_window = 0, 0.0, None
        record = {"kind": "epoch", "epoch": epoch + 1, "step": state["step"], "epoch_time_s": epoch_time,
                  "train_time_s": clock.total, "lr": optimizer.param_groups[0]["lr"]}
        if running:
            t_eval = time.perf_counter()
            final = state["step"] >= total_steps
            test_loss, acc_plain, acc_tta = evaluate(model if ema is None else ema.model, test_batches, policy,
                                                     tta=tta or final)
            test_acc = acc_tta if tta else acc_plain
            record.update(test_loss=test_loss, test_acc=test_acc, test_acc_no_tta=acc_plain, test_acc_tta=acc_tta,
                          eval_time_s=time.perf_counter() - t_eval)
            best_acc = test_acc if best_acc is None else max(best_acc, test_acc)
            if trainer.target_acc is not None and time_to_target is None and test_acc >= trainer.target_acc:
                time_to_target, epochs_to_target = clock.total, epoch + 1
        epochs.append(record)
        log(record)
        more = running and state["step"] < total_steps and epoch + 1 < trainer.epochs
        if more and checkpoint is not None:
            checkpoint(snapshot(epoch + 1))
        why = stop() if more else None
        if why:   # a signal during evaluation: the checkpoint just written holds everything
            status, reason, running = "interrupted", f"{why} after step {state['step']} (epoch {epoch + 1} done)", False

    return {
        "status": status,
        "reason": reason,
        "nonfinite": state["nonfinite"],
        "metrics": {
            **loop_metrics(state, steps_per_epoch, clock, epochs, trainer, policy, setup_time_s),
            "final_test_acc": test_acc if status == "completed" else None,
            "final_test_loss": test_loss if status == "completed" else None,
            "final_test_acc_no_tta": acc_plain if status == "completed" else None,
            "final_test_acc_tta": acc_tta if status == "completed" else None,
            "best_test_acc": best_acc,
            "setup_time_s": setup_time_s,
            "time_to_target_s": time_to_target,
            "epochs_to_target": epochs_to_target,
            "target_acc": trainer.target_acc,
        },
        "epochs": epochs,
    }
