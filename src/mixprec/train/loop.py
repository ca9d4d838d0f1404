"""The one training loop every job runs (image and language model), the training clock and the
non-finite policy; the step itself is step.py's.

The loop: `fit(steps, batches, loop, state)` runs epochs (`run_epoch`: the training steps;
`end_epoch`: the record, evaluation, checkpoint and stop check) from where `state` (LoopState:
counters, accumulators, clock totals, place in the epoch, open log window) is. `steps` supplies the
job kind's part: `image_steps.ImageSteps`, `lm_steps.LMSteps` for language models (hidden state,
truncated BPTT, perplexity); each gives start_epoch, step (one batch: forward, loss, train_step,
schedule), row, evaluate and metrics. `loop` (Loop) holds what the run trains with: policy,
optimizer, trainer config, total steps, log, checkpoint writer, stop check, ranks.

What is timed: `TrainClock` measures training only (forward, backward, step, and the on-device batch
preparation, as DAWNBench counts it); evaluation is timed separately and never included. Every clock
reading synchronizes the device first, so queued GPU work is always counted. Steady-state throughput
leaves out the first `trainer.warmup_steps` steps (cuDNN autotuning, allocator growth, lazy init);
the summary says so. It leaves out the memory ledger's measured step too (memory.py: its
saved-tensor hooks slow that one step), its time and its samples: it runs between two clock
readings (device syncs, as every reading is). Host syncs in the loop (tests/unit/train/test_speed.py
counts them), exactly these:
  - every `trainer.log_every` steps and at an epoch's end: the window flush, one transfer
    (`to_host`) of one vector: the window's losses, its correct count, the weights' finiteness (one
    inf-norm per tensor, in one foreach call) and, for fused steps, their found-inf flags and scales
    (the skip count and the scale follow); the progress bar shows the mean loss it read. A
    non-finite event adds the probe's attribution (a replay);
  - per step, only under a dynamic loss scale (amp, o1, o2 dynamic, fastai_fp16) with a non-fused
    optimizer: one, GradScaler's found-inf check before the optimizer step; a fused optimizer
    (CUDA's `auto`) skips itself on the device and its flag is read at the flush
    (step.backward_and_step(defer=True)), none per step, except under probe=ranges, which reads
    it at once to attribute the skip;
  - per step, only under on_nonfinite=skip without a dynamic loss scale: one, the loss check before
    backward;
  - once, at step 1: the input check (probe.see_batch: a blank or constant batch, one label, a first
    layer that outputs zeros; numerics/probe.py);
so at most one per step in every mode (two at step 1), and none between log steps after step 1 in
fp32, tf32, bf16, static-scale modes and amp with a fused optimizer.
Under DDP the stop flag (a small CPU all-reduce, dist.agreed_stop) is agreed every
`trainer.log_every` steps, so a signal stops the run at the next log step; the clock's barriers come
at epoch ends and around the ledger's measured step only.

Checkpoints (checkpoint.py writes them): `loop.checkpoint(state)` is called at each epoch end
(except the last) and when `loop.stop()` returns a reason (SIGTERM/SIGINT, signals.py): then
mid-epoch, after the current step. Resuming happens before `fit` is called: the checkpoint restores
the LoopState and every part, the training loader included, which continues the epoch at its next
batch (data.Resumable): the loop never skips batches. After a resume the first `warmup_steps` steps
are excluded from throughput again.

Under DDP (`ranks`, src/mixprec/runtime/dist.py) each rank trains on its slice of every global
batch: the logged loss and accuracy are summed over the ranks at each host sync (so every rank takes
the same stop decision), samples are counted for the global batch (throughput = global samples/s),
and the clock waits for every rank (a barrier after each device sync). Evaluation: every rank
evaluates the whole test set (the weights are the same on all ranks, so the numbers are; no
communication, and the wall time is that of one rank alone). `trainer.eval_batches` caps each split
at its first N batches (Scored); the stop flag is read between evaluation batches, so a signal
during evaluation stops it there: the checkpoint then holds the epoch's training with its
evaluation pending (LoopState.eval_pending), which a resume runs first.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from tqdm.auto import tqdm

from ..runtime import busy
from ..config import TrainerConfig
from ..runtime.dist import SINGLE, Ranks
from ..runtime.hardware import mark_steady, synchronize
from ..precision.policy import Deferred, PrecisionPolicy, by_dtype
from ..numerics.probe import Attribution
from .memory import Ledger
from .parallel import local

# one line per log window where no progress bar is drawn (not a terminal: nohup, Slurm, a pipe);
# conf/hydra/job_logging/mixprec.yaml sends it to stdout and train.log
PROGRESS = logging.getLogger("mixprec.progress")

# GradScaler skips optimizer.step() on an overflow by design, and the schedule still advances (the
# torch.amp recipe); PyTorch's warning about a scheduler step before an optimizer step says nothing
# useful then.
warnings.filterwarnings(
    "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
)


class TrainClock:
    """Accumulates training time; each start/stop/mark synchronizes the device before reading the
    clock."""

    def __init__(self, device: torch.device, barrier=lambda: None):
        self.device = device
        self.barrier = barrier  # under DDP: the clock reads after every rank is done
        self.total = 0.0        # all training time, warm-up included
        self.steady = 0.0       # training time after the warm-up mark
        self._t0 = None
        self._warm = None
        self._excluded = 0.0    # host seconds of this segment not counted (busy.py's spins, waits)
        self._unsteady = 0.0    # seconds of this segment counted in the total only (steady_out)

    def start(self) -> None:
        synchronize(self.device)
        self.barrier()
        self._t0 = time.perf_counter()

    def mark_warm(self) -> None:
        synchronize(self.device)
        mark_steady(self.device)   # the steady-state memory peak starts here
        self.barrier()
        self._warm = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of the running segment (after the warm-up mark) out of every total."""
        self._excluded += seconds

    def now(self) -> float:
        """A reading inside the running segment (the bounds of a step timed apart), after the
        device's queued work and every rank."""
        synchronize(self.device)
        self.barrier()
        return time.perf_counter()

    def steady_out(self, seconds: float) -> None:
        """Leave `seconds` of the running segment, after the warm-up mark, out of the steady time
        only: a step that trains, so it stays in the total, but runs slower than the others (the
        memory ledger's measured step)."""
        self._unsteady += seconds

    def stop(self) -> float:
        now = self.now()
        elapsed = now - self._t0 - self._excluded
        self.total += elapsed
        if self._warm is not None:
            self.steady += now - max(self._t0, self._warm) - self._excluded - self._unsteady
        self._excluded = self._unsteady = 0.0
        return elapsed


