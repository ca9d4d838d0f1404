"""scripts/reproduce.py (its logic in src/mixprec/tools/) and its plan
(src/mixprec/tools/plan.yaml): the plan agrees with the presets, the published numbers and the
README; cutting to a budget; and, as real runs of the script on the CPU, resume after kill -9, a
failing sweep, two results folders side by side, and the whole --smoke plan."""
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, compose_config
from helpers.reproducing import _tiny_plan, reproduce
from mixprec.tools.plan import (
    PLAN_FILE,
    PlanError,
    Sweep,
    apply_cut,
    fit,
    load_plan,
    parse_duration,
    readme_table,
)
from mixprec.tools.estimate import _flops
from mixprec.tools.state import plan_summary
from mixprec.report.published import load_sources


# ----------------------------------------------------------------------------------------- the plan


def test_plan_runs_every_preset_grid_and_covers_every_published_value():
    plan = load_plan()
    for exp in (
        "fastai_cifar100",
        "apex_word_lm",
        "apex_word_lm_readme",
        "half_pitfalls",
        "opt_levels",
        "page_ladder",
        "torch_amp",
    ):
        params = compose_config(f"experiment={exp}").hydra.sweeper.params
        axes = [str(v).split(",") for v in params.values()]
        preset = {tuple(sorted(zip(params, vals))) for vals in itertools.product(*axes)}
        planned = {
            tuple(sorted(job.items()))
            for s in plan.sweeps
            if s.command == "train" and list(s.overrides) == [f"experiment={exp}"]
            for job in s.jobs
        }
        assert planned == preset, exp
    sources = {s.id: s for s in load_sources()}
    articles = {a.id: a for a in plan.articles}
    assert set(articles) == set(sources)   # one article per published source, and no other
    for a in plan.articles:
        assert set(a.not_reproduced) <= {v.id for v in sources[a.id].values}, a.id


def test_readme_reproductions_table_is_the_plan():
    readme = (ROOT / "README.md").read_text()
    table = readme_table(load_plan())
    assert table in readme, (
        "README's reproductions table differs from src/mixprec/tools/plan.yaml; regenerate it "
        "with: python -c 'from mixprec.tools.plan import *; print(readme_table(load_plan()))'"
    )
    # every command the table lists is one of the plan's (a hand count of the plan file's sweeps)
    n_sweeps = sum(len(a["sweeps"]) for a in yaml.safe_load(PLAN_FILE.read_text())["articles"])
    assert table.count("`python ") == n_sweeps == 9


def test_parse_duration():
    assert parse_duration("60m") == 3600
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90
    assert parse_duration("25") == 1500
    with pytest.raises(PlanError, match="not a duration"):
        parse_duration("soon")


def _sweep(name, grid, cuts, epochs=10):
    return Sweep(article="a", name=name, command="train", overrides=(f"trainer.epochs={epochs}",),
                   grid={k: tuple(v) for k, v in grid.items()}, cuts=tuple(cuts))


def _fake_predict(sweep):
    """10 s per epoch per job; configs as the sweep's overrides set them (a second, independent
    model)."""
    epochs = int(dict(o.split("=") for o in sweep.overrides)["trainer.epochs"])
    steps = [int(o.split("=")[1]) for o in sweep.overrides if o.startswith("trainer.max_steps=")]
    cfg = {"trainer": {"epochs": epochs, "max_steps": steps[0] if steps else None}}
    return 10.0 * epochs * len(sweep.jobs), [cfg] * len(sweep.jobs)


def test_fit_cuts_the_longest_sweep_first_in_plan_order():
    a = _sweep(
        "a", {"model": ["m1", "m2", "m3"]}, [{"epochs": 2}, {"grid": {"model": ["m1"]}}, "drop"]
    )  # 300 s
    b = _sweep("b", {"seed": ["0", "1"]}, [{"epochs": 5}, "drop"])  # 200 s
    assert fit([a, b], _fake_predict, None) == [a, b]                   # no budget: full fidelity
    assert fit([a, b], _fake_predict, 500) == [a, b]                    # fits already
    # 500 s -> a is longest: epochs 10->2 (60 s), total 260 s <= 300 s
    cut = fit([a, b], _fake_predict, 300)
    assert [s.applied for s in cut] == [("epochs 10->2",), ()]
    # 150 s: a epochs->2 (total 260), then b (200 s) epochs->5 (total 160), then a (60) grid->m1
    # (total 120)
    cut = fit([a, b], _fake_predict, 150)
    assert [s.applied for s in cut] == [("epochs 10->2", "model 3->1 (m1)"), ("epochs 10->5",)]
    assert sum(_fake_predict(s)[0] for s in cut) == 20 + 100
    # nothing fits: every cut is taken, both sweeps are dropped
    cut = fit([a, b], _fake_predict, 1)
    assert all(s.dropped for s in cut) and cut[1].applied == ("epochs 10->5", "dropped")


