"""FSDP's units in every precision mode (train/parallel.py, precision/fsdp.py), on this process as a
1-rank gloo group: a ResNet is one unit a stage and the root whatever the mode, its BatchNorm layers
inside their units computing in fp32; compiled, every mode makes fp32's graphs and the records count
the graph breaks. Each BatchNorm was an fp32 unit of its own under every mode with keep_bn_fp32:
ResNet-18 had 25 units under amp_bf16 against fp32's 5, and compiled its stages in 21 graphs a
training forward against fp32's 4 while eager_calls said 0."""
import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchvision.models.resnet import BasicBlock

from helpers import compose_config
from helpers.compiling import CountingBackend
from mixprec.config import validate
from mixprec.models import build_model
from mixprec.precision.fsdp import ShardedPolicy
from mixprec.runtime import dist
from mixprec.train import checkpoint, compile, parallel
from mixprec.train.loop import LoopState

CPU = torch.device("cpu")


@pytest.fixture
def one_rank():
    """This process as the one rank of a gloo group (destroyed after the test)."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def sharded(mode: str, arch: str = "resnet18", compile_mode: str = "none", device=CPU, model=None):
    """`arch` with a 10-class head (or `model`) as a sharded job of precision `mode` builds it on
    `device` (the policy's model, then parallel.shard, its units compiled first in
    `compile_mode`)."""
    config = validate(compose_config("logger=none", "trainer.device=cpu", "trainer.strategy=fsdp",
                                     f"model={arch}", f"precision={mode}"))
    torch.manual_seed(0)
    model = build_model(config.model, 10) if model is None else model
    model = ShardedPolicy(config.precision, device).prepare_model(model)
    return parallel.shard(model, config.precision, device, compile_mode=compile_mode)


def fsdp_units(model) -> int:
    return sum(isinstance(m, FSDPModule) for m in model.modules())


@pytest.mark.parametrize("mode, arch", [("amp_bf16", "resnet18"), ("amp", "resnet18"),
                                        ("amp_bf16", "resnet50")])
def test_every_mode_shards_a_resnet_in_fp32s_units(one_rank, mode, arch):
    """One unit a stage and the root (5) in every mode, as in fp32: each BatchNorm was an fp32
    unit of its own under a mode with keep_bn_fp32 (ResNet-18 25 units, ResNet-50 58), two more
    latency-bound collectives each a step."""
    assert fsdp_units(sharded(mode, arch)) == fsdp_units(sharded("fp32", arch)) == 5


def test_batchnorm_computes_in_fp32_inside_its_stage(one_rank):
    """Under amp_bf16 a stage's BatchNorm is in the stage's bf16 unit (FSDP registers its weight
    in bf16) and computes in fp32: it reads its weight and bias in fp32, its running statistics
    stay fp32, and its bf16 output is the fp32 computation from the upcast input, rounded once.
    Its gradients reach its fp32 shards."""
    check_batchnorm(sharded("amp_bf16"), torch.bfloat16, CPU)


def check_batchnorm(model, low: torch.dtype, device: torch.device) -> None:
    """The test above's checks, on `model` sharded in a mode whose param_dtype is `low`."""
    bn, seen = model.get_submodule("layer2.0.bn1"), {}

    def hook(m, args, out):
        (x,) = args
        seen.update(registered=m._parameters["weight"].dtype, weight=m.weight.dtype,
                    stats=m.running_mean.dtype, x=x.dtype, out=out.dtype,
                    fp32=F.batch_norm(x.float(), None, None, m.weight.float(), m.bias.float(),
                                      True, 0.0, m.eps).to(out.dtype),
                    got=out.detach().clone())   # before the stage's in-place ReLU
    bn.register_forward_hook(hook)
    model(torch.randn(2, 3, 8, 8, device=device)).sum().backward()
    assert {k: seen[k] for k in ("registered", "weight", "stats", "x", "out")} == {
        "registered": low, "weight": torch.float32, "stats": torch.float32, "x": low, "out": low}
    ulp = torch.finfo(low).eps   # one rounding of the output apart at most
    torch.testing.assert_close(seen["got"], seen["fp32"], rtol=ulp, atol=ulp)
    assert bn.running_var.dtype == torch.float32 and bn.running_var.ne(1).all()
    grad = parallel.local(bn.weight.grad)
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0


