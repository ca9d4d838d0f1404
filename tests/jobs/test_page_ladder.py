"""Page's bag-of-tricks ladder: every step's settings, a real run of the last step, the whole ladder
as a sweep, and the ladder table's summary of repeated runs."""
import json

import pytest

from helpers import compose_config, run_cli, run_tiny
from helpers.configs import LADDER_TINY
from mixprec.config import validate
from mixprec.report.analyse import ladder_rows
from mixprec.report.published import page_ladder
from mixprec.report.rows import ladder_cells

PAGE_LADDER = page_ladder()
STEPS = list(PAGE_LADDER)
# per step: the flags it turns on (on top of the step before) and Page's max lr for a mean loss (his
# lr x 512)
NEW_FLAGS = {
    "page_01_baseline": ({"loss_sum"}, 0.4),
    "page_02_gpu_preproc": (set(), 0.4),
    "page_03_maxpool_reorder": ({"maxpool_reorder"}, 0.4),
    "page_04_label_smoothing": (set(), 0.4),
    "page_05_celu": ({"celu"}, 0.4),
    "page_06_ghost_bn": ({"ghost_bn"}, 0.6),
    "page_07_frozen_bn_scale": ({"frozen_bn_scale"}, 0.6),
    "page_08_whitening": ({"whitening"}, 1.0),
    "page_09_ema": ({"ema"}, 1.0),
    "page_10_tta": ({"tta"}, 1.0),
}
FLAGS = (
    "loss_sum",
    "maxpool_reorder",
    "celu",
    "ghost_bn",
    "frozen_bn_scale",
    "whitening",
    "ema",
    "tta",
)


@pytest.mark.parametrize("i,step", list(enumerate(STEPS)))
def test_each_step_has_pages_settings_and_keeps_the_steps_before(i, step):
    c = validate(compose_config(f"trick={step}"))
    on = {f for f in FLAGS if getattr(c.trick, f)}
    before = {f for s in STEPS[:i + 1] for f in NEW_FLAGS[s][0]}
    assert c.trick.name == step and on == before
    assert (
        c.model.arch == "resnet9"
        and c.trainer.epochs == PAGE_LADDER[step][2]
        and c.trainer.batch_size == 512
    )
    assert c.trainer.target_acc == 0.94
    # Page's parametrisation: summed loss, lr / 512 and weight decay 5e-4 * 512; Nesterov SGD
    assert (
        c.optimizer.lr * 512 == pytest.approx(NEW_FLAGS[step][1])
        and c.optimizer.weight_decay == 0.256
    )
    assert c.optimizer.name == "sgd" and c.optimizer.nesterov and c.optimizer.momentum == 0.9
    # lr: linear warm-up to the peak at epoch 5 of 24, then at a fifth of training; EMA steps floor
    # it at 0.1
    peak = 5 / 24 if i < 2 else 0.2
    assert c.schedule.knots[1] == pytest.approx(peak, abs=1e-6) and c.schedule.values[:2] == (
        0.0,
        1.0,
    )
    if c.trick.ema:
        assert c.schedule.knots[2] * c.trainer.epochs == pytest.approx(
            c.trainer.epochs - 2, abs=1e-5
        )
        assert c.schedule.values[2:] == (0.1, 0.1)
    else:
        assert c.schedule.values[-1] == 0.0
    # fp16 weights with BatchNorm in fp32, no master weights, no loss scale (the summed loss is
    # Page's)
    assert (
        c.precision.name == "half" and c.precision.keep_bn_fp32 and c.precision.loss_scale == "none"
    )
    assert c.dataset.pipeline == ("dataloader" if i == 0 else "device")
    # ghost BN steps in NCHW, Page's layout
    assert c.trainer.channels_last == (not c.trick.ghost_bn)
    # Page's loader ran in the main process (torch_backend.py at 37a13cc:49, num_workers=0)
    if i == 0:
        assert (
            c.dataset.workers == 0
            and validate(compose_config(f"trick={step}", "dataset.workers=4")).dataset.workers == 4
        )
    assert c.dataset.cutout == (8 if i < 7 else 5 if i < 9 else 0)
    assert c.trick.label_smoothing == (0.2 if i >= 3 else 0.0)
    assert (c.trick.celu_alpha, c.trick.bn_bias_lr, c.model.output_scale) == (
        (0.3, 64.0, 0.0625) if c.trick.frozen_bn_scale else (0.075, 1.0, 0.125))


