"""The probe's story of a divergence (src/mixprec/numerics/events.py, verdicts.py): the first event
in time order, the mechanism from the measurements, inputs that are not what they seem; each verdict
made to happen on the CPU at small size, and a healthy run that gets none."""
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import TINY, compose_config, run_tiny
from helpers.probes import CPU, ctx, fit_probed, Scale
from mixprec.config import ConfigError, PrecisionConfig, validate
from mixprec.numerics import events
from mixprec.numerics import verdicts
from mixprec.numerics.probe import NUMERICS
from mixprec.train.parts import JobContext

TINY8 = [*TINY, "dataset.image_size=8"]
# Page's step 5 (CELU) at 8 px: the 8 px cutout blanks every image (the Page case of issue 29)
PAGE8 = [
    "experiment=page_ladder",
    "trick=page_05_celu",
    "precision=half",
    "dataset=synthetic",
    "dataset.image_size=8",
    "dataset.train_size=128",
    "dataset.test_size=32",
    "trainer.batch_size=64",
    "trainer.max_steps=2",
    "logger=none",
    "trainer.device=cpu",
    "model.channels=[8,8,8,8]",
    "hydra.mode=RUN",
]


def judged(result, numerics, rows, precision, **kw):
    return verdicts.judge(
        numerics, rows, ctx(precision, result["status"], result["metrics"]["steps"], **kw)
    )


# -- inputs that are not what they seem ------------------------------------------------------------

def test_a_cutout_as_large_as_the_image_is_refused_in_one_line_unless_meant():
    with pytest.raises(
        ConfigError,
        match=r"dataset.cutout=8 is as large as dataset.image_size=8: it blanks every "
        r"image; scale it \(dataset.cutout=2",
    ) as e:
        validate(compose_config(*PAGE8))
    assert "\n" not in str(e.value)
    assert validate(compose_config(*PAGE8, "dataset.cutout_on_purpose=true")).dataset.cutout == 8
    assert validate(compose_config(*PAGE8, "dataset.cutout=2")).dataset.cutout == 2
    with pytest.raises(
        ConfigError, match=r"dataset.crop_padding=32: the random crop reflect-pads the stored 32 px"
    ):
        validate(compose_config(*PAGE8, "dataset.cutout=2", "dataset.crop_padding=32"))


def test_batch_findings():
    y = torch.arange(4)
    blank = events.batch_findings(torch.zeros(4, 3, 8, 8), y)
    assert [f["what"] for f in blank] == ["batch all zeros"]
    assert [f["what"] for f in events.batch_findings(torch.full((4, 3, 8, 8), 0.5), y)] == [
        "batch constant"
    ]
    each = torch.arange(4.0).view(4, 1, 1, 1).expand(4, 3, 8, 8)
    assert [f["what"] for f in events.batch_findings(each, torch.zeros(4, dtype=torch.long))] == [
        "every image constant", "labels constant"]
    assert events.batch_findings(torch.randn(4, 3, 8, 8), y) == []


# -- each verdict made to happen -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("probe", ["ranges", "none"])
def test_page_8px_blank_input_is_a_backward_overflow_in_pure_fp16(tmp_path, caplog, probe):
    """The issue's case: at 8 px Page's cutout blanks every image; BatchNorm over all-zero
    activations divides the backward by sqrt(eps) per layer and CELU passes it on: at step 1 the
    backward overflows fp16 at layer2.pool. Under probe=none the divergence is replayed under
    probe=ranges (train/replay.py) to say the same."""
    s = run_tiny(
        tmp_path,
        *PAGE8,
        f"probe={probe}",
        "probe.every=1",
        "dataset.cutout_on_purpose=true",
        base=[],
    )
    assert s["status"] == "diverged"
    e = s["numerics"]["first_nonfinite"]
    assert (e["step"], e["pass"], e["module"], e["tensor"], e["what"], e["limit"]) == (
        1, "backward", "layer2.pool", "act_grad", "overflow", 65504.0)
    assert s["reason"].startswith(
        "loss became nan at step 2; first non-finite: step 1 backward, layer2.pool act_grad: "
        "overflow past 65504 (float16)"
    )
    if probe == "ranges":
        assert s["numerics"]["worst_overflow"][0]["layer"] == "layer2.pool"
    else:
        assert (
            e["replayed"]
            and s["numerics"]["replay"]["matched"]
            and (tmp_path / "replay" / NUMERICS).exists()
        )
    assert [f["what"] for f in s["numerics"]["inputs"]] == [
        "batch all zeros",
        "first layer output all zeros",
    ]
    assert "step 1: batch all zeros" in caplog.text
    v = s["verdict"]
    assert (v["mechanism"], v["step"], v["pass"], v["module"]) == (
        "backward_overflow_fp16",
        1,
        "backward",
        "layer2.pool",
    )
    assert "precision=amp" in v["line"] and "inputs at step 1: batch all zeros" in v["line"]
    assert v["cites"][0].startswith(
        ("" if probe == "ranges" else "replay/") + "numerics.jsonl step 1 act_grad layer2.pool"
    )