class OneStage(nn.Module):
    """A ResNet's layout at its smallest: a stem (a convolution and a BatchNorm, in the root), one
    stage of one basic block (torchvision's, 8 channels: two convolutions, each followed by a
    BatchNorm; a unit: parallel.unit_slots), a classifier."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.layer1 = BasicBlock(8, 8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.layer1(self.bn1(self.stem(x)).relu()).mean((2, 3)))


def compiled_graphs(mode: str, monkeypatch, model=None, device=CPU) -> tuple[int, dict]:
    """`model` (a ResNet-18 if None) sharded in `mode` on `device`, its units compiled through a
    counting backend: the graphs dynamo made for one training forward and backward, and what
    GraphWatch records of them."""
    torch._dynamo.reset()
    backend = CountingBackend()
    monkeypatch.setattr(parallel, "compile_model", lambda net, mode, **options:
                        compile.compile_model(net, mode, backend=backend))
    model = sharded(mode, compile_mode="default", device=device, model=model)
    watch = compile.GraphWatch(model, "default")
    model(torch.randn(2, 3, 8, 8, device=device)).sum().backward()
    return len(backend.graphs), watch.finish()


def test_a_compiled_stage_is_one_graph_in_every_mode_with_no_graph_break(one_rank, monkeypatch):
    """Compiled before fully_shard, a stage is one graph in amp_bf16 as in fp32: the hooks
    of each BatchNorm's own unit (dynamo-disabled) broke the stage's graph at every BatchNorm (3
    graphs, 2 breaks), and the job's records said eager_calls=0. The records count the breaks
    (graph_breaks; tests/unit/train/test_compile.py shows a job saying them)."""
    seen = {mode: compiled_graphs(mode, monkeypatch, OneStage())
            for mode in ("fp32", "amp_bf16")}
    assert seen == {mode: (1, {"compiled_graphs": 1, "graph_breaks": 0, "eager_calls": 0})
                    for mode in seen}


@pytest.mark.slow   # about 12 s of dynamo tracing on a CPU
def test_a_compiled_resnet18_makes_fp32s_graphs_in_every_mode(one_rank, monkeypatch):
    """The quick test's promise on ResNet-18: its 4 stages are 4 graphs in a training forward under
    amp_bf16 as under fp32 (it made 21, broken at every BatchNorm's own unit), with no graph
    break."""
    fp32, bf16 = (compiled_graphs(mode, monkeypatch) for mode in ("fp32", "amp_bf16"))
    assert bf16 == fp32 == (4, {"compiled_graphs": 4, "graph_breaks": 0, "eager_calls": 0})


def steps(model, optimizer, seeds) -> list[float]:
    """One SGD step of `model` a seed (a batch of 8x8 images, 10 classes), then an evaluation
    forward (which leaves the root's weights gathered, as the job's evaluations do); the losses."""
    losses = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        with torch.no_grad():
            model.eval()(x)
        model.train()
    return losses


def test_a_sharded_checkpoint_of_fp32_batchnorms_resumes_exactly(one_rank, tmp_path):
    """amp_bf16, its BatchNorms (in the root and in the stage) reading fp32 weights: 2 steps, a
    checkpoint, 2 more; a model built from another seed restored from the checkpoint takes the same
    2 steps and ends with the same weights and running statistics (DCP sees the layers' own
    parameter names and fp32 shards)."""
    meta, ranks = {"config": {}, "device_type": "cpu"}, dist.Ranks()
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = sharded("amp_bf16", model=OneStage())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        saver = checkpoint.Checkpointer(tmp_path, meta, ranks=ranks, sharded=True)
        saver.parts.update(model=model, optimizer=optimizer)
        models.append((model, optimizer, saver))
    model, optimizer, saver = models[0]
    steps(model, optimizer, (1, 2))
    saver.save(LoopState())
    straight = steps(model, optimizer, (3, 4))
    model2, optimizer2, saver2 = models[1]
    saver2.restore(checkpoint.read(tmp_path, {}, "cpu", world=1), LoopState())
    assert steps(model2, optimizer2, (3, 4)) == straight
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(parallel.local(a), parallel.local(b)), name
    assert "layer1.bn1.running_var" in model.state_dict()


def test_keep_bn_fp32_false_is_refused_only_where_a_batchnorm_would_get_low_weights():
    """precision.keep_bn_fp32=false failed at a sharded image model's first forward ("expected
    scalar type BFloat16 but found Float": bf16 weights against fp32 running statistics); it is
    refused in one line (tests/distributed/test_fsdp.py's refusals), but not where no BatchNorm
    would get low-precision weights: in fp32, or for the GPT, which has none."""
    for overrides in (["model=resnet18", "precision=fp32"], ["model=gpt", "precision=amp_bf16",
                                                            "dataset=synthetic_text"]):
        config = validate(compose_config("logger=none", "trainer.device=cpu",
                                         "trainer.strategy=fsdp", *overrides,
                                         "precision.keep_bn_fp32=false"))
        assert not config.precision.keep_bn_fp32


@pytest.mark.gpu
def test_gpu_every_mode_has_fp32s_units_and_graphs_and_batchnorm_computes_in_fp32(monkeypatch):
    """The CPU tests on cuda:0, one rank of an NCCL group: ResNet-18 in 5 units under amp_bf16
    and amp (CUDA's BatchNorm kernels take the low-dtype input with the fp32 weights), its
    BatchNorm computing in fp32, and compiled (the counting backend) fp32's 4 stage graphs."""
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    tdist.init_process_group("nccl", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        for mode, low in (("amp_bf16", torch.bfloat16), ("amp", torch.float16)):
            model = sharded(mode, device=cuda)
            assert fsdp_units(model) == 5
            check_batchnorm(model, low, cuda)
        fp32, bf16 = (compiled_graphs(mode, monkeypatch, device=cuda)
                      for mode in ("fp32", "amp_bf16"))
        assert bf16 == fp32 == (4, {"compiled_graphs": 4, "graph_breaks": 0, "eager_calls": 0})
    finally:
        tdist.destroy_process_group()