def test_only_pages_step_1_loads_in_the_main_process():
    """Page's step 1 loader had no workers; the dataloader pipeline elsewhere keeps its 2 (speed
    over fidelity)."""
    assert validate(compose_config("trick=page_01_baseline")).dataset.workers == 0
    assert validate(compose_config("dataset.pipeline=dataloader")).dataset.workers == 2


def test_a_trick_flag_combines_alone_and_the_precision_can_be_swept_over_a_step():
    c = validate(
        compose_config(
            "model=resnet9", "trick.ghost_bn=true", "trick.tta=true", "trainer.batch_size=64"
        )
    )
    assert c.trick.ghost_bn and c.trick.tta and not c.trick.celu and c.trick.name == "none"
    c = validate(compose_config("trick=page_10_tta", "precision=amp"))
    assert c.precision.name == "amp" and c.precision.loss_scale == "dynamic" and c.trick.tta


@pytest.mark.slow
def test_the_last_step_trains_with_every_trick_in_its_own_precision(tmp_path):
    # fp16 weights, BN fp32, ghost BN, whitening...
    s = run_tiny(tmp_path, "trick=page_10_tta", base=LADDER_TINY)
    m = s["metrics"]
    assert s["status"] == "completed" and s["choices"]["precision"] == "half" and m["steps"] == 2
    assert m["final_test_acc"] == m["final_test_acc_tta"] and m["final_test_acc_no_tta"] is not None
    # Page's clock: the whitening fit is timed apart (setup_time_s), the prewarm step runs before
    # the clock
    assert m["train_time_s"] == pytest.approx(sum(m["epoch_times_s"]))
    assert m["prewarm_time_s"] > 0 and s["config"]["trainer"]["prewarm_steps"] == 1
    assert m["time_to_target_s"] is None and m["target_acc"] == 0.94
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_acc_tta"] for r in rows if r["kind"] == "epoch"] == [m["final_test_acc"]]
    # logged per sample, not summed
    assert all(r["loss"] < 10 for r in rows if r["kind"] == "train")


def test_step_1_is_timed_on_pages_clock_with_its_data_preparation(tmp_path):
    """dawn.py@55be9b98 (lines 33-40) starts its timer before padding and normalising the split:
    mixprec times its one-off preparation (here the loader's pad and normalise, Page's step 1)
    as preprocess_time_s, and page_clock_s, the ladder table's "time+prep s", adds it to
    train_time_s."""
    # 32 px: the pad-once loader
    base = [o for o in LADDER_TINY if not o.startswith("dataset.image_size")]
    s = run_tiny(tmp_path, "trick=page_01_baseline", "precision=fp32", base=base)
    m = s["metrics"]
    assert s["status"] == "completed" and s["config"]["dataset"]["workers"] == 0
    assert (
        m["preprocess_time_s"] > 0
        and m["page_clock_s"] == m["train_time_s"] + m["preprocess_time_s"]
    )
    (row,) = ladder_rows([s])
    assert row["page_clock_s"] == pytest.approx(m["page_clock_s"])


