"""The half-precision pitfalls as real runs, the BN-eval case, the opt-level and pitfall sweeps, and
the batch-size search."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compose_config, load_script, run_cli
from mixprec.config import validate
from mixprec.models import set_bn_eval, small_cnn
from mixprec.precision.modes import hazards
from mixprec.precision.policy import PrecisionPolicy
from mixprec.tools.search import largest_fitting

SMALL = [
    "dataset.train_size=64",
    "dataset.test_size=16",
    "trainer.batch_size=8",
    "trainer.eval_batch_size=16",
    "dataset.image_size=8",
    "logger=none",
    "trainer.device=cpu",
]


def test_adam_in_pure_fp16_diverges_for_real_and_says_why(tiny, tmp_path):
    s = tiny("pitfall=adam_fp16", "trainer.max_steps=6", "trainer.log_every=1")
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["status"] == "diverged" and 1 <= on_disk["nonfinite"]["step"] <= 3
    assert "optimizer.eps=1e-08 rounds to 0 in float16" in on_disk["reason"]
    # the verdict (docs/numerics.md, adam_eps_zero; measured under probe=ranges: the slow
    # tests/unit/numerics/test_probe_verdicts.py::test_adam_in_pure_fp16_is_eps_at_zero_measured)
    assert on_disk["verdict"]["mechanism"] == "adam_eps_zero", on_disk["verdict"]
    # conf/pitfall/adam_fp16.yaml
    finding = validate(compose_config("pitfall=adam_fp16")).case.finding
    assert "eps=1e-8 rounds to 0 in fp16" in finding
    assert (
        on_disk["case"]
        == s["case"]
        == {"name": "adam_fp16", "expect": "diverged", "as_expected": True, "finding": finding}
    )


@pytest.mark.parametrize("case", ["adam_fp16_eps1e4", "adam_amp"])
@pytest.mark.slow
def test_the_fixes_train(tiny, case):
    s = tiny(f"pitfall={case}", "trainer.max_steps=6", "trainer.log_every=1")
    assert s["status"] == "completed" and s["nonfinite"] is None and s["case"]["as_expected"]
    assert s["hazards"] == []


def test_hazards_are_found_from_the_config():
    def found(*overrides):
        c = validate(compose_config(*overrides))
        return hazards(c.precision, c.optimizer)
    assert found("precision=half", "optimizer=adam") and found("precision=o3", "optimizer=adamw")
    assert not found("precision=half", "optimizer=adam", "optimizer.eps=1e-4")
    assert not found("precision=o2", "optimizer=adam")      # fp32 masters: fp32 optimizer state
    assert not found("precision=amp", "optimizer=adam")
    assert not found("precision=bf16", "optimizer=adam")    # 1e-8 is representable in bf16
    assert not found("precision=half", "optimizer=sgd")


@pytest.mark.parametrize(
    "overrides",
    [
        ["pitfall=adam_fp16"],
        ["pitfall=adam_fp16_eps1e4"],
        ["numerics_case=adam_fp16"],
        ["experiment=half_pitfalls", "pitfall=adam_fp16"],
    ],
)
def test_the_fp16_adam_cases_pin_the_kernels_they_demonstrate(overrides):
    # optimizer.impl=auto is fused on CUDA, whose Adam computes in fp32 and does not diverge
    assert validate(compose_config(*overrides)).optimizer.impl == "foreach"


def test_the_eps_hazard_names_the_kernels_it_applies_to():
    c = validate(compose_config("precision=half", "optimizer=adam"))
    assert "foreach and for-loop Adam add eps in float16" in hazards(c.precision, c.optimizer)[0]
    assert hazards(c.precision, c.optimizer, "cuda") == []   # auto: fused on CUDA
    for impl, found in (("fused", False), ("foreach", True), ("loop", True)):
        c = validate(compose_config("precision=half", "optimizer=adam", f"optimizer.impl={impl}"))
        assert (
            bool(hazards(c.precision, c.optimizer, "cuda"))
            == bool(hazards(c.precision, c.optimizer))
            == found
        )


@pytest.mark.parametrize("impl, finite", [("fused", True), ("foreach", False), ("loop", False)])
def test_fused_adam_on_fp16_weights_survives_eps_1e8(impl, finite):
    # torch's CPU fused Adam takes fp16 (as CUDA's does) and computes in fp32: sqrt(v) + eps is
    # never 0 there, where foreach and the for-loop add eps=1e-8 in fp16 (0) to a second moment that
    # underflowed to 0.
    from mixprec.config import OptimizerConfig
    from mixprec.train.optim import build_optimizer

    w = torch.nn.Parameter(torch.full((6,), 0.5, dtype=torch.float16))
    opt = build_optimizer(OptimizerConfig(name="adam", lr=1e-3, eps=1e-8, impl=impl), [w])
    for _ in range(2):
        w.grad = torch.tensor([1e-4, 0.0, 1e-3, 2e-4, 1e-5, 0.0], dtype=torch.float16)
        opt.step()
    # underflowed in fp16
    assert torch.equal(opt.state[w]["exp_avg_sq"], torch.zeros(6, dtype=torch.float16))
    assert bool(torch.isfinite(w).all()) == finite


@pytest.mark.parametrize("keep_bn_fp32", [True, False])
def test_bn_in_eval_mode_inside_a_half_model(keep_bn_fp32):
    """The article's fine-tuning case (apex O2 keeps BN fp32; BN in eval mode). It failed with a
    dtype error in the PyTorch of the time; today's PyTorch runs it on the CPU: fp16 in, fp32 BN
    parameters, fp16 out. The fix the article used (BN cast to half) runs all in fp16."""
    c = validate(compose_config("precision=half", f"precision.keep_bn_fp32={keep_bn_fp32}"))
    policy = PrecisionPolicy(c.precision, torch.device("cpu"))
    model = policy.prepare_model(small_cnn(8, 10))
    model.train()
    set_bn_eval(model)
    bn = model[1]
    stats = bn.running_mean.clone()
    x = policy.cast_input(torch.randn(4, 3, 32, 32))
    out = model(x)
    bn_out = bn(model[0](x))
    assert not bn.training and model[0].training
    assert bn.weight.dtype == (torch.float32 if keep_bn_fp32 else torch.float16)
    assert bn.running_mean.dtype == bn.weight.dtype
    assert bn_out.dtype == torch.float16 and out.dtype == torch.float16
    out.float().sum().backward()
    assert torch.equal(bn.running_mean, stats)   # eval mode: running statistics frozen


@pytest.mark.slow
def test_bn_eval_runs_keep_running_statistics(tiny):
    s = tiny("pitfall=bn_eval_fp32bn", "trainer.max_steps=3")
    assert s["status"] == "completed" and s["config"]["model"]["bn_eval"] is True


@pytest.mark.slow   # a subprocess sweep
def test_pitfall_and_opt_level_sweeps_run_every_job_with_their_tables(tmp_path):
    expected = {
        "adam_fp16": "diverged",
        "adam_fp16_eps1e-4": "completed",
        "adam_amp": "completed",
        "bn_eval_fp32bn": "completed",
        "bn_eval_half": "completed",
        "small_fp32": "completed",
        "small_half": "completed",
        "large_fp32": "completed",
        "large_half": "completed",
        "bf16_pure": "completed",
        "bf16_stochastic_round": "completed",
        "bf16_amp": "completed",
    }
    r = run_cli(
        "-m",
        "experiment=half_pitfalls",
        "trainer.max_steps=3",
        *SMALL,
        f"hydra.sweep.dir={tmp_path / 'hp'}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "hp").glob("*/summary.json")]
    assert {s["case"]["name"]: s["status"] for s in summaries} == expected
    assert all(s["case"]["as_expected"] for s in summaries)
    assert "sweep" in r.stdout and r.stdout.count("as expected]") == len(expected)

    r = run_cli(
        "-m",
        "experiment=opt_levels",
        "trainer.max_steps=3",
        *SMALL,
        f"hydra.sweep.dir={tmp_path / 'ol'}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summaries = {s["choices"]["precision"]: s for s in
                 (json.loads(p.read_text()) for p in (tmp_path / "ol").glob("*/summary.json"))}
    assert sorted(summaries) == ["o0", "o1", "o2", "o3"] and all(
        s["status"] == "completed" for s in summaries.values()
    )
    assert (
        summaries["o0"]["metrics"]["loss_scale"] is None
        and summaries["o3"]["metrics"]["loss_scale"] is None
    )
    # dynamic scale: starts at 2^16, halves on an overflow, the trace records it
    for p in ("o1", "o2"):
        ls = summaries[p]["metrics"]["loss_scale"]
        assert ls["max"] <= 65536.0 and ls["final"] in [65536.0 / 2 ** k for k in range(17)]
        rows = [
            json.loads(line)
            for line in (Path(summaries[p]["job"]["output_dir"]) / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        trace = [row["loss_scale"] for row in rows if row["kind"] == "train"]
        assert (
            trace and trace[-1] == ls["final"] and all(ls["min"] <= v <= ls["max"] for v in trace)
        )
    # the fp16 levels run emulated on a CPU
    for p in ("o0", "o1(emulated)", "o2(emulated)", "o3(emulated)"):
        assert any(line.split()[2:3] == [p] for line in r.stdout.splitlines())


def test_largest_fitting_doubles_then_bisects():
    calls = []
    best, probes = largest_fitting(lambda b: calls.append(b) or b <= 37)
    assert best == 37 and [b for b, _ in probes] == calls
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64] and calls[7:] == [48, 40, 36, 38, 37]
    assert largest_fitting(lambda b: True, limit=100)[0] == 100
    assert largest_fitting(lambda b: b <= 64, start=8)[0] == 64
    assert largest_fitting(lambda b: False) == (0, [(1, False)])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on machines without a GPU"
)
@pytest.mark.slow
def test_max_batch_without_a_gpu_says_so():
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "max_batch.py"),
            "model=resnet50",
            "precision=fp32,amp",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "max_batch: no GPU is visible here; the search measures GPU memory, so it needs one "
        "(--device cpu runs the probes on the CPU, as a check that they run)")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on machines without a GPU"
)
def test_max_batch_without_a_gpu_says_so_in_this_process(capsys):
    """The quick loop's twin of the subprocess test above: max_batch.py's main, in this process."""
    assert load_script("max_batch").main(["model=resnet50", "precision=fp32,amp"]) == 2
    assert capsys.readouterr().err.strip() == (
        "max_batch: no GPU is visible here; the search measures GPU memory, so it needs one "
        "(--device cpu runs the probes on the CPU, as a check that they run)")


@pytest.mark.parametrize("precision", ["o2", "half"])
@pytest.mark.slow
def test_saved_weights_are_fp32_and_reproduce_the_runs_accuracy(tiny, tmp_path, precision):
    s = tiny(
        f"precision={precision}",
        "trainer.max_steps=null",
        "trainer.epochs=2",
        "dataset.test_size=256",
        "trainer.eval_batch_size=64",
    )
    state = torch.load(tmp_path / "model_fp32.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(tmp_path), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["recorded_test_acc"] == s["metrics"]["final_test_acc"]
    assert abs(result["test_acc"] - s["metrics"]["final_test_acc"]) <= 0.001   # within 0.1 points
    assert result["test_loss"] == pytest.approx(s["metrics"]["final_test_loss"], rel=0.01)


def test_an_o2_job_saves_fp32_weights_that_evaluate_scores_as_the_job_did(tiny, tmp_path, capsys):
    """The quick loop's guard of the two promises above (docs/pitfalls.md: saved weights are fp32,
    under o2 the fp32 masters; evaluate.py reproduces the recorded accuracy): a 2-step o2 job, and
    evaluate.py's main in this process instead of a subprocess."""
    s = tiny("precision=o2")
    state = torch.load(tmp_path / "model_fp32.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    capsys.readouterr()
    assert load_script("evaluate").main([str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    # it says what the job trained in (o2), not the fp32 it evaluates in
    assert result["precision"] == "o2" and "trained in o2;" in "\n".join(out)
    assert result["recorded_test_acc"] == s["metrics"]["final_test_acc"]
    assert abs(result["test_acc"] - s["metrics"]["final_test_acc"]) <= 0.001   # within 0.1 points
    assert result["test_loss"] == pytest.approx(s["metrics"]["final_test_loss"], rel=0.01)


@pytest.mark.slow
def test_evaluate_without_weights_says_so(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("evaluate: ") and "Traceback" not in r.stderr
