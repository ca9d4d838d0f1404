"""The CPU-emulated reference plan (src/mixprec/tools/plan_cpu.yaml) and the report's seed-by-seed
comparison with fp32."""
import json
import sys

import pytest

from helpers import ROOT, load_script
from mixprec.tools.plan import PlanError, load_plan, merge_overrides
from mixprec.config import validate_job
from mixprec.report.analyse import paired_difference, t975
from mixprec.report.published import load_sources
from mixprec.tools.calibrate import calibrate
from mixprec.tools.sweeps import compose, job_configs, sweep_overrides

CPU_PLAN = ROOT / "src" / "mixprec" / "tools" / "plan_cpu.yaml"


def diagonal_jobs(sweep) -> list[dict]:
    """As few jobs as the longest value list of the sweep's grid, the j-th taking each key's j-th
    value (cyclically): every value the grid sets is in one of them."""
    n = max((len(v) for v in sweep.grid.values()), default=1)
    return [{k: v[j % len(v)] for k, v in sweep.grid.items()} for j in range(n)]


def test_every_value_of_the_cpu_plan_composes_and_every_published_value_is_accounted_for():
    """The quick loop's twin of the slow test below: each value of each sweep's grid composed and
    validated once (37 jobs) instead of every job of the product (93), as reproduce.py's
    job_configs composes a job."""
    reproduce = load_script("reproduce")
    plan = load_plan(CPU_PLAN)
    args = reproduce.parse(["--plan-file", str(CPU_PLAN), "dataset.data_dir=/nowhere"])
    sources = {s.id: s for s in load_sources()}
    assert {a.id for a in plan.articles} == set(sources)
    precisions = set()
    for a in plan.articles:
        for s in a.sweeps:
            over = sweep_overrides(plan, s, args)
            for job in diagonal_jobs(s):
                c = compose(
                    tuple(merge_overrides(over, [f"{k}={v}" for k, v in job.items()]))
                )
                assert c["trainer"]["device"] == "auto"
                validate_job(c)
                precisions |= {c["precision"]["name"]} if s is plan.sweeps[0] else set()
        ids = {v.id for v in sources[a.id].values}
        assert set(a.not_reproduced) <= ids and set(a.stand_ins) <= ids, a.id
    assert precisions == {"fp32", "tf32", "amp", "amp_bf16", "half", "bf16", "o0", "o1", "o2",
                          "o3", "fastai_fp16", "apex_fp16"}


@pytest.mark.slow   # 93 compositions; the quick twin above composes each grid value once
def test_the_cpu_plan_composes_every_job_and_accounts_for_every_published_value():
    reproduce = load_script("reproduce")
    plan = load_plan(CPU_PLAN)
    args = reproduce.parse(["--plan-file", str(CPU_PLAN), "dataset.data_dir=/nowhere"])
    sources = {s.id: s for s in load_sources()}
    assert {a.id for a in plan.articles} == set(sources)
    for a in plan.articles:
        for s in a.sweeps:
            configs = job_configs(plan, s, args)  # a bad override: ConfigError
            assert len(configs) == len(s.jobs) and all(
                c["trainer"]["device"] == "auto" for c in configs
            )
            # a bad value, as the job would find it (a synthetic-only size on real data)
            for c in configs:
                validate_job(c)
        ids = {v.id for v in sources[a.id].values}
        assert set(a.not_reproduced) <= ids and set(a.stand_ins) <= ids, a.id
    precisions = {c["precision"]["name"] for c in job_configs(plan, plan.sweeps[0], args)}
    assert precisions == {
        "fp32",
        "tf32",
        "amp",
        "amp_bf16",
        "half",
        "bf16",
        "o0",
        "o1",
        "o2",
        "o3",
        "fastai_fp16",
        "apex_fp16",
    }


