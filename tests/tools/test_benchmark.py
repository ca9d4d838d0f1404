"""scripts/benchmark.py: what each loop times (a fake clock that only moves in backward), the
statistics over rounds (known throughputs in, hand-computed medians, ratio and spread out),
speed-ups against fp32, and the CLI on the CPU."""
import json
import statistics
import subprocess
import sys
import time
import weakref
from argparse import Namespace

import pytest
import torch

from helpers import ROOT, load_script
from helpers.fakes import FakeClock, Timed

BENCH = [sys.executable, str(ROOT / "scripts" / "benchmark.py")]
TINY = ["model=small_cnn", "model.width=8", "trainer.batch_size=16", "trainer.device=cpu"]
STEP_S = 0.25   # the fake clock's seconds per training step


@pytest.fixture
def bench():
    return load_script("benchmark")


@pytest.fixture
def step_clock(monkeypatch):
    """time.perf_counter frozen except in Tensor.backward, which advances it by STEP_S: a loop that
    times exactly its steady steps of batch b measures b / STEP_S samples/s; one that counts a
    warm-up step, or times one step too many or too few, measures something else."""
    now = [1000.0]
    backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        now[0] += STEP_S
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.Tensor, "backward", timed_backward)


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
@pytest.mark.slow
def test_both_loops_time_exactly_their_steps_after_warmup(bench, step_clock, precision):
    overrides = bench.sized(
        [*TINY, "model.width=4", "dataset.image_size=8", f"precision={precision}"],
        steps=4,
        warmup=3,
    )
    expected = 16 / STEP_S   # batch 16, one fake step each
    assert bench.hand_throughput(overrides)["samples_per_s"] == pytest.approx(expected)
    assert bench.mixprec_throughput(overrides)["samples_per_s"] == pytest.approx(expected)


def test_overhead_discards_round_0_and_reports_medians_ratio_and_spread(bench, monkeypatch):
    """Known throughputs per call: round 0 (5 and 7) is discarded; the medians, their ratio and the
    spread of the per-round ratios are the hand-computed ones; each round runs the two loops in a
    seeded random order."""
    values = {"mixprec": [5.0, 90.0, 96.0, 120.0], "hand": [7.0, 100.0, 100.0, 100.0]}
    calls = []

    def fake(name):
        return lambda overrides: (
            calls.append(name) or {"samples_per_s": values[name][calls.count(name) - 1]}
        )

    monkeypatch.setattr(bench, "mixprec_throughput", fake("mixprec"))
    monkeypatch.setattr(bench, "hand_throughput", fake("hand"))
    args = Namespace(
        overrides=[*TINY, "dataset.image_size=8"],
        compile="none",
        steps=2,
        warmup=1,
        repeats=3,
        seed=0,
    )
    res = bench.overhead(args)
    assert (
        res["mixprec_samples_per_s"] == [90.0, 96.0, 120.0]
        and res["hand_samples_per_s"] == [100.0] * 3
    )
    assert res["median_mixprec"] == 96.0 and res["median_hand"] == 100.0
    assert res["ratio"] == pytest.approx(0.96) and res["overhead"] == pytest.approx(100 / 96 - 1)
    assert res["spread"] == pytest.approx([0.9, 1.2])
    rounds = [tuple(calls[i:i + 2]) for i in range(0, len(calls), 2)]
    # both orders occur
    assert all(sorted(r) == ["hand", "mixprec"] for r in rounds) and len(set(rounds)) == 2


def test_table_builds_each_model_once_and_speedups_are_against_fp32_of_the_same_batch_and_compile(
    bench, monkeypatch
):
    speed = {
        ("fp32", 4): 100.0,
        ("amp", 4): 250.0,
        ("amp_bf16", 4): 180.0,
        ("fp32", 8): 200.0,
        ("amp", 8): 300.0,
        ("amp_bf16", 8): 500.0,
    }
    built = []
    real_build = bench.build_base
    monkeypatch.setattr(
        bench, "build_base", lambda *a: built.append(a[0].model.arch) or real_build(*a)
    )
    monkeypatch.setattr(
        bench,
        "time_cell",
        lambda cfg, *a: {
            "samples_per_s": speed[cfg.precision.name, cfg.trainer.batch_size],
            "emulated": False,
            "step_ms": 1.0,
            "gpu_busy_fraction": None,
            "peak_memory_mb": None,
        },
    )
    args = Namespace(
        models="small_cnn",
        precisions="fp32,amp,amp_bf16",
        overrides=[*TINY, "dataset.image_size=8"],
        steps=2,
        warmup=1,
        batches=[4, 8],
        compiles=["none"],
    )
    rows, _ = bench.table_cells(args)
    assert built == ["small_cnn"]
    assert [(r["batch"], r["precision"], r["speedup"]) for r in rows] == [
        (4, "fp32", 1.0),
        (4, "amp", 2.5),
        (4, "amp_bf16", 1.8),
        (8, "fp32", 1.0),
        (8, "amp", 1.5),
        (8, "amp_bf16", 2.5),
    ]


