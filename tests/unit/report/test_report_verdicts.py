"""The report's verdicts against published values, from job records written here with known numbers:
within / below / above a published range, `compare: difference`, "k/n agree" for outcomes, and the
half-precision article's small vs large network speed-ups stated as measured (fp32 time / half time
of the records)."""
import json

import pytest

from mixprec.report.make import make_report

SOURCE = """
id: verdicts
title: Verdicts for the tests
url: https://example.org/verdicts
experiments: [verdicts]
hardware: Test GPU
values:
  - {id: inside, label: inside, metric: train_time_s, value: [4.5, 5.5], unit: s, source: t1,
     match: {model: resnet18}}
  - {id: under, label: under, metric: train_time_s, value: [6, 8], unit: s, source: t2,
     match: {model: resnet18}}
  - {id: over, label: over, metric: train_time_s, value: [1, 4], unit: s, source: t3,
     match: {model: resnet18}}
  - {id: acc_diff, label: accuracy, metric: test_acc_pct, value: 90, unit: "%",
     compare: difference, source: t4,
     match: {model: resnet18}}
  - {id: acc_range_diff, label: accuracy range, metric: test_acc_pct, value: [88, 92], unit: "%",
     compare: difference, source: t5, match: {model: resnet18}}
  - {id: nan, label: Adam fp16, metric: status, value: diverged, unit: outcome, source: t6,
     match: {model: small_cnn}}
  - {id: never, label: never fails, metric: status, value: failed, unit: outcome, source: t7,
     match: {model: small_cnn}}
"""


def write_job(root, name, experiment, seed, status, choices, metrics, config=None):
    d = root / name
    d.mkdir(parents=True)
    summary = {
        "status": status,
        "name": experiment,
        "seed": seed,
        "choices": choices,
        "overrides": [f"seed={seed}"],
        "job": {"name": "train", "num": None, "output_dir": str(d)},
        "config": {"seed": seed, "name": experiment, **(config or {})},
        "metrics": metrics,
        "env": {
            "device": "cuda:0",
            "device_name": "Test GPU",
            "torch": "2.x",
            "cuda": "12",
            "cudnn": 9,
        },
    }
    (d / "summary.json").write_text(json.dumps(summary))


def test_range_difference_and_outcome_verdicts(tmp_path):
    published = tmp_path / "published"
    published.mkdir()
    (published / "verdicts.yaml").write_text(SOURCE)
    runs = tmp_path / "runs"
    # two seeds of resnet18 amp: 4 s and 6 s (mean 5), 93% and 95% (mean 94)
    for seed, t, acc in ((0, 4.0, 0.93), (1, 6.0, 0.95)):
        write_job(
            runs,
            f"r18_{seed}",
            "verdicts",
            seed,
            "completed",
            {"model": "resnet18", "precision": "amp"},
            {"train_time_s": t, "final_test_acc": acc},
        )
    # three seeds of a case published as diverging: two diverged, one completed
    for seed, status in ((0, "diverged"), (1, "diverged"), (2, "completed")):
        write_job(
            runs,
            f"cnn_{seed}",
            "verdicts",
            seed,
            status,
            {"model": "small_cnn", "precision": "half"},
            {"train_time_s": 1.0, "final_test_acc": 0.5},
        )
    data = make_report([str(runs)], tmp_path / "report", published)
    (exp,) = data["experiments"]
    rows = {c["id"]: c["rows"] for c in exp["comparisons"]}
    mean = (4.0 + 6.0) / 2
    (inside,), (under,), (over,) = rows["inside"], rows["under"], rows["over"]
    assert inside["verdict"] == "within range" and inside["ratio"] == pytest.approx(
        [mean / 5.5, mean / 4.5]
    )
    assert under["verdict"] == "below" and under["ratio"] == pytest.approx([mean / 8, mean / 6])
    assert over["verdict"] == "above" and over["ratio"] == pytest.approx([mean / 4, mean / 1])
    assert inside["reproduced"]["values"] == [4.0, 6.0]
    (diff,), (range_diff,) = rows["acc_diff"], rows["acc_range_diff"]
    assert diff["difference"] == pytest.approx(94.0 - 90.0) and diff["ratio"] is None
    assert range_diff["difference"] == pytest.approx(94.0 - (88 + 92) / 2)
    (nan,), (never,) = rows["nan"], rows["never"]
    assert nan["verdict"] == "2/3 agree" and nan["reproduced"]["statuses"] == [
        "diverged",
        "diverged",
        "completed",
    ]
    assert never["verdict"] == "differs"
    md = (tmp_path / "report" / "report.md").read_text()
    lines = {
        line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| verdicts |")
    }
    assert "+4 (difference)" in lines["accuracy"] and "+4 (difference)" in lines["accuracy range"]
    assert "2/3 agree" in lines["Adam fp16"]
    assert (
        "within range" in lines["inside"] and "below" in lines["under"] and "above" in lines["over"]
    )


def test_the_small_and_large_network_speedups_are_stated_as_measured(tmp_path):
    """The half-precision article's timing remark, compared with what the records say (here half is
    slower on the small net, as on a CPU: the report states 0.8x beside the published 1.0x, it does
    not assert a gain)."""
    runs = tmp_path / "runs"
    times = {"small_fp32": 10.0, "small_half": 12.5, "large_fp32": 20.0, "large_half": 16.0}
    for case, t in times.items():
        size, precision = case.split("_")
        model = "small_cnn" if size == "small" else "resnet50"
        choices = {"model": model, "precision": precision, "pitfall": case}
        write_job(
            runs,
            case,
            "half_pitfalls",
            0,
            "completed",
            choices,
            {"train_time_s": t, "final_test_acc": 0.5},
            config={"model": {"arch": model}},
        )
    data = make_report([str(runs)], tmp_path / "report")   # the shipped published numbers
    (exp,) = data["experiments"]
    rows = {c["id"]: c for c in exp["comparisons"]}
    (small,), (large,) = rows["small_net_no_gain"]["rows"], rows["larger_net_gain"]["rows"]
    assert rows["small_net_no_gain"]["value"] == 1.0 and rows["larger_net_gain"]["value"] == 1.2
    assert small["reproduced"]["mean"] == pytest.approx(10.0 / 12.5) and small[
        "ratio"
    ] == pytest.approx(0.8 / 1.0)
    assert large["reproduced"]["mean"] == pytest.approx(20.0 / 16.0) and large[
        "ratio"
    ] == pytest.approx(1.25 / 1.2)
    assert small["verdict"] is None and large["verdict"] is None   # a measurement, not a pass/fail
    md = (tmp_path / "report" / "report.md").read_text()
    stated = {line.split(" | ")[1]: line.split(" | ")[5:7] for line in md.splitlines()
              if line.startswith("| half_pitfalls |")}
    # reproduced, ratio to 1.0
    assert stated["small network, fp32 time / fp16 time"] == ["0.8 x", "0.80"]
    # reproduced, ratio to 1.2
    assert stated["larger network, fp32 time / fp16 time"] == ["1.25 x", "1.04"]
