"""How busy the GPU was in a job's steady-state steps: the GPU's own time for a step against the
step's wall time.

Method (docs/speed.md, "Host-bound steps"): a few steady steps an epoch are *sampled*. For a sampled
step the device is synchronized, a spin kernel (torch.cuda._sleep) holds the stream while the host
queues the whole step behind it, between two CUDA events; the events' elapsed time is then the GPU's
time for that step with no wait for the host in it (the sample counts only if the start event had
not yet run when the host finished queuing, i.e. the host never waited on the GPU inside the step;
else the next spin is twice the host's queuing time or twice the spin, and a step that reads the
device every time gives no figure: sampling stops after MAX_INVALID such samples). The wall time of
a step is the steady training clock over the job's steady steps, sampled ones included. busy
fraction = GPU time / wall time, at most 1: below HOST_BOUND the GPU waited for Python (the launch
overhead of eager PyTorch), and a speed-up measured there says little about the precision.

Sampled steps train as any other (same batch, same update) and stay in the training clock and the
steady throughput; only what sampling adds is taken out of the clock (clock.exclude): the spin and
the wait it causes. What a sampled step keeps is its own time as a steady step would take it: with a
valid sample the longer of the host's queuing time and the GPU's time (in a pipelined steady step
the slower side sets the pace); with an invalid one (the host waited) its wall time less everything
the GPU ran before the step could start (the spin, its launch and calibration), which leaves out too
the host's queuing that overlapped the spin before its wait. CUDA single-process jobs only: on a CPU
(and under DDP) no figure is recorded (None), never a made-up one.
"""
from __future__ import annotations

import statistics
import time

import torch

from .hardware import synchronize

HOST_BOUND = 0.8       # below this busy fraction a step is called host-bound
# the epoch's steady steps sampled (1-based): past the warm-up's queue effects
SAMPLE_AT = (4, 5)
# the first spin; after a sample the host needed longer to queue: twice that time, or twice
SPIN_S = 0.02
# the spin, whichever is longer (an eager fp8 GPT step queues ~48 x 311 ops: ~0.6 s)
SPIN_MAX_S = 2.56
# samples the host waited in before sampling stops (a step that reads the device every time)
MAX_INVALID = 4

ADVICE = (
    "a bigger trainer.batch_size, or trainer.compile=reduce-overhead (CUDA graphs) / default "
    "(fewer kernels)"
)


def busy_fraction(gpu_s: float | None, wall_s: float | None) -> float | None:
    """The GPU's share of a step's wall time (None without both; at most 1: timer noise aside, the
    GPU cannot work longer than the step took)."""
    if not gpu_s or not wall_s:
        return None
    return min(1.0, gpu_s / wall_s)


def verdict(fraction: float | None) -> str | None:
    """host-bound / gpu-bound for a busy fraction (None: not measured)."""
    if fraction is None:
        return None
    return "host-bound" if fraction < HOST_BOUND else "gpu-bound"


def note(fraction: float | None) -> str | None:
    """One line for a table or report when a figure was measured host-bound."""
    if verdict(fraction) != "host-bound":
        return None
    return (
        f"host-bound: the GPU was busy {100 * fraction:.0f}% of a step, so its speed-up measures "
        f"Python's launch overhead more than the precision; use {ADVICE}"
    )