@dataclass
class Window:
    """Per-step values kept on the device between host syncs."""
    first_step: int = 1
    losses: list = field(default_factory=list)
    correct: list = field(default_factory=list)
    samples: int = 0
    t0: float = field(default_factory=time.perf_counter)
    # (step, precision.Deferred) of fused steps, read at the flush
    deferred: list = field(default_factory=list)
    # the window's correct count, as the flush read it
    correct_total: int | None = None

    def add(self, loss: torch.Tensor, correct: torch.Tensor | None, n: int) -> None:
        self.losses.append(loss)
        if correct is not None:
            self.correct.append(correct)
        self.samples += n

    def state_dict(self) -> dict:
        return {"first_step": self.first_step, "losses": self.losses, "correct": self.correct,
                "samples": self.samples, "elapsed": time.perf_counter() - self.t0,
                "deferred": [(step, *d) for step, d in self.deferred]}

    @classmethod
    def restore(cls, state: dict, device: torch.device) -> "Window":
        return cls(
            state["first_step"],
            [t.to(device) for t in state["losses"]],
            [t.to(device) for t in state["correct"]],
            state["samples"],
            time.perf_counter() - state["elapsed"],
            [
                (step, Deferred(f.to(device), s.to(device)))
                for step, f, s in state.get("deferred", [])
            ],
        )


@dataclass
class LoopState:
    """Where a run is and what it has counted: all a checkpoint needs of the loop (the parts save
    the rest)."""
    step: int = 0
    # training samples (tokens for a language model) of the global batches
    samples: int = 0
    steady_samples: int = 0        # those after the warm-up
    skipped: int = 0               # optimizer steps the loss scaler skipped
    nonfinite_steps: int = 0
    nonfinite: dict | None = None  # the first non-finite event
    scale_min: float | None = None
    scale_max: float | None = None
    # the clock's totals (setup time included), saved at each checkpoint
    train_time: float = 0.0
    steady_time: float = 0.0
    epoch: int = 0                 # the epoch in progress (0-based) ...
    batch: int = 0                 # ... and its batches done
    steps_per_epoch: int = 0
    # training time of the epoch in progress so far (an earlier process's too)
    epoch_time: float = 0.0
    window: dict | None = None     # the open log window of an epoch stopped in the middle
    epochs: list = field(default_factory=list)   # the epoch records
    # the job kind's accumulators (best accuracy, time to target, ...)
    best: dict = field(default_factory=dict)
    # the epoch's training is done, its evaluation not (a signal stopped it): a resume evaluates it
    eval_pending: bool = False

    def state_dict(self) -> dict:
        return copy.deepcopy(dataclasses.asdict(self))

    def load_state_dict(self, state: dict) -> None:
        for key, value in copy.deepcopy(state).items():
            setattr(self, key, value)


