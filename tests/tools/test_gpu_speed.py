"""scripts/gpu_check.sh and its 8-minute speed check (scripts/gpu_speed.py, gpu_check.sh --speed):
the check runs every gpu-marked test; the speed check asks its questions in order of value, each
under a budget of its own that counts its compiles (the budgets within 8 minutes), runs on synthetic
data where a dataset is absent, and is rehearsed on the CPU at tiny sizes (--dry-run), graphs
counted."""
import json
import re
import os
import shlex
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, load_script
from mixprec.tools import cli

ORDER = ["fp8_wide", "table_eager", "table_compiled", "page10", "gpt"]
ALL = {"cifar10": True, "wikitext2": True}
NONE = {"cifar10": False, "wikitext2": False}


def gpu_check_pytest_args() -> list[str]:
    """The arguments of gpu_check.sh's `python -m pytest` command (the one line that runs it)."""
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    (line,) = [line for line in lines if line.startswith("python -m pytest")]
    return shlex.split(line)[3:]


def collected(args: list[str]) -> set[str]:
    """The node ids pytest selects with these arguments (verbosity aside: one -q lists the ids)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    args = [a for a in args if a not in ("-q", "-qq", "-v", "-vv")]
    r = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q",
                        "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {line for line in r.stdout.splitlines() if "::" in line}


@pytest.mark.slow   # two collections of the whole suite (each imports every test module)
def test_gpu_check_runs_every_gpu_marked_test():
    every = collected(["-m", "gpu", "tests/"])
    files = {test.split("::")[0] for test in every}
    assert {"tests/gpu/test_gpu.py", "tests/unit/runtime/test_busy.py",
            "tests/unit/train/test_compile.py", "tests/unit/train/test_speed.py"} <= files
    left_out = every - collected(gpu_check_pytest_args())
    assert not left_out, (f"{len(left_out)} gpu-marked tests gpu_check.sh does not run, e.g. "
                          f"{sorted(left_out)[:5]}")


def test_gpu_check_selects_the_gpu_marker_over_the_whole_suite():
    """The quick twin of the collection test above: gpu_check.sh's pytest selects by the gpu marker
    alone over all of tests/ (no -k, no file, no deselection: a narrower command leaves gpu tests
    out), and the marker is the one pyproject declares."""
    args = gpu_check_pytest_args()
    output_only = ("-q", "-qq", "-v", "-rA", "-x")
    selecting = [a for a in args if a not in output_only and not a.startswith("--durations")
                 and a not in ("-p", "no:cacheprovider")]
    assert selecting == ["-m", "gpu", "tests/"], selecting
    assert '"gpu: needs a CUDA GPU' in (ROOT / "pyproject.toml").read_text()


def test_the_questions_come_in_order_of_value_each_with_its_budget(tmp_path):
    gs = load_script("gpu_speed")
    steps = gs.plan(tmp_path, False, ["dataset.data_dir=/data"], ALL)
    assert [s["name"] for s in steps] == ORDER
    assert sum(s["budget"] for s in steps) <= gs.BUDGET_S == 480
    by = {s["name"]: s for s in steps}
    compiled = ("fp8_wide", "table_compiled", "page10")
    for s in steps:   # a compiled step's budget holds each of its graphs' compile time
        assert s["budget"] >= s["run_s"] + s["graphs"] * s["compile_s"]
        assert (s["graphs"] > 0 and s["compile_s"] > 0) == (s["name"] in compiled)
    cmd = {s["name"]: " ".join(s["cmd"]) for s in steps}
    wide = cmd["fp8_wide"]   # where torchao's float8 benchmarks show a gain (K, N >= 4096)
    assert "model.n_embd=4096" in wide and "precision=amp_bf16,fp8" in wide
    assert "trainer.compile=default" in wide
    assert by["fp8_wide"]["graphs"] == 4   # amp_bf16, fp8: a training and an evaluation graph each
    assert "--compiles none" in cmd["table_eager"] and "--batches 64,256" in cmd["table_eager"]
    assert f"--precisions {gs.TABLE_PRECISIONS}" in cmd["table_eager"]
    assert "--compiles default,reduce-overhead" in cmd["table_compiled"]
    assert by["table_compiled"]["graphs"] == 4
    assert "trick=page_10_tta seed=0 trainer.compile=none,reduce-overhead" in cmd["page10"]
    # the reduce-overhead job's training graph (its EMA evaluates eagerly)
    assert by["page10"]["graphs"] == 1
    assert "precision=fp32,amp_bf16,fp8 trainer.compile=none" in cmd["gpt"]
    assert "dataset.data_dir=/data" in cmd["page10"] and "dataset.data_dir=/data" in cmd["gpt"]


def test_a_missing_dataset_means_synthetic_data_said_in_one_line(tmp_path):
    gs = load_script("gpu_speed")
    root, present = gs.found_data([f"dataset.data_dir={tmp_path}"])
    assert root == tmp_path and present == NONE
    steps = gs.plan(tmp_path, False, [f"dataset.data_dir={tmp_path}", "gpu=h100"], present)
    cmd = {s["name"]: s["cmd"] for s in steps}
    assert "dataset=synthetic" in cmd["page10"] and "dataset.train_size=50000" in cmd["page10"]
    assert "dataset=synthetic_text" in cmd["gpt"] and "dataset.train_size=2088628" in cmd["gpt"]
    for name in ("page10", "gpt", "fp8_wide"):   # a synthetic dataset has no data_dir key
        assert not any(o.startswith("dataset.data_dir") for o in cmd[name])
        assert "gpu=h100" in cmd[name]
    lines = gs.data_lines(steps, root, False)
    assert len(lines) == 3 and lines[0].startswith("fp8_wide: dataset=synthetic_text")
    assert lines[1].startswith("page10: CIFAR-10 not found: runs on dataset=synthetic")
    assert str(tmp_path) in lines[1] and "Page's accuracy is skipped" in lines[1]
    assert lines[2].startswith("gpt: Wikitext-2 not found: runs on dataset=synthetic_text")
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    (tmp_path / "wikitext-2").mkdir()
    for split in ("train", "valid", "test"):
        (tmp_path / "wikitext-2" / f"{split}.txt").write_text("a b\n")
    assert gs.found_data([f"dataset.data_dir={tmp_path}"])[1] == ALL


def test_pages_accuracy_is_skipped_in_one_line_without_cifar10(tmp_path):
    gs = load_script("gpu_speed")
    env = {"device_name": "NVIDIA H200", "torch": "2.14.1", "date": "today", "command": "x"}
    without = gs.summary_markdown(tmp_path, env, gs.plan(tmp_path, False, [], NONE), "", [])
    with_cifar = gs.summary_markdown(tmp_path, env, gs.plan(tmp_path, False, [], ALL), "", [])
    skipped = [line for line in without.splitlines() if "accuracy" in line.lower()]
    assert skipped == [gs.PAGE_SKIPPED]
    assert gs.PAGE_SKIPPED == ("Page's accuracy: skipped (CIFAR-10 absent: the jobs ran on "
                               "dataset=synthetic).")
    assert ("- Page's step 10 on his clock (training + data preparation, as dawn.py timed it; his "
            "26 s): - s (- s training) eager, - s (- s training) under reduce-overhead "
            "(target <= 4 s)\n") in without
    assert "Page's accuracy: skipped" not in with_cifar
    assert ("- s (- s training) under reduce-overhead (target <= 4 s); test accuracy - eager, "
            "- under CUDA graphs" in with_cifar)
    # the test accuracy column: fp8_wide's, gpt's and, with CIFAR-10, Page's
    assert with_cifar.count("| test acc |") == 3 and without.count("| test acc |") == 2


def test_a_step_out_of_time_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    gs = load_script("gpu_speed")
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    slow = gs.step("slow", "a step that overruns", sleep, [], run_s=10)
    quick = gs.step("quick", "the next question", [sys.executable, "-c", "pass"], [], run_s=10)
    monkeypatch.setattr(gs, "plan", lambda out, dry, extra, present, mxfp8: [slow, quick])
    monkeypatch.setattr(gs, "environment", lambda dry: {"device_name": "NVIDIA H200"})
    assert gs.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "budget.json").read_text())["steps"]
    assert [(r["name"], r["outcome"]) for r in rows] == [("slow", "timed out"), ("quick", "ok")]
    assert rows[0]["seconds"] < 10 and rows[0]["limit_s"] == 10
    budget = (tmp_path / "budget.md").read_text()
    assert "| slow | a step that overruns | 10 (10 + 0 x 0) | 10 | 0 | - |" in budget


def test_the_default_folder_is_one_git_keeps():
    gs = load_script("gpu_speed")
    out = gs.default_out({"device_name": "NVIDIA H100 80GB HBM3"}, False)
    assert out.parent == ROOT / "outputs" / "reference"
    assert out.name.startswith("nvidia-h100-80gb-hbm3-speed-20")
    ignored = lambda path: subprocess.run(["git", "check-ignore", "-q", str(path)],
                                          cwd=ROOT).returncode
    assert ignored(out / "SUMMARY.md") == 1   # not ignored: a user can commit it
    assert ignored(out / "fp8_wide" / "0_job" / "weights.pt") == 0   # weights are (and deleted)
    assert gs.default_out({}, True).parent == ROOT / "outputs" / "gpu_speed_dry"


@pytest.mark.slow   # five steps, each a subprocess: about 2.5 minutes on 2 shared cores
def test_the_speed_check_dry_run_counts_its_graphs_and_writes_every_file(tmp_path):
    out = tmp_path / "speed"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--speed", "--dry-run",
                        "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "every file is there" in r.stdout
    assert "gpu_speed: dry run: every step at tiny sizes" in r.stdout
    gs = load_script("gpu_speed")
    steps = gs.plan(out, True, [], NONE, mxfp8=True)   # the dry run rehearses the MXFP8 job
    assert gs.missing(out, steps) == []
    budget = json.loads((out / "budget.json").read_text())
    assert [s["name"] for s in budget["steps"]] == ORDER
    assert all(s["outcome"] == "ok" for s in budget["steps"])
    # each step compiled the graphs its budget assumes: fp8_wide 6 (amp_bf16, fp8, mxfp8),
    # table_compiled 4, page10 1
    assert ([(s["graphs_counted"], s["graphs"]) for s in budget["steps"]]
            == [(6, 6), (0, 0), (4, 4), (1, 1), (0, 0)])
    assert not list(out.glob("*/*/*.pt"))   # the jobs' weights are not kept
    table = json.loads((out / "table_eager" / "table.json").read_text())
    assert table["complete"] and len(table["rows"]) == 6
    compiled = json.loads((out / "table_compiled" / "table.json").read_text())
    assert {r["compile"] for r in compiled["rows"]} == {"default", "reduce-overhead"}
    page = {r["compile"]: r for r in gs.job_rows(out, "page10")}
    assert set(page) == {"none", "reduce-overhead"}
    assert all(r["status"] == "completed" for r in page.values())
    summary = (out / "SUMMARY.md").read_text()
    for part in ("## Answers", "- fp8 / amp_bf16, 2 x 4096 GPT compiled:",
                 "- mxfp8 / amp_bf16, 2 x 4096 GPT compiled: dry run on",
                 "## FP8 (and, where native, MXFP8) against amp_bf16",
                 "## table_eager: speed table", "## table_compiled: speed table",
                 "## Page's step 10", "## GPT 12 x 768, eager",
                 "| fp8_wide | fp8, mxfp8 against amp_bf16, 2 x 4096 GPT, compiled | 187 (55 + 6 x "
                 "22)"):
        assert part in summary, part


def test_a_bad_override_fails_in_one_line_before_any_step(tmp_path, capsys):
    """A typo among the user's overrides ends the check before any step, in one line, in a dry run
    too (whose tiny sizes leave most overrides out of its commands)."""
    gs = load_script("gpu_speed")
    out = tmp_path / "check"
    code = cli.run("gpu_speed", gs.main, ["--dry-run", "--out", str(out), "dataset.datadir=/data"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("gpu_speed: config error: dataset.datadir: no such key")
    assert not out.exists()   # nothing ran, nothing written


def write_job(folder, precision, compile_mode, throughput, graphs=None, eager=None):
    """A train.py job's summary.json as a speed-check step leaves it."""
    folder.mkdir(parents=True)
    metrics = {"throughput": throughput}
    if graphs is not None:
        metrics.update(compiled_graphs=graphs, eager_calls=eager)
    (folder / "summary.json").write_text(json.dumps({
        "status": "completed", "choices": {"precision": precision}, "metrics": metrics,
        "config": {"trainer": {"compile": compile_mode}}}))


