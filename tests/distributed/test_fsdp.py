"""trainer.strategy=fsdp (FSDP2, train/parallel.py, precision/fsdp.py) on the CPU: real jobs on 2
gloo ranks under torchrun, 2 spawned gloo ranks for what one job cannot show (per-rank bytes, an
overflow in one rank's shard), and the one-line refusals."""
import json

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from helpers import ROOT, TINY, compose_config, run_tiny
from helpers.compiling import CountingBackend
from helpers.configs import GPT_TINY, SGD, SMALL
from helpers.distributed import (
    assert_one_rank_fsdp_job,
    assert_same_weights,
    job,
    on_ranks,
    PARAM_DTYPE,
    rows,
    weights,
    whole_bytes,
)
from helpers.fsdp_ranks import FP32, gpu_checks_on_rank
from mixprec.config import ConfigError, validate
import mixprec.job
from mixprec.data import build_image_data, pipelines
from mixprec.job import validate_job
from mixprec.models.gpt import GPT
from mixprec.runtime import dist
from mixprec.train import compile, parallel
from mixprec.train.optim import build_optimizer

GPU_GPT = [o for o in GPT_TINY if not o.startswith("trainer.device")]   # auto: the GPU
# small_cnn with BatchNorm in eval mode (statistics independent of the split, as
# tests/distributed/test_ddp.py)
CNN = [*TINY, "trainer.max_steps=4", "trainer.log_every=2", "trainer.deterministic=true",
       "+model.bn_eval=true", "schedule=constant", "optimizer.lr=0.2"]


@pytest.mark.slow   # a 2-rank torchrun job (about 15 s)
def test_fsdp_fp32_gpt_on_two_ranks_and_one_equals_one_process(tmp_path):
    """The same global batch and seed: 2 sharded ranks (each its 4 columns, gradients averaged by
    reduce-scatter), FSDP on one rank, and one plain process give the same losses and weights. The
    bound: 2 ranks average two half-batch means where one process takes one mean over the batch,
    a different order of fp32 additions (a few ulps per gradient element); SGD moves the weights by
    lr times that difference, so after 6 steps at lr 0.5 they agree to 1e-6 (measured: losses
    6e-8 relative, weights 1.4e-7). FSDP on one rank adds nothing to reduce: identical."""
    two = job([*GPT_TINY, *SGD, "trainer.strategy=fsdp"], tmp_path / "two", tmp_path)
    assert two["distributed"]["world_size"] == 2 and two["distributed"]["strategy"] == "fsdp"
    one = run_tiny(tmp_path / "one", *SGD, base=GPT_TINY)
    solo = run_tiny(tmp_path / "solo", *SGD, "trainer.strategy=fsdp", base=GPT_TINY)
    assert one["status"] == solo["status"] == "completed"
    assert rows(tmp_path / "solo") == rows(tmp_path / "one")
    assert_same_weights(weights(tmp_path / "solo"), weights(tmp_path / "one"), atol=0)
    assert rows(tmp_path / "two") == pytest.approx(rows(tmp_path / "one"), rel=1e-6, abs=0)
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "one"), atol=1e-6)
    first, last = rows(tmp_path / "two")[0], rows(tmp_path / "two")[-1]
    assert last < first - 0.05   # it trains


@pytest.mark.slow
def test_fsdp_fp32_equals_ddp_exactly_and_one_process(tmp_path):
    """small_cnn (BatchNorm in eval mode): FSDP's reduce-scatter and DDP's all-reduce both add the
    two ranks' gradients (one addition: commutative, exact order) and halve them (exact in binary),
    so FSDP's losses and weights are DDP's bit for bit; one process with the same global batch
    agrees to 1e-6 (one mean over 16 images against two over 8: measured 5e-8)."""
    fsdp = job([*CNN, "trainer.strategy=fsdp"], tmp_path / "fsdp", tmp_path)
    job([*CNN, "trainer.strategy=ddp"], tmp_path / "ddp", tmp_path)
    assert fsdp["distributed"]["weight_spread"] is None   # shards: no copies to compare
    assert rows(tmp_path / "fsdp") == rows(tmp_path / "ddp")
    assert_same_weights(weights(tmp_path / "fsdp"), weights(tmp_path / "ddp"), atol=0)
    assert run_tiny(tmp_path / "one", base=CNN)["status"] == "completed"
    assert rows(tmp_path / "fsdp") == pytest.approx(rows(tmp_path / "one"), rel=1e-6, abs=0)
    assert_same_weights(weights(tmp_path / "fsdp"), weights(tmp_path / "one"), atol=1e-6)


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="NCCL across 2 GPUs needs 2 GPUs")