@pytest.mark.slow
@pytest.mark.parametrize("probe", ["none", "ranges"])
def test_adam_in_pure_fp16_is_eps_at_zero_measured(tmp_path, probe):
    s = run_tiny(
        tmp_path,
        "pitfall=adam_fp16",
        *TINY8,
        "trainer.batch_size=8",
        "trainer.log_every=1",
        f"probe={probe}",
        "probe.every=1",
        base=[],
    )
    v = s["verdict"]
    assert s["status"] == "diverged" and (v["mechanism"], v["step"], v["pass"]) == (
        "adam_eps_zero", 1, "optimizer update"), v
    # the replay names the module, the rows the weight
    assert v["module"] == ("0" if probe == "none" else "0.weight")
    assert "eps=1e-08 is 0 in float16" in v["line"]
    assert (
        ("Adam state: v == 0 at 100%" in v["cites"][0])
        if probe == "none"
        else "update 0.weight" in v["cites"][0]
    )


def test_a_layer_multiplying_by_1e6_in_fp16_is_a_forward_overflow(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), Scale(1e6), nn.Flatten(), nn.Linear(256, 10)
    )
    half = PrecisionConfig(name="half", param_dtype="float16", keep_bn_fp32=False)
    result, n, rows = fit_probed(model, half, tmp_path, steps=2)
    v = judged(result, n, rows, half)
    assert (v["mechanism"], v["step"], v["pass"], v["module"]) == (
        "forward_overflow",
        1,
        "forward",
        "1",
    ), v
    assert "passed 65504 (float16)" in v["line"] and n["worst_overflow"][0]["layer"] == "1"


def test_a_static_scale_past_fp16s_range_is_a_backward_overflow(tmp_path):
    """The quick loop's guard of `backward_overflow_fp16` (the Page 8 px jobs above are slow): a
    static loss scale of 1e9 on fp16 weights, no masters, makes the logits' gradient inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(256, 10))
    half = PrecisionConfig(
        name="half", param_dtype="float16", keep_bn_fp32=False, loss_scale=1e9
    )
    result, n, rows = fit_probed(model, half, tmp_path, steps=2)
    v = judged(result, n, rows, half)
    assert (v["mechanism"], v["step"], v["pass"], v["module"]) == (
        "backward_overflow_fp16",
        1,
        "backward",
        "2",
    ), v
    assert "precision=amp" in v["line"] and v["cites"][0].startswith(
        "numerics.jsonl step 1 act_grad 2"
    )


def test_batchnorm_in_eval_mode_in_half_precision(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(256, 10)
    )
    # frozen statistics that fp16 cannot hold: the output is x / sqrt(eps) and more
    model[1].running_var.fill_(1e-8)
    half = PrecisionConfig(name="half", param_dtype="float16", keep_bn_fp32=False)
    result, n, rows = fit_probed(model, half, tmp_path, steps=2, x_scale=1000.0, bn_eval=True)
    v = judged(result, n, rows, half, bn_eval=True)
    assert (v["mechanism"], v["step"], v["pass"], v["module"]) == (
        "bn_eval_half",
        1,
        "forward",
        "1",
    ), v


class GradBoom(torch.autograd.Function):
    """Identity forward; a backward that overflows at any loss scale GradScaler could reach."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g.float() * 1e38 * 1e38).to(g.dtype)


class Boom(nn.Module):
    def forward(self, x):
        return GradBoom.apply(x)


def test_a_dynamic_scale_that_keeps_backing_off(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Boom(), nn.Flatten(), nn.Linear(256, 10))
    amp = PrecisionConfig(name="amp", autocast_dtype="float16", loss_scale="dynamic")
    result, n, rows = fit_probed(model, amp, tmp_path, probe="none", steps=6)
    assert result["status"] == "completed" and n["skipped_total"] == 6
    v = judged(result, n, rows, amp)
    assert (v["mechanism"], v["step"], v["pass"], v["module"]) == (
        "scale_backoff",
        1,
        "backward",
        "0.weight",
    ), v
    assert "steps 1-6 skipped, scale 65536 -> 2048" in v["line"]


def test_a_scale_that_backs_off_at_the_start_and_then_fits_is_no_verdict():
    amp = PrecisionConfig(name="amp", autocast_dtype="float16", loss_scale="dynamic")
    skips = [
        {"step": k, "scale": 2.0 ** (17 - k), "nonfinite_grads": ["0.weight"]} for k in range(1, 7)
    ]
    n = {"skipped_steps": skips, "skipped_total": 6, "first_nonfinite": None, "inputs": []}
    # 6 skips at the start of 50 steps: healthy
    assert verdicts.judge(n, [], ctx(amp, "completed", 50)) is None
    # to the end: not
    assert verdicts.judge(n, [], ctx(amp, "completed", 6))["mechanism"] == "scale_backoff"


