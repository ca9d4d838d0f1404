"""trainer.compile: every model kind compiled gives the eager losses (CPU inductor), CUDA graphs'
rules kept by the loop (a step mark before every compiled call, no compiled output kept past the
next call), and the warm-up covering every shape the clock would otherwise pay for."""
import json

import pytest
import torch
from torch import nn

from mixprec.train import compile
from mixprec import job
from mixprec.train import parts
from helpers import run_tiny
from helpers.compiling import CountingBackend, traced_only
from helpers.configs import GPT_JOB, GPT_TINY, SMALL
from mixprec.report.analyse import compile_cell, sweep_rows
from mixprec.report.console import compiled_note, job_block


class FakeGraphs(nn.Module):
    """What CUDA graphs do to a compiled module's outputs, on a CPU: each call overwrites (with NaN)
    the output of the previous call, as a graph's replay overwrites its output pool; a call not
    preceded by torch.compiler.cudagraph_mark_step_begin() since the previous one is counted in
    `unmarked`."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.previous = None
        self.calls = self.unmarked = self.marks = 0
        self.marks_at_last_call = -1
        self.seen = []   # (training?, input shape) of every call
        self.warmed = None   # calls made before fit

    # torch.compile's module reaches the model's attributes likewise
    def init_hidden(self, batch_size: int):
        return self.net.init_hidden(batch_size)

    def mark(self):
        self.marks += 1

    def forward(self, *args):
        if self.previous is not None:
            with torch.no_grad():
                self.previous.fill_(float("nan"))
        self.calls += 1
        self.unmarked += self.marks == self.marks_at_last_call
        self.marks_at_last_call = self.marks
        self.seen.append((self.training, tuple(args[0].shape)))
        out = self.net(*args)
        self.previous = out if isinstance(out, torch.Tensor) else out[0]
        return out


def fake_graphs(monkeypatch) -> list:
    """parts.compile_model makes FakeGraphs; each fit notes how many calls the warm-up made
    (fake.warmed)."""
    made = []
    fit = job.loop.fit

    def noted_fit(*args, **kwargs):
        if made and made[-1].warmed is None:   # the job that made it (a later eager job leaves it)
            made[-1].warmed = len(made[-1].seen)
        return fit(*args, **kwargs)
    monkeypatch.setattr(job.loop, "fit", noted_fit)

    def compile_model(net, mode, **options):
        if mode == "none":
            return net
        made.append(FakeGraphs(net))
        monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", made[-1].mark)
        return made[-1]
    monkeypatch.setattr(parts, "compile_model", compile_model)
    return made


def train_rows(path):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_mark_each_step_and_keep_no_graph_output(tmp_path, monkeypatch, mode):
    """Under the fake graphs, every call (warm-up, training, evaluation with flip TTA) is marked,
    and the job's losses and accuracies (TTA's too) are those of the eager run: nothing read a graph
    output after the next call."""
    made = fake_graphs(monkeypatch)
    common = ["trainer.max_steps=4", "trainer.log_every=1", "trick.tta=true"]
    s = run_tiny(
        tmp_path / "graphs", *common, f"trainer.compile={mode}", "dataset.test_size=24", base=SMALL
    )
    eager = run_tiny(tmp_path / "eager", *common, "dataset.test_size=24", base=SMALL)
    assert s["status"] == eager["status"] == "completed", s.get("error")
    fake = made[0]
    # warm-up, 4 steps, evaluation (two calls a batch)
    assert fake.calls > 4 + 2 and fake.unmarked == 0
    warm, timed = fake.seen[:fake.warmed], fake.seen[fake.warmed:]
    # a partial test batch
    assert {(False, (8, 3, 8, 8)), (False, (16, 3, 8, 8)), (True, (16, 3, 8, 8))} == set(timed)
    # CUDA graphs record on a shape's 2nd call
    assert all(warm.count(key) >= 3 for key in set(timed)), warm
    assert [r["loss"] for r in train_rows(tmp_path / "graphs")] == [
        r["loss"] for r in train_rows(tmp_path / "eager")
    ]
    assert [r["acc"] for r in train_rows(tmp_path / "graphs")] == [
        r["acc"] for r in train_rows(tmp_path / "eager")
    ]
    for key in ("final_test_acc", "final_test_loss", "final_test_acc_tta", "final_test_acc_no_tta"):
        assert s["metrics"][key] == eager["metrics"][key], key


def test_a_compiled_gpt_under_cuda_graphs_marks_each_window(tmp_path, monkeypatch):
    made = fake_graphs(monkeypatch)
    s = run_tiny(
        tmp_path,
        "trainer.max_steps=3",
        "trainer.compile=reduce-overhead",
        "dataset.train_size=400",
        "dataset.test_size=100",
        base=GPT_JOB,
    )
    assert s["status"] == "completed", s.get("error")
    fake = made[0]
    assert fake.calls > 3 and fake.unmarked == 0
    warm, timed = fake.seen[:fake.warmed], fake.seen[fake.warmed:]
    assert len(set(timed)) >= 2 and all(warm.count(key) >= 3 for key in set(timed)), (
        set(timed),
        warm,
    )
    assert all(r["loss"] == r["loss"] for r in train_rows(tmp_path))   # not NaN


@pytest.mark.parametrize("mode", ["default", "max-autotune"])
def test_the_compile_warmup_leaves_no_compilation_to_the_run(tmp_path, monkeypatch, mode):
    """Every shape an image job's model sees (the training batch; the evaluation batch and the test
    set's last, partial, one, in eval mode) is compiled before the clock: nothing compiles during
    training or evaluation."""
    torch._dynamo.reset()
    made = traced_only(monkeypatch)
    s = run_tiny(
        tmp_path,
        "trainer.max_steps=3",
        "dataset.test_size=24",
        f"trainer.compile={mode}",
        base=SMALL,
    )
    assert s["status"] == "completed", s.get("error")
    assert s["metrics"]["compile_time_s"] > 0 and made == [0]


def test_a_gpt_compile_warmup_covers_its_windows(tmp_path, monkeypatch):
    """The GPT's windows: full and last (shorter) ones, in training and in both evaluation
    splits."""
    torch._dynamo.reset()
    made = traced_only(monkeypatch)
    s = run_tiny(
        tmp_path,
        "trainer.max_steps=60",
        "trainer.compile=default",
        "dataset.train_size=400",
        "dataset.test_size=100",
        base=GPT_JOB,
    )
    assert s["status"] == "completed", s.get("error")
    assert s["metrics"]["compile_time_s"] > 0 and made == [0]


def counted(monkeypatch) -> CountingBackend:
    """trainer.compile through the real compile_model with the counting backend; fit marks the
    graphs' calls."""
    backend = CountingBackend()
    monkeypatch.setattr(parts, "compile_model",
                        lambda net, mode, **options: compile.compile_model(net, mode,
                                                                          backend=backend))
    fit = job.loop.fit
    monkeypatch.setattr(job.loop, "fit", lambda *a, **k: backend.mark() or fit(*a, **k))
    return backend