@pytest.mark.slow   # reads the session's spawn of 2 gloo ranks (ranks_ran: about 25 s)
def test_each_rank_holds_half_of_the_parameters_gradients_and_optimizer_state(ranks_ran):
    """2 ranks: each holds half of every parameter (dim 0 split; every dim 0 of this GPT is even,
    so exactly half), of its gradient and of AdamW's two moments; the tied embedding counts once."""
    assert_half_held(ranks_ran)


def assert_half_held(folder):
    """What _bytes_on_rank wrote on 2 ranks: each held half of one process's bytes."""
    for rank in (0, 1):
        held = json.loads((folder / f"bytes.{rank}").read_text())
        assert held["whole"] == whole_bytes()
        assert held["sharded"] == {k: v // 2 for k, v in held["whole"].items()}


@pytest.mark.slow   # reads the session's spawn of 2 gloo ranks (ranks_ran: about 25 s)
def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(ranks_ran):
    """The step whose overflow only rank 1's shard holds is skipped by both ranks and both halve
    the scale: ShardedGradScaler all-reduces the found-inf flag (and in torch 2.11-2.14 DTensor's
    dispatch of the foreach unscale reduces it too, Partial("max"), so a plain GradScaler would
    agree as well: docs/fsdp.md)."""
    expected = [[False, 1024.0], [True, 512.0], [False, 512.0]]
    for rank in (0, 1):
        assert json.loads((ranks_ran / f"steps.{rank}").read_text()) == expected


@pytest.mark.slow
def test_fp16_loss_scaling_skips_the_steps_of_one_process(tmp_path):
    """precision=amp on the GPT with a scale too high for fp16 and growth every 2 steps: the sharded
    job skips the steps one process skips, with the same scale after each step (one process's fp16
    is emulated on fp32 kernels, FSDP's is the CPU's fp16 kernels: the scales are far enough from
    the overflow threshold for both to agree)."""
    amp = ["precision=amp", "precision.init_scale=16777216", "precision.growth_interval=2",
           "trainer.log_every=1", "trainer.max_steps=8", "optimizer=adamw", "optimizer.lr=3e-3"]
    two = job([*GPT_TINY, *amp, "trainer.strategy=fsdp"], tmp_path / "two", tmp_path)
    one = run_tiny(tmp_path / "one", *amp, base=GPT_TINY)
    assert two["metrics"]["skipped_steps"] == one["metrics"]["skipped_steps"] > 0
    scales = rows(tmp_path / "two", "loss_scale")
    assert scales == rows(tmp_path / "one", "loss_scale")
    assert scales[-1] > min(scales)   # it grew again after the skips


FSDP = ["trainer.strategy=fsdp"]


@pytest.mark.parametrize("overrides, line", [
    (["precision=half"], "precision=half: its weights live in float16 without fp32 masters, but "
     "FSDP's sharded parameters are the fp32 masters; use precision=amp_bf16 (bfloat16) or amp "
     "(float16)"),
    (["precision=bf16"], "precision=bf16: its weights live in bfloat16 without fp32 masters"),
    (["precision=o3"], "precision=o3: its weights live in float16 without fp32 masters"),
    (["precision=apex_fp16_2018"], "precision=apex_fp16_2018: it clips the fp16 model's scaled "
     "gradients, which FSDP does not keep apart from the fp32 masters; use precision=apex_fp16"),
    (["model=lstm", "dataset=synthetic_text"], "model=lstm: FSDP shards the GPT and the image "
     "models; a recurrent model trains in one process (trainer.strategy=auto)"),
    (["precision=amp_bf16", "precision.emulate=true"], "precision=amp_bf16 with "
     "precision.emulate=true: FSDP casts the weights to real fp16/bf16 tensors"),
    (["trick.ema=true"], "trick.ema=true: the averaged copy of a sharded model is not supported"),
    (["trainer.sync_bn=true"], "trainer.sync_bn=true: SyncBatchNorm is DDP's"),
    (["trainer.prewarm_steps=2"], "trainer.prewarm_steps=2: prewarm steps a deep copy"),
    (["trainer.compile=reduce-overhead"], "trainer.compile=reduce-overhead: CUDA graphs need fixed "
     "addresses, and FSDP frees and re-gathers the weights every step"),
    (["probe=ranges"], "probe=ranges: the probe's hooks read whole layers"),
    (["optimizer=sgd", "optimizer.impl=fused"], "optimizer.impl=fused: torch's fused SGD has no "
     "DTensor rule, and FSDP's parameters are DTensors (trainer.strategy=fsdp)"),
    (["precision=amp_bf16", "precision.keep_bn_fp32=false"], "precision=amp_bf16 with "
     "precision.keep_bn_fp32=false: FSDP would hand each BatchNorm low-precision weights against "
     "its fp32 running statistics; under trainer.strategy=fsdp use precision.keep_bn_fp32=true"),
])
def test_what_fsdp_cannot_express_is_refused_in_one_line(overrides, line):
    base = ["logger=none"] if "model=lstm" in overrides else TINY
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*base, *FSDP, *overrides))
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def sharded_commands(path) -> list[list[str]]:
    """The overrides of every sharded train.py command in `path`'s bash blocks (continued lines
    joined; the launcher's and Hydra's own options, and lines with placeholders, left out)."""
    blocks = path.read_text().split("```bash")[1:]
    lines = [b.split("```", 1)[0].replace("\\\n", " ") for b in blocks]
    commands = [c.split("#", 1)[0] for b in lines for c in b.splitlines()]
    return [[t for t in c.split("train.py", 1)[1].split() if "=" in t and not t.startswith("hydra")]
            for c in commands if "train.py" in c and "strategy=fsdp" in c
            and "..." not in c and "[" not in c]


