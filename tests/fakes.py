"""Test doubles shared by the test files: a fake clock that only training steps move, and a model
wrapper that moves it (and can answer evaluations with controlled logits)."""
import time

from torch import nn

import mixprec.job

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
    build = mixprec.job.build_model

    def timed(cfg, n, **kw):
        clock.models.append(Timed(build(cfg, n, **kw), clock, cost, eval_out))
        return clock.models[-1]

    monkeypatch.setattr(mixprec.job, "build_model", timed)
    return clock