class CudaTimer:
    """The GPU side of a sample on a CUDA device: synchronize, spin, events.
    tests/unit/runtime/test_busy.py fakes it; its gpu-marked test runs it. CUDA only: the spin
    (torch.cuda._sleep) has no device-generic twin."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cycles_per_s = None

    def sync(self) -> None:
        synchronize(self.device)

    def event(self):
        return torch.get_device_module(self.device).Event(enable_timing=True)

    def spin(self, seconds: float) -> None:
        if self.cycles_per_s is None:   # calibrate once: a known number of cycles against events
            start, end = self.event(), self.event()
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)
        torch.cuda._sleep(int(seconds * self.cycles_per_s))


class BusyMeter:
    """Samples steps (sample), counts the steady steps (tick), and gives the busy fraction per
    epoch (epoch_record) and for the job (metrics). `timer`: CudaTimer or a fake; `clock`: the host
    clock."""

    def __init__(self, timer, clock=time.perf_counter):
        self.timer, self.clock = timer, clock
        self.spin_s = SPIN_S
        self.gpu_s: list = []          # every valid sample, the job's
        self.epoch_gpu_s: list = []
        self.epoch_steady = 0          # steady steps of this epoch so far (sampled ones included)
        self.steady_steps = 0          # steady steps, sampled ones included, the job's
        self.epoch_steps = 0
        self.invalid = 0
        self.steady_at_epoch = self.steady_at_start = 0.0

    def start(self, steady_s: float) -> None:
        """The training clock's steady time when this process's loop starts (a resumed job's earlier
        time)."""
        self.steady_at_epoch = self.steady_at_start = steady_s

    def wants(self, steady: bool) -> bool:
        """Whether the coming step is sampled (a steady one at SAMPLE_AT in its epoch; none once
        MAX_INVALID samples gave no figure and none did)."""
        if self.invalid >= MAX_INVALID and not self.gpu_s:
            return False
        return steady and self.epoch_steady + 1 in SAMPLE_AT

    def sample(self, step, args, clock) -> tuple:
        """Run step(*args) queued behind a spin between two events; returns its result. The spin
        and the wait it causes are taken out of the training clock (clock.exclude); the step's own
        time stays (module docstring). The caller counts the step as any steady one (tick)."""
        t = self.timer
        t.sync()
        t0 = self.clock()
        before, start, end = t.event(), t.event(), t.event()
        before.record()
        t.spin(self.spin_s)
        start.record()
        queued_from = self.clock()
        result = step(*args)
        end.record()
        queuing = self.clock() - queued_from   # the host's time to queue the step
        # the GPU was still spinning when the host had queued the whole step
        queued_ahead = not start.query()
        t.sync()
        took = self.clock() - t0
        if queued_ahead:
            self.gpu_s.append(start.elapsed_time(end) / 1e3)
            self.epoch_gpu_s.append(self.gpu_s[-1])
            own = max(queuing, self.gpu_s[-1])
        else:
            self.invalid += 1
            self.spin_s = min(max(2 * self.spin_s, 2 * queuing), SPIN_MAX_S)
            # less all the GPU ran before the step could start
            own = took - before.elapsed_time(start) / 1e3
        clock.exclude(took - min(took, max(0.0, own)))
        return result

    def tick(self) -> None:
        """A steady step, sampled or not: a step's wall time is the steady clock over them all."""
        self.epoch_steady += 1
        self.steady_steps += 1
        self.epoch_steps += 1

    def epoch_record(self, steady_s: float) -> dict:
        """The epoch's figures (steady_s: the clock's steady time so far); resets the epoch's
        counts."""
        wall = (steady_s - self.steady_at_epoch) / self.epoch_steps if self.epoch_steps else None
        gpu = statistics.median(self.epoch_gpu_s) if self.epoch_gpu_s else None
        record = {"gpu_busy_fraction": busy_fraction(gpu, wall)}
        self.epoch_gpu_s, self.epoch_steady, self.epoch_steps, self.steady_at_epoch = (
            [],
            0,
            0,
            steady_s,
        )
        return record

    def metrics(self, steady_s: float) -> dict:
        """The job's figures: the median sampled GPU time of a step, the steady wall time of a step,
        their ratio and its verdict."""
        wall = (steady_s - self.steady_at_start) / self.steady_steps if self.steady_steps else None
        gpu = statistics.median(self.gpu_s) if self.gpu_s else None
        fraction = busy_fraction(gpu, wall)
        return {
            "gpu_busy_fraction": fraction,
            "gpu_step_ms": None if gpu is None else 1e3 * gpu,
            "wall_step_ms": None if wall is None else 1e3 * wall,
            "host_bound": verdict(fraction) == "host-bound" if fraction is not None else None,
            "busy_samples": len(self.gpu_s),
            "busy_samples_invalid": self.invalid,
        }


def meter_for(device: torch.device, world: int = 1) -> BusyMeter | None:
    """A meter for a single-process CUDA job; None elsewhere (no figure on a CPU or under DDP)."""
    if device.type != "cuda" or world > 1:
        return None
    return BusyMeter(CudaTimer(device))


def no_metrics() -> dict:
    """What a job without a meter records: no figure."""
    return {"gpu_busy_fraction": None, "host_bound": None}
