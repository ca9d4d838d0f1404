"""FSDP on many ranks without them: this process as one rank of torch.testing's fake process group
(`dist.init_process_group("fake", ...)`: every collective returns at once, nothing is sent), which
lays out each rank's shards as NCCL's ranks would have them. What depends only on a rank's own
shards (an empty shard of a small head, the groups a mesh makes) is checked here on the CPU; the
collectives themselves run on 2 gloo ranks in tests/distributed/test_fsdp.py."""
from types import SimpleNamespace
import pytest
import torch
import torch.distributed as tdist
from torch.testing._internal.distributed.fake_pg import FakeStore

from helpers import compose_config
from mixprec.config import validate
from mixprec.models import build_model
from mixprec.runtime import dist
from mixprec.train import parallel
from mixprec.train.loop import finite_flag
import mixprec.train.parts
from mixprec.train.parts import JobContext

CPU = torch.device("cpu")


@pytest.fixture
def rank_7_of_8():
    """This process as rank 7 of a fake group of 8 (destroyed after the test: a later in-process
    job makes its own group)."""
    assert not tdist.is_initialized()
    tdist.init_process_group("fake", store=FakeStore(), rank=7, world_size=8)
    try:
        yield
    finally:
        tdist.destroy_process_group()


def sharded_resnet18():
    """ResNet-18 with a 10-class head, fully_shard over the fake group (fp32)."""
    config = validate(compose_config("model=resnet18", "trainer.device=cpu",
                                     "trainer.strategy=fsdp"))
    model = build_model(config.model, 10)
    return parallel.shard(model, config.precision, CPU), config


def test_an_empty_shard_of_a_small_head_counts_as_finite(rank_7_of_8):
    """A 10-class fc on 8 ranks: dim 0 split in shards of 2, so ranks 5-7 hold none of it. The log
    flush's finiteness check (loop.finite_flag, an inf-norm per tensor) raised on the empty shard
    ("_foreach_norm cannot compute the infinity norm on an empty tensor"; CUDA's kernel has the
    same check) while the other ranks waited in the flush's all-reduce. Empty shards are finite; a
    NaN in this rank's other shards is still seen."""
    model, _ = sharded_resnet18()
    params = {n: parallel.local(p) for n, p in model.named_parameters()}
    assert params["fc.weight"].shape == (0, 512) and params["fc.bias"].numel() == 0
    assert finite_flag(list(params.values())).item() == 1.0
    with torch.no_grad():
        model.get_parameter("layer4.1.conv2.weight").to_local().view(-1)[0] = float("nan")
    assert finite_flag([parallel.local(p) for p in model.parameters()]).item() == 0.0
    assert finite_flag([torch.empty(0), torch.empty(0, 3)]).item() == 1.0


@pytest.mark.gpu
def test_gpu_an_empty_tensor_counts_as_finite():
    """CUDA's _foreach_norm refuses an empty tensor's inf-norm as the CPU's does."""
    cuda = torch.device("cuda")
    tensors = [torch.empty(0, device=cuda), torch.ones(3, device=cuda),
               torch.empty(0, 512, device=cuda, dtype=torch.bfloat16)]
    assert finite_flag(tensors).item() == 1.0
    tensors[1][0] = float("inf")
    assert finite_flag(tensors).item() == 0.0


def groups() -> int:
    return len(tdist.distributed_c10d._world.pg_map)


