"""The reproduction report from real tiny jobs: tables, published numbers, plots, HTML, the sweep
callback, W&B."""
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig

from helpers import ROOT, compose_config, load_script, run_cli
from mixprec.report.make import make_report
from mixprec.report.published import SourceError, load_source, load_sources

# small enough for ResNet-18 on a CPU: 8x8 images, one step per epoch, two epochs; every step logged
# precision.emulate=false: the CPU's own fp16 kernels, so that amp's times are real times and its
# speed-up is computed (an emulated job's time is an fp32 time: no speed-up;
# tests/unit/precision/test_emulation.py checks that)
SIZES = [
    "dataset.image_size=8",
    "dataset.train_size=8",
    "dataset.test_size=8",
    "trainer.batch_size=8",
    "trainer.eval_batch_size=8",
    "trainer.epochs=2",
    "trainer.log_every=1",
    "trainer.warmup_steps=1",
    "trainer.target_acc=0.01",
    "logger=none",
    "precision.emulate=false",
    "trainer.device=cpu",
]
PNG = b"\x89PNG\r\n\x1a\n"

TINY_SOURCE = """
id: tinyref
title: A tiny reference for the tests
url: https://example.org/tiny
experiments: [default]
hardware: Test GPU
values:
  - {id: cnn_speedup, label: small CNN amp speed-up, metric: speedup, value: 2.0, unit: x,
     source: table 1,
     match: {model: small_cnn, precision: amp, optimizer: sgd}}
  - {id: r101_speedup, label: ResNet-101 amp speed-up, metric: speedup, value: 1.18, unit: x,
     source: table 2,
     match: {model: resnet101, precision: amp}}
  - {id: adam_nan, label: Adam in pure fp16, metric: status, value: diverged, unit: outcome,
     source: a sentence,
     match: {precision: half, optimizer: adam}}
  - {id: step_a, label: A (fp32), metric: time_to_target_s, value: 3, unit: s, source: ladder,
     match: {model: small_cnn, precision: fp32, optimizer: sgd}}
  - {id: step_b, label: B (amp), metric: time_to_target_s, value: [1, 2], unit: s, source: ladder,
     match: {model: small_cnn, precision: amp, optimizer: sgd}}
"""