def test_an_epochs_cut_that_would_not_shorten_is_skipped():
    s = _sweep("s", {"x": ["1"]}, [{"epochs": 20}, {"epochs": 1}], epochs=3)
    assert apply_cut(s, {"epochs": 20}, _fake_predict(s)[1]) is None
    assert apply_cut(s, {"epochs": 1}, _fake_predict(s)[1]).applied == ("epochs 3->1",)


def test_bad_options_say_one_line():
    r = reproduce("--only", "nonsense", "--plan")
    assert r.returncode == 2 and "--only nonsense: not an article or sweep of the plan" in r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------- real runs


def _summaries(folder):
    return {p.parent.name: p for p in Path(folder).glob("runs/*/*/summary.json")}


@pytest.mark.slow
def test_kill_9_then_the_same_command_completes_and_no_finished_job_runs_twice(tmp_path):
    out, plan = tmp_path / "ref", _tiny_plan(tmp_path)
    args = ["--smoke", "--plan-file", plan, "--out", out]
    proc = reproduce(*args, wait=False)
    deadline = time.time() + 900
    while time.time() < deadline:  # until two jobs of the second sweep are done
        done = [
            p
            for p in _summaries(out).values()
            if json.loads(p.read_text())["status"] == "completed"
        ]
        if len(done) >= 2 or proc.poll() is not None:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    os.kill(
        proc.pid, signal.SIGKILL
    )  # reproduce.py itself; its running sweep dies with it (PR_SET_PDEATHSIG)
    proc.wait()
    time.sleep(1)
    before = {n: (p.read_bytes(), p.stat().st_mtime_ns) for n, p in _summaries(out).items()
              if json.loads(p.read_text())["status"] == "completed"}
    assert len(before) >= 2
    r = reproduce(*args)
    assert r.returncode == 1, r.stdout + r.stderr      # the broken sweep fails ...
    assert "broken failed" in r.stdout and "continuing the plan" in r.stdout
    after = _summaries(out)
    statuses = {n: json.loads(p.read_text())["status"] for n, p in after.items()}
    assert (
        sorted(n for n in statuses if n.startswith(tuple("012345")))
        and sum(1 for n, s in statuses.items() if s == "completed") == 6
    )  # ... and the other sweep's 6 jobs finish
    for name, (data, mtime) in before.items():  # jobs finished before the kill were not run again
        assert (after[name].read_bytes(), after[name].stat().st_mtime_ns) == (data, mtime), name
    state = json.loads((out / "plan.json").read_text())
    assert [e["status"] for e in state["sweeps"]] == ["failed", "done"]
    commands = (out / "COMMANDS.md").read_text()
    assert (
        commands.count("sweep seeds") == 2 and "calibration of seeds" in commands
    )  # the plan was not redone
    assert commands.count("calibration of seeds") == 1