@pytest.mark.parametrize("doc", ["README.md", "docs/fsdp.md"])
def test_the_docs_sharded_commands_make_a_job(doc):
    """Each sharded command the README and docs/fsdp.md show composes and validates as a job (a
    GPT needs a text dataset: the commands name one)."""
    commands = sharded_commands(ROOT / doc)
    assert commands
    for overrides in commands:
        config = validate_job(compose_config(*overrides))
        assert config.trainer.sharded and config.dataset.is_text, overrides


def test_reduce_dtype_is_a_sharded_jobs_choice():
    assert validate(compose_config(*TINY, *FSDP)).precision.reduce_dtype is None
    config = validate(compose_config(*TINY, *FSDP, "precision=amp_bf16",
                                     "precision.reduce_dtype=bfloat16"))
    assert config.precision.reduce_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"^precision.reduce_dtype=bfloat16: only sharded jobs "
                       r"choose it \(trainer.strategy=fsdp\); DDP reduces"):
        validate(compose_config(*TINY, "precision.reduce_dtype=bfloat16"))
    with pytest.raises(ConfigError, match=r"^precision.reduce_dtype='float16': allowed values are "
                       r"float32, bfloat16"):
        validate(compose_config(*TINY, *FSDP, "precision.reduce_dtype=float16"))


def test_fsdp_without_torch_distributed_is_one_line_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(dist.tdist, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        run_tiny(tmp_path, *FSDP)
    assert e.value.code == 2
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["error"] == ("config error: trainer.strategy=fsdp: this PyTorch build has no "
                          "torch.distributed (FSDP2 shards through it); install a build with it, "
                          "or use trainer.strategy=auto")
    assert "metrics" not in s and "traceback" not in s   # nothing trained


def test_a_batch_the_ranks_do_not_divide_and_the_dataloader_pipeline_are_refused():
    """The checks a sharded job shares with DDP's, each in one line before the model is built."""
    two, cpu = dist.Ranks(rank=0, world=2), torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^trainer.batch_size=15: the global batch must divide "
                       r"by the 2 ranks"):
        dist.check(15, False, cpu, two, sharded=True)
    assert dist.check(16, False, cpu, two, sharded=True) == 8
    config = validate(compose_config(*TINY, *FSDP, "dataset.pipeline=dataloader"))
    data = build_image_data(config.dataset)
    with pytest.raises(ConfigError, match=r"^dataset.pipeline=dataloader: not sharded across ranks "
                       r"\(DDP or FSDP\); use dataset.pipeline=device"):
        pipelines.image_loaders(data, config.dataset, config.trainer, cpu, seed=0, shard=(0, 2))


