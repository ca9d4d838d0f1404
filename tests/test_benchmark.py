"""scripts/benchmark.py runs on the CPU: both loops measured, the overhead is their ratio, the table has MFU."""
import json
import subprocess
import sys

from helpers import ROOT

BENCH = [sys.executable, str(ROOT / "scripts" / "benchmark.py")]
TINY = ["model=small_cnn", "model.width=8", "trainer.batch_size=16", "trainer.device=cpu"]


def test_overhead_reports_both_loops_and_their_ratio(tmp_path):
    out = tmp_path / "overhead.json"
    r = subprocess.run([*BENCH, "overhead", *TINY, "precision=amp_bf16", "--steps", "3", "--warmup", "2",
                        "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert len(res["mixprec_samples_per_s"]) == len(res["hand_samples_per_s"]) == 2
    assert all(v > 0 for v in res["mixprec_samples_per_s"] + res["hand_samples_per_s"])
    assert res["overhead"] == res["median_hand"] / res["median_mixprec"] - 1
    assert res["ratio"] == res["median_mixprec"] / res["median_hand"]
    ratios = sorted(m / h for m, h in zip(res["mixprec_samples_per_s"], res["hand_samples_per_s"]))
    assert res["spread"] == [ratios[0], ratios[-1]]
    assert "harness overhead:" in r.stdout


def test_table_and_bad_input(tmp_path):
    out = tmp_path / "table.json"
    r = subprocess.run([*BENCH, "table", "--models", "small_cnn", "--precisions", "fp32,amp", "model.width=8",
                        "trainer.batch_size=16", "gpu=h100", "--steps", "2", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["model"], x["precision"]) for x in rows] == [("small_cnn", "fp32"), ("small_cnn", "amp")]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    assert all(x["mfu"] is None for x in rows)   # the h100 profile does not match a CPU: not used
    r = subprocess.run([*BENCH, "overhead", "precision=half"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "covers the autocast family" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*BENCH, "overhead", "trick.label_smoothing=0.1"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "has no tricks" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*BENCH, "overhead", "trainer.batch_size=0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("benchmark: config error: trainer.batch_size=0")