# a shorter last window (99 targets a column in 16-token windows: 6 full and one of 3) and a
# partial last test batch (24 images in 16s)
STATIC_JOBS = {
    "gpt": (["trainer.max_steps=8", "trainer.compile=default", "dataset.train_size=400",
             "dataset.test_size=100"], GPT_JOB),
    "image": (["trainer.max_steps=3", "trainer.compile=default", "dataset.test_size=24"], SMALL),
}


@pytest.mark.parametrize("kind", STATIC_JOBS)
def test_the_timed_steps_and_evaluations_run_static_shape_graphs(tmp_path, monkeypatch, kind):
    """Warming the shorter last window (or the partial last test batch) must not make dynamo
    recompile with that dimension dynamic: that graph would then serve every full window of the run.
    Each shape has its own static graph, and every graph called after the warm-up is static; the
    GPT's full and last windows both train."""
    torch._dynamo.reset()
    backend = counted(monkeypatch)
    overrides, base = STATIC_JOBS[kind]
    s = run_tiny(tmp_path, *overrides, base=base)
    assert s["status"] == "completed", s.get("error")
    used = backend.after_warmup()
    assert used and not [g["shapes"] for g in used if g["dynamic"]], backend.graphs
    assert s["metrics"]["compiled_graphs"] == len(backend.graphs)
    assert s["metrics"]["eager_calls"] == 0
    if kind == "gpt":   # (window, columns) of the tokens
        assert {(16, 4), (3, 4)} <= {g["shapes"][0] for g in used}, used


