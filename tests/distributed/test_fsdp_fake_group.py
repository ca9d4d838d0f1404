"""FSDP on many ranks without them: this process as one rank of torch.testing's fake process group
(`dist.init_process_group("fake", ...)`: every collective returns at once, nothing is sent), which
lays out each rank's shards as NCCL's ranks would have them. What depends only on a rank's own
shards (an empty shard of a small head, the groups a mesh makes) and what a rank hands FSDP's
collectives (the dtype its gradients are reduce-scattered in, its float8 weights' all-gather) is
checked here on the CPU, in the quick loop; the collectives themselves run on 2 gloo ranks in
tests/distributed/test_fsdp.py (slow)."""
from types import SimpleNamespace
import pytest
import torch
import torch.distributed as tdist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.testing._internal.distributed.fake_pg import FakeStore

from helpers import compose_config
from helpers.configs import GPT_TINY
from mixprec.config import validate
from mixprec.models import build_model
from mixprec.runtime import dist
from mixprec.train import parallel
from mixprec.train.build import build_trained
from mixprec.train.loop import finite_flag
import mixprec.train.parts
from mixprec.train.parts import JobContext

CPU = torch.device("cpu")


def fake_group(rank: int, world: int):
    """This process as `rank` of a fake group of `world`, destroyed after the test with the groups
    its meshes made (a later in-process job, in this xdist worker too, makes its own group)."""
    assert not tdist.is_initialized()
    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        parallel.release_meshes()
        tdist.destroy_process_group()


@pytest.fixture
def rank_7_of_8():
    """This process as rank 7 of a fake group of 8."""
    yield from fake_group(7, 8)


@pytest.fixture
def rank_0_of_2():
    """This process as rank 0 of a fake group of 2 (the slow tests' 2 gloo ranks)."""
    yield from fake_group(0, 2)


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


def collectives(monkeypatch) -> dict:
    """What this rank hands FSDP's collectives from now on (the fake group sends nothing on):
    "reduce_scatter", each reduce-scatter's gradient dtype; "all_gather", each all-gather's
    parameters (by name) and the dtype each goes into its buffer in; "all_gather_bytes", each
    buffer's bytes. Every all-gather's output is filled with this rank's shard, as if each rank
    held it (finite values for the forward, where the fake group leaves memory unwritten)."""
    seen = {"reduce_scatter": [], "all_gather": [], "all_gather_bytes": []}
    # FSDP2's collectives by name: *_single from torch 2.14, *_tensor before (2.11, the oldest)
    rs_name, ag_name = (("reduce_scatter_single", "all_gather_single")
                        if hasattr(tdist, "reduce_scatter_single")
                        else ("reduce_scatter_tensor", "all_gather_into_tensor"))
    reduce_scatter, all_gather = getattr(tdist, rs_name), getattr(tdist, ag_name)
    gather_params = _fsdp_param_group.foreach_all_gather

    def spy_reduce_scatter(output, input, *args, **kwargs):
        seen["reduce_scatter"].append(input.dtype)
        return reduce_scatter(output, input, *args, **kwargs)

    def spy_all_gather(output_tensor, input_tensor, *args, **kwargs):
        seen["all_gather_bytes"].append(input_tensor.nbytes)
        work = all_gather(output_tensor, input_tensor, *args, **kwargs)
        output_tensor.view(-1, input_tensor.numel()).copy_(input_tensor.clone())
        return work

    def spy_gather_params(fsdp_params, *args, **kwargs):
        result = gather_params(fsdp_params, *args, **kwargs)
        seen["all_gather"].append(
            {p._param_fqn: dtypes for p, dtypes
             in zip(fsdp_params, result.param_all_gather_input_dtypes, strict=True)})
        return result

    monkeypatch.setattr(tdist, rs_name, spy_reduce_scatter)
    monkeypatch.setattr(tdist, ag_name, spy_all_gather)
    monkeypatch.setattr(_fsdp_param_group, "foreach_all_gather", spy_gather_params)
    return seen