@pytest.mark.parametrize("layout,most,before", [
    ("false", 235, 336),
    pytest.param("true", 260, 575, marks=pytest.mark.slow),   # channels_last: 5 s
])
def test_step_10_dispatches_fewer_ops_a_step(layout, most, before):
    """ATen ops per steady step of Page's step 10 on the CPU (scripts/bench_ladder_ops.py): before
    these changes (799519f) 336 in NCHW and 575 in channels_last; the EMA update was ~142 ops every
    5 steps, ghost BN 14 a layer (24 in channels_last, plus ~20 backward), the batch's augmentation
    33."""
    from helpers import load_script
    ops = load_script("bench_ladder_ops").count_step_ops(
        "page_10_tta", batch=32, measure=5, warm=1, overrides=[f"trainer.channels_last={layout}"]
    )
    assert ops["total"] <= most < before
    assert (
        ops["ema"] <= 0.4
        and ops["ghost_bn"] <= 8 * (6 if layout == "false" else 8)
        and ops["data"] <= 22
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "11"], "--steps 11: ladder steps are 1..10"),
        (
            ["--steps", "10", "--batch", "24"],
            "bench_ladder_ops: trick.ghost_splits=16: must divide trainer.batch_size=24",
        ),
    ],
)
def test_the_ops_script_says_what_was_wrong(args, message):
    from helpers import load_script
    with pytest.raises(SystemExit) as e:
        load_script("bench_ladder_ops").main(args)
    assert str(e.value) == message