def _sharded_linear_sgd(device, impl):
    """A sharded Linear (one FSDP rank) and optimizer=sgd in `impl` over its DTensor parameters;
    one step taken."""
    model = parallel.shard(torch.nn.Linear(8, 8).to(device), FP32, device)
    cfg = validate(compose_config(*TINY, "optimizer=sgd", f"optimizer.impl={impl}")).optimizer
    optimizer = build_optimizer(cfg, list(model.parameters()))
    model(torch.randn(4, 8, device=device)).sum().backward()
    optimizer.step()
    return optimizer


def test_fused_sgd_over_fsdps_dtensors_is_refused_in_one_line_and_auto_is_foreach():
    """DTensor has no rule for torch's fused SGD (its first step raises NotImplementedError):
    optimizer.impl=fused under FSDP is one line at the build, auto steps with foreach."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError) as e:
            _sharded_linear_sgd(torch.device("cpu"), "fused")
        assert str(e.value) == ("optimizer.impl=fused: torch's fused SGD has no DTensor rule, and "
                                "FSDP's parameters are DTensors (trainer.strategy=fsdp); use "
                                "optimizer.impl=auto or foreach")
        group = _sharded_linear_sgd(torch.device("cpu"), "auto").param_groups[0]
        assert group["foreach"] and not group["fused"]
    finally:
        tdist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_sgd_over_fsdps_dtensors_steps_with_foreach():
    """On CUDA optimizer.impl=auto is fused, but not for SGD over FSDP's DTensors: it steps."""
    tdist.init_process_group(dist.backend(), store=tdist.HashStore(), rank=0, world_size=1)
    try:
        group = _sharded_linear_sgd(torch.device("cuda:0"), "auto").param_groups[0]
        assert group["foreach"] and not group["fused"]
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow   # reads the session's spawn of 2 gloo ranks (ranks_ran: about 25 s)
def test_fp8_weights_are_all_gathered_in_float8_with_scales_precomputed_after_the_step(ranks_ran):
    """precision=fp8 under FSDP (torchao's emulation on the CPU): each float8 Linear's shard is
    torchao's WeightWithDynamicFloat8CastTensor, which sends float8_e4m3fn over the all-gather, cast
    with the scale computed after the optimizer step from the whole updated weight (448 / amax)."""
    assert_float8_all_gather(ranks_ran)


def assert_float8_all_gather(folder):
    """What _fp8_on_rank wrote on 2 ranks: every float8 shard sends float8_e4m3fn, its scale
    precomputed after the step."""
    for rank in (0, 1):
        seen = json.loads((folder / f"fp8.{rank}").read_text())
        assert len(seen) == 8   # 4 Linear layers per block; the tied head stays bf16
        assert all(s == {"subclass": True, "sent": "torch.float8_e4m3fn", "scale_ok": True}
                   for s in seen.values()), seen


# a test's CPU run and, marked gpu, its run on 2 GPUs over NCCL (skipped with a reason below 2)
ON_CPU_AND_TWO_GPUS = pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])


def on_device(device: str) -> list:
    """The tiny GPT's overrides for 2 ranks on `device`: the CPU (gloo), or cuda (each rank its
    GPU, NCCL)."""
    return GPT_TINY if device == "cpu" else GPU_GPT


@pytest.mark.gpu
@TWO_GPUS
def test_gpu_two_nccl_ranks_hold_half_and_all_gather_float8(tmp_path):
    """The CPU's spawned-rank checks on 2 GPUs over NCCL (the same code, on cuda:rank): each rank
    holds half of one process's parameter, gradient and AdamW bytes; every float8 shard sends
    float8_e4m3fn with the scale precomputed after the step."""
    on_ranks(gpu_checks_on_rank, tmp_path, backend="nccl")
    assert_half_held(tmp_path)
    assert_float8_all_gather(tmp_path)