def sharded_gpt_step(monkeypatch, *overrides) -> tuple[dict, object]:
    """The job's sharded GPT (GPT_TINY, trainer.strategy=fsdp and `overrides`; built as
    parts.language_model_parts builds it: the policy, parallel.shard over the job's mesh, the
    optimizer) through one forward and backward on this rank of the fake group; returns what it
    handed the collectives (collectives) and the built parts."""
    config = validate(compose_config(*GPT_TINY, "trainer.strategy=fsdp", *overrides))
    ctx = JobContext(config, CPU, dist.Ranks(tdist.get_rank(), tdist.get_world_size()),
                     per_rank=config.trainer.batch_size // tdist.get_world_size())
    model = build_model(config.model, config.dataset.vocab_size)
    built = build_trained(model, config, CPU, wrap=mixprec.train.parts.wrapper(ctx))
    seen = collectives(monkeypatch)
    tokens = torch.randint(0, config.dataset.vocab_size, (config.dataset.bptt, ctx.per_rank))
    logits, _ = built.net(tokens)
    logits.float().square().mean().backward()
    return seen, built


@pytest.mark.parametrize("reduce", ["float32", "bfloat16"])
def test_gradients_are_reduce_scattered_in_precision_reduce_dtype(rank_0_of_2, monkeypatch,
                                                                  reduce):
    """precision=amp_bf16 with precision.reduce_dtype=float32 or bfloat16, the job's sharded GPT on
    rank 0 of 2: every unit (2 blocks, the root) is all-gathered in bfloat16 and hands its
    gradients to the reduce-scatter in reduce_dtype (a policy that reduced in float32 whatever it
    said, or in the compute dtype, fails one of the two); the rank's gradient shards are float32
    either way. The quick twin of test_fsdp.py::test_bf16_against_fp32_gradient_reduction_on_the_gpt
    (20-step jobs on 2 gloo ranks, slow)."""
    seen, built = sharded_gpt_step(monkeypatch, "precision=amp_bf16",
                                   f"precision.reduce_dtype={reduce}")
    assert seen["reduce_scatter"] == [getattr(torch, reduce)] * 3
    assert len(seen["all_gather"]) == 5   # the root, each block before its forward and backward
    assert {d for gathered in seen["all_gather"] for ds in gathered.values() for d in ds} == \
        {torch.bfloat16}
    grads = [parallel.local(p.grad) for p in built.model.parameters()]
    assert len(grads) == 28 and {g.dtype for g in grads} == {torch.float32}


def test_fp8_weights_are_all_gathered_in_float8(rank_0_of_2, monkeypatch):
    """precision=fp8, the job's sharded GPT on rank 0 of 2: each block's 4 float8 Linear weights
    are torchao's WeightWithDynamicFloat8CastTensor shards and go into the all-gather as
    float8_e4m3fn, the rest (biases, LayerNorms, the root's embeddings and tied head) in
    bfloat16, one byte a float8 element on the wire (each buffer holds its parameters' bytes, no
    more); the summary says so. The quick twin of test_fsdp.py::
    test_fp8_weights_are_all_gathered_in_float8_with_scales_precomputed_after_the_step (the
    session's spawn of 2 gloo ranks, slow)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    seen, built = sharded_gpt_step(monkeypatch, "precision=fp8")
    float8 = {f"{layer}.weight" for layer in built.policy.fp8["float8_layers"]}
    assert len(float8) == 8   # 4 Linear layers per block; the tied head stays bf16
    gathered = {name: ds for unit in seen["all_gather"] for name, ds in unit.items()}
    assert len(seen["all_gather"]) == 5 and len(gathered) == 28
    assert {n for n, ds in gathered.items() if ds == [torch.float8_e4m3fn]} == float8
    assert all(ds == [torch.bfloat16] for n, ds in gathered.items() if n not in float8)
    shards = dict(built.model.named_parameters())
    assert all(isinstance(shards[n].to_local(), WeightWithDynamicFloat8CastTensor) for n in float8)
    assert seen["all_gather_bytes"] == [
        sum(shards[n].to_local().numel() * ds[0].itemsize for n, ds in unit.items())
        for unit in seen["all_gather"]]
    assert seen["reduce_scatter"] == [torch.float32] * 3
    assert built.policy.fp8["fsdp_float8_all_gather"] is True
