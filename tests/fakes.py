"""Test doubles shared by the test files: a fake clock that only training steps move, a model
wrapper that moves it (and can answer evaluations with controlled logits), and ranks that are
threads of this process (what the ranks of a job agree on, without a process group)."""
import builtins
import dataclasses
import threading
import time

from torch import nn

import mixprec.train.parts
from mixprec.runtime import dist

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