@pytest.mark.slow
@ON_CPU_AND_TWO_GPUS
def test_bf16_against_fp32_gradient_reduction_on_the_gpt(tmp_path, device):
    """precision=amp_bf16 on 2 ranks, gradients reduced in float32 (the default) or bfloat16: both
    train, each summary records its reduce dtype, and the bf16 reduction moves the run by a small,
    nonzero amount (measured on the CPU after 20 AdamW steps: train losses within 2.2e-4, final
    validation loss 2.7e-5 apart; docs/fsdp.md)."""
    bf16 = [*on_device(device), "precision=amp_bf16", "trainer.strategy=fsdp", "optimizer=adamw",
            "optimizer.lr=3e-3", "trainer.max_steps=20", "trainer.log_every=5"]
    runs = {dt: job([*bf16, f"precision.reduce_dtype={dt}"], tmp_path / dt, tmp_path)
            for dt in ("float32", "bfloat16")}
    for dt, s in runs.items():
        d = s["distributed"]
        assert (d["reduce_dtype"], d["param_dtype"], d["backend"]) == \
            (dt, "bfloat16", "gloo" if device == "cpu" else "nccl")
    losses = {dt: rows(tmp_path / dt) for dt in runs}
    for dt in runs:
        assert losses[dt][-1] < losses[dt][0] - 0.3, (dt, losses[dt])   # both train
    gaps = [abs(a - b) for a, b in zip(losses["float32"], losses["bfloat16"], strict=True)]
    assert 0 < max(gaps) < 2e-3, gaps
    w32, w16 = weights(tmp_path / "float32"), weights(tmp_path / "bfloat16")
    assert any(not torch.equal(w32[k], w16[k]) for k in w32)


@pytest.mark.slow
@ON_CPU_AND_TWO_GPUS
def test_fp8_all_gather_gpt_compiled_on_two_ranks(tmp_path, device):
    """precision=fp8 under FSDP, compiled (trainer.compile=default; about 70 s of inductor on 2 CPU
    ranks): the float8 weights all-gathered in float8 (torchao's emulation of the matmuls on the
    CPU and below sm_89), every step in compiled graphs, and the GPT trains."""
    s = job([*on_device(device), "precision=fp8", "trainer.strategy=fsdp",
             "trainer.compile=default", "optimizer=adamw", "optimizer.lr=3e-3"],
            tmp_path / "fp8", tmp_path)
    emulated = device == "cpu" or torch.cuda.get_device_capability(0) < (8, 9)
    assert s["fp8"]["fsdp_float8_all_gather"] is True and s["fp8"]["fp8_emulated"] is emulated
    assert s["metrics"]["compiled_graphs"] >= 1 and s["metrics"]["eager_calls"] == 0
    losses = rows(tmp_path / "fp8")
    assert losses[-1] < losses[0]


ADAMW = ["optimizer=adamw", "optimizer.lr=3e-3"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(PARAM_DTYPE))
def test_gpu_one_rank_fsdp_job_per_precision_mode(tmp_path, mode):
    """A 1-GPU FSDP job (NCCL in a 1-rank group) per mode FSDP expresses: it completes on cuda:0 in
    native arithmetic, computes in the mode's dtype and reduces in float32 (summary.json), holds
    all of one process's fp32 bytes, and trains (finite, falling losses); fp8 all-gathers in float8
    (emulated matmuls below sm_89)."""
    s = run_tiny(tmp_path, f"precision={mode}", *FSDP, *ADAMW, base=GPU_GPT)
    assert_one_rank_fsdp_job(s, tmp_path, mode, "cuda:0")
    if mode == "fp8":
        native = torch.cuda.get_device_capability(0) >= (8, 9)
        assert s["fp8"]["fsdp_float8_all_gather"] is True and s["fp8"]["fp8_emulated"] is not native


@pytest.mark.gpu
def test_gpu_one_rank_fsdp_fp32_equals_one_process(tmp_path):
    one = run_tiny(tmp_path / "one", *SGD, base=GPU_GPT)
    solo = run_tiny(tmp_path / "solo", *SGD, *FSDP, base=GPU_GPT)
    assert one["status"] == solo["status"] == "completed"
    assert rows(tmp_path / "solo") == pytest.approx(rows(tmp_path / "one"), rel=1e-6, abs=0)
    assert_same_weights(weights(tmp_path / "solo"), weights(tmp_path / "one"), atol=1e-6)


