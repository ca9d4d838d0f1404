"""scripts/reproduce.py's calibration continues after a kill as its sweeps do (a run of the script);
a replan and a Ctrl-C keep the minutes spent, what git keeps of its folders (the logic in
src/mixprec/tools/, the arguments parsed by the script)."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from helpers import ROOT, load_script
from mixprec.tools.folder import write_gitignore
from mixprec.tools.plan import load_plan
from mixprec.tools.reproduce import Progress, run_sweeps
from mixprec.tools.state import load_or_plan, make_state
from helpers.reproducing import _tiny_plan, reproduce


def _calibrated(out):
    return {p.parent.name: p for p in (out / "calibration").glob("*/*/summary.json")
            if json.loads(p.read_text())["status"] == "completed"}


@pytest.mark.slow   # real calibration jobs in subprocesses
def test_a_killed_calibration_continues_where_it_stopped(tmp_path):
    out, plan = tmp_path / "ref", _tiny_plan(tmp_path)
    args = ["--smoke", "--calibrate", "all", "--plan", "--plan-file", plan, "--out", out]
    proc = reproduce(*args, wait=False)
    deadline = time.time() + 600
    # until two of the six jobs of the second sweep's calibration are done
    while time.time() < deadline:
        if len([n for n in _calibrated(out) if n[:1].isdigit()]) >= 2 or proc.poll() is not None:
            break
        time.sleep(0.3)
    assert proc.poll() is None, proc.stdout.read()
    os.kill(proc.pid, signal.SIGKILL)   # reproduce.py; its running calibration sweep dies with it
    proc.wait()
    time.sleep(1)
    before = {n: (p.read_bytes(), p.stat().st_mtime_ns) for n, p in _calibrated(out).items()}
    assert 2 <= len(before) < 6 and not (out / "plan.json").exists()
    saved = json.loads((out / "calibration.json").read_text())
    # the first sweep's calibration was kept as it ended
    assert list(saved["sweeps"]) == ["broken"]
    r = reproduce(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        "continuing the calibration" in r.stdout
        and "1 sweep(s) calibrated before, kept" in r.stdout
    )
    after = _calibrated(out)
    assert len(after) == 6
    # calibration jobs finished before the kill did not run again
    for name, (data, mtime) in before.items():
        assert (after[name].read_bytes(), after[name].stat().st_mtime_ns) == (data, mtime), name
    commands = (out / "COMMANDS.md").read_text()
    assert (
        commands.count("calibration of broken") == 1 and commands.count("calibration of seeds") == 2
    )
    assert "trainer.resume=auto" in commands.split("calibration of seeds")[1]
    state = json.loads((out / "plan.json").read_text())
    assert len(state["calibration"]["sweeps"]["seeds"]["costs"]) == 6
    # another calibration (other options) in the same folder sets this one aside rather than reusing
    # its jobs
    r = reproduce(
        "--smoke", "--calibrate", "first", "--plan", "--plan-file", plan, "--out", out, "--replan"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "calibration: it was made with other options; moved to" in r.stdout
    assert len(list((out / "replaced").glob("calibration-*/seeds/*/summary.json"))) == 6


def test_replan_keeps_the_minutes_of_the_sweeps_it_keeps(tmp_path):
    """A --replan whose sweep command is unchanged keeps that sweep's progress, and the folder's
    time in its total (it was reset to the calibration's seconds: a 47-minute folder then said 0.1
    min in all), also the time no sweep holds (an attempt stopped before, the reports: 157 minutes
    once became 136); a sweep whose command changed starts over, and its time leaves the total."""
    plan_file, out = _tiny_plan(tmp_path), tmp_path / "ref"
    out.mkdir()
    args = load_script("reproduce").parse(   # the script's arguments; the rest: mixprec.tools
        ["--smoke", "--plan-file", str(plan_file), "--out", str(out), "--only", "seeds"]
    )
    args.calibrate = "first"
    plan = load_plan(plan_file).only(["seeds"]).smoked()
    old = make_state(plan, args, {"sweeps": {}, "seconds": 5.0, "mode": "first"}, None)
    old["sweeps"][0].update(status="done", actual_s=600.0)
    old["elapsed_s"] = 905.0   # 5 calibration + 600 in the sweep + 300 in no sweep
    (out / "plan.json").write_text(json.dumps(old))
    args.replan = True
    state = load_or_plan(plan, args, {})
    assert state["sweeps"][0]["status"] == "done" and state["elapsed_s"] == 905.0
    (out / "runs" / "seeds").mkdir(parents=True)
    old["sweeps"][0]["command"] = ["python", "train.py", "another=command"]
    (out / "plan.json").write_text(json.dumps(old))
    state = load_or_plan(plan, args, {})
    assert state["sweeps"][0]["status"] == "planned" and state["elapsed_s"] == 305.0
    assert list((out / "replaced").glob("seeds-*"))


def test_a_sweep_stopped_by_ctrl_c_keeps_its_minutes(tmp_path, monkeypatch):
    plan_file, out = _tiny_plan(tmp_path), tmp_path / "ref"
    out.mkdir()
    args = load_script("reproduce").parse(
        ["--smoke", "--plan-file", str(plan_file), "--out", str(out), "--only", "seeds"]
    )
    plan = load_plan(plan_file).only(["seeds"]).smoked()
    state = make_state(plan, args, {"sweeps": {}, "seconds": 5.0, "mode": "first"}, None)

    def stopped(*a, **k):
        time.sleep(0.2)
        raise KeyboardInterrupt

    monkeypatch.setattr("mixprec.tools.reproduce.spawn", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_sweeps(out, state, Progress(out, state))
    assert state["sweeps"][0]["actual_s"] >= 0.2   # a replan keeps it in the folder's total


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_ignores_what_the_tools_write_but_a_completed_reference_folder(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "outputs" / "reference").mkdir(parents=True)
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.setattr("mixprec.tools.folder.ROOT", repo)
    files = [
        "ENVIRONMENT.md",
        "plan.md",
        "plan.json",
        "calibration.json",
        "logs/seeds.log",
        "runs/seeds/0_seed=0/summary.json",
        "runs/seeds/0_seed=0/model_fp32.pt",
        "runs/seeds/0_seed=0/wandb/x",
        "calibration/seeds/0_seed=0/summary.json",
        "report/report.md",
    ]
    planned, done = (
        repo / "outputs" / "reference" / "cpu-plan",
        repo / "outputs" / "reference" / "h100-done",
    )
    for folder in (planned, done):
        for f in files:
            (folder / f).parent.mkdir(parents=True, exist_ok=True)
            (folder / f).write_text("x")
    for f in (
        "runs/2026-01-01_00-00-00/summary.json",
        "sweeps/x/0_/summary.json",
        "smoke/cpu/plan.md",
        "numerics/x/numerics.md",
    ):
        (repo / "outputs" / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / "outputs" / f).write_text("x")
    (repo / "outputs" / "reference" / "README.md").write_text("x")
    write_gitignore(planned, finished=False)   # a --plan, or a run not finished
    write_gitignore(done, finished=True)
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "outputs"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    kept = {f"outputs/reference/h100-done/{f}" for f in files if not f.endswith((".pt", "/x")) and
            not f.startswith("calibration/")}
    assert set(listed) == kept | {
        "outputs/reference/README.md",
        "outputs/reference/h100-done/.gitignore",
    }