def test_a_compiled_job_whose_calls_ran_eagerly_says_so(tmp_path, monkeypatch, caplog):
    """With dynamo's recompile limit at 1 the evaluation shape is past it and its calls run eagerly:
    the job records them (eager_calls), says so in one warning line, in its end-of-job block and in
    the sweep table."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    counted(monkeypatch)
    with caplog.at_level("WARNING"):
        s = run_tiny(tmp_path, "trainer.max_steps=3", "trainer.compile=default",
                     "dataset.test_size=24", base=SMALL)
    assert s["status"] == "completed", s.get("error")
    eager = s["metrics"]["eager_calls"]
    assert eager > 0 and s["metrics"]["compiled_graphs"] == 1
    lines = [r.message for r in caplog.records if "ran eagerly" in r.message]
    assert lines == [f"mixprec: trainer.compile=default: {eager} calls of the compiled model "
                     "after its warm-up ran eagerly (dynamo gave up on them; TORCH_LOGS=recompiles "
                     "says why): this job's time is partly an eager time"]
    assert f"(1 graphs; {eager} calls ran EAGERLY after the warm-up)" in job_block(s)
    assert sweep_rows([s])[0]["compile"] == f"default, {eager} eager calls"


class Broken(nn.Module):
    """Two layers with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def test_a_compiled_model_whose_graph_broke_says_so(caplog):
    """A compiled model that dynamo breaks in two graphs (as an FSDP unit holding units of its own
    was broken at each inner unit's hooks, each piece still compiled and eager_calls 0): the records
    count the break (graph_breaks), and one warning line, the job block and the sweep table say
    it."""
    torch._dynamo.reset()
    backend = CountingBackend()
    net = compile.compile_model(Broken(), "default", backend=backend)
    watch = compile.GraphWatch(net, "default")
    net(torch.randn(2, 4))
    watch.warmed()
    net(torch.randn(2, 4))
    with caplog.at_level("WARNING"):
        m = watch.finish()
    assert m == {"compiled_graphs": len(backend.graphs), "graph_breaks": 1, "eager_calls": 0}
    assert len(backend.graphs) == 2
    assert [r.message for r in caplog.records if "broke" in r.message] == [
        "mixprec: trainer.compile=default: dynamo broke the compiled graphs 1 time "
        "(TORCH_LOGS=graph_breaks says where): the compiled modules ran in pieces, with eager "
        "code between them"]
    assert compiled_note(m) == " (2 graphs; 1 GRAPH BREAK)"
    assert compiled_note({**m, "graph_breaks": 0}) == " (2 graphs)"
    assert compile_cell({"config": {"trainer": {"compile": "default"}}, "metrics": m}) == \
        "default, 1 graph breaks"


def train_losses(path, *overrides, base):
    s = run_tiny(path, "trainer.log_every=1", *overrides, base=base)
    assert s["status"] == "completed", s.get("error")
    return [r["loss"] for r in train_rows(path)], s