def test_a_stand_in_needs_a_match_and_a_reason(tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("articles: [{id: a, sweeps: [], stand_ins: {x: {match: {precision: amp}}}}]\n")
    with pytest.raises(PlanError, match=r"stand_ins: a mapping of published value id -> \{match"):
        load_plan(bad)


def test_paired_difference_is_students_interval():
    # mean 0.2, sd 0.3, n 3: half-width 4.303 * 0.3 / sqrt(3)
    d = paired_difference([0.5, -0.1, 0.2])
    assert d["mean"] == pytest.approx(0.2) and d["std"] == pytest.approx(0.3)
    assert d["ci95"] == pytest.approx([0.2 - 0.74530, 0.2 + 0.74530], abs=1e-4)
    assert d["verdict"] == "no difference detected"
    assert paired_difference([-1.0, -1.2, -0.9])["verdict"] == "worse than fp32"
    assert paired_difference([1.0, 1.2, 1.1])["verdict"] == "better than fp32"
    assert paired_difference([1.0, 1.2])["verdict"] == "no difference detected"   # n=2: t = 12.7
    assert paired_difference([1.0]) is None and paired_difference([None, 1.0]) is None
    assert t975(1) == 12.706 and t975(11) == 2.179 and t975(100) == 1.96



def test_calibration_on_stand_in_data_leaves_out_the_users_data_dir(tmp_path, monkeypatch):
    """The stand-in is synthetic data, which has no data_dir: `reproduce.py dataset.data_dir=/data`
    must not fail its calibration (it did: "Key 'data_dir' is not in struct")."""
    reproduce = load_script("reproduce")
    plan = load_plan(CPU_PLAN).only(["half_pitfalls"])
    args = reproduce.parse(["--plan-file", str(CPU_PLAN), "dataset.data_dir=/nowhere", "seed=3"])
    args.calibrate, commands = "first", []
    monkeypatch.setattr(
        "mixprec.tools.calibrate.spawn", lambda cmd, *a, **k: (commands.append(cmd), (0, 1.0))[1]
    )
    calibrate(plan, args, tmp_path)
    (cmd,) = commands
    assert (
        "seed=3" in cmd
        and "dataset=synthetic" in cmd
        and not any(c.startswith("dataset.data_dir") for c in cmd)
    )
    # composes
    compose(tuple(c for c in cmd[3:] if "=" in c and not c.startswith("hydra")))


# -------------------------------------------------------------------------------- committed results

def test_a_language_models_perplexity_is_reported_per_epoch(tmp_path):
    """Two seeds of an LSTM, fp32 and apex_fp16, two epochs each, with known perplexities:
    report.json and report.md hold each epoch's mean over the seeds, and the runs table shows the
    best-validation test perplexity."""
    from mixprec.report.make import make_report

    ppl = {
        ("fp32", 0): [(200.0, 190.0), (150.0, 140.0)],
        ("fp32", 1): [(210.0, 200.0), (160.0, 150.0)],
        ("apex_fp16", 0): [(202.0, 192.0), (152.0, 142.0)],
        ("apex_fp16", 1): [(206.0, 196.0), (156.0, 146.0)],
    }
    for (precision, seed), epochs in ppl.items():
        d = tmp_path / "runs" / f"{precision}_{seed}"
        d.mkdir(parents=True)
        metrics = {
            "train_time_s": 1.0,
            "final_valid_ppl": epochs[-1][0],
            "test_ppl_at_best_valid": epochs[-1][1],
        }
        (d / "summary.json").write_text(json.dumps({
            "status": "completed", "name": "lm", "seed": seed, "overrides": [f"seed={seed}"],
            "choices": {"model": "lstm", "precision": precision},
            "config": {"seed": seed, "name": "lm", "model": {"arch": "lstm"}},
            "job": {"name": "train", "num": None, "output_dir": str(d)}, "metrics": metrics,
            "env": {"device": "cpu", "device_name": "x86_64", "torch": "2.x"}}))
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"kind": "epoch", "epoch": e + 1, "valid_ppl": v, "test_ppl": t}) + "\n"
            for e, (v, t) in enumerate(epochs)))
    data = make_report([str(tmp_path / "runs")], tmp_path / "report")
    (exp,) = data["experiments"]
    rows = {(r["precision"], r["epoch"]): r for r in exp["perplexity"]}
    assert sorted(rows) == [("apex_fp16", 1), ("apex_fp16", 2), ("fp32", 1), ("fp32", 2)]
    assert rows["fp32", 1]["valid_ppl"]["mean"] == pytest.approx(205.0)
    assert rows["apex_fp16", 2]["test_ppl"]["mean"] == pytest.approx(144.0)
    assert rows["apex_fp16", 2]["runs"] == 2
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| lstm | apex_fp16 | 2 | 2 | 154.00 ± 2.83 (n=2) | 144.00 ± 2.83 (n=2) |" in md
    # fp32: 140 and 150
    assert "| test ppl (best valid epoch) |" in md and "| 145.00 ± 7.07 (n=2) |" in md


