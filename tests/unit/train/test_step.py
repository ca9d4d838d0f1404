"""The step on one screen (train/step.py) and the one builder (train/build.py), issue 42 items 1 and
3: step.py reads top to bottom as nanoGPT's amp step, the policy keeps no step of its own, every
training path (image and language-model jobs, prewarm, the benchmark's cells, the scripts) calls
the loss scaler from step.py alone, only the builder prepares a model, and a job's per-rank batch
is dist.check's."""
import ast
import sys
from pathlib import Path

import pytest
import torch

import mixprec.job
import mixprec.train.parts
from helpers import ROOT, TINY, load_script, run_tiny
from mixprec.precision.policy import StaticScaler

SRC = ROOT / "src" / "mixprec"
STEP = SRC / "train" / "step.py"
SCALER_CALLS = ("scale", "unscale_", "step", "update")
# Tiny language-model job (as tests/helpers/configs.py's LM): a 2-layer LSTM of 8 units, clipping
LM = ["logger=none", "trainer.max_steps=2", "model=lstm", "dataset=synthetic_text",
      "dataset.vocab_size=40", "dataset.train_size=1200", "dataset.test_size=200",
      "model.emsize=8", "model.nhid=8", "trainer.batch_size=4", "trainer.eval_batch_size=5",
      "dataset.bptt=6", "trainer.grad_clip=0.25", "trainer.device=cpu"]


def functions(path: Path) -> dict:
    tree = ast.parse(path.read_text())
    return {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}


def calls_in(node) -> list[str]:
    """The calls under `node`, as their source text, in source order."""
    found = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    return [ast.unparse(c) for c in sorted(found, key=lambda c: (c.lineno, c.col_offset))]


def test_the_step_module_holds_the_amp_step_on_one_screen():
    """step.py is at most 90 lines; its training step functions each fit a screen; the amp step's
    lines are there, in nanoGPT's order, with the policy's primitives where the mode decides."""
    assert len(STEP.read_text().splitlines()) <= 90
    fs = functions(STEP)
    for name in ("backward_and_step", "train_step"):
        assert fs[name].end_lineno - fs[name].lineno + 1 <= 30, name
    calls = calls_in(fs["backward_and_step"])
    order = ["scaler.scale(loss).backward()", "clip_scaled_model_grads_(",
             "policy.grads_to_masters()", "scaler.unscale_(optimizer)",
             "torch.nn.utils.clip_grad_norm_(", "policy.watch(optimizer)",
             "scaler.step(optimizer)", "scaler.update()",
             "policy.masters_to_model()", "policy.skipped(defer)"]
    at = [next(i for i, c in enumerate(calls) if c.startswith(want)) for want in order]
    assert at == sorted(at)
    assert "image_forward" in fs and "cross_entropy(" in " ".join(calls_in(fs["image_forward"]))
    assert "loop.optimizer.zero_grad(set_to_none=True)" in calls_in(fs["train_step"])


def test_the_policy_keeps_no_step_of_its_own():
    """precision/policy.py never calls backward nor the loss scaler's scale/unscale_/step/update
    (StaticScaler's own methods aside): those lines are step.py's."""
    tree = ast.parse((SRC / "precision" / "policy.py").read_text())
    static = next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "StaticScaler")
    inside = {id(n) for n in ast.walk(static)}
    bad = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in inside
           and isinstance(n.func, ast.Attribute) and n.func.attr in ("backward", *SCALER_CALLS)]
    assert bad == []


def scaler_callers(monkeypatch) -> set:
    """(method, calling file relative to the repository, calling function) of every call of a loss
    scaler's scale/unscale_/step/update from outside torch (GradScaler and StaticScaler)."""
    seen = set()
    for cls in (torch.amp.GradScaler, StaticScaler):
        for name in SCALER_CALLS:
            def spy(self, *args, _real=getattr(cls, name), _name=name, **kwargs):
                frame = sys._getframe(1)
                where = Path(frame.f_code.co_filename).resolve()
                if ROOT in where.parents:
                    seen.add((_name, where.relative_to(ROOT).as_posix(), frame.f_code.co_name))
                return _real(self, *args, **kwargs)
            monkeypatch.setattr(cls, name, spy)
    return seen


ONE_STEP = {(name, "src/mixprec/train/step.py", "backward_and_step") for name in SCALER_CALLS}