# Compiled (CPU inductor) against eager, the losses of the first `compared` steps, measured largest
# relative gaps: resnet18 7.3e-5 over 3 steps (at 8x8 pixels and batch 16 its last BatchNorms
# normalise 16 values each, which amplifies inductor's rounding about 10x a step: 3.5e-3 at step 4,
# 1.6e-2 at step 5), the GPT 1.2e-7 over 10 (fp32: inductor's fused kernels reassociate sums), the
# GPT under precision=fp8 1.2e-4 over 6 (float8 quantisation and bf16 roundings fused differently;
# precision.emulate=false: torchao's own float8 emulation, CPU bf16 autocast). Bounds: about 10x
# those. (small_cnn: tests/unit/train/test_speed.py, 1e-4 over 20 steps.)
KINDS = {
    "resnet18": (
        ["model=resnet18", "trainer.max_steps=5", "optimizer.lr=0.01"],
        [o for o in SMALL if not o.startswith("model")],
        1e-3,
        3,
    ),
    "gpt": (
        [
            "trainer.max_steps=10",
            "dataset.train_size=800",
            "dataset.test_size=200",
            "trainer.device=cpu",
        ],
        GPT_JOB,
        1e-5,
        10,
    ),
    "fp8": (
        [
            "trainer.max_steps=6",
            "dataset.train_size=1000",
            "dataset.test_size=256",
            "trainer.device=cpu",
            "precision=fp8",
            "precision.emulate=false",
        ],
        GPT_JOB,
        2e-3,
        6,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_models_give_the_eager_losses(tmp_path, kind):
    """Every model kind that compiles, step by step against its eager run."""
    overrides, base, rel, compared = KINDS[kind]
    eager, _ = train_losses(tmp_path / "eager", *overrides, base=base)
    compile, s = train_losses(
        tmp_path / "compiled", *overrides, "trainer.compile=default", base=base
    )
    assert len(compile) == len(eager) >= compared
    assert compile[:compared] == pytest.approx(eager[:compared], rel=rel)
    assert s["metrics"]["compile_time_s"] > 0 and s["config"]["trainer"]["compile"] == "default"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_each_compile_mode_trains_on_a_gpu(tmp_path, mode):
    """The H200 run's failure at the first step ("accessing tensor output of CUDAGraphs that has
    been overwritten"): an image job (amp, fused steps, flip TTA, a partial test batch) and the GPT
    (amp_bf16) train a few steps in each mode, and the image job's losses follow its eager run's."""
    gpu = [o for o in SMALL if o not in ("trainer.device=cpu", "trainer.deterministic=true")]
    common = ["trainer.max_steps=6", "precision=amp", "trick.tta=true", "dataset.test_size=24"]
    eager, _ = train_losses(tmp_path / "eager", *common, base=gpu)
    compile, s = train_losses(tmp_path / "compiled", *common, f"trainer.compile={mode}", base=gpu)
    assert s["env"]["device"].startswith("cuda") and s["metrics"]["compile_time_s"] > 0
    # fp16 autocast: inductor's fusions round differently
    assert compile == pytest.approx(eager, rel=1e-2)
    gpt = [o for o in GPT_JOB if o != "trainer.deterministic=true"]
    losses, _ = train_losses(
        tmp_path / "gpt",
        "trainer.max_steps=4",
        "precision=amp_bf16",
        "dataset.train_size=800",
        "dataset.test_size=200",
        f"trainer.compile={mode}",
        base=gpt,
    )
    assert len(losses) == 4 and all(v == v for v in losses)


@pytest.mark.parametrize("recipe, options", [
    ("rowwise", {"dynamic": False, "options": {"emulate_precision_casts": True}}),
    ("mxfp8", {"dynamic": False, "options": {"emulate_precision_casts": True}}),
    ("tensorwise", {"mode": "default", "dynamic": False}),
    (None, {"mode": "default", "dynamic": False}),
])
def test_a_one_process_compile_emulates_the_casts_of_rowwise_fp8_and_mxfp8(
    tmp_path, monkeypatch, recipe, options
):
    """The job's own torch.compile (one process; under DDP the same call wraps the DDP module)
    gets what FSDP's units get: rowwise fp8 and MXFP8 with inductor's emulate_precision_casts
    (only FSDP's units had it); tensorwise and amp_bf16 compile in their mode alone."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda net, **kwargs: seen.append(kwargs) or net)
    mode = ["precision=amp_bf16"] if recipe is None else (
        ["precision=mxfp8"] if recipe == "mxfp8"
        else ["precision=fp8", f"precision.fp8_recipe={recipe}"])
    # precision.emulate=false: a job refuses to compile the emulated bf16 (it runs eagerly)
    s = run_tiny(tmp_path, *mode, "precision.emulate=false", "trainer.compile=default",
                 "trainer.max_steps=1", base=GPT_TINY)
    assert s["status"] == "completed", s.get("error")
    assert seen == [options]


def rowwise_grads(compiled: bool) -> list[torch.Tensor]:
    """The weight gradients of a 2-layer MLP under rowwise fp8 (torchao's emulated float8 on the
    CPU, its bf16 autocast: precision.emulate=false, as a compiled job must) after one forward and
    backward, eager or through inductor with the mode's options."""
    from mixprec.config import validate
    from mixprec.precision.policy import PrecisionPolicy
    from helpers import compose_config

    config = validate(compose_config("precision=fp8", "precision.fp8_recipe=rowwise",
                                     "precision.emulate=false"))
    policy = PrecisionPolicy(config.precision, torch.device("cpu"))
    torch.manual_seed(0)
    model = policy.prepare_model(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)))
    net = model if not compiled else compile.compile_model(
        model, "default", options=policy.compile_options())
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    with policy.autocast():
        net(x).float().square().mean().backward()
    return [m.weight.grad.clone() for m in (model[0], model[2])]


