"""scripts/benchmark.py: what each loop times (a fake clock that only moves in backward), the statistics over rounds
(known throughputs in, hand-computed medians, ratio and spread out), speed-ups against fp32, and the CLI on the CPU."""
import json
import statistics
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

from helpers import ROOT, load_script

BENCH = [sys.executable, str(ROOT / "scripts" / "benchmark.py")]
TINY = ["model=small_cnn", "model.width=8", "trainer.batch_size=16", "trainer.device=cpu"]
STEP_S = 0.25   # the fake clock's seconds per training step


@pytest.fixture
def bench():
    return load_script("benchmark")


@pytest.fixture
def step_clock(monkeypatch):
    """time.perf_counter frozen except in Tensor.backward, which advances it by STEP_S: a loop that times exactly
    its steady steps of batch b measures b / STEP_S samples/s; one that counts a warm-up step, or times one step
    too many or too few, measures something else."""
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
    overrides = bench.sized([*TINY, "model.width=4", "dataset.image_size=8", f"precision={precision}"], steps=4, warmup=3)
    expected = 16 / STEP_S   # batch 16, one fake step each
    assert bench.hand_throughput(overrides)["samples_per_s"] == pytest.approx(expected)
    assert bench.mixprec_throughput(overrides)["samples_per_s"] == pytest.approx(expected)


def test_overhead_discards_round_0_and_reports_medians_ratio_and_spread(bench, monkeypatch):
    """Known throughputs per call: round 0 (5 and 7) is discarded; the medians, their ratio and the spread of the
    per-round ratios are the hand-computed ones; each round runs the two loops in a seeded random order."""
    values = {"mixprec": [5.0, 90.0, 96.0, 120.0], "hand": [7.0, 100.0, 100.0, 100.0]}
    calls = []

    def fake(name):
        return lambda overrides: calls.append(name) or {"samples_per_s": values[name][calls.count(name) - 1]}

    monkeypatch.setattr(bench, "mixprec_throughput", fake("mixprec"))
    monkeypatch.setattr(bench, "hand_throughput", fake("hand"))
    args = Namespace(overrides=[*TINY, "dataset.image_size=8"], compile="none", steps=2, warmup=1, repeats=3, seed=0)
    res = bench.overhead(args)
    assert res["mixprec_samples_per_s"] == [90.0, 96.0, 120.0] and res["hand_samples_per_s"] == [100.0] * 3
    assert res["median_mixprec"] == 96.0 and res["median_hand"] == 100.0
    assert res["ratio"] == pytest.approx(0.96) and res["overhead"] == pytest.approx(100 / 96 - 1)
    assert res["spread"] == pytest.approx([0.9, 1.2])
    rounds = [tuple(calls[i:i + 2]) for i in range(0, len(calls), 2)]
    assert all(sorted(r) == ["hand", "mixprec"] for r in rounds) and len(set(rounds)) == 2   # both orders occur


def test_table_speedups_are_against_fp32(bench, monkeypatch):
    speed = {"fp32": 100.0, "amp": 250.0, "amp_bf16": 180.0}
    monkeypatch.setattr(bench, "mixprec_throughput", lambda o: {
        "samples_per_s": speed[next(x.split("=")[1] for x in o if x.startswith("precision="))], "mfu": None,
        "peak_memory_mb": 1.0})
    args = Namespace(models="small_cnn", precisions="fp32,amp,amp_bf16", overrides=[], steps=2, warmup=1)
    assert [r["speedup"] for r in bench.table(args)["rows"]] == [1.0, 2.5, 1.8]


@pytest.mark.slow
def test_the_cli_writes_both_loops_and_the_table(tmp_path):
    out = tmp_path / "overhead.json"
    r = subprocess.run([*BENCH, "overhead", *TINY, "dataset.image_size=8", "precision=amp_bf16", "--steps", "3",
                        "--warmup", "2", "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert len(res["mixprec_samples_per_s"]) == len(res["hand_samples_per_s"]) == 2
    assert res["median_hand"] == statistics.median(res["hand_samples_per_s"])
    assert f"ratio mixprec / hand: {res['ratio']:.3f}" in r.stdout and "harness overhead:" in r.stdout
    out = tmp_path / "table.json"
    r = subprocess.run([*BENCH, "table", "--models", "small_cnn", "--precisions", "fp32,amp", "model.width=8",
                        "trainer.batch_size=16", "dataset.image_size=8", "gpu=h100", "--steps", "2", "--warmup", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["model"], x["precision"]) for x in rows] == [("small_cnn", "fp32"), ("small_cnn", "amp")]
    assert all(x["mfu"] is None for x in rows)   # the h100 profile does not match a CPU: not used


def test_bad_input_is_one_line(bench, capsys):
    with pytest.raises(SystemExit, match=r"^benchmark: the hand-written loop covers the autocast family"):
        bench.main(["overhead", "precision=half"])
    with pytest.raises(SystemExit, match=r"^benchmark: the hand-written loop has no tricks"):
        bench.main(["overhead", "trick.label_smoothing=0.1"])
    assert bench.main(["overhead", "trainer.batch_size=0"]) == 2
    assert capsys.readouterr().err.strip().startswith("benchmark: config error: trainer.batch_size=0")