@dataclass
class Loop:
    """What a run trains with besides its state and its kind's steps; status/reason say how it
    ended."""
    policy: PrecisionPolicy
    optimizer: torch.optim.Optimizer
    trainer: TrainerConfig
    total_steps: int
    log: Callable = lambda row: None
    # checkpoint(state): every rank calls it (rank 0 writes the file)
    checkpoint: Callable | None = None
    stop: Callable = lambda: None        # the name of a stop signal received, else None
    ranks: Ranks = SINGLE
    progress: bool = True
    # the numerics probe's calls (numerics/probe.py)
    probe: Attribution = field(default_factory=Attribution)
    status: str = "completed"
    reason: str | None = None
    warm_at: int = 0
    # the open log window (train_step adds a fused step's deferred outcome to it)
    window: Window | None = None
    # busy.BusyMeter on a single-process CUDA job: the GPU's share of a steady step
    busy: object = None
    # the memory ledger (memory.py): what autograd saves at one steady step
    memory: Ledger = field(default_factory=Ledger)

    def __post_init__(self):
        self.clock = TrainClock(self.policy.device, self.ranks.barrier)
        # read at a non-finite event only (Adam's state: numerics/probe.py)
        self.probe.optimizer = self.optimizer

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])   # torchao's optimizers: a tensor

    def save(self, state: LoopState) -> None:
        if self.checkpoint is not None:
            state.train_time, state.steady_time = self.clock.total, self.clock.steady
            self.checkpoint(state)


class EvalStopped(Exception):
    """A stop signal read between evaluation batches; the message is the signal's name."""


