"""Test doubles shared by the test files: a fake clock that only training steps move, a model
wrapper that moves it (and can answer evaluations with controlled logits), and ranks that are
threads of this process (what the ranks of a job agree on, without a process group); a fake GPU
timer and events, a counter of the host's syncs, a model that sends its process SIGTERM."""
import builtins
import dataclasses
import os
import signal
import threading
import time

import torch
from torch import nn
from mixprec.precision.policy import PrecisionPolicy
from mixprec.runtime import dist
import mixprec.train.parts

STEPS_PER_EPOCH = 64 // 16   # helpers.TINY: 64 training images, batches of 16


class FakeClock:
    """time.perf_counter that moves only when a training step says so: every timed interval is known
    exactly."""

    def __init__(self):
        self.now = 1000.0
        self.models = []   # the models built under it (Timed wrappers), for the tests to inspect

    def __call__(self):
        return self.now

    def __deepcopy__(self, memo):   # a copied model (a benchmark cell's) moves the same clock
        return self


class Timed(nn.Module):
    """Wraps a model; its k-th training forward advances the fake clock by cost(k) seconds. In eval
    mode it answers eval_out(x, training forwards so far) when given (a controlled test accuracy),
    else the wrapped model's output."""

    def __init__(self, inner, clock, cost, eval_out=None):
        super().__init__()
        self.inner, self.clock, self.cost, self.eval_out, self.calls = (
            inner,
            clock,
            cost,
            eval_out,
            0,
        )

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.clock.now += self.cost(self.calls)
        elif self.eval_out is not None:
            return self.eval_out(x, self.calls)
        return self.inner(x)


def with_clock(monkeypatch, cost, eval_out=None) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    build = mixprec.train.parts.build_model

    def timed(cfg, n, **kw):
        clock.models.append(Timed(build(cfg, n, **kw), clock, cost, eval_out))
        return clock.models[-1]

    monkeypatch.setattr(mixprec.train.parts, "build_model", timed)
    return clock


class Meeting:
    """Where thread ranks meet: gather and barrier as collectives, with a timeout in place of a
    hang (a rank that never comes breaks the barrier: threading.BrokenBarrierError)."""

    def __init__(self, world: int, timeout: float = 10.0):
        self.slots = [None] * world
        self.wall = threading.Barrier(world, timeout=timeout)

    def gather(self, rank: int, obj) -> list:
        self.slots[rank] = obj
        self.wall.wait()
        out = list(self.slots)
        self.wall.wait()   # every rank has its copy before the next gather writes the slots
        return out


@dataclasses.dataclass(frozen=True)
class ThreadRanks(dist.Ranks):
    """dist.Ranks whose collectives meet in a Meeting of threads instead of a process group."""
    meeting: Meeting | None = None

    def gather(self, obj) -> list:
        return self.meeting.gather(self.rank, obj)

    def barrier(self) -> None:
        self.meeting.wall.wait()

    def any(self, flag: bool) -> bool:
        return builtins.any(self.gather(bool(flag)))


def on_threads(fn, world: int = 2, timeout: float = 10.0) -> list:
    """fn(ranks) on `world` thread ranks at once; each rank's result, or the exception it raised."""
    meeting, out = Meeting(world, timeout), [None] * world

    def run(rank):
        try:
            out[rank] = fn(ThreadRanks(rank=rank, world=world, meeting=meeting))
        except BaseException as e:   # noqa: BLE001 - returned to the test, which checks it
            out[rank] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class FakeEvent:
    def __init__(self, timer):
        self.timer, self.t = timer, None

    def record(self):   # the GPU time (on the host's clock) at which the GPU reaches the event
        self.t = self.timer.reach()

    def query(self):
        return self.t <= self.timer.clock.now

    def elapsed_time(self, end):   # ms, as torch.cuda.Event's
        return 1e3 * (end.t - self.t)


class FakeTimer:
    """A fake GPU: a spin keeps it busy for its seconds; the work the host queues takes `fraction`
    of the host's time queuing it and starts once the GPU is free (after the spin). host_waited
    (read once a sample): the host waits out the spin before it queues the step, as a step that
    reads the device first does."""

    def __init__(self, clock, fraction, host_waited=False):
        self.clock, self.fraction, self.host_waited, self.spins = clock, fraction, host_waited, []
        self.free = clock.now   # when the GPU's queued work ends
        self.mark = clock.now   # the host time the GPU's queue is counted up to

    def queue(self):   # the work the host queued since the last mark
        self.free = max(self.free, self.mark) + self.fraction * (self.clock.now - self.mark)
        self.mark = self.clock.now

    def reach(self):
        self.queue()
        return self.free

    def sync(self):
        self.queue()
        self.clock.now = self.mark = max(self.clock.now, self.free)

    def event(self):
        return FakeEvent(self)

    def spin(self, seconds):
        self.queue()
        self.spins.append(seconds)
        self.free = max(self.free, self.clock.now) + seconds
        if self.host_waited:
            self.sync()


class SyncCounter:
    """Counts the Tensor methods that make the host wait for the device, while `on`. On a CPU every
    tensor is a host tensor, so the policy's host-side copies of the loss scale
    (PrecisionPolicy._shadow: CPU tensors on every device, never a sync) are told apart by their
    storage."""
    METHODS = ("item", "__bool__", "cpu", "tolist", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.on, self.count, self.host = False, 0, set()
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.counted(original))
        shadow = PrecisionPolicy._shadow

        def recorded(policy, scale):
            tensors = shadow(policy, scale)
            self.host.update(t.untyped_storage().data_ptr() for t in tensors)
            return tensors
        monkeypatch.setattr(PrecisionPolicy, "_shadow", recorded)

    def counted(self, original):
        def method(tensor, *args, **kwargs):
            self.count += self.on and tensor.untyped_storage().data_ptr() not in self.host
            return original(tensor, *args, **kwargs)
        return method

    def on_during(self, monkeypatch, module, name):
        self.off_during(monkeypatch, module, name, on=True)

    def off_during(self, monkeypatch, module, name, on=False):
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            was, self.on = self.on, on
            try:
                return original(*args, **kwargs)
            finally:
                self.on = was
        monkeypatch.setattr(module, name, wrapped)


class SignalAt(nn.Module):
    """Wraps a model; its `at`-th training forward sends this process SIGTERM (a pre-emption,
    in-process)."""

    def __init__(self, inner, at):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
        return self.inner(x)