def test_gradients_lost_to_underflow_say_which_scale_keeps_them(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), Scale(1e-4), nn.Flatten(), nn.Linear(256, 10)
    )
    half = PrecisionConfig(name="half", param_dtype="float16", keep_bn_fp32=False)
    result, n, rows = fit_probed(model, half, tmp_path, steps=1)
    v = judged(result, n, rows, half)
    assert (v["mechanism"], v["step"], v["pass"], v["module"]) == (
        "grad_underflow",
        1,
        "backward",
        "1",
    ), v  # Tanh
    assert "would have lifted 99% of them" in v["line"] and "precision.loss_scale=" in v["fix"]


def test_blank_inputs_that_do_not_diverge_are_the_verdict(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10)
    )
    fp32 = PrecisionConfig(name="fp32")
    result, n, rows = fit_probed(model, fp32, tmp_path, probe="none", steps=2, x_scale=0.0)
    assert result["status"] == "completed" and n["first_nonfinite"] is None
    assert [f["what"] for f in n["inputs"]] == ["batch all zeros", "first layer output all zeros"]
    v = judged(result, n, rows, fp32)
    assert (v["mechanism"], v["step"], v["pass"], v["module"]) == (
        "blank_inputs",
        1,
        "forward",
        "0",
    ), v


def test_no_rule_fits_says_so(tmp_path):
    n = {
        "first_nonfinite": {
            **events.event(3, "forward", "3", "float32", "NaN"),
            "module_type": "NanFrom",
        },
        "inputs": [],
    }
    v = verdicts.judge(n, [], ctx(PrecisionConfig(name="fp32"), "diverged", 3))
    assert v["mechanism"] is None and v["line"].startswith(
        "no rule fits: first non-finite: step 3 forward, 3 output"
    )


# -- a healthy run gets none -----------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "amp"])
def test_a_healthy_run_gets_no_verdict(tmp_path, precision):
    s = run_tiny(
        tmp_path, *TINY8, f"precision={precision}", "probe=ranges", "probe.every=1", base=[]
    )
    assert s["status"] == "completed" and s["verdict"] is None, s["verdict"]
    assert s["numerics"]["first_nonfinite"] is None and s["numerics"]["inputs"] == []


# -- shown where people look -----------------------------------------------------------------------

@pytest.mark.slow
def test_the_verdict_is_in_the_console_block_the_sweep_note_report_md_and_wandb(tmp_path):
    """A blank batch (cutout = image, on purpose) in fp32: it completes, and the verdict says what
    was wrong."""
    pytest.importorskip("wandb")
    from mixprec.report.analyse import sweep_rows
    from mixprec.report.make import make_report
    from mixprec.report.console import job_block
    from helpers.wandb_files import final_summary

    s = run_tiny(
        tmp_path / "job",
        *TINY8,
        "dataset.cutout=8",
        "dataset.cutout_on_purpose=true",
        "logger=wandb",
        base=[],
    )
    v = s["verdict"]
    assert s["status"] == "completed" and v["mechanism"] == "blank_inputs", v
    block = job_block(s)
    assert (
        f"verdict     {v['line']}" in block
        and "            from step 1 inputs: batch all zeros" in block
    )
    assert sweep_rows([s])[0]["note"].startswith("verdict: blank_inputs (step 1, forward")
    make_report([str(tmp_path / "job")], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "### Numerics verdicts" in md and v["line"] in md
    mirrored = final_summary(Path(s["wandb"]["dir"]))
    assert mirrored["verdict"] == v["line"] and mirrored["verdict_mechanism"] == "blank_inputs"


def test_a_failing_replay_leaves_the_job_diverged_with_its_attribution(tmp_path):
    from mixprec.train import replay

    cfg = validate(compose_config(*TINY8, "probe=none"))
    e = {**events.event(2, "update", "0", "float16", None), "tensor": "weights"}
    summary = {
        "status": "diverged",
        "nonfinite": {"step": 2},
        "numerics": {"first_nonfinite": e},
        "config": {},
    }

    def out_of_memory(*args):
        raise RuntimeError("out of memory")
    out = replay.explain(summary, JobContext(cfg, CPU, out_dir=tmp_path), out_of_memory)
    assert out["numerics"]["first_nonfinite"] == e and "verdict" not in out and "reason" not in out
    assert out["numerics"]["replay"] == {
        "dir": str(tmp_path / "replay"),
        "steps": 2,
        "matched": False,
        "error": "RuntimeError: out of memory",
    }
    assert (
        replay.replay_step(summary, "ranges", False) is None
        and replay.replay_step(summary, "none", True) is None
    )


def test_a_sharded_job_is_not_replayed(tmp_path):
    """trainer.strategy=fsdp, even on one rank: its probe sees no model (its layers hold shards), so
    a replay under probe=ranges could name no module; none is run."""
    from mixprec.train import replay

    cfg = validate(compose_config(*TINY8, "probe=none", "trainer.strategy=fsdp"))
    e = {**events.event(2, "update", "0", "float16", None), "tensor": "weights"}
    summary = {"status": "diverged", "nonfinite": {"step": 2}, "numerics": {"first_nonfinite": e},
               "config": {}}
    calls = []
    ctx = JobContext(cfg, CPU, out_dir=tmp_path)
    assert replay.explain(summary, ctx, lambda *a: calls.append(a)) == {}
    assert calls == [] and not (tmp_path / "replay").exists()