@pytest.mark.slow
def test_inductor_gives_the_eager_rowwise_fp8_gradients_with_its_options():
    """Inductor on the CPU against eager, largest gradient gap over the gradients' largest value:
    3.3e-2 and 3.6e-2 without emulate_precision_casts, 0 with it (torch 2.14.1, torchao 0.18).
    About 40 s of inductor compiling."""
    compile.reset_compile_state()
    for a, b in zip(rowwise_grads(False), rowwise_grads(True)):
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-6


class CompilingStep(torch.optim.SGD):
    """SGD whose step goes through torch.compile per parameter shape, as torchao's AdamW does on
    CUDA (single_param_adam), with the test's counting backend."""

    def __init__(self, params, backend):
        super().__init__(params, lr=0.1)
        self.update = torch.compile(lambda p, g: p.sub_(0.1 * g), backend=backend, dynamic=False)

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                self.update(p, p.grad)


@pytest.mark.parametrize("mode", ["default", "none"])
def test_the_optimizers_graphs_are_counted_apart_from_the_models(mode):
    """compiled_graphs is the model's: graphs made inside the optimizer's steps (torchao's AdamW
    compiles one per parameter shape on CUDA, whatever trainer.compile says) were added to it."""
    torch._dynamo.reset()
    backend = CountingBackend()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = CompilingStep(model.parameters(), backend)
    net = compile.compile_model(model, mode, backend=backend)
    watch = compile.GraphWatch(model, mode, optimizer)
    for _ in range(2):
        net(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    shapes = {tuple(p.shape) for p in model.parameters()}   # 4 shapes: a graph each
    model_graphs = 0 if mode == "none" else 1
    assert len(backend.graphs) == model_graphs + len(shapes)
    counted = {"optimizer_graphs": len(shapes)}
    whole = {"compiled_graphs": 1, "graph_breaks": 0, "eager_calls": 0}
    assert watch.finish() == ({**counted, **whole} if mode != "none" else counted)


@pytest.mark.parametrize("overrides, starts", [
    (["optimizer=adamw8bit"], True), (["optimizer=adamw", "optimizer.stochastic_round=true",
                                       "precision=bf16"], True),
    (["trainer.compile=default"], True), (["optimizer=adamw"], False),
])
def test_inductors_workers_start_before_anything_compiles_on_an_accelerator(
    monkeypatch, overrides, starts
):
    """A GPU job whose optimizer compiles (torchao's AdamW on CUDA) starts inductor's workers out of
    reach of its stop signals with trainer.compile=none too, before the model is built (its
    prewarm steps the optimizer); they started only for trainer.compile. The CPU never starts
    them (inductor compiles in the job's process there)."""
    from mixprec.config import validate
    from mixprec.train import build
    from helpers import compose_config

    config = validate(compose_config(*overrides))
    started = []
    monkeypatch.setattr(build, "start_compile_workers", lambda: started.append(True))
    assert build.compiles(config, torch.device("cuda")) is starts
    assert not build.compiles(config, torch.device("cpu"))
    build.build_trained(nn.Linear(4, 4), config, torch.device("cpu"))
    assert started == []
    monkeypatch.setattr(build, "compiles", lambda config, device: True)   # the CUDA answer
    build.build_trained(nn.Linear(4, 4), config, torch.device("cpu"))
    assert started == [True]
