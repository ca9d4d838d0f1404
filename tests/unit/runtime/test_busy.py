"""The GPU busy fraction (src/mixprec/runtime/busy.py) on faked clocks: a fake GPU whose events
report a known share of the host time a sampled step took, inside real tiny CPU jobs
(tests/helpers/fakes.py's clock moves only with training steps), and the host-bound verdict the
tables and the report show."""
import pytest

import mixprec.job
from helpers import run_tiny
from helpers.fakes import FakeTimer, with_clock
from mixprec.runtime import busy

CPU = ["trainer.device=cpu"]
TEN_STEPS = [
    "dataset.train_size=160",
    "trainer.max_steps=null",
    "trainer.epochs=1",
    "trainer.warmup_steps=2",
]


def run_busy(tmp_path, monkeypatch, fraction, host_waited=False):
    clock = with_clock(monkeypatch, cost=lambda k: 0.01)
    timer = FakeTimer(clock, fraction, host_waited)
    monkeypatch.setattr(
        mixprec.job.busy, "meter_for", lambda device, world: busy.BusyMeter(timer, clock)
    )
    return run_tiny(tmp_path, *CPU, *TEN_STEPS), timer


@pytest.mark.parametrize("fraction, verdict", [(0.3, True), (0.95, False)])
def test_busy_fraction_on_faked_clocks_says_host_bound_or_not(
    tmp_path, monkeypatch, fraction, verdict
):
    s, timer = run_busy(tmp_path, monkeypatch, fraction)
    m = s["metrics"]
    assert (
        m["gpu_busy_fraction"] == pytest.approx(fraction, rel=1e-6) and m["host_bound"] is verdict
    )
    assert m["busy_samples"] == 2 and m["gpu_step_ms"] == pytest.approx(10 * fraction, rel=1e-6)
    # 10 steps of 10 ms of host time: the host queues a sampled step during its spin (the GPU's
    # share of it runs after the spin), and only the spin and its wait are out of the clock:
    # 10 steps' time, 8 steady ones of 10 ms
    assert m["train_time_s"] == pytest.approx(10 * 0.01, rel=1e-6)
    assert m["wall_step_ms"] == pytest.approx(10.0, rel=1e-6)
    assert (
        m["throughput"] == pytest.approx(16 / 0.01, rel=1e-6) and timer.spins == [busy.SPIN_S] * 2
    )
    assert s["epochs"][0]["epoch_time_s"] == pytest.approx(10 * 0.01, rel=1e-6)
    assert s["epochs"][0]["gpu_busy_fraction"] == pytest.approx(fraction, rel=1e-6)
    assert (busy.note(m["gpu_busy_fraction"]) is not None) is verdict


def test_a_step_the_host_waited_in_gives_no_figure_and_a_longer_spin(tmp_path, monkeypatch):
    s, timer = run_busy(tmp_path, monkeypatch, 0.5, host_waited=True)
    m = s["metrics"]
    assert (
        m["gpu_busy_fraction"] is None
        and m["host_bound"] is None
        and m["busy_samples_invalid"] == 2
    )
    assert timer.spins == [busy.SPIN_S, 2 * busy.SPIN_S]
    # the host waited out the spin before the step: only the spin is out of the clock
    assert m["train_time_s"] == pytest.approx(10 * 0.01, rel=1e-6)


def test_a_cpu_job_records_no_busy_fraction(tmp_path):
    s = run_tiny(tmp_path, *CPU)
    assert s["metrics"]["gpu_busy_fraction"] is None and s["metrics"]["host_bound"] is None
    assert "gpu_busy_fraction" not in s["epochs"][0]


def test_the_verdict_and_its_advice():
    assert busy.verdict(None) is None and busy.note(None) is None
    assert busy.verdict(0.79) == "host-bound" and busy.verdict(0.8) == "gpu-bound"
    assert "trainer.compile=reduce-overhead" in busy.note(0.3) and "batch_size" in busy.note(0.3)
    assert busy.busy_fraction(0.012, 0.010) == 1.0 and busy.busy_fraction(None, 0.01) is None


def test_tables_and_report_say_batch_compile_and_host_bound(tmp_path):
    import json

    from mixprec import records
    from mixprec.report.analyse import sweep_rows
    from mixprec.report.make import make_report
    from mixprec.report.console import format_table, job_block, sweep_note

    jobs = []
    for i, (precision, b) in enumerate([("fp32", 0.3), ("tf32", 0.95)]):
        s = run_tiny(tmp_path / str(i), *CPU, f"precision={precision}")
        s["metrics"].update(
            gpu_busy_fraction=b, gpu_step_ms=10 * b, wall_step_ms=10.0, host_bound=b < 0.8
        )
        s["arithmetic"] = "native"   # as on the GPU these fractions fake (TF32 does its work there)
        (tmp_path / str(i) / "summary.json").write_text(json.dumps(records.jsonable(s)))
        jobs.append(s)
    rows = sweep_rows(jobs)
    assert [(r["batch"], r["compile"], r["busy"]) for r in rows] == [
        (16, "none", 0.3),
        (16, "none", 0.95),
    ]
    assert (
        rows[1]["speedup"] is not None and "host-bound: GPU busy 95%, fp32 30%" in rows[1]["note"]
    )
    table = format_table(rows)
    assert (
        "GPU busy" in table.splitlines()[0]
        and "compile" in table.splitlines()[0]
        and " 0.30 " in table
    )
    assert "host-bound" in sweep_note(jobs) and "trainer.compile=reduce-overhead" in sweep_note(
        jobs
    )
    assert (
        "GPU busy    30% of a steady step (3.00 of 10.00 ms; batch 16, compile none): host-bound"
        in job_block(jobs[0])
    )
    make_report([str(tmp_path / "0"), str(tmp_path / "1")], out=tmp_path / "report")
    report = tmp_path / "report" / "report.md"
    text = report.read_text()
    assert (
        "| batch | compile | GPU busy (%) |" in text
        and "**Host-bound:**" in text
        and "| 16 | none | 30 |" in text
    )
    cpu = sweep_rows([run_tiny(tmp_path / "cpu", *CPU)])   # a CPU job: no figure, "-" in the table
    assert cpu[0]["busy"] is None and format_table(cpu).splitlines()[2].split()[9] == "-"