@pytest.mark.gpu
@TWO_GPUS
def test_gpu_two_nccl_ranks_fsdp_equal_one_process_and_skip_alike(tmp_path):
    """The CPU tests' assertions on 2 GPUs (NCCL): fp32 FSDP against one process, and fp16 loss
    scaling skipping the steps and scales of one process."""
    two = job([*GPU_GPT, *SGD, *FSDP], tmp_path / "two", tmp_path)
    assert two["distributed"]["backend"] == "nccl"
    assert run_tiny(tmp_path / "one", *SGD, base=GPU_GPT)["status"] == "completed"
    assert rows(tmp_path / "two") == pytest.approx(rows(tmp_path / "one"), rel=1e-5, abs=0)
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "one"), atol=1e-5)
    amp = ["precision=amp", "precision.init_scale=16777216", "precision.growth_interval=2",
           "trainer.log_every=1", "trainer.max_steps=8", *ADAMW]
    job([*GPU_GPT, *amp, *FSDP], tmp_path / "amp2", tmp_path)
    run_tiny(tmp_path / "amp1", *amp, base=GPU_GPT)
    assert rows(tmp_path / "amp2", "loss_scale") == rows(tmp_path / "amp1", "loss_scale")


def test_resnet_stages_and_gpt_blocks_are_units_and_batchnorm_computes_in_fp32(tmp_path):
    """One rank (FSDP's path, a 1-rank group): torchvision ResNet-18 is sharded per stage and its
    BatchNorm layers (precision=amp_bf16 keeps them fp32) read their weights in fp32 inside their
    units (test_fsdp_units.py: no unit of their own), so in the forward a stage's convolutions see
    bf16 weights, BatchNorm fp32 weights, and the root returns fp32 logits; the GPT's units are its
    blocks."""
    from mixprec.models import build_model

    config = validate(compose_config("logger=none", *FSDP, "model=resnet18", "precision=amp_bf16"))
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(config.model, 10)
        assert [name for name, m in model.named_children() if m in parallel.units(model)] == \
            ["layer1", "layer2", "layer3", "layer4"]
        parallel.shard(model, config.precision, torch.device("cpu"))
        seen = {}
        for name in ("layer1.0.conv1", "layer1.0.bn1", "bn1", "fc"):
            model.get_submodule(name).register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(name, m.weight.dtype))
        out = model(torch.randn(2, 3, 32, 32))
        assert seen == {"layer1.0.conv1": torch.bfloat16, "layer1.0.bn1": torch.float32,
                        "bn1": torch.float32, "fc": torch.bfloat16}
        assert out.dtype == torch.float32
        gpt = GPT(64, 3, 2, 32, 16)
        assert parallel.units(gpt) == list(gpt.blocks)
    finally:
        tdist.destroy_process_group()


class ConvGraphs(CountingBackend):
    """The counting backend (graphs run as traced, their calls counted), noting also how many
    convolutions each graph holds."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        call = super().__call__(gm, example_inputs)
        self.graphs[-1]["convs"] = sum(n.op == "call_function" and "conv" in str(n.target)
                                       for n in gm.graph.nodes)
        return call

    def convs_after_warmup(self) -> int:
        return sum(g["convs"] * (g["calls"] - (g["at_fit"] or 0)) for g in self.graphs)


class Calls(nn.Module):
    """The loop's model, its calls counted (outside any compiled frame)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net, self.calls, self.at_fit = net, 0, 0

    def forward(self, *args):
        self.calls += 1
        return self.net(*args)


# ResNet-18 (8x8 images, stem 3x3): 20 convolutions a forward, the stem's in the root (eager under
# FSDP: torchtitan compiles the units), 19 in the 4 stages (4, 5, 5, 5 with the shortcuts')
RESNET18_FSDP = [o for o in SMALL if not o.startswith("model")] + [
    "model=resnet18", "trainer.strategy=fsdp", "trainer.compile=default", "trainer.max_steps=2"]