@pytest.mark.slow   # a subprocess sweep
def test_the_ladder_sweep_runs_all_ten_steps_and_prints_them_beside_the_article(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli(
        "-m",
        "experiment=page_ladder",
        "precision=fp32",
        *LADDER_TINY,
        f"hydra.sweep.dir={sweep}",
        # the overrides would make too long a directory name
        "hydra.sweep.subdir=${hydra.job.num}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sweep.glob("*/summary.json")]
    assert sorted(s["choices"]["trick"] for s in summaries) == sorted(STEPS)
    for s in summaries:
        assert (
            s["status"] == "completed"
            and s["metrics"]["steps"] == 2
            and s["choices"]["precision"] == "fp32"
        )
        assert s["config"]["trainer"]["epochs"] == PAGE_LADDER[s["choices"]["trick"]][2]
    out = r.stdout
    table = out[out.index("Page's ladder"):].splitlines()
    assert table[1].split()[:3] == ["step", "variant", "runs"] and "acc (TTA)" in table[1]
    rows = [line.split() for line in table[3:13]]
    assert [row[0] for row in rows] == STEPS
    for row, step in zip(rows, STEPS):
        assert row[1] == "1/1" and row[-2:] == [
            f"{PAGE_LADDER[step][1]:.1f}",
            str(PAGE_LADDER[step][2]),
        ]


def fake(step, seed, acc, acc_tta, to_target, extra=()):
    return {
        "status": "completed",
        "choices": {"trick": step},
        "overrides": ["experiment=page_ladder", f"trick={step}", f"seed={seed}", *extra],
        "metrics": {
            "epochs": 10.0,
            "train_time_s": 100.0 + seed,
            "time_to_target_s": to_target,
            "final_test_acc": acc_tta or acc,
            "final_test_acc_no_tta": acc,
            "final_test_acc_tta": acc_tta,
        },
    }


def test_the_ladder_table_summarises_repeated_runs_per_step():
    summaries = [
        fake("page_10_tta", 0, 0.93, 0.940, 30.0),
        fake("page_10_tta", 1, 0.92, 0.942, None),
        fake("page_01_baseline", 0, 0.93, 0.94, None),
        fake("page_01_baseline", 1, 0.94, 0.95, 80.0),
        fake("page_01_baseline", 2, 0.95, 0.96, 70.0),
        fake("page_01_baseline", 0, 0.9, 0.9, None, ["precision=amp"]),
        {"status": "completed", "choices": {"trick": "none"}, "overrides": [], "metrics": {}},
    ]
    rows = [ladder_cells(r) for r in ladder_rows(summaries)]
    assert [(r["step"], r["variant"]) for r in rows] == [
        ("page_01_baseline", ""),
        ("page_01_baseline", "precision=amp"),
        ("page_10_tta", ""),
    ]
    base, amp, tta = rows
    assert (
        base["runs"] == "3/3"
        and base["acc"] == "0.9400 +- 0.0100"
        and base["acc_tta"] == "0.9500 +- 0.0100"
    )
    # all runs: 2 of 3 reached; the median of (never, 80, 70) is 80; the time is the mean of 100,
    # 101, 102 +- 1
    assert (
        base["reached"] == "2/3"
        and base["to_94_s"] == "80.00"
        and base["train_time_s"] == "101.00 +- 1.00"
    )
    assert (
        (base["page_s"], base["page_epochs"]) == (75.0, 24)
        and amp["acc"] == "0.9000"
        and amp["runs"] == "1/1"
    )
    # one of two reached: the median over both runs is "not reached", never the survivor's 30 s
    assert (
        tta["acc_tta"] == "0.9410 +- 0.0014"
        and tta["reached"] == "1/2"
        and tta["to_94_s"] == "not reached"
    )
    assert ladder_rows([summaries[-1]]) == []


def test_the_sweep_table_and_the_report_show_the_same_ladder_rows(tmp_path, capsys):
    """The end-of-sweep callback and make_report read the same sweep folder: the console's ladder
    table and the report's come from one analysis (analyse.ladder_rows), so their cells agree, and
    match a hand count."""
    from omegaconf import OmegaConf

    from mixprec.report.callbacks import SweepTable
    from mixprec.report.make import make_report

    sweep = tmp_path / "sweep"
    runs = [
        fake("page_01_baseline", 0, 0.93, 0.94, None),
        fake("page_01_baseline", 1, 0.94, 0.95, 80.0),
        fake("page_01_baseline", 2, 0.95, 0.96, 70.0),
        fake("page_10_tta", 0, 0.93, 0.940, 30.0),
    ]
    for i, s in enumerate(runs):
        s.update(name="page_ladder", choices=dict(s["choices"], model="resnet9", precision="fp32"))
        (sweep / f"{i}_job").mkdir(parents=True)
        (sweep / f"{i}_job" / "summary.json").write_text(json.dumps(s))
    SweepTable().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    out = capsys.readouterr().out
    console = [line.split("  ") for line in out[out.index("Page's ladder"):].splitlines()[3:]]
    console = [
        [c.strip() for c in row if c.strip() not in ("", "-")] for row in console if row and row[0]
    ]
    data = make_report([str(sweep)], out=tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    table = md[md.index("### Ladder"):].split("\n\n")[2].splitlines()[2:]
    report = [
        [c.strip() for c in line.strip("|").split(" | ") if c.strip() and c.strip() != "-"]
        for line in table
    ]
    assert console == report
    # page_01: 3 of 3 completed and reached 2/3, times 100, 101, 102 s; the median time to target of
    # (never, 80, 70)
    assert report[0] == ["page_01_baseline", "3/3", "10.00", "101.00 +- 1.00", "0.9400 +- 0.0100",
                         "0.9500 +- 0.0100", "2/3", "80.00", "75.0", "24"]
    assert report[1][:2] == ["page_10_tta", "1/1"] and report[1][-3:] == ["30.00", "26.0", "10"]
    assert [r["step"] for r in data["experiments"][0]["ladder"]] == [
        "page_01_baseline",
        "page_10_tta",
    ]


@pytest.mark.parametrize("step", ["page_09_ema", "page_10_tta"])
def test_steps_9_and_10_build_their_ema_and_evaluate_it(tmp_path, monkeypatch, step):
    """The quick twin of the slow EMA tests (tests/jobs/test_trick_jobs.py): a tiny job of Page's
    steps 9 and 10 builds the EMA, updates it, and every evaluation scores the average, not the
    model."""
    from mixprec.train import image_steps, tricks

    made, scored = [], []

    class RecordingEMA(tricks.EMA):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    evaluate = image_steps.evaluate
    monkeypatch.setattr(tricks, "EMA", RecordingEMA)
    monkeypatch.setattr(image_steps, "evaluate",
                        lambda model, *a, **k: (scored.append(model), evaluate(model, *a, **k))[1])
    s = run_tiny(tmp_path, f"trick={step}", "trick.ema_every=1", base=LADDER_TINY)
    assert s["status"] == "completed"
    assert len(made) == 1 and scored and all(m is made[0].model for m in scored), (made, scored)