def test_each_answer_names_its_graphs_and_a_partly_eager_ratio_says_so(tmp_path):
    gs = load_script("gpu_speed")
    write_job(tmp_path / "fp8_wide" / "0", "amp_bf16", "default", 100.0, 2, 0)
    write_job(tmp_path / "fp8_wide" / "1", "fp8", "default", 150.0, 2, 37)
    (line,) = [x for x in gs.answers(tmp_path, {}) if x.startswith("- fp8 / amp_bf16")]
    assert "1.50x" in line
    assert "amp_bf16 2 graphs, 0 eager calls; fp8 2 graphs, 37 eager calls" in line
    assert "PARTLY EAGER (fp8): this ratio mixes eager and compiled time" in line
    rows = gs.jobs_markdown("t", gs.job_rows(tmp_path, "fp8_wide"))
    assert any("| 2 / 37 |" in r for r in rows), rows


def test_a_dry_run_answers_with_no_ratio(tmp_path):
    """A dry run's answers are tiny CPU jobs: each says so in place of a figure."""
    gs = load_script("gpu_speed")
    write_job(tmp_path / "fp8_wide" / "0", "amp_bf16", "default", 100.0, 2, 0)
    write_job(tmp_path / "fp8_wide" / "1", "fp8", "default", 27.0, 2, 0)
    (tmp_path / "table_eager").mkdir()
    (tmp_path / "table_eager" / "table.json").write_text(json.dumps({"rows": [
        {"model": "resnet18", "precision": p, "batch": 8, "compile": "none",
         "samples_per_s": v} for p, v in (("fp32", 10.0), ("amp", 2.7))]}))
    lines = [x for x in gs.answers(tmp_path, {}, "x86_64") if x.startswith("- ")]
    assert len(lines) == 4
    for line in lines:
        assert line.endswith(": dry run on x86_64: not a measurement"), line
        assert not re.search(r"\d\.\d\dx", line), line