@pytest.mark.slow
def test_two_folders_one_report_with_a_column_each(tmp_path):
    plan = _tiny_plan(tmp_path)
    for name, gpu in (("a", "h100"), ("b", "v100")):
        r = reproduce(
            "--smoke",
            "--plan-file",
            plan,
            "--out",
            tmp_path / name,
            "--only",
            "seeds",
            f"gpu={gpu}",
        )
        assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_report.py"),
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--out",
            str(tmp_path / "both"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    ref = json.loads((tmp_path / "both" / "report.json").read_text())["reference"]
    assert (
        len(ref["columns"]) == 2
        and "(a, smoke)" in ref["columns"][0]
        and "(b, smoke)" in ref["columns"][1]
    )
    # the fastai ratio per folder: fp32 time / amp time, mean over seeds, from each folder's own
    # summaries
    for col, folder in zip(range(2), ("a", "b")):
        s = [
            json.loads(p.read_text())
            for p in (tmp_path / folder / "runs" / "seeds").glob("*/summary.json")
        ]
        t = {(x["choices"]["precision"], x["seed"]): x["metrics"]["train_time_s"] for x in s}
        expected = sum(t[("fp32", k)] / t[("amp", k)] for k in range(3)) / 3
        row = ref["ratios"]["rows"][0]
        assert row["model"] == "small_cnn" and row["cells"][col] == f"{expected:.2f}x"
        assert row["published"] == "-"   # fastai published a ratio for ResNet-101 only
    # every published value has a row, with a value or a stated reason in each column
    ids = {(s.id, v.id) for s in load_sources() for v in s.values}
    rows = {(a["id"], r["id"]): r for a in ref["articles"] for r in a["rows"]}
    assert set(rows) == ids
    assert all(c for r in rows.values() for c in r["cells"])
    pitfalls = rows[("half_pitfalls", "adam_fp16_nan")]["cells"]
    assert pitfalls[0].startswith("missing: no run matches {'pitfall': 'adam_fp16'}")
    md = (tmp_path / "both" / "report.md").read_text()
    assert "## Reproductions side by side" in md and ref["columns"][1] in md


@pytest.mark.slow
def test_a_budget_too_small_drops_every_sweep_and_the_report_says_so(tmp_path):
    out = tmp_path / "ref"
    r = reproduce(
        "--smoke",
        "--plan-file",
        _tiny_plan(tmp_path),
        "--out",
        out,
        "--only",
        "seeds",
        "--budget",
        "1s",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    state = json.loads((out / "plan.json").read_text())
    assert (
        state["sweeps"][0]["cuts"] == ["seed 3->1 (0)", "dropped"]
        and state["sweeps"][0]["jobs"] == 0
    )
    assert "seed 3->1 (0); dropped" in (out / "plan.md").read_text()
    assert "nothing ran" in r.stdout and not (out / "runs").exists()


@pytest.mark.slow
def test_smoke_runs_every_command_and_reports_every_published_value(tmp_path):
    out = tmp_path / "smoke"
    t0 = time.time()
    r = reproduce("--smoke", "--out", out, timeout=3000)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plan = load_plan()
    commands = (out / "COMMANDS.md").read_text()
    for s in plan.sweeps:
        assert f"sweep {s.name} (" in commands, s.name
    ref = json.loads((out / "report" / "report.json").read_text())["reference"]
    ids = {(s.id, v.id) for s in load_sources() for v in s.values}
    rows = {(a["id"], r["id"]): r["cells"][0] for a in ref["articles"] for r in a["rows"]}
    assert set(rows) == ids and all(rows.values())
    assert rows[("half_pitfalls", "adam_fp16_nan")].startswith("diverged")
    assert rows[("fastai_2080ti", "batch_gain")].startswith(
        "1x"
    )  # max_batch on the CPU: both stop at --limit 4
    for f in ("ENVIRONMENT.md", "plan.md", "report/report.html", "report/report.md"):
        assert (out / f).is_file(), f
    print(f"smoke: {time.time() - t0:.0f} s")


def test_estimate_counts_a_pretrained_model_without_its_weights(tmp_path, monkeypatch):
    """--estimate counts FLOPs: the fastai preset's pretrained ResNets need no ImageNet weights for
    that (none in an empty hub cache here, and no download: one would fail)."""
    import torch

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    model = {"arch": "resnet18", "stem": "imagenet", "head": "fastai"}
    pretrained = _flops(json.dumps({**model, "pretrained": True, "freeze_body": True}), 100, 32)
    assert pretrained == _flops(json.dumps({**model, "pretrained": False}), 100, 32) > 0


def test_a_plan_that_cannot_fit_its_budget_says_so():
    state = {"budget_s": 1800, "calibration": {"seconds": 60, "mode": "first"}, "report_s": 60,
             "sweeps": [{"predicted_s": 1500, "jobs": 9}, {"predicted_s": 0, "jobs": 0}]}
    assert "OVER BUDGET" not in plan_summary(state)
    state["sweeps"][0]["predicted_s"] = 3408
    line = plan_summary(state)
    assert (
        "sweeps predicted 56.8 min" in line
        and "OVER BUDGET: every cut the plan allows is made" in line
    )
    assert "OVER BUDGET" not in plan_summary({**state, "budget_s": None})
