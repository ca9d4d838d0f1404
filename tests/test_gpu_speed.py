"""scripts/gpu_speed.py (scripts/gpu_check.sh --speed): the 8-minute GPU speed check, rehearsed on the CPU at tiny
sizes (--dry-run): every step runs and the folder holds every file it should."""
import json
import subprocess

import pytest

from helpers import ROOT, load_script


@pytest.mark.slow   # eight steps, each a subprocess: about 3 minutes on 2 shared cores
def test_the_speed_check_dry_run_writes_every_file(tmp_path):
    out = tmp_path / "speed"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--speed", "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "every file is there" in r.stdout
    gs = load_script("gpu_speed")
    steps = gs.plan(out, True, [])
    assert gs.missing(out, steps) == []
    budget = json.loads((out / "budget.json").read_text())
    assert [s["name"] for s in budget["steps"]] == ["table_eager", "page10", "overhead_b64", "overhead_b256",
                                                    "gpt_eager", "table_compiled", "gpt_compiled", "gpt_wide_compiled"]
    assert all(s["outcome"] == "ok" for s in budget["steps"]) and budget["total_s"] < budget["budget_s"]
    assert not list(out.glob("*/*/*.pt"))   # the jobs' weights are not kept
    table = json.loads((out / "table_eager" / "table.json").read_text())
    assert table["complete"] and len(table["rows"]) == 4
    summary = (out / "SUMMARY.md").read_text()
    for part in ("## table_eager: speed table", "## table_compiled: speed table", "## Page's step 10",
                 "## GPT, eager", "## GPT, compiled", "## GPT 2 x 4096", "- batch 64: ratio mixprec / hand",
                 "a GPU run requests trainer.compile=default,reduce-overhead; the dry run ran eager"):
        assert part in summary


def test_a_gpu_run_requests_compiled_cells_and_the_issue_sizes(tmp_path):
    gs = load_script("gpu_speed")
    steps = {s["name"]: " ".join(s["cmd"]) for s in gs.plan(tmp_path, False, ["dataset.data_dir=/data"])}
    assert "--compiles default,reduce-overhead" in steps["table_compiled"] and "--batches 64,256" in steps["table_compiled"]
    assert "--compiles none" in steps["table_eager"] and "--precisions fp32,tf32,amp,amp_bf16,half,bf16" in steps["table_eager"]
    assert "trainer.compile=default" in steps["gpt_compiled"] and "precision=fp32,amp_bf16,fp8" in steps["gpt_compiled"]
    wide = steps["gpt_wide_compiled"]   # the width where torchao's float8 benchmarks show a gain (K, N >= 4096)
    assert "model.n_embd=4096" in wide and "precision=amp_bf16,fp8" in wide and "trainer.compile=default" in wide
    assert "trick=page_10_tta seed=0,1 dataset.data_dir=/data" in steps["page10"]
    assert "trainer.batch_size=64" in steps["overhead_b64"] and "trainer.batch_size=256" in steps["overhead_b256"]
    assert sum(s["limit"] for s in gs.plan(tmp_path, False, [])) > 450   # the budget, not the sum, bounds the run
    rows = [gs.run_step({"name": "late", "cmd": ["true"], "limit": 60, "files": []}, tmp_path, 5.0)]
    assert rows[0]["outcome"] == "skipped: out of budget"