class Scored:
    """An evaluation's batches: `trainer.eval_batches` of `batches` (all when null), the loop's stop
    flag read before each (under DDP/FSDP an agreed flag: every rank evaluates the same batches, so
    every rank stops at the same one; EvalStopped). `count`: the targets scored (images or tokens).
    spread: the N batches evenly spaced over the split (an image test set stored by class, as a
    JPEG copy of CIFAR-10 is, would give its first batches of one class: an accuracy of nothing);
    else the first N (a language model's windows, consecutive so its hidden state carries)."""

    def __init__(self, batches: Iterable, loop: "Loop", spread: bool = False):
        self.batches, self.loop, self.count, self.spread = batches, loop, 0, spread

    def chosen(self) -> Iterable:
        n = self.loop.trainer.eval_batches
        total = len(self.batches) if self.spread and hasattr(self.batches, "__len__") else None
        if n is None or total is None or total <= n:
            return itertools.islice(self.batches, n)
        keep = {i * total // n for i in range(n)}   # 0, total/n, 2 total/n, ...
        return (b for i, b in enumerate(self.batches) if i in keep)

    def __iter__(self):
        for x, y in self.chosen():
            why = self.loop.stop()
            if why:
                raise EvalStopped(why)
            self.count += y.numel()
            yield x, y


def total_steps(trainer: TrainerConfig, steps_per_epoch: int) -> int:
    """The run's optimizer steps: every epoch's, or trainer.max_steps if fewer."""
    return min(
        trainer.epochs * steps_per_epoch, trainer.max_steps or trainer.epochs * steps_per_epoch
    )


def to_host(vector: torch.Tensor) -> list:
    """The log flush's one host sync: a device vector as a Python list."""
    return vector.tolist()


def finite_flag(tensors: list) -> torch.Tensor:
    """1.0 when every element of every tensor is finite, else 0.0, on the device, in a few ops: the
    inf-norm (max |x|) of each tensor in one foreach call per dtype (inf or NaN when any element is;
    never an overflow of finite values, as a 2-norm or a sum in fp16 could), then one isfinite over
    their stack. An empty tensor (an FSDP rank's empty shard of a small head: 10 classes on 8
    ranks) is finite; it is left out, as _foreach_norm refuses its inf-norm."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.ones(1)
    norms = [n for (group,) in by_dtype(tensors) for n in torch._foreach_norm(group, float("inf"))]
    return torch.stack(norms).isfinite().all().float().reshape(1)


def read_window(window: Window, loop: Loop) -> tuple[list, bool, list]:
    """One transfer of everything the flush reads: the window's losses (averaged over ranks: the
    global batches'), its correct count (summed over ranks; into window.correct_total), whether the
    stepped weights are finite, and the fused steps' deferred (found-inf flag, scale) pairs. Returns
    (losses, weights finite, [(step, skipped, scale)])."""
    n, world = len(window.losses), loop.ranks.world
    summed = [torch.stack(window.losses).float() / world]
    if window.correct:
        # summed over ranks, not averaged
        summed.append(torch.stack(window.correct).sum().float().reshape(1))
    # this rank's part of the weights (FSDP: its shards), the flags summed: world = all finite
    params = [local(p) for p in loop.policy.stepped_params()]
    device = params[0].device if params else window.losses[0].device
    summed.append(finite_flag(params).to(window.losses[0].device))
    parts = [loop.ranks.sum_(torch.cat(summed))]
    parts += [t.to(device) for _, d in window.deferred for t in d]
    host = to_host(torch.cat(parts))
    if window.correct:
        window.correct_total = round(host[n])
    rest = host[n + bool(window.correct):]
    pairs = rest[1:]
    return host[:n], rest[0] == world, [(step, pairs[2 * i] > 0, pairs[2 * i + 1])
                                      for i, (step, _) in enumerate(window.deferred)]


def settle_deferred(deferred: list, state: LoopState, loop: Loop) -> None:
    """The fused steps' skips and scales, as read at the flush: counted, attributed, the host's
    scale set."""
    for step, skipped, scale in deferred:
        if skipped:
            state.skipped += 1
            loop.probe.record_deferred_skip(step, scale_before(deferred, step, loop))
        state.scale_min, state.scale_max = min(state.scale_min, scale), max(state.scale_max, scale)
    if deferred:
        loop.policy.settle_scale(deferred[-1][2])


def scale_before(deferred: list, step: int, loop: Loop) -> float:
    """The scale a deferred step used: the one after the step before it (the host's copy before the
    window)."""
    earlier = [scale for s, _, scale in deferred if s < step]
    return earlier[-1] if earlier else loop.policy.scale_value


def check_window(window: Window, state: LoopState, loop: Loop) -> tuple[float, str | None]:
    """The non-finite check on the window's one transfer (read_window): the losses, then the stepped
    weights. Returns the mean of the finite losses and what went non-finite (None when all is
    finite); counts it and records the first, with the probe's first non-finite module."""
    losses, weights_finite, deferred = read_window(window, loop)
    settle_deferred(deferred, state, loop)
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    bad_step = what = None
    if bad:
        bad_step = window.first_step + bad[0]
        what = f"loss became {losses[bad[0]]} at step {bad_step}"
        state.nonfinite_steps += len(bad)
    elif not weights_finite:
        bad_step = state.step
        what = (f"weights became non-finite by step {bad_step} (checked every "
                f"{loop.trainer.log_every} steps)")
        state.nonfinite_steps += 1
    if bad_step is not None and state.nonfinite is None:
        what = "; ".join(filter(None, (what, loop.probe.on_nonfinite(bad_step))))
        state.nonfinite = {"step": bad_step, "what": what, "policy": loop.trainer.on_nonfinite}
    finite = [v for v in losses if math.isfinite(v)]
    return (sum(finite) / len(finite) if finite else math.nan), what


def flush(steps, window: Window, loop: Loop, state: LoopState) -> float:
    """Sync once (read_window's one transfer): check the window's losses and the weights, count the
    fused steps' skips; log a row; on_nonfinite=stop ends the run. Returns the window's mean loss
    (for the progress bar)."""
    loss, what = check_window(window, state, loop)
    elapsed = time.perf_counter() - window.t0
    loop.log({"kind": "train", "step": state.step, "epoch": state.epoch + 1, "loss": loss,
              **steps.row(loss, window, loop), "lr": loop.lr, "loss_scale": loop.policy.scale_value,
              steps.rate: window.samples / elapsed if elapsed > 0 else None})
    if what is not None and loop.trainer.on_nonfinite == "stop":
        loop.status, loop.reason = "diverged", what
    return loss


def say_window(steps, loss: float, rate: float, loop: Loop, state: LoopState) -> None:
    """The log window's line where no progress bar is drawn (a job without a terminal): step,
    epoch, mean loss, throughput and loss scale, on stdout and in train.log (rank 0: the other
    ranks' notes are errors only, runtime/logs.py)."""
    scale = loop.policy.scale_value
    PROGRESS.info(
        f"step {state.step}/{loop.total_steps}  epoch {state.epoch + 1}/{loop.trainer.epochs}  "
        f"loss {loss:.4f}  {rate:.1f} {steps.rate.removesuffix('_per_s')}/s  "
        f"loss scale {'none' if scale is None else f'{scale:g}'}"
    )


def fit(steps, batches, loop: Loop, state: LoopState) -> dict:
    """Every job's training loop, image or language model (`steps` supplies the kind's step,
    evaluation and metrics): epochs from where `state` is (a checkpoint's place: it and the loader's
    position are restored before this is called) to the end, a divergence or a stop signal (then a
    checkpoint is written first)."""
    state.steps_per_epoch = len(batches)
    if state.step == 0:
        state.scale_min = state.scale_max = loop.policy.scale_value
    loop.clock.total, loop.clock.steady = state.train_time, state.steady_time
    # warm-up is excluded again in a resumed process
    loop.warm_at = state.step + loop.trainer.warmup_steps
    if loop.busy is not None:
        loop.busy.start(loop.clock.steady)
    while loop.status == "completed" and (
        state.eval_pending
        or (state.epoch < loop.trainer.epochs and state.step < loop.total_steps)
    ):
        if not state.eval_pending:   # else a resumed job: its epoch trained, not evaluated
            run_epoch(steps, batches, loop, state)
        if loop.status == "interrupted":
            loop.save(state)   # mid-epoch: the loader knows its place, the state the rest
            break
        end_epoch(steps, loop, state)
    return {"status": loop.status, "reason": loop.reason, "nonfinite": state.nonfinite,
            "metrics": {**loop_metrics(state, loop), **steps.metrics(state, loop)},
            "epochs": state.epochs}


def run_epoch(steps, batches, loop: Loop, state: LoopState) -> None:
    """The training steps of one epoch, from batch state.batch (a resumed epoch: the loader
    continues there) to its end, the run's last step, a divergence or a stop signal (loop.status
    then says which)."""
    tr, n_ranks = loop.trainer, loop.ranks.world
    steps.start_epoch(state.batch)
    bar = tqdm(
        total=min(state.steps_per_epoch, state.batch + loop.total_steps - state.step),
        initial=state.batch,
        desc=f"epoch {state.epoch + 1}/{tr.epochs}",
        disable=not loop.progress,
        leave=False,
        dynamic_ncols=True,
    )
    window = (
        Window.restore(state.window, loop.policy.device)
        if state.window
        else Window(first_step=state.step + 1)
    )
    loop.window = window
    loop.clock.start()
    for x, y in batches:
        loss, correct, n, steady = train_one(steps, x, y, loop, state)
        state.samples += n * n_ranks   # the global batch
        state.steady_samples += n * n_ranks if steady else 0
        if steady and loop.busy is not None:
            loop.busy.tick()
        window.add(loss, correct, n * n_ranks)
        bar.update(1)
        if state.step == loop.warm_at:
            loop.clock.mark_warm()
        if (
            state.step % tr.log_every == 0
            or state.batch == state.steps_per_epoch
            or state.step >= loop.total_steps
        ):
            loss = flush(steps, window, loop, state)
            rate = window.samples / max(time.perf_counter() - window.t0, 1e-9)
            bar.set_postfix(loss=f"{loss:.3f}", rate=f"{rate:.0f}")
            if not loop.progress:
                say_window(steps, loss, rate, loop, state)
            window = loop.window = Window(first_step=state.step + 1)
        if loop.status != "completed" or state.step >= loop.total_steps:
            break
        # DDP: the stop flag's all-reduce every log_every steps
        if loop.ranks.active and state.step % tr.log_every:
            continue
        why = loop.stop()
        if why:
            loop.status, loop.reason = "interrupted", f"{why} after step {state.step}"
            break
    state.epoch_time += loop.clock.stop()
    state.window = window.state_dict() if loop.status == "interrupted" else None
    loop.window = None
    bar.close()


def train_one(steps, x, y, loop: Loop, state: LoopState) -> tuple:
    """Training step state.step + 1 (the counters advanced): its loss, correct count and samples
    (this rank's), and whether it counts in the steady throughput: a step after the warm-up, a
    busy-sampled one too (only its spin is out of the clock), but not the memory ledger's measured
    step, which its saved-tensor hooks slow: it runs between two clock readings and its time leaves
    the steady clock (it stays in the total), unless it is the run's only steady step (a
    calibration job's: a steady throughput with the hooks beats none); it is never the one busy
    samples."""
    step = state.step + 1
    steady, measured = step > loop.warm_at, loop.memory.measures(loop, step)
    sampled = not measured and loop.busy is not None and loop.busy.wants(steady)
    out = measured and steady and loop.total_steps - loop.warm_at >= 2   # others stay steady
    t0 = loop.clock.now() if out else None
    with loop.memory.around(loop, step):
        loss, correct, n = (loop.busy.sample(steps.step, (x, y, loop, state), loop.clock)
                            if sampled else steps.step(x, y, loop, state))
    state.step, state.batch = step, state.batch + 1
    loop.memory.took(step, n)
    if t0 is not None:
        loop.clock.steady_out(loop.clock.now() - t0)
    return loss, correct, n, steady and not out


def end_epoch(steps, loop: Loop, state: LoopState) -> None:
    """The epoch's record (evaluated unless the run diverged), then between epochs a checkpoint and
    the stop check. A signal during evaluation stops it: a checkpoint with the evaluation pending,
    and no record (the resume evaluates the epoch and records it)."""
    record = {
        "kind": "epoch",
        "epoch": state.epoch + 1,
        "step": state.step,
        "epoch_time_s": state.epoch_time,
        "train_time_s": loop.clock.total,
        "lr": loop.lr,
    }
    if loop.busy is not None:
        record.update(loop.busy.epoch_record(loop.clock.steady))
    if loop.status == "completed":
        state.eval_pending, t_eval = True, time.perf_counter()
        try:
            record.update(steps.evaluate(state, loop, final=state.step >= loop.total_steps))
        except EvalStopped as e:
            loop.status, loop.reason = (
                "interrupted",
                f"{e} during evaluation after step {state.step} (epoch {state.epoch + 1}; "
                "it is evaluated again on resume)",
            )
            loop.save(state)
            return
        state.eval_pending = False
        record["eval_time_s"] = time.perf_counter() - t_eval
    state.epochs.append(record)
    loop.log(record)
    state.epoch, state.batch, state.epoch_time = state.epoch + 1, 0, 0.0
    if (
        loop.status == "completed"
        and state.step < loop.total_steps
        and state.epoch < loop.trainer.epochs
    ):
        loop.save(state)
        why = loop.stop()
        if why:  # a signal during evaluation: the checkpoint just written holds everything
            loop.status, loop.reason = (
                "interrupted",
                f"{why} after step {state.step} (epoch {state.epoch} done)",
            )


def loop_metrics(state: LoopState, loop: Loop) -> dict:
    """The metrics every training loop reports (image and language model): steps, timing, throughput
    (steady state when there is one, warm-up excluded), the loss-scale range."""
    clock = loop.clock
    steady = clock.steady > 0 and state.steady_samples > 0
    return {
        "epochs": state.step / state.steps_per_epoch,
        "steps": state.step,
        "steps_per_epoch": state.steps_per_epoch,
        "skipped_steps": state.skipped,
        "nonfinite_steps": state.nonfinite_steps,
        "train_time_s": clock.total,
        "epoch_times_s": [e["epoch_time_s"] for e in state.epochs],
        "eval_time_s": sum(e.get("eval_time_s", 0.0) for e in state.epochs),
        "throughput": (state.steady_samples / clock.steady) if steady else
        state.samples / clock.total,
        "throughput_includes_warmup": not steady,
        "warmup_steps": loop.trainer.warmup_steps,
        # each evaluated split's first N batches only (None: whole splits)
        "eval_batches": loop.trainer.eval_batches,
        "loss_scale": None if loop.policy.scale_value is None else
        {"min": state.scale_min, "max": state.scale_max, "final": loop.policy.scale_value},
        **(busy.no_metrics() if loop.busy is None else loop.busy.metrics(clock.steady)),
    }