def test_a_jobs_hsdp_groups_are_destroyed_at_its_end(rank_7_of_8, monkeypatch):
    """trainer.replicate=2 on 8 ranks: the job's (2, 4) mesh makes a replicate and a shard group
    besides the default one. A torchrun sweep runs its jobs in one process, and every job made
    its own groups, never destroyed (NCCL communicators that hold GPU memory). Each job's groups
    are destroyed at its end, whether it ended well or raised; the default group is the
    process's."""
    config = validate(compose_config("model=resnet18", "trainer.device=cpu",
                                     "trainer.strategy=fsdp", "trainer.replicate=2"))
    ranks, during = dist.Ranks(7, 8, nodes=2), []

    def parts(ctx):   # the job's FSDP model over the job's mesh
        model = mixprec.train.parts.wrapper(ctx)(build_model(ctx.config.model, 10))
        return SimpleNamespace(steps=None, batches=None, model=model)

    def train(built):   # stands in for job.train_job's training inside built_parts
        during.append(groups())
        if len(during) == 2:
            raise RuntimeError("the job failed")
        return {"status": "completed"}

    monkeypatch.setattr(mixprec.train.parts, "image_parts", parts)
    release, released = parallel.release_meshes, []   # what each end was told: failed or not
    monkeypatch.setattr(parallel, "release_meshes",
                        lambda failed=False: (released.append(failed), release(failed)))
    assert groups() == 1
    ctx = JobContext(config, CPU, ranks, per_rank=2)
    with mixprec.train.parts.built_parts(ctx) as built:
        assert train(built)["status"] == "completed"
    assert groups() == 1
    with pytest.raises(RuntimeError, match="the job failed"):
        with mixprec.train.parts.built_parts(ctx) as built:
            train(built)
    assert groups() == 1 and during == [3, 3]
    assert released == [False, True]   # a failed job's groups are aborted under NCCL


def test_a_failed_jobs_groups_are_aborted_under_nccl_and_destroyed_under_gloo(monkeypatch):
    """A rank whose job failed first ends its groups without a collective: under NCCL, whose
    graceful destroy was a collective in some versions (a peer waiting for this rank in its own
    collective would never join), it aborts them; under gloo it destroys them as usual."""
    from mixprec.runtime import dist

    aborted = []
    monkeypatch.setattr(dist.tdist.distributed_c10d, "_abort_process_group", aborted.append)
    monkeypatch.setattr(dist.tdist, "get_backend", lambda group=None: "nccl")
    assert dist.abort("g") and aborted == ["g"]
    monkeypatch.setattr(dist.tdist, "get_backend", lambda group=None: "gloo")
    assert not dist.abort("h") and aborted == ["g"]


@pytest.mark.parametrize("spec,aborts", [
    ("cpu:gloo,cuda:nccl", True),   # backend() on a GPU machine: what every GPU job's group is
    ("nccl", True), ("gloo", False), ("cpu:gloo", False), ("cpu:gloo,xpu:xccl", False),
])
def test_a_gpu_jobs_group_is_aborted_as_torch_names_its_backends(monkeypatch, spec, aborts):
    """get_backend answers a group made with "cpu:gloo,cuda:nccl" with that whole string (a
    torch Backend, lower case), and abort must read NCCL in it: a failing GPU rank that destroyed
    its NCCL groups gracefully would wait in a collective for the peers that wait for it."""
    from mixprec.runtime import dist

    aborted = []
    monkeypatch.setattr(dist.tdist.distributed_c10d, "_abort_process_group", aborted.append)
    monkeypatch.setattr(dist.tdist, "get_backend",
                        lambda group=None: dist.tdist.Backend(spec))
    assert dist.abort("g") is aborts and aborted == (["g"] if aborts else [])


@pytest.mark.gpu
def test_gpu_a_gpu_jobs_own_group_is_aborted_not_destroyed():
    """The twin on a GPU: the group a GPU job makes (dist.backend(): "cpu:gloo,cuda:nccl"), one
    rank in this process, names NCCL and is aborted."""
    assert not tdist.is_initialized()
    spec = dist.backend()
    assert spec.startswith("cpu:gloo,cuda:"), spec
    tdist.init_process_group(spec, store=tdist.HashStore(), rank=0, world_size=1,
                             device_id=torch.device("cuda", 0))
    try:
        assert "nccl" in dist.backends(None)
        tdist.all_reduce(torch.ones(1, device="cuda"))   # NCCL's communicator made
        assert dist.abort(None) and not tdist.is_initialized()   # the world is gone with it
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