def test_an_image_models_test_loss_is_no_perplexity(tmp_path):
    """A huge test loss of an image model (a run that blew up but completed) is not exp()-ed into a
    perplexity."""
    from mixprec.report.load import Job

    summary = {
        "status": "completed",
        "config": {"model": {"arch": "resnet"}},
        "metrics": {"final_test_loss": 1e4},
    }
    assert Job(tmp_path, summary).metric("test_ppl") is None


RESULTS = ROOT / "outputs" / "reference" / "cpu-emulated-2026-11-25"
COMMITTED = ["torch_amp", "half_pitfalls", "fastai_2080ti", "page_ladder", "apex_word_lm"]
# what a CPU run can stand beside
ACCURACY = ("test_acc_pct", "acc_change_vs_fp32", "test_ppl", "status")


def test_committed_cpu_results_have_a_row_for_every_published_accuracy_and_show_in_docs():
    from mixprec.report import readme

    found = readme.folders(RESULTS)
    assert [f.name for f in found] == COMMITTED
    sources = {s.id: s for s in load_sources()}
    for f in found:
        state = json.loads((f / "plan.json").read_text())
        assert all(e["status"] == "done" for e in state["sweeps"]), f.name
        summaries = [json.loads(p.read_text()) for p in f.glob("runs/*/*/summary.json")]
        assert len(summaries) == sum(e["jobs"] for e in state["sweeps"]), f.name
        # every job ran to its end on the CPU, fp16/bf16 emulated where it had any
        for s in summaries:
            assert s["status"] in ("completed", "diverged"), (f.name, s["status"])
            # plain_fp32: a tf32 job on the CPU, as jobs record it since issue 49 (item 1)
            assert s["env"]["device"] == "cpu" and s["arithmetic"] in (
                "emulated", "native", "plain_fp32"), f.name
            assert s["arithmetic"] != "plain_fp32" or s["choices"]["precision"] == "tf32", f.name
        report = json.loads((f / "report" / "report.json").read_text())
        (article,) = [
            a for a in report["reference"]["articles"] if a["id"] == state["articles"][0]["id"]
        ]
        rows = {r["id"]: r["cells"][0] for r in article["rows"]}
        source = sources[article["id"]]
        assert set(rows) == {v.id for v in source.values}, f.name
        # an accuracy-like value has our number, or the plan's stated reason
        for v in source.values:
            if v.metric in ACCURACY:
                assert not rows[v.id].startswith("missing: no run matches"), (
                    f.name,
                    v.id,
                    rows[v.id],
                )
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == readme.page(RESULTS), ("docs/results.md differs from the folders; regenerate: "
                                          "python -m mixprec.report.readme " + str(RESULTS))
    links = page.count("](../outputs/reference/cpu-emulated-2026-11-25/")   # from docs/
    assert links == 2 * len(COMMITTED)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