def job(out_dir, *overrides):
    """One real job in this process (as helpers.run_tiny, with this file's sizes)."""
    from mixprec.job import run_job

    cfg = compose_config(*SIZES, *overrides, output_dir=out_dir)
    HydraConfig.instance().set_config(cfg)
    return run_job(cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    sweep = root / "sweep"
    # a real sweep: fp32 and amp on two models, ending with its report (the callback)
    r = run_cli(
        "-m",
        "precision=fp32,amp",
        "model=small_cnn,resnet18",
        *SIZES,
        f"hydra.sweep.dir={sweep}",
        "hydra.callbacks.sweep_table.report=true",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    extra = root / "extra"
    # a second seed of the small CNN (mirrored to W&B offline), a run that diverges, a run that
    # fails
    seed1 = [
        job(extra / f"seed1_{p}", "model=small_cnn", f"precision={p}", "seed=1", "logger=wandb")
        for p in ("fp32", "amp")
    ]
    diverged = job(extra / "half_adam", "model=small_cnn", "precision=half", "optimizer=adam")
    with pytest.raises(SystemExit):
        job(extra / "bad_lr", "model=small_cnn", "optimizer.lr=-1")
    assert [s["status"] for s in seed1] == ["completed", "completed"]
    assert diverged["status"] == "diverged", diverged.get("reason")   # Adam's eps=1e-8 is 0 in fp16
    published = root / "published"
    published.mkdir()
    (published / "tinyref.yaml").write_text(TINY_SOURCE)
    data = make_report([str(sweep), str(extra)], out=root / "report", published=published)
    return {
        "root": root,
        "sweep": sweep,
        "extra": extra,
        "cli": r,
        "data": data,
        "out": root / "report",
    }


def summaries(*dirs):
    return [json.loads(p.read_text()) for d in dirs for p in sorted(Path(d).rglob("summary.json"))]


def md_table(md: str, heading: str) -> list[list[str]]:
    lines = md[md.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


@pytest.mark.slow   # a subprocess sweep
def test_speedup_column_is_the_ratio_of_recorded_times(runs):
    all_runs = [s for s in summaries(runs["sweep"], runs["extra"]) if s["status"] == "completed"]

    def time_of(model, precision, seed):
        return next(s["metrics"]["train_time_s"] for s in all_runs if s["choices"]["model"] == model
                    and s["choices"]["precision"] == precision and s["seed"] == seed)

    exp = runs["data"]["experiments"][0]
    assert exp["name"] == "default" and exp["jobs"] == 8
    groups = {
        (g["model"], g["precision"]): g for g in exp["groups"] if g["variant"] == "optimizer=sgd"
    }
    assert set(groups) == {(m, p) for m in ("small_cnn", "resnet18") for p in ("fp32", "amp")}
    r18 = groups[("resnet18", "amp")]["metrics"]["speedup"]
    assert r18["n"] == 1 and r18["mean"] == pytest.approx(
        time_of("resnet18", "fp32", 0) / time_of("resnet18", "amp", 0)
    )
    cnn = groups[("small_cnn", "amp")]
    # two seeds: mean and spread
    assert cnn["seeds"] == [0, 1] and cnn["metrics"]["speedup"]["n"] == 2
    ratios = [time_of("small_cnn", "fp32", s) / time_of("small_cnn", "amp", s) for s in (0, 1)]
    assert cnn["metrics"]["speedup"]["values"] == pytest.approx(ratios)
    assert groups[("small_cnn", "fp32")]["metrics"]["speedup"]["mean"] == 1.0
    # the same numbers in report.md's runs table
    md = (runs["out"] / "report.md").read_text()
    rows = {(r[0], r[1]): r for r in md_table(md, "### Runs")}
    assert float(rows[("resnet18 optimizer=sgd", "amp")][4]) == pytest.approx(
        r18["mean"], abs=0.006
    )
    mean, rest = rows[("small_cnn optimizer=sgd", "amp")][4].split(" ± ")
    assert float(mean) == pytest.approx(sum(ratios) / 2, abs=0.006) and rest.endswith("(n=2)")
    assert rows[("small_cnn optimizer=sgd", "fp32")][2] == "2 completed (seeds 0,1)"
    assert (
        json.loads((runs["out"] / "report.json").read_text())["experiments"][0]["groups"]
        == exp["groups"]
    )


@pytest.mark.slow   # a subprocess sweep
def test_published_values_matched_missing_and_diverged(runs):
    exp = runs["data"]["experiments"][0]
    comp = {c["id"]: c for c in exp["comparisons"]}
    speed = exp_group(exp, "small_cnn", "amp")["metrics"]["speedup"]["mean"]
    (row,) = comp["cnn_speedup"]["rows"]
    assert row["group"] == "small_cnn optimizer=sgd" and row["ratio"] == pytest.approx(speed / 2.0)
    assert comp["r101_speedup"]["rows"] == [
        {
            "group": None,
            "verdict": "missing: no run yet",
            "reproduced": None,
            "ratio": None,
            "difference": None,
            "runs": 0,
        }
    ]
    assert comp["adam_nan"]["rows"][0]["verdict"] == "agrees"
    md = (runs["out"] / "report.md").read_text()
    table = md_table(md, "### Reproduced against published")
    assert [
        "tinyref",
        "ResNet-101 amp speed-up",
        "1.18 x",
        "Test GPU",
        "-",
        "missing: no run yet",
        "-",
        "-",
        "-",
    ] in table
    # the diverged and the failed runs, with their reasons
    problems = {p["status"]: p for p in exp["not_completed"]}
    assert set(problems) == {"diverged", "failed"}
    assert problems["diverged"]["step"] >= 1 and "non-finite" in problems["diverged"]["reason"]
    assert (
        problems["failed"]["reason"] == "config error: optimizer.lr=-1.0: must be a positive number"
    )
    listed = {r[4]: r for r in md_table(md, "### Runs that diverged or failed")}
    assert set(listed) == {"diverged", "failed"}
    assert listed["diverged"][5] == problems["diverged"]["reason"]
    assert listed["diverged"][6] == str(problems["diverged"]["step"])
    assert listed["failed"][5] == problems["failed"]["reason"]


def exp_group(exp, model, precision):
    return next(
        g
        for g in exp["groups"]
        if (g["model"], g["precision"], g["variant"]) == (model, precision, "optimizer=sgd")
    )


@pytest.mark.slow   # a subprocess sweep
def test_every_plot_is_a_png_embedded_in_the_html(runs):
    figs = runs["data"]["experiments"][0]["plots"]
    names = sorted(Path(f["path"]).name for f in figs)
    assert names == sorted(
        f"default_{k}.png" for k in ("speedup", "time_memory", "curves", "ladder", "loss_scale",
                                     "memory_ledger")
    )
    html = (runs["out"] / "report.html").read_text()
    md = (runs["out"] / "report.md").read_text()
    for f in figs:
        data = Path(f["path"]).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000          # matplotlib drew a real figure
        assert "data:image/png;base64," + base64.b64encode(data).decode() in html
        assert f"](plots/{Path(f['path']).name})" in md
    assert (
        html.count("data:image/png;base64,") == len(figs)
        and "<img" in html
        and 'src="plots/' not in html
    )


@pytest.mark.slow   # a subprocess sweep
def test_the_sweep_ends_with_its_report(runs):
    out = runs["cli"].stdout
    assert f"report      {runs['sweep'] / 'report' / 'report.html'}" in out
    data = json.loads((runs["sweep"] / "report" / "report.json").read_text())
    # no ladder: no source lists `default`
    # speed-up, time and memory, curves, loss scale, the memory ledger's bars
    assert data["jobs"] == 4 and len(data["experiments"][0]["plots"]) == 5
    assert all(
        (runs["sweep"] / "report" / "plots" / Path(f["path"]).name).exists()
        for f in data["experiments"][0]["plots"]
    )


def run_script(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_report.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=e,
        cwd=ROOT,
    )


@pytest.mark.slow   # a subprocess sweep
def test_wandb_offline_says_why_in_one_line_and_writes_the_local_report(runs, tmp_path):
    r = run_script(str(runs["sweep"]), str(runs["extra"] / "*"), "--out", str(tmp_path), "--wandb",
                   env={"WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("W&B")]
    assert lines == [
        "W&B report not made: offline: WANDB_MODE=offline; the local report above is complete"
    ]
    assert "Traceback" not in r.stderr
    md = (tmp_path / "report.md").read_text()
    assert (tmp_path / "report.html").stat().st_size > 50_000
    # the shipped published numbers: no job belongs to their experiments, so the report of this
    # sweep does not list them; the script's line counts them apart
    assert "Published sources with no matching run" not in md and "fastai_2080ti" not in md
    assert "5 other published source(s) name no experiment run here" in r.stdout


@pytest.mark.slow
def test_bad_input_is_one_line(tmp_path):
    r = run_script(str(tmp_path / "nowhere"))
    assert (
        r.returncode == 2
        and r.stderr.strip() == f"make_report: {tmp_path / 'nowhere'}: no such file or folder"
    )
    (tmp_path / "empty").mkdir()
    r = run_script(str(tmp_path / "empty"))
    assert r.returncode == 2 and "no summary.json under" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow   # a subprocess sweep
def test_wandb_report_objects(runs, monkeypatch):
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from mixprec.report import wandb_report

    data, jobs = runs["data"], runs["data"]["_jobs"]
    ids = [j.summary["wandb"]["run_id"] for j in jobs if j.summary.get("wandb")]
    assert len(ids) == 2   # the two seed-1 jobs logged to W&B (offline)
    assert wandb_report.project_of(jobs) == (None, "mixprec")
    report = wandb_report.build(data, jobs, entity="someone", project="mixprec")
    assert (report.entity, report.project, report.title) == (
        "someone",
        "mixprec",
        "mixprec reproduction report",
    )
    kinds = [type(b).__name__ for b in report.blocks]
    assert kinds == ["P", "H2", "MarkdownBlock", "PanelGrid"]
    assert (
        "| small CNN amp speed-up | 2 x | Test GPU | small_cnn optimizer=sgd, amp |"
        in report.blocks[2].text
    )
    assert "missing: no run yet" in report.blocks[2].text
    grid = report.blocks[3]
    (runset,) = grid.runsets
    assert (
        runset.groupby == ["config.precision.name", "config.model.arch"]
        and runset.project == "mixprec"
    )
    assert runset.filters == "ID in [" + ", ".join(repr(i) for i in ids) + "]"
    bars = [p for p in grid.panels if isinstance(p, wr.BarPlot)]
    assert [p.metrics for p in bars] == [
        ["train_time_s"],
        ["throughput"],
        ["peak_memory_mb"],
        ["final_test_acc"],
    ]
    lines = [p for p in grid.panels if isinstance(p, wr.LinePlot)]
    assert [(p.x, p.y) for p in lines] == [("epoch", ["test_acc"]), ("step", ["loss_scale"])]
    # what save() would send, with the one project look-up it makes answered here instead of by the
    # server
    monkeypatch.setattr("wandb_workspaces.reports.v2.interface.execute_graphql",
                        lambda api, query, variables: {"project": {"internalId": "p-1"}})
    monkeypatch.setattr("wandb_workspaces.reports.v2.interface._get_api", lambda: None)
    spec = report._to_model().model_dump(by_alias=True)
    text = json.dumps(spec, default=str)
    assert spec["project"]["name"] == "mixprec" and all(i in text for i in ids)


def test_shipped_published_numbers_load_with_source_hardware_and_unit():
    sources = {s.id: s for s in load_sources()}
    assert set(sources) == {
        "fastai_2080ti",
        "apex_word_lm",
        "half_pitfalls",
        "page_ladder",
        "torch_amp",
    }
    for s in sources.values():
        assert s.experiments and s.values
        assert all(v.hardware and v.unit and v.quote and v.match for v in s.values)
    ladder = [
        v for v in sources["page_ladder"].values if v.metric in ("train_time_s", "page_clock_s")
    ]
    assert [v.value for v in ladder] == [75, 70, 64, 59, 52, 46, 43, 36, (33.5, 34.0), 26]
    # step 1 on Page's clock (dawn.py)
    assert [v.metric for v in ladder][:2] == ["page_clock_s", "train_time_s"]
    assert (
        sources["fastai_2080ti"].values[0].value == 1.18
        and sources["fastai_2080ti"].values[1].value == 1.13
    )


@pytest.mark.parametrize(
    "text,expect",
    [
        (
            "id: bad\ntitle: t\nexperiments: [x]\nvalues:\n  - {id: a, metric: speedup, value: "
            "fast, unit: x, hardware: h, "
            "source: s, match: {precision: amp}}\n",
            "values[0] (a).value: 'fast'; expected a number or a [low, high] range",
        ),
        (
            "id: bad\ntitle: t\nexperiments: [x]\nvalues:\n  - {id: a, metric: speedup, value: 1, "
            "unit: x, source: s, "
            "match: {precision: amp}}\n",
            "values[0] (a).hardware: missing",
        ),
        (
            "id: other\ntitle: t\nexperiments: [x]\nvalues: []\n",
            "id: 'other' must equal the file name 'bad'",
        ),
    ],
)
def test_a_bad_published_file_names_the_file_and_field(tmp_path, text, expect):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SourceError) as e:
        load_source(path)
    assert str(e.value).startswith(f"{path}: {expect}")


def test_variants_name_what_sets_jobs_apart_and_nothing_it_implies(tmp_path):
    from mixprec.report.analyse import by_experiment
    from mixprec.report.load import Job

    def summary(case, optimizer, precision, extra=()):
        return {
            "name": "half_pitfalls",
            "status": "completed",
            "seed": 0,
            "config": {"seed": 0},
            "choices": {
                "model": "small_cnn",
                "precision": precision,
                "optimizer": optimizer,
                "pitfall": case,
            },
            "overrides": [f"pitfall={case}", "trainer.max_steps=3", *extra],
            "metrics": {"train_time_s": 1.0},
        }

    jobs = [
        Job(tmp_path / str(i), s)
        for i, s in enumerate(
            [
                summary("adam_fp16", "adam", "half"),
                summary("small_fp32", "sgd", "fp32"),
                summary("small_half", "sgd", "half"),
                summary(
                    "small_half",
                    "sgd",
                    "half",
                    ["dataset.train_size=4096", "trainer.batch_size=256"],
                ),
            ]
        )
    ]
    by_experiment(jobs)
    # the case implies its optimizer: only the case is named; a long difference gets a short name
    assert [j.variant for j in jobs] == [
        "pitfall=adam_fp16",
        "pitfall=small_fp32",
        "pitfall=small_half",
        "[v1]",
    ]
    assert (
        jobs[3].variant_full == "dataset.train_size=4096,pitfall=small_half,trainer.batch_size=256"
    )


def test_every_precision_mode_has_its_own_colour_and_place():
    from mixprec.precision.modes import MODES
    from mixprec.report.plots import color

    modes = sorted(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))
    assert sorted(MODES) == modes
    assert len({color(m) for m in modes}) == len(modes)


def test_a_new_mode_takes_its_place_and_a_colour_of_its_own_with_no_edit_in_report(monkeypatch):
    """The report's order and colours derive from precision.modes.MODES: a mode named there (fp4,
    added after the others) sorts after them in a colour none of them has, and one named nowhere
    (int8) sorts last in a colour that is its own in every process and none of the named modes'."""
    from mixprec.precision import modes
    from mixprec.report.analyse import precision_key
    from mixprec.report.plots import color

    named = {m: color(m) for m in modes.MODES}
    int8 = color("int8")
    other = subprocess.run(   # another process, another hash seed: the same colour
        [sys.executable, "-c", "from mixprec.report.plots import color; print(color('int8'))"],
        capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "7"}, check=True,
    )
    assert other.stdout.strip() == str(int8) and int8 not in named.values()
    monkeypatch.setattr(modes, "MODES", (*modes.MODES, "fp4"))
    order = sorted(["int8", "fp4", "amp", "fp32"], key=precision_key)
    assert order == ["fp32", "amp", "fp4", "int8"]
    assert {m: color(m) for m in named} == named
    assert color("fp4") not in named.values()
    assert color("int8") not in {*named.values(), color("fp4")}


# ------------------------------------------------------------------------------ a user's sweep

def write_job(root, name, precision, train_time, emulated, experiment="default", trick=None):
    """A completed CPU job's records with a known time and memory; `emulated`: fp16/bf16 rounding
    on fp32 kernels."""
    d = root / name
    d.mkdir(parents=True)
    model = "resnet9" if trick else "small_cnn"
    choices = {"model": model, "precision": precision, "optimizer": "sgd"}
    if trick:
        choices["trick"] = trick
    metrics = {"train_time_s": train_time, "final_test_acc": 0.5, "peak_memory_mb": 100.0,
               "peak_memory_kind": "process_peak_rss", "time_to_target_s": train_time,
               "target_acc": 0.94}
    summary = {"status": "completed", "name": experiment, "seed": 0, "choices": choices,
               "overrides": [f"precision={precision}"] + ([f"trick={trick}"] if trick else []),
               "job": {"name": "train", "num": None, "output_dir": str(d)},
               "config": {"seed": 0, "name": experiment, "model": {"arch": model}},
               "arithmetic": "emulated" if emulated else "native", "metrics": metrics,
               "env": {"device": "cpu", "device_name": "x86_64", "torch": "2.x"}}
    (d / "summary.json").write_text(json.dumps(summary))


def drawn_figures(monkeypatch):
    """What each figure the report draws shows, by file name: per axes, its bars (height, hatch)
    and its legend's entries."""
    from mixprec.report import plots

    seen, real = {}, plots.save

    def keep(fig, path):
        seen[Path(path).name] = [
            {"bars": [(round(p.get_height(), 6), p.get_hatch()) for p in ax.patches],
             "legend": [t.get_text() for t in ax.get_legend().get_texts()],
             "lines": [list(line.get_xdata()) for line in ax.lines]}
            for ax in fig.axes]
        return real(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    return seen


def test_the_time_bars_mark_emulated_runs_as_the_tables_do(tmp_path, monkeypatch):
    """A CPU sweep: fp32 at 10 s, amp emulated at 15 s (an fp32 time with rounding on top, not
    amp's). The runs table says `(emulated: ...)`; the training-time and memory bars of amp are
    hatched and its legend says (emulated), fp32's are plain; the caption says what that means."""
    write_job(tmp_path / "runs", "fp32", "fp32", 10.0, emulated=False)
    write_job(tmp_path / "runs", "amp", "amp", 15.0, emulated=True)
    seen = drawn_figures(monkeypatch)
    data = make_report([str(tmp_path / "runs")], tmp_path / "report")
    (time_panel, memory_panel) = seen["default_time_memory.png"]
    for panel, (fp32, amp) in ((time_panel, (10.0, 15.0)), (memory_panel, (100.0, 100.0))):
        assert panel["bars"] == [(fp32, None), (amp, "//")]
        assert panel["legend"] == ["fp32", "amp (emulated)"]
    (fig,) = [f for f in data["experiments"][0]["plots"] if f["path"].endswith("_time_memory.png")]
    assert "Hatched, (emulated): fp16/bf16 rounding emulated" in fig["caption"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| amp (emulated: not a low-precision time) |" in md


def test_the_ladder_plot_marks_an_emulated_precision(tmp_path, monkeypatch):
    """Page's ladder on a CPU: half emulated, fp32 native; the staircase of half says (emulated)."""
    for step in ("page_01_baseline", "page_02_gpu_preproc"):
        write_job(tmp_path / "runs", f"{step}_fp32", "fp32", 60.0, False, "page_ladder", step)
        write_job(tmp_path / "runs", f"{step}_half", "half", 70.0, True, "page_ladder", step)
    seen = drawn_figures(monkeypatch)
    make_report([str(tmp_path / "runs")], tmp_path / "report")
    (ax,) = seen["page_ladder_ladder.png"]
    assert "reproduced (half, emulated)" in ax["legend"] and "reproduced (fp32)" in ax["legend"]


UNMATCHED_SOURCE = """
id: nomatch
title: A source this sweep does not run
url: https://example.org/nomatch
experiments: [default]
hardware: Test GPU
values:
  - {id: big, label: ResNet-152 amp speed-up, metric: speedup, value: 2.0, unit: x, source: t1,
     match: {model: resnet152, precision: amp}}
  - {id: big_acc, label: ResNet-152 accuracy, metric: test_acc_pct, value: 90, unit: "%",
     source: t2, match: {model: resnet152, precision: fp32}}
"""


def test_a_source_with_no_matching_job_takes_one_line(tmp_path):
    """A user's sweep (experiment `default`) against the shipped sources, none of which lists it:
    none is in the report (report.json keeps each with the commands that run its jobs, the plan's
    sweeps); against a source that lists it but whose values match none of its jobs: one line,
    not a table of "missing" rows; in report.md and in the W&B Report's table alike."""
    from mixprec.tools import plan
    from mixprec.report.wandb_report import _comparison_markdown

    write_job(tmp_path / "runs", "fp32", "fp32", 10.0, emulated=False)
    write_job(tmp_path / "runs", "amp", "amp", 15.0, emulated=True)
    data = make_report([str(tmp_path / "runs")], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    # the 5 shipped sources name other experiments: not listed in this sweep's report (report.json
    # keeps them, each with the commands that run its jobs)
    assert "missing: no run yet" not in md and "fastai_2080ti" not in md
    assert "no job here matches" not in md
    (fastai,) = [u for u in data["sources_without_runs"] if u["id"] == "fastai_2080ti"]
    article = next(a for a in plan.load_plan().articles if a.id == "fastai_2080ti")
    assert fastai["commands"] == [plan.full_command(s) for s in article.sweeps]

    published = tmp_path / "published"
    published.mkdir()
    (published / "nomatch.yaml").write_text(UNMATCHED_SOURCE)
    (published / "tinyref.yaml").write_text(TINY_SOURCE)   # matches some of these jobs
    data = make_report([str(tmp_path / "runs")], tmp_path / "report2", published)
    md = (tmp_path / "report2" / "report.md").read_text()
    assert "Published sources: nomatch, tinyref" in md
    (line,) = [line for line in md.splitlines()
               if "nomatch" in line and not line.startswith("Published sources")]
    assert line.startswith("- `nomatch` (A source this sweep does not run): no job here matches "
                           "its 2 published")
    assert "ResNet-152" not in md   # neither its rows nor its quotes
    table = md_table(md, "### Reproduced against published")
    assert ["tinyref", "A (fp32)", "3 s"] == table[3][:3] and all(r[0] == "tinyref" for r in table)
    wandb_md = _comparison_markdown(data["experiments"][0])
    assert line in wandb_md.splitlines() and "ResNet-152" not in wandb_md
    assert "| A (fp32) | 3 s |" in wandb_md


# --------------------------------------------------------------- no number on the screen misleads

def fake_job(root, name, precision="fp32", model="small_cnn", experiment="default", **metrics):
    """A completed CPU job's records (summary.json; metrics.jsonl when `rows` is given), with the
    metrics given over a small image job's defaults; `overrides`, `dataset`, `seed` as keywords."""
    d = root / name
    d.mkdir(parents=True)
    rows = metrics.pop("rows", None)
    dataset, seed = metrics.pop("dataset", None), metrics.pop("seed", 0)
    overrides = metrics.pop("overrides", [f"precision={precision}", f"model={model}"])
    lm = model in ("lstm", "gpt")
    m = {"train_time_s": 10.0, "throughput": 100.0, "peak_memory_mb": 100.0, "steps": 3,
         "skipped_steps": 0, "peak_memory_kind": "process_peak_rss", "epochs": 1.0,
         **({"best_valid_ppl": 300.0, "test_ppl_at_best_valid": 310.0} if lm
            else {"final_test_acc": 0.5}), **metrics}
    choices = {"model": model, "precision": precision, "optimizer": "sgd", "dataset": dataset}
    summary = {"status": "completed", "name": experiment, "seed": seed, "choices": choices,
               "overrides": overrides, "job": {"name": "train", "num": None, "output_dir": str(d)},
               "config": {"seed": seed, "name": experiment, "model": {"arch": model}},
               "arithmetic": "native", "metrics": m,
               "env": {"device": "cpu", "device_name": "x86_64", "torch": "2.x"}}
    (d / "summary.json").write_text(json.dumps(summary))
    if rows:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def fp32_and_tf32(tmp_path_factory):
    """Two real tiny CPU jobs, fp32 then tf32, and their report."""
    from helpers import run_tiny

    root = tmp_path_factory.mktemp("tf32")
    for p in ("fp32", "tf32"):
        assert run_tiny(root / "runs" / p, f"precision={p}")["status"] == "completed"
    data = make_report([str(root / "runs")], root / "report")
    return root, data


def test_tf32_on_a_cpu_gets_no_speedup(fp32_and_tf32):
    """TF32 changes no arithmetic off an NVIDIA GPU of compute capability 8.0+: on a CPU a tf32 job
    is an fp32 job, and a gap between their times is noise and one-time costs. The sweep table,
    the runs table and the speed-up plot show no ratio for it, and say why."""
    from mixprec.report.analyse import sweep_rows
    from mixprec.report.console import format_table

    root, data = fp32_and_tf32
    ss = summaries(root / "runs")
    rows = {r["precision"]: r for r in sweep_rows(ss)}
    assert rows["fp32"]["speedup"] == pytest.approx(1.0)
    assert rows["tf32"]["speedup"] is None, rows["tf32"]
    assert "TF32" in rows["tf32"]["note"] and "fp32" in rows["tf32"]["note"]
    assert "plain fp32" in format_table(list(rows.values()))
    table = md_table((root / "report" / "report.md").read_text(), "### Runs")
    (tf32,) = [r for r in table if r[1].startswith("tf32")]
    assert tf32[4] == "-" and "plain fp32" in tf32[1]
    assert not any(p["path"].endswith("_speedup.png") for p in data["experiments"][0]["plots"])
    # the time plot draws its bar, hatched and said to be fp32 arithmetic (not a faster tf32)
    (timing,) = [p for p in data["experiments"][0]["plots"] if p["path"].endswith("_memory.png")
                 and "time" in p["path"]]
    assert "(fp32 arithmetic)" in timing["caption"] and "not a speed-up" in timing["caption"]
    # and the tf32 job's own block says it, a job on several ranks says how many
    from mixprec.report.console import job_block

    tf32_job, = [s for s in ss if s["choices"]["precision"] == "tf32"]
    assert "TF32 does nothing here: plain fp32 arithmetic" in job_block(tf32_job)
    assert "; 2 ranks, fsdp (gloo)" in job_block(
        {**tf32_job, "distributed": {"world_size": 2, "strategy": "fsdp", "backend": "gloo"}})


def test_the_hardware_row_shows_each_jobs_own_tf32_flags(fp32_and_tf32):
    """The fp32 job ran with TF32 off, the tf32 job with it on: the hardware table has a row for
    each, not the first job's flags for both."""
    root, _ = fp32_and_tf32
    table = md_table((root / "report" / "report.md").read_text(), "### Hardware and software")
    tf32 = sorted(r[5] for r in table)
    assert len(table) == 2 and tf32[0].startswith("matmul False") \
        and tf32[1].startswith("matmul True"), table
    assert all("no effect on a CPU" in c for c in tf32)


def test_skipped_steps_are_a_column_and_a_job_that_skipped_most_is_flagged(tmp_path):
    """ResNet-152 amp skipped 3 of its 3 steps: it never trained. The sweep table and the runs
    table say so; a job that skipped none says 0."""
    from mixprec.report.analyse import by_experiment
    from mixprec.report.load import sweep_jobs
    from mixprec.report.console import format_table

    fake_job(tmp_path / "runs", "0_fp32", "fp32", "resnet152")
    fake_job(tmp_path / "runs", "1_amp", "amp", "resnet152", skipped_steps=3)
    jobs, _ = sweep_jobs(tmp_path / "runs")
    by_experiment(jobs)
    lines = format_table([j.row for j in jobs]).splitlines()
    assert "skipped" in lines[0]
    fp32, amp = lines[2:]
    assert "3/3" in amp and "skipped 3 of 3 steps: did not train" in amp
    assert "0/3" in fp32 and "did not train" not in fp32
    make_report([str(tmp_path / "runs")], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    heads = md[md.index("### Runs"):].splitlines()[2]
    col = heads.strip("|").split(" | ").index("skipped steps")
    table = md_table(md, "### Runs")
    assert [r[col] for r in table] == ["0/3", "3/3 (most: did not train)"]


def test_the_sweep_table_shows_every_swept_key(tmp_path):
    """A `dataset=` sweep (and a seed sweep) is one row per job that says which: no two rows
    alike."""
    from mixprec.report.analyse import by_experiment
    from mixprec.report.load import sweep_jobs
    from mixprec.report.console import format_table

    for n, (ds, seed) in enumerate([("cifar10", 0), ("synthetic", 0), ("synthetic", 1)]):
        fake_job(tmp_path / "runs", f"{n}_{ds}_{seed}", dataset=ds, seed=seed,
                 overrides=[f"dataset={ds}", f"seed={seed}"])
    jobs, _ = sweep_jobs(tmp_path / "runs")
    by_experiment(jobs)
    lines = format_table([j.row for j in jobs]).splitlines()[2:]
    assert len(set(lines)) == 3, lines
    assert "dataset=cifar10" in lines[0] and "seed=1" in lines[2], lines


def test_image_and_language_model_jobs_get_a_table_each(tmp_path):
    """A report (and a sweep table) mixing ResNet and LSTM jobs: the image jobs under samples/s and
    test accuracy, the language models under tokens/s and perplexity."""
    from mixprec.report.analyse import by_experiment
    from mixprec.report.load import sweep_jobs
    from mixprec.report.console import sweep_tables

    fake_job(tmp_path / "runs", "0_cnn", "fp32", "small_cnn", throughput=123.0)
    fake_job(tmp_path / "runs", "1_lstm", "fp32", "lstm", throughput=4567.0)
    make_report([str(tmp_path / "runs")], tmp_path / "report")
    html = (tmp_path / "report" / "report.html").read_text()
    tables = [t for t in html.split("<table>")[1:] if "<th>model</th>" in t]
    image = next(t for t in tables if "samples/s" in t)
    lm = next(t for t in tables if "tokens/s" in t)
    assert "123.0" in image and "test acc (%)" in image and "lstm" not in image
    assert "4567" in lm and "test ppl" in lm and "small_cnn" not in lm
    jobs, _ = sweep_jobs(tmp_path / "runs")
    by_experiment(jobs)
    text = sweep_tables([j.row for j in jobs])
    image_t, lm_t = text.split("\n\n")
    assert "samples/s" in image_t and "small_cnn" in image_t and "lstm" not in image_t
    assert "tokens/s" in lm_t and "lstm" in lm_t and "small_cnn" not in lm_t


def test_make_report_counts_the_published_values_it_lists_without_a_run(tmp_path, capsys):
    """The script's count is that of the values the report lists as having no run; a user's own
    sweep lists no published source that none of its jobs matches and no experiment of its
    names."""
    make_report_script = load_script("make_report")
    fake_job(tmp_path / "runs", "0_cnn_amp", "amp", "small_cnn", speedup=1.5)
    fake_job(tmp_path / "runs", "1_cnn_fp32", "fp32", "small_cnn")
    published = tmp_path / "published"
    published.mkdir()
    (published / "tinyref.yaml").write_text(TINY_SOURCE)   # 2 of 5 values match these jobs
    (published / "nomatch.yaml").write_text(UNMATCHED_SOURCE)   # lists `default`, matches none
    (published / "other.yaml").write_text(UNMATCHED_SOURCE.replace("nomatch", "other").replace(
        "[default]", "[an_experiment_not_run]"))
    assert make_report_script.main([str(tmp_path / "runs"), "--out", str(tmp_path / "report"),
                                    "--published", str(published)]) == 0
    out = capsys.readouterr().out
    md = (tmp_path / "report" / "report.md").read_text()
    listed = sum(1 for r in md_table(md, "### Reproduced against published") if "missing" in r[5])
    listed += 2   # nomatch's two values, in its one line
    assert f"{listed} published value(s)" in out.splitlines()[0], out
    assert "`other`" not in md and "fastai_2080ti" not in md
    assert "Published sources with no matching run" not in md


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def drawn_boxes(monkeypatch):
    """Per figure the report draws: per axes, its legend's box and its value labels' boxes (display
    coordinates, as drawn), and every text the figure holds."""
    from mixprec.report import plots

    seen, real = {}, plots.save

    def keep(fig, path):
        fig.tight_layout()
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        seen[Path(path).name] = {
            "axes": [{"legend": ax.get_legend() and ax.get_legend().get_window_extent(r),
                      "labels": [(t.get_text(), t.get_window_extent(r)) for t in ax.texts]}
                     for ax in fig.axes],
            "texts": [t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text"))]}
        return real(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    return seen


def test_no_legend_covers_a_value_label(tmp_path, monkeypatch):
    """The speed-up and time/memory bars carry their values above them; each legend sits where no
    value label is."""
    for n, (p, t, mem) in enumerate([("fp32", 10.0, 500.0), ("amp", 7.0, 480.0),
                                     ("amp_bf16", 7.5, 490.0), ("half", 6.0, 450.0)]):
        for model in ("small_cnn", "resnet18"):
            fake_job(tmp_path / "runs", f"{n}_{model}_{p}", p, model, train_time_s=t,
                     peak_memory_mb=mem)
    seen = drawn_boxes(monkeypatch)
    make_report([str(tmp_path / "runs")], tmp_path / "report")
    checked = 0
    for name in ("default_speedup.png", "default_time_memory.png"):
        for ax in seen[name]["axes"]:
            assert ax["legend"] is not None and ax["labels"], name
            for text, box in ax["labels"]:
                assert not overlaps(ax["legend"], box), f"{name}: the legend covers {text}"
                checked += 1
    assert checked >= 3 * 2 + 4 * 2 * 2


def test_code_wraps_and_cjk_has_a_font_in_the_html(tmp_path):
    """A long command in `code` wraps inside the page (no horizontal scrollbar); the page's font
    stack names CJK fonts after the Latin ones."""
    import re

    fake_job(tmp_path / "runs", "0_fp32")
    make_report([str(tmp_path / "runs")], tmp_path / "report")
    html = (tmp_path / "report" / "report.html").read_text()
    style = html[html.index("<style>"):html.index("</style>")]
    code = re.search(r"(?:^|})code\{([^}]*)\}", style)
    assert code and "overflow-wrap:anywhere" in code[1] and "white-space:pre-wrap" in code[1]
    body = re.search(r"body\{([^}]*)\}", style)[1]
    assert "Noto Sans CJK" in body and body.index("system-ui") < body.index("Noto Sans CJK")


def test_a_cjk_title_is_drawn_with_a_cjk_font(tmp_path, monkeypatch):
    """An experiment named in Chinese: its figures' titles are drawn with a font that has the
    glyphs (matplotlib warns "Glyph ... missing from font(s)" otherwise and draws empty boxes)."""
    import warnings

    from matplotlib import font_manager

    from mixprec.report import plots

    families = {f.name for f in font_manager.fontManager.ttflist}
    if not families & set(plots.CJK_FONTS if hasattr(plots, "CJK_FONTS") else ["Noto Sans CJK JP"]):
        pytest.skip("no CJK font installed here (e.g. apt-get install fonts-noto-cjk)")
    for p, t in (("fp32", 10.0), ("amp", 7.0)):
        fake_job(tmp_path / "runs", p, p, experiment="精度实验", train_time_s=t)
    seen = drawn_boxes(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_report([str(tmp_path / "runs")], tmp_path / "report")
    assert any("精度实验" in t for f in seen.values() for t in f["texts"])
    missing = [str(w.message) for w in caught if "missing from font" in str(w.message)]
    assert not missing, missing[:2]


def test_each_caption_is_said_once(tmp_path):
    """A figure's caption is in report.md and report.html once (not also as the image's alt text
    printed beside it)."""
    rows = [{"kind": "train", "step": s, "epoch": 1, "loss": 2.0, "loss_scale": 2.0 ** (16 - s)}
            for s in range(1, 5)]
    fake_job(tmp_path / "runs", "0_amp", "amp", rows=rows)
    data = make_report([str(tmp_path / "runs")], tmp_path / "report")
    (fig,) = [f for f in data["experiments"][0]["plots"] if f["path"].endswith("loss_scale.png")]
    for name in ("report.md", "report.html"):
        text = (tmp_path / "report" / name).read_text()
        assert text.count(fig["caption"]) == 1, name


def test_a_one_epoch_run_gets_curves_not_points(tmp_path, monkeypatch):
    """Image runs of one epoch (a short CPU sweep): a test-accuracy "curve" per epoch would be one
    point each; the report draws their training loss per logged step instead (every log_every
    steps and the epoch's end), and no one-point figure."""
    for p, loss in (("fp32", 2.0), ("amp", 2.1)):
        rows = [{"kind": "train", "step": s, "epoch": 1, "loss": loss - 0.1 * s, "lr": 0.1}
                for s in (2, 4, 6, 8)]
        rows.append({"kind": "epoch", "epoch": 1, "step": 8, "test_acc": 0.5})
        fake_job(tmp_path / "runs", p, p, rows=rows)
    seen = drawn_figures(monkeypatch)
    make_report([str(tmp_path / "runs")], tmp_path / "report")
    assert "default_curves.png" not in seen
    (ax,) = seen["default_train_loss.png"]
    assert ax["legend"] == ["small_cnn, fp32", "small_cnn, amp"]
    assert all(len(line) == 4 for line in ax["lines"]), ax["lines"]


def test_side_by_side_gives_an_article_no_folder_planned_one_line_not_a_table():
    """Two results folders of torch_amp only: page_ladder's 25 published values are one line naming
    it, not a table of "not in this folder's plan" cells (report.json keeps every row)."""
    from mixprec.report.reference import NOT_PLANNED
    from mixprec.report.render import Doc, reference_section

    row = lambda label, cells: {"label": label, "published": "1", "hardware": "V100",
                                "cells": cells}
    sec = {"columns": ["CPU (a)", "CPU (b)"], "folders": ["a", "b"], "ratios": None,
           "articles": [
               {"id": "torch_amp", "title": "AMP",
                "rows": [row("speed-up", ["1.2x", NOT_PLANNED])]},
               {"id": "page_ladder", "title": "Page",
                "rows": [row(f"{i} step", [NOT_PLANNED, NOT_PLANNED]) for i in range(25)]}]}
    d = Doc()
    reference_section(d, sec)
    md = d.markdown()
    assert "### torch_amp: AMP" in md and "### page_ladder" not in md
    assert "Not in any folder's plan (scripts/reproduce.py --only): page_ladder;" in md
    assert md.count(NOT_PLANNED) == 1