def test_sampling_stops_after_max_invalid_samples_and_leaves_the_clock_whole():
    from helpers.fakes import FakeClock

    class Clock:   # loop.TrainClock's exclude, recorded
        excluded = 0.0

        def exclude(self, seconds):
            self.excluded += seconds

    clock, train = FakeClock(), Clock()
    meter = busy.BusyMeter(FakeTimer(clock, 0.5, host_waited=True), clock)
    sampled = 0
    for epoch in range(6):
        for _ in range(10):
            if meter.wants(True):
                sampled += 1
                meter.sample(lambda: setattr(clock, "now", clock.now + 0.01), (), train)
            meter.tick()   # as loop.run_epoch: every steady step, sampled or not
        meter.epoch_record(1.0)
    assert sampled == busy.MAX_INVALID and meter.invalid == busy.MAX_INVALID
    assert meter.metrics(1.0)["gpu_busy_fraction"] is None
    assert train.excluded == pytest.approx(sum(meter.timer.spins))   # the steps' time stays


def test_after_a_step_the_host_took_long_to_queue_the_spin_covers_twice_its_queuing_time():
    from helpers.fakes import FakeClock

    class Clock:
        def exclude(self, seconds):
            pass

    clock = FakeClock()
    timer = FakeTimer(clock, 0.5, host_waited=True)
    meter = busy.BusyMeter(timer, clock)
    # 0.3 s of queuing: an eager fp8 GPT
    meter.sample(lambda: setattr(clock, "now", clock.now + 0.3), (), Clock())
    timer.host_waited = False
    meter.sample(lambda: setattr(clock, "now", clock.now + 0.3), (), Clock())
    assert timer.spins == [busy.SPIN_S, pytest.approx(0.6)] and meter.gpu_s == [pytest.approx(0.15)]


@pytest.mark.parametrize("fraction, kept", [(0.3, 0.01), (2.0, 0.02)])
def test_a_valid_sample_keeps_the_slower_side_of_its_step_in_the_clock(fraction, kept):
    """A host-bound sampled step (the GPU's share 30% of the host's 10 ms) keeps the host's 10 ms;
    a GPU-bound one (the GPU 20 ms) keeps the GPU's 20 ms: what a pipelined steady step takes.
    Out go the spin and its wait."""
    from helpers.fakes import FakeClock

    clock, train = FakeClock(), HostClock()
    meter = busy.BusyMeter(FakeTimer(clock, fraction), clock)
    t0 = clock.now
    meter.sample(lambda: setattr(clock, "now", clock.now + 0.01), (), train)
    took = clock.now - t0
    assert meter.gpu_s == [pytest.approx(0.01 * fraction)]
    assert took == pytest.approx(busy.SPIN_S + 0.01 * fraction)
    assert took - train.excluded == pytest.approx(kept)


class HostClock:
    """The training clock's side of busy.BusyMeter.sample: what it leaves out."""
    excluded = 0.0

    def exclude(self, seconds):
        self.excluded += seconds


@pytest.mark.gpu
def test_the_cuda_timer_times_a_step_queued_behind_its_spin():
    """busy.CudaTimer on the GPU (the spin, CUDA events, the queued-ahead check): a few large
    matmuls keep the GPU busy for most of their wall time; hundreds of one-element adds are the
    host's launch time, not the GPU's."""
    import time

    import torch

    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    heavy = lambda: [a @ a for _ in range(8)]
    light = lambda: [a[:1, :1] + 1 for _ in range(300)]
    meter, clock = busy.BusyMeter(busy.CudaTimer(device)), HostClock()
    fractions = []
    for step in (heavy, light):
        step()   # cuBLAS and the allocator warmed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        for _ in range(3):   # a first sample may have to lengthen the spin
            excluded, t0 = clock.excluded, time.perf_counter()
            meter.sample(step, (), clock)
            kept = time.perf_counter() - t0 - (clock.excluded - excluded)
            if len(meter.gpu_s) > len(fractions):
                break
        assert len(meter.gpu_s) == len(fractions) + 1, (
            "no valid sample: the host waited on the GPU every time"
        )
        fractions.append(busy.busy_fraction(meter.gpu_s[-1], wall))
        # the clock keeps a sampled step's own time, near an unsampled one's: no spin in it
        assert 0.5 * wall < kept < 2 * wall, (kept, wall)
    assert fractions[0] > busy.HOST_BOUND and fractions[1] < fractions[0], fractions
    assert clock.excluded > 0


@pytest.mark.gpu
def test_a_cuda_job_records_its_busy_fraction(tmp_path):
    from helpers import TINY

    s = run_tiny(tmp_path, *TEN_STEPS, base=[o for o in TINY if not o.startswith("trainer.device")])
    m = s["metrics"]
    assert s["env"]["device"].startswith("cuda"), s["env"]
    assert (
        m["busy_samples"] >= 1
        and 0 < m["gpu_busy_fraction"] <= 1
        and m["host_bound"] in (True, False)
    )
    assert s["epochs"][0]["gpu_busy_fraction"] is not None