def test_a_gpu_with_mxfp8_tensor_cores_is_asked_mxfp8_against_amp_bf16(tmp_path):
    """MXFP8 was never asked (a B200 passed the check without one MXFP8 job): where it is native,
    fp8_wide runs it as a third compiled job, within BUDGET_S + MX_S; elsewhere the answer says
    why not (torchao would emulate it: PyTorch's casts, not an MXFP8 time)."""
    gs = load_script("gpu_speed")
    native = gs.plan(tmp_path, False, [], ALL, mxfp8=True)
    wide = native[0]
    assert "precision=amp_bf16,fp8,mxfp8" in " ".join(wide["cmd"]) and wide["graphs"] == 6
    assert wide["files"] == [("fp8_wide/*/summary.json", 3)]
    assert sum(s["budget"] for s in native) <= gs.BUDGET_S + gs.MX_S
    assert "precision=amp_bf16,fp8 " in " ".join(gs.plan(tmp_path, False, [], ALL)[0]["cmd"])
    for i, (p, v) in enumerate((("amp_bf16", 100.0), ("fp8", 120.0), ("mxfp8", 150.0))):
        write_job(tmp_path / "fp8_wide" / str(i), p, "default", v, 2, 0)
    asked = [x for x in gs.answers(tmp_path, {"fp8_wide": wide}) if x.startswith("- mxfp8")]
    assert asked == ["- mxfp8 / amp_bf16, 2 x 4096 GPT compiled: 1.50x (150 against 100 "
                     "tokens/s)"]
    (line,) = [x for x in gs.answers(tmp_path, {}) if x.startswith("- mxfp8")]
    assert line.endswith(gs.MX_NOT_ASKED) and "compute capability 10.0+" in line
    if not torch.cuda.is_available():
        assert not gs.native_mxfp8(False)


def test_a_ratio_over_a_job_whose_graphs_broke_says_so(tmp_path):
    """A compiled job that ran in pieces between graph breaks (graph_breaks, FSDP's BatchNorm units
    once) is partly eager: its ratio says so, as for eager calls."""
    gs = load_script("gpu_speed")
    write_job(tmp_path / "fp8_wide" / "0", "amp_bf16", "default", 100.0, 2, 0)
    write_job(tmp_path / "fp8_wide" / "1", "fp8", "default", 150.0, 9, 0)
    summary = json.loads((tmp_path / "fp8_wide" / "1" / "summary.json").read_text())
    summary["metrics"]["graph_breaks"] = 7
    (tmp_path / "fp8_wide" / "1" / "summary.json").write_text(json.dumps(summary))
    (line,) = [x for x in gs.answers(tmp_path, {}) if x.startswith("- fp8 / amp_bf16")]
    assert "amp_bf16 2 graphs, 0 eager calls; fp8 9 graphs, 7 graph breaks, 0 eager calls" in line
    assert "PARTLY EAGER (fp8)" in line
