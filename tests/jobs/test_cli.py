"""The command line as a user meets it: a sweep in a subprocess, and bad overrides."""
import json

import pytest

from helpers import TINY, run_cli

SIZES = [o for o in TINY if not o.startswith(("model", "logger"))]


@pytest.mark.slow   # a subprocess sweep
def test_sweep_writes_one_summary_and_one_wandb_run_per_job_and_a_table(tmp_path):
    sweep = tmp_path / "sweep"
    # the CPU's own fp16 kernels (precision.emulate=false), so that amp's time is a real time with a
    # speed-up (an emulated job has none); 8 px images: they are reference kernels (ResNet-18 amp at
    # 32 px takes minutes)
    r = run_cli(
        "-m",
        "precision=fp32,amp",
        "model=small_cnn,resnet18",
        *SIZES,
        "dataset.image_size=8",
        "precision.emulate=false",
        "logger=wandb",
        f"hydra.sweep.dir={sweep}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert len(summaries) == 4
    got = sorted((s["choices"]["model"], s["choices"]["precision"]) for s in summaries)
    assert got == sorted((m, p) for m in ("small_cnn", "resnet18") for p in ("fp32", "amp"))
    assert all(s["status"] == "completed" for s in summaries)
    runs = sorted(sweep.glob("*/wandb/offline-run-*"))
    assert len(runs) == 4 and len({s["wandb"]["run_id"] for s in summaries}) == 4
    assert all((run / f"run-{s_id}.wandb").exists() for run, s_id in
               zip(runs, [r.name.rsplit("-", 1)[1] for r in runs]))
    assert {s["wandb"]["dir"] for s in summaries} == {str(r) for r in runs}
    # the end-of-sweep table: a header and one row per job, speed-up against fp32 of the same model
    out = r.stdout
    assert f"sweep {sweep}: 4 jobs" in out
    table = out[out.index(f"sweep {sweep}"):].splitlines()
    assert "vs fp32" in table[1]
    rows = [line.split() for line in table[3:7]]
    assert sorted((row[1], row[2]) for row in rows) == got
    by_job = {s["job"]["num"]: s for s in summaries}
    for row in rows:
        s = by_job[int(row[0])]
        assert row[3] == "completed"
        if s["choices"]["precision"] == "fp32":
            # batch, compile, GPU busy ("-": a CPU job), vs fp32
            assert row[7:11] == ["16", "none", "-", "1.00"]
        else:
            base = next(
                b for b in summaries if b["choices"] == {**s["choices"], "precision": "fp32"}
            )
            assert float(row[10]) == pytest.approx(
                base["metrics"]["train_time_s"] / s["metrics"]["train_time_s"], abs=0.006
            )


@pytest.mark.parametrize(
    "args,expect",
    [
        (["trainer.batch_size=0"], "trainer.batch_size=0: must be an integer >= 1"),
        (
            ["precision.loss_scale=banana"],
            "precision.loss_scale='banana': allowed values are dynamic, none",
        ),
        (["optimizer.lr=-1"], "optimizer.lr=-1.0: must be a positive number"),
    ],
)
@pytest.mark.slow
def test_bad_values_give_one_clear_line(tmp_path, args, expect):
    r = run_cli(*args, "logger=none", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert (
        err == [f"mixprec: config error: {expect}" + err[0].split(expect, 1)[1]] and len(err) == 1
    )
    assert "Traceback" not in r.stderr + r.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert (
        f"[mixprec.job][ERROR] - mixprec: config error: {expect}"
        in (tmp_path / "train.log").read_text()
    )


@pytest.mark.slow
def test_unknown_option_lists_the_choices(tmp_path):
    r = run_cli("model=resnet9000", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert (
        "Could not find 'model/resnet9000'" in r.stderr
        and "resnet18" in r.stderr
        and "resnet152" in r.stderr
    )