@pytest.mark.parametrize("overrides", [
    [*TINY, "precision=amp", "trainer.prewarm_steps=1"],                 # image job and prewarm
    [*TINY, "precision=o2", "trainer.prewarm_steps=1", "trainer.grad_clip=1"],   # masters
    [*LM, "precision=amp", "trainer.prewarm_steps=1"],                   # language model
    [*LM, "precision=apex_fp16_2018", "trainer.prewarm_steps=1"],        # static, scaled clip
])
def test_every_job_and_its_prewarm_run_the_one_step(tmp_path, monkeypatch, overrides):
    seen = scaler_callers(monkeypatch)
    assert run_tiny(tmp_path, *overrides, base=[])["status"] == "completed"
    assert seen == ONE_STEP


def test_the_benchmark_cells_and_the_scripts_run_the_one_step(monkeypatch):
    """scripts/benchmark.py's table cell, max_batch.py's probe and bench_emulation.py's timed steps
    (both models) step through step.py."""
    seen = scaler_callers(monkeypatch)
    bench, cpu = load_script("benchmark"), torch.device("cpu")
    cfg, _ = bench.compose([*TINY, "dataset.image_size=8", "precision=amp"])
    base, shape, classes = bench.build_base(cfg, cpu)
    bench.time_cell(cfg, base, shape, classes, cpu, 1, 1)
    assert seen == ONE_STEP
    seen.clear()
    max_batch = load_script("max_batch")
    max_batch.two_steps(max_batch.compose([*TINY, "dataset.image_size=8", "precision=amp"]), cpu, 4)
    assert seen == ONE_STEP
    seen.clear()
    emul = load_script("bench_emulation")
    monkeypatch.setitem(emul.MODELS, "resnet18", ["model=small_cnn", "model.width=8",
                                                  "trainer.batch_size=4"])
    monkeypatch.setitem(emul.MODELS, "lstm", [*LM[2:4], "model.emsize=8", "model.nhid=8",
                                              "trainer.batch_size=4", "dataset.bptt=6"])
    monkeypatch.setattr(emul, "VOCAB", 40)
    for model in ("resnet18", "lstm"):
        emul.Job(model, "amp", True).step()
        assert seen == ONE_STEP
        seen.clear()


def test_only_the_builder_prepares_a_model():
    """prepare_model and optimizer_params are called in train/build.py alone, in src/ and scripts/
    (tools.evaluate.evaluate_saved included)."""
    callers = []
    for path in [*SRC.rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        for call in ast.walk(ast.parse(path.read_text())):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("prepare_model", "optimizer_params")):
                callers.append(path.relative_to(ROOT).as_posix())
    assert set(callers) == {"src/mixprec/train/build.py"}


def test_a_jobs_per_rank_batch_is_dist_checks(tmp_path, monkeypatch):
    """The per-rank batch is computed once, by dist.check, and that value is what prewarm and the
    compile warm-up's shapes get (here dist.check answers 8 for a batch of 16)."""
    real, got = mixprec.job.dist.check, {}
    monkeypatch.setattr(mixprec.job.dist, "check", lambda *a, **k: real(*a, **k) // 2)
    prewarm, image_warmup = mixprec.train.parts.prewarm, mixprec.train.parts.image_warmup
    monkeypatch.setattr(mixprec.train.parts, "prewarm", lambda m, p, o, steps, batch, *a: (
        got.__setitem__("prewarm", batch), prewarm(m, p, o, steps, batch, *a))[1])
    monkeypatch.setattr(mixprec.train.parts, "image_warmup", lambda batch, *a, **k: (
        got.__setitem__("warmup", batch), image_warmup(batch, *a, **k))[1])
    assert run_tiny(tmp_path, "trainer.prewarm_steps=1")["status"] == "completed"
    assert got == {"prewarm": 8, "warmup": 8}


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_prewarm_steps_an_optimizer_of_the_jobs_kind(monkeypatch, impl):
    """Prewarm's throwaway optimizer is the job's kind: a fused one keeps the constructor's flag
    that makes GradScaler hand it the scale and found-inf flag on the device
    (_step_supports_amp_scaling), so a CUDA amp job's prewarm warms its sync-free fused step, not
    GradScaler's per-step host read."""
    from mixprec.train import warmup

    seen = []
    monkeypatch.setattr(warmup, "backward_and_step",
                        lambda loss, pol, opt, clip: seen.append(opt) or False)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, **{impl: True})
    policy = StaticScaler(1.0)   # a stand-in: prewarm only copies it and hands it on
    policy.device = torch.device("cpu")
    warmup.run_prewarm(model, policy, opt, 1, lambda gen, device: (torch.ones(2, 4), None),
                       lambda net, pol, x, y: net(x).sum(), None)
    (copied,) = seen
    assert copied is not opt and type(copied) is type(opt)
    assert (getattr(copied, "_step_supports_amp_scaling", False)
            == getattr(opt, "_step_supports_amp_scaling", False) == (impl == "fused"))
    assert copied.defaults["fused"] == opt.defaults["fused"]