@pytest.mark.slow   # about 20 s of dynamo tracing on a CPU
@pytest.mark.parametrize("limit", [None, 1])
def test_fsdp_compiles_each_unit_whole_and_counts_every_eager_call(tmp_path, monkeypatch, limit):
    """trainer.compile under FSDP (a 1-rank ResNet-18, the counting backend): compiled after
    fully_shard, the root broke its graph at every unit's FSDP hooks (dynamo-disabled) and 72 of
    its 140 convolution calls after the warm-up ran outside any graph while the job recorded
    eager_calls=0. Each stage is compiled before fully_shard, one graph a stage and mode (4, 5, 5,
    5 convolutions): every stage convolution of every call after the warm-up runs in a graph. With
    dynamo's recompile limit at 1 (the evaluation graphs past it), every convolution that ran
    outside a graph is counted in eager_calls (each layer with weights of a compiled unit counts
    its eager calls)."""
    if limit is not None:
        monkeypatch.setattr(torch._dynamo.config, "recompile_limit", limit)
    s, outside, backend = unit_compiled_job(tmp_path, monkeypatch, RESNET18_FSDP)
    if limit is None:
        assert outside == 0 and s["metrics"]["eager_calls"] == 0
        assert [g["convs"] for g in backend.graphs] == [4, 5, 5, 5] * 2   # training, evaluation
    else:
        assert outside > 0 and s["metrics"]["eager_calls"] >= outside


@pytest.mark.gpu
def test_gpu_fsdp_compiles_each_unit_whole(tmp_path, monkeypatch):
    """The CPU test's job on the GPU (FSDP on one rank over NCCL, the counting backend): every
    stage convolution after the warm-up in a graph, no eager call."""
    base = [o for o in RESNET18_FSDP if not o.startswith("trainer.device")]
    s, outside, _ = unit_compiled_job(tmp_path, monkeypatch, base)
    assert s["distributed"]["backend"] == "nccl"
    assert outside == 0 and s["metrics"]["eager_calls"] == 0


def unit_compiled_job(tmp_path, monkeypatch, base):
    """A sharded ResNet-18 job compiled through the counting backend (ConvGraphs); its summary, the
    stage convolutions of the calls after the warm-up that ran outside a graph, the backend."""
    torch._dynamo.reset()
    backend, model = ConvGraphs(), []

    def compiled(net, mode, **options):
        return compile.compile_model(net, mode, backend=backend)

    def counted(net, mode, **options):
        model.append(Calls(compiled(net, mode)))
        return model[0]

    def marked(*args, **kwargs):
        backend.mark()
        model[0].at_fit = model[0].calls
        return fit(*args, **kwargs)

    monkeypatch.setattr(parallel, "compile_model", compiled, raising=False)
    monkeypatch.setattr(mixprec.train.parts, "compile_model", counted)
    fit = mixprec.job.loop.fit
    monkeypatch.setattr(mixprec.job.loop, "fit", marked)
    s = run_tiny(tmp_path, base=base)
    assert s["status"] == "completed", s.get("error")
    forwards = model[0].calls - model[0].at_fit
    assert forwards >= 3   # 2 steps, the evaluations
    assert s["metrics"]["compiled_graphs"] == len(backend.graphs)
    return s, 19 * forwards - backend.convs_after_warmup(), backend


@pytest.mark.parametrize("recipe, options", [
    ("rowwise", {"dynamic": False, "options": {"emulate_precision_casts": True}}),
    ("tensorwise", {"mode": "default", "dynamic": False}),
])
def test_fsdp_compiles_rowwise_fp8_units_with_emulated_precision_casts(monkeypatch, recipe,
                                                                        options):
    """As torchtitan's float8 converter, the rowwise recipe compiles with inductor's
    emulate_precision_casts (here each FSDP unit's torch.compile, not a process-wide setting that
    a sweep's later jobs would inherit); tensorwise compiles in its mode alone."""
    config = validate(compose_config(*GPT_TINY, "precision=fp8", f"precision.fp8_recipe={recipe}",
                                     "trainer.strategy=fsdp", "trainer.compile=default"))
    seen = []
    monkeypatch.setattr(torch, "compile", lambda net, **kwargs: seen.append(kwargs) or net)
    parallel.compile_units(GPT(64, 2, 2, 32, 16), config.precision, config.trainer.compile)
    assert seen == [options, options]   # the 2 blocks
