"""The versions a job ran with against constraints.txt: recorded in summary.json, flagged in the
report."""
from pathlib import Path

import torch

from mixprec.runtime import hardware, versions
from mixprec.report.analyse import _env_table
from mixprec.report.load import Job
from mixprec.report import render


def test_constraints_are_read_as_canonical_names():
    pins = versions.read_constraints()
    assert pins["torch"] == "2.14.1" and pins["hydra-core"] and pins["pyyaml"]
    assert versions.read_constraints(Path("/nonexistent/constraints.txt")) == {}


def test_a_job_records_the_key_versions():
    env = hardware.describe(torch.device("cpu"))
    assert (
        env["versions"]["torch"] == torch.__version__.split("+")[0]
        or env["versions"]["torch"] == torch.__version__
    )
    assert set(versions.KEY_PACKAGES) <= set(env["versions"])


def test_differences_ignore_the_local_build_label():
    pins = {"torch": "2.14.1", "numpy": "2.4.6"}
    assert (
        versions.differences({"torch": "2.14.1+cu130", "numpy": "2.4.6", "wandb": "9"}, pins) == []
    )
    assert versions.differences({"torch": "2.15.0+cu132", "numpy": None}, pins) == [
        "torch 2.15.0+cu132 (pinned 2.14.1)"
    ]


def _job(tmp_path, name, vers):
    summary = {
        "status": "completed",
        "choices": {"model": "small_cnn", "precision": "fp32"},
        "config": {"name": "x"},
        "env": {"device_name": "cpu", "device": "cpu", "torch": "2.14.1", "versions": vers},
    }
    return Job(tmp_path / name, summary)


def test_the_report_flags_a_job_whose_versions_differ_from_the_pins(tmp_path):
    pins = versions.read_constraints()
    same = {k: pins.get(k) for k in ("torch", "numpy")}
    other = dict(same, torch="2.99.0")
    rows = _env_table(
        [_job(tmp_path, "a", same), _job(tmp_path, "b", other), _job(tmp_path, "c", None)]
    )
    assert [r["pinned"] for r in rows] == [
        "as constraints.txt",
        "differ: torch 2.99.0 (pinned 2.14.1)",
        "not recorded",
    ]
    exp = {
        "name": "x",
        "jobs": 3,
        "sources": [],
        "env": rows,
        "groups": [],
        "comparisons": [],
        "not_completed": [],
        "variants": {},
    }
    text = render.document(
        {
            "generated": "now",
            "inputs": ["in"],
            "jobs": 3,
            "problems": [],
            "experiments": [exp],
            "sources_without_runs": [],
        }
    ).markdown()
    assert "1 job(s) ran with package versions other than the tested ones" in text
    assert "differ: torch 2.99.0 (pinned 2.14.1)" in text
