"""What the FSDP tests read from 2 spawned gloo ranks (conftest.py's ranks_ran, one spawn for
the session): per-rank bytes, an overflow in one rank's shard, the FP8 all-gather, and (from
helpers/checkpoint_ranks.py and helpers/hsdp_ranks.py) a sharded checkpoint and HSDP's mesh."""
import json

import torch

from helpers.checkpoint_ranks import _save_and_resume_on_rank, _unshared_on_rank
from helpers.hsdp_ranks import _hsdp_on_rank
from mixprec.config import PrecisionConfig
from mixprec.models.gpt import GPT
from mixprec.precision.fsdp import ShardedPolicy, after_steps
from mixprec.train import parallel
from mixprec.train.step import backward_and_step


def checks_on_rank(rank, folder):
    """What the spawned-rank tests read (conftest.py's ranks_ran), made in one spawn of 2 ranks
    (each spawn costs a process start and torch's import): the per-rank bytes, the overflow, the FP8
    all-gather, a sharded checkpoint's exact resume and ranks that see different checkpoints
    (helpers/checkpoint_ranks.py), HSDP's 2-D mesh (helpers/hsdp_ranks.py)."""
    for fn in (_bytes_on_rank, _overflow_on_rank, _fp8_on_rank, _save_and_resume_on_rank,
               _unshared_on_rank, _hsdp_on_rank):
        fn(rank, folder)


def gpu_checks_on_rank(rank, folder):
    """The spawned-rank checks the CPU's ranks_ran makes, on cuda:rank over NCCL: the per-rank
    bytes and the FP8 all-gather."""
    for fn in (_bytes_on_rank, _fp8_on_rank):
        fn(rank, folder, torch.device("cuda", rank))


FP32 = PrecisionConfig(name="fp32")


def _gpt_step(model, optimizer, seed=0):
    """One AdamW step of the tiny GPT on a fixed batch (on the model's device); gradients kept (no
    zero_grad)."""
    x = torch.randint(0, 64, (16, 4), generator=torch.Generator().manual_seed(seed))
    x = x.to(next(model.parameters()).device)
    out, _ = model(x)
    torch.nn.functional.cross_entropy(out.float().reshape(-1, 64), x.reshape(-1)).backward()
    optimizer.step()


def _bytes_on_rank(rank, folder, device=torch.device("cpu")):
    torch.manual_seed(0)
    whole = GPT(64, 2, 2, 32, 16).to(device)
    sharded = parallel.shard(GPT(64, 2, 2, 32, 16).to(device), FP32, device)
    held = {}
    for name, model in (("whole", whole), ("sharded", sharded)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _gpt_step(model, optimizer)
        held[name] = parallel.held_bytes(model, optimizer)
    (folder / f"bytes.{rank}").write_text(json.dumps(held))


AMP = PrecisionConfig(name="amp", autocast_dtype="float16", loss_scale="dynamic",
                      init_scale=1024.0, growth_interval=1000)


def _overflow_on_rank(rank, folder):
    """Steps of the fp16 GPT under FSDP; at step 2 rank 1's shard of one gradient is inf (an
    overflow only that rank sees)."""
    torch.manual_seed(0)
    policy = ShardedPolicy(AMP, torch.device("cpu"))
    model = parallel.shard(policy.prepare_model(GPT(64, 2, 2, 32, 16)), AMP, torch.device("cpu"))
    optimizer = torch.optim.SGD(policy.optimizer_params(model), lr=0.1)
    first = next(model.parameters())
    seen = []
    for step in range(1, 4):
        x = torch.randint(0, 64, (16, 4), generator=torch.Generator().manual_seed(step))
        out, _ = model(x)
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, 64), x.reshape(-1))
        poison = lambda: step == 2 and rank == 1 and parallel.local(first.grad).fill_(torch.inf)
        skipped = backward_and_step(loss, policy, optimizer, 1.0, after_backward=poison)
        optimizer.zero_grad(set_to_none=True)
        seen.append([bool(skipped), policy.scale_value])
    (folder / f"steps.{rank}").write_text(json.dumps(seen))


FP8 = PrecisionConfig(name="fp8", autocast_dtype="bfloat16", fp8_recipe="tensorwise")


def _fp8_on_rank(rank, folder, device=torch.device("cpu")):
    """The fp8 GPT sharded as the job builds it (train/build.py: policy, shard, optimizer, the
    scales' step hook), one AdamW step; what each float8 weight would all-gather next."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    torch.manual_seed(0)
    policy = ShardedPolicy(FP8, device)
    model = parallel.shard(policy.prepare_model(GPT(64, 2, 2, 32, 16)).to(device), FP8, device)
    optimizer = torch.optim.AdamW(policy.optimizer_params(model), lr=1e-2)
    after_steps(model, optimizer, policy.fp8)
    _gpt_step(model, optimizer)
    seen = {}
    for name in policy.fp8["float8_layers"]:
        weight = model.get_submodule(name).weight
        shard_ = weight._local_tensor   # the object itself (to_local() returns an alias)
        (data,), (scale,) = shard_.fsdp_pre_all_gather(weight.device_mesh)
        expected = torch.finfo(torch.float8_e4m3fn).max / weight.full_tensor().abs().max().double()
        seen[name] = {"subclass": isinstance(shard_, WeightWithDynamicFloat8CastTensor),
                      "sent": str(data.dtype),
                      "scale_ok": shard_._precomputed_scale is not None
                      and torch.equal(shard_._precomputed_scale, expected.float())
                      and torch.equal(scale.reshape(()), expected.float())}
    (folder / f"fp8.{rank}").write_text(json.dumps(seen))
