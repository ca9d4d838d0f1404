"""Sweep job folders named by long override lists: short, stable, unique names
(mixprec.runtime.jobdirs), under the basic and the submitit launchers, the full overrides in
summary.json."""
import json

import pytest

from helpers import TINY, compose_config, run_cli
from mixprec.runtime.jobdirs import MAX_BYTES, job_dirname, shorten

SIZES = [
    o
    for o in TINY
    if not o.startswith(("trainer.max_steps", "trainer.batch_size", "dataset.train_size"))
]
SIZES += [
    "trainer.max_steps=1",
    "trainer.batch_size=16",
    "dataset.train_size=16",
    "dataset.image_size=8",
]


def test_a_short_name_is_kept_and_a_long_one_is_a_prefix_and_a_hash():
    assert job_dirname(3, "model=resnet18,precision=amp") == "3_model=resnet18,precision=amp"
    assert job_dirname(0, "") == "0_"   # a sweep without overrides: Hydra's own name
    long = ",".join(f"key{i}=" + "v" * 20 for i in range(15))
    name = job_dirname(7, long)
    assert len(name.encode()) <= MAX_BYTES < 255 and name.startswith(
        "7_key0=" + "v" * 20 + ",key1="
    )
    assert name == job_dirname(7, long)                                    # stable
    assert name != job_dirname(8, long) and name != job_dirname(7, long + "w")   # unique
    # cut on a character, not inside one
    assert len(shorten("é" * 300).encode()) <= MAX_BYTES


def test_the_sweep_subdir_is_named_by_it():
    cfg = compose_config("name=" + "n" * 300)
    assert cfg.hydra.sweep._get_node("subdir")._value() == \
        "${mixprec.job_dirname:${hydra.job.num},${hydra.job.override_dirname}}"


@pytest.mark.slow   # two subprocess sweeps (basic launcher, then submitit's local one)
@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
def test_a_sweep_with_300_characters_of_overrides_runs_and_resumes(tmp_path, launcher):
    name = "name=" + "a_long_experiment_name_" * 11                 # 258 characters
    args = ["-m", *SIZES, name, "seed=0,1", f"hydra.sweep.dir={tmp_path}"]
    args += [] if launcher == "basic" else ["hydra/launcher=submitit_local"]
    assert len(",".join(a for a in args if "=" in a and not a.startswith("hydra"))) > 300
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "File name too long" not in r.stdout + r.stderr
    dirs = sorted(p.parent for p in tmp_path.glob("*/summary.json"))
    assert [d.name[:2] for d in dirs] == ["0_", "1_"] and all(
        len(d.name.encode()) <= MAX_BYTES for d in dirs
    )
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    assert all(s["status"] == "completed" for s in summaries)
    assert all(name in s["overrides"] and name in s["job"]["override_dirname"] for s in summaries)
    assert [d.name for d in dirs] == [
        job_dirname(s["job"]["num"], s["job"]["override_dirname"]) for s in summaries
    ]
    written = [(d / "summary.json").stat().st_mtime_ns for d in dirs]
    # the same folders are found again: both jobs skipped
    again = run_cli(*args, "trainer.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.parent for p in tmp_path.glob("*/summary.json")) == dirs
    assert [(d / "summary.json").stat().st_mtime_ns for d in dirs] == written
    logs = (
        again.stdout
        + again.stderr
        + "".join(p.read_text() for p in tmp_path.glob(".submitit/*/*.out"))
    )
    assert logs.count("already completed, skipped") == 2