def test_the_speed_table_times_every_cell_in_seconds_and_writes_json_and_markdown(bench, tmp_path):
    out = tmp_path / "table"
    t0 = time.perf_counter()
    assert (
        bench.main(
            [
                "table",
                "--models",
                "small_cnn",
                "--precisions",
                "fp32,amp_bf16",
                "--batches",
                "4,8",
                *TINY,
                "dataset.image_size=8",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert time.perf_counter() - t0 < 60
    res = json.loads((out / "table.json").read_text())
    assert [(r["model"], r["precision"], r["batch"], r["compile"]) for r in res["rows"]] == [
        ("small_cnn", p, b, "none") for b in (4, 8) for p in ("fp32", "amp_bf16")]
    for r in res["rows"]:
        assert r["samples_per_s"] > 0 and r["step_ms"] > 0 and r["cell_s"] < 30
        # a CPU: not measured, no fake number
        assert r["gpu_busy_fraction"] is None and r["peak_memory_mb"] is None
        # amp_bf16 is emulated here: no speed-up
        assert r["speedup"] == (1.0 if r["precision"] == "fp32" else None)
    md = (out / "table.md").read_text().splitlines()
    rows = [line for line in md if line.startswith("| small_cnn")]
    assert len(rows) == 4 and rows[1].endswith("| - | - | emulated: an fp32 time |")
    assert md[0].startswith("# Speed table (") and "4 cells in" in md[2]


@pytest.mark.slow
def test_the_cli_writes_both_loops_and_the_table(tmp_path):
    out = tmp_path / "overhead.json"
    r = subprocess.run(
        [
            *BENCH,
            "overhead",
            *TINY,
            "dataset.image_size=8",
            "precision=amp_bf16",
            "--steps",
            "3",
            "--warmup",
            "2",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert len(res["mixprec_samples_per_s"]) == len(res["hand_samples_per_s"]) == 2
    assert res["median_hand"] == statistics.median(res["hand_samples_per_s"])
    assert (
        f"ratio mixprec / hand: {res['ratio']:.3f}" in r.stdout and "harness overhead:" in r.stdout
    )
    r = subprocess.run(
        [
            *BENCH,
            "table",
            "--models",
            "small_cnn",
            "--precisions",
            "fp32,amp",
            "model.width=8",
            "dataset.image_size=8",
            "--batches",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / "table"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "table" / "table.json").read_text())["rows"]
    assert [(x["model"], x["precision"], x["batch"]) for x in rows] == [
        ("small_cnn", "fp32", 16),
        ("small_cnn", "amp", 16),
    ]


def test_bad_input_is_one_line(bench, capsys):
    with pytest.raises(
        SystemExit, match=r"^benchmark: the hand-written loop covers the autocast family"
    ):
        bench.main(["overhead", "precision=half"])
    with pytest.raises(SystemExit, match=r"^benchmark: the hand-written loop has no tricks"):
        bench.main(["overhead", "trick.label_smoothing=0.1"])
    assert bench.main(["overhead", "trainer.batch_size=0"]) == 2
    assert (
        capsys.readouterr().err.strip().startswith("benchmark: config error: trainer.batch_size=0")
    )


def test_a_table_cell_samples_until_the_host_queued_a_step_ahead_and_reports_its_busy_fraction(
    bench, monkeypatch
):
    """A cell samples a job's steady steps (busy.SAMPLE_AT) with the job's meter: the first
    sample, which the host waited in, gives no figure and a longer spin; the second does."""
    from helpers.fakes import FakeTimer

    from mixprec.runtime import busy

    class OnceTimer(FakeTimer):   # the first sample: the host waited; the next: queued ahead
        queries = 0

        @property
        def host_waited(self):
            self.queries += 1
            return self.queries == 1

        @host_waited.setter
        def host_waited(self, value):
            pass

    clock = FakeClock()   # moves only with the training forwards (10 ms each) and the fake GPU
    monkeypatch.setattr(time, "perf_counter", clock)
    timer = OnceTimer(clock, 0.4)
    monkeypatch.setattr(busy, "meter_for", lambda device, world=1: busy.BusyMeter(timer, clock))
    cfg, _ = bench.compose([*TINY, "dataset.image_size=8", "precision=fp32"])
    base, shape, classes = bench.build_base(cfg, torch.device("cpu"))
    base = Timed(base, clock, lambda k: 0.01)
    cell = bench.time_cell(cfg, base, shape, classes, torch.device("cpu"), 1, 6)
    assert timer.queries == 2 and len(timer.spins) == 2
    # the GPU busy 40% of the sampled step's 10 ms of queuing, against the steps' 10 ms of wall time
    assert cell["gpu_busy_fraction"] == pytest.approx(0.4) and cell["host_bound"] is True
    assert cell["gpu_step_ms"] == pytest.approx(4.0)


FUSED_AMP = ["precision=amp", "optimizer.impl=fused"]


def counted_calls(monkeypatch, *targets) -> dict:
    """How often each (owner, name) of targets is called, by name."""
    calls = {}
    for owner, name in targets:
        original, calls[name] = getattr(owner, name), 0

        def counted(*args, _f=original, _n=name, **kwargs):
            calls[_n] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("overrides, per_step", [
    (FUSED_AMP, 0),                                     # the found-inf flag: read at the flush
    (["precision=amp", "optimizer.impl=foreach"], 1),   # GradScaler's own check, as in a job
    (["precision=fp32"], 0),
])
def test_a_table_cell_syncs_per_step_as_a_job_does(bench, monkeypatch, overrides, per_step):
    """A cell runs a job's loop (loop.fit: a log window, its one flush):
    tests/unit/train/test_speed.py's sync count for a job, here for a cell: 0 syncs in a steady
    fused-amp step, and the window flushed as a job flushes it."""
    from helpers.fakes import SyncCounter

    from mixprec.train import image_steps
    from mixprec.train import loop
    from mixprec.numerics.probe import Attribution

    counter = SyncCounter(monkeypatch)
    counter.off_during(monkeypatch, Attribution, "see_batch")   # step 1's input check, once a run
    counter.on_during(monkeypatch, image_steps.ImageSteps, "step")
    calls = counted_calls(monkeypatch, (image_steps.ImageSteps, "step"), (loop, "flush"))
    cfg, _ = bench.compose([*TINY, "dataset.image_size=8", *overrides])
    base, shape, classes = bench.build_base(cfg, torch.device("cpu"))
    cell = bench.time_cell(cfg, base, shape, classes, torch.device("cpu"), 2, 4)
    assert calls["step"] == 6 and cell["samples_per_s"] > 0
    assert counter.count == 6 * per_step
    assert calls["flush"] >= 1   # the found-inf flags and losses read once, at the window's end


def layouts_seen(monkeypatch) -> list:
    """Records the memory layout of every batch the loop's forward gets (step.forward, which the
    step's image_forward calls)."""
    from mixprec.train import step

    seen, forward = [], step.forward

    def recorded(model, x, policy):
        nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        seen.append("channels_last" if nhwc else "nchw" if x.is_contiguous() else "other")
        return forward(model, x, policy)
    monkeypatch.setattr(step, "forward", recorded)
    return seen


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_table_cell_feeds_batches_in_the_jobs_memory_format(bench, tmp_path, monkeypatch,
                                                               channels_last):
    """A job's pipeline gives channels_last batches to a channels_last model
    (data.pipelines.in_layout); a cell must too, or its convolutions time a layout conversion no
    job makes."""
    from helpers import run_tiny

    flag = f"trainer.channels_last={str(channels_last).lower()}"
    seen = layouts_seen(monkeypatch)
    job = run_tiny(tmp_path, "dataset.image_size=8", flag)
    assert job["status"] == "completed"
    job_layouts, seen[:] = set(seen), []
    cfg, _ = bench.compose([*TINY, "dataset.image_size=8", flag])
    base, shape, classes = bench.build_base(cfg, torch.device("cpu"))
    bench.time_cell(cfg, base, shape, classes, torch.device("cpu"), 1, 2)
    assert set(seen) == job_layouts == {"channels_last" if channels_last else "nchw"}


OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"
COMPILE_ERROR = "backend='inductor' raised: CompilationError"


def test_a_failing_cell_is_recorded_and_the_table_goes_on(bench, tmp_path, monkeypatch):
    """An OOM in one cell's step and a compile error in others: each recorded with its error, dynamo
    reset and the device's cache emptied after each (the failed cell's model freed first), the other
    cells timed; table.json and table.md name every failed cell."""
    from mixprec.train import compile
    from mixprec.train import step

    forward, compile_model = step.forward, compile.compile_model
    resets, emptied, failed_models = [], [], []

    def oom_at_fp32_batch_4(model, x, policy):
        if policy.cfg.name == "fp32" and len(x) == 4:
            failed_models.append(weakref.ref(model))
            raise torch.OutOfMemoryError(OOM)
        return forward(model, x, policy)

    def compile_error(model, mode, **options):
        if mode == "default":
            raise RuntimeError(COMPILE_ERROR)
        return compile_model(model, mode, **options)
    monkeypatch.setattr(step, "forward", oom_at_fp32_batch_4)
    monkeypatch.setattr(bench, "compile_model", compile_error)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(torch.cpu, "empty_cache",
                        lambda: emptied.append([m() for m in failed_models]), raising=False)
    out = tmp_path / "table"
    assert bench.main(["table", "--models", "small_cnn", "--precisions", "fp32,tf32",
                       "--batches", "4,8", "--compiles", "none,default", *TINY,
                       "dataset.image_size=8", "--steps", "2", "--warmup", "1",
                       "--out", str(out)]) == 0
    res = json.loads((out / "table.json").read_text())
    failed = {(r["precision"], r["batch"], r["compile"]): r["error"]
              for r in res["rows"] if r["error"]}
    assert failed == {("fp32", 4, "none"): f"OutOfMemoryError: {OOM}",
                      **{(p, b, "default"): f"RuntimeError: {COMPILE_ERROR}"
                         for p in ("fp32", "tf32") for b in (4, 8)}}
    assert res["complete"] and len(res["rows"]) == 8
    assert [(f["precision"], f["batch"], f["compile"]) for f in res["failed"]] == list(failed)
    timed = [r for r in res["rows"] if not r["error"]]
    assert [(r["precision"], r["batch"]) for r in timed] == [("tf32", 4), ("fp32", 8), ("tf32", 8)]
    assert all(r["samples_per_s"] > 0 for r in timed)
    assert timed[0]["speedup"] is None   # its fp32 cell failed
    assert len(resets) >= 5 and len(emptied) >= 5   # after every failed cell at least
    assert failed_models and emptied[0] == [None]   # the OOM cell's model freed before the emptying
    md = (out / "table.md").read_text()
    assert md.count("| failed |") == 5 and "Failed cells (5)" in md
    assert f"- small_cnn fp32 batch 4 compile none: OutOfMemoryError: {OOM}" in md
    monkeypatch.setattr(step, "forward", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):   # a user's Ctrl-C still ends the table
        bench.main(["table", "--models", "small_cnn", "--precisions", "fp32", "--batches", "4",
                    *TINY, "dataset.image_size=8", "--steps", "1", "--warmup", "1"])


@pytest.mark.gpu
def test_a_cuda_table_cell_makes_no_sync_in_an_amp_step_and_measures_gpu_busy(bench, monkeypatch):
    """CUDA's own count, as test_speed.test_cuda_syncs_per_step counts a job's:
    torch.cuda.set_sync_debug_mode("warn") during the loop's steps of an amp cell
    (optimizer.impl=auto: fused on CUDA): none; and its GPU busy fraction is measured (a step that
    reads found-inf at once gave '-'), its peak memory too."""
    import warnings

    from mixprec.train import image_steps
    step = image_steps.ImageSteps.step

    def watched(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return step(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    monkeypatch.setattr(image_steps.ImageSteps, "step", watched)
    device = torch.device("cuda")
    cfg, _ = bench.compose(["model=small_cnn", "model.width=8", "trainer.batch_size=16",
                            "dataset.image_size=8", "precision=amp", "trainer.device=cuda"])
    base, shape, classes = bench.build_base(cfg, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cell = bench.time_cell(cfg, base, shape, classes, device, 2, 8)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == []
    assert cell["gpu_busy_fraction"] is not None and cell["gpu_step_ms"] > 0
    assert cell["peak_memory_mb"] > 0
