"""HSDP's 2-D mesh on 2 spawned gloo ranks (helpers/fsdp_ranks.py's checks_on_rank): replicas
hold whole copies that stay equal, loss scaling, FP8 scales and a resume across meshes."""
import json

import torch
from torch.distributed.tensor import DTensor

from mixprec.config import PrecisionConfig
from mixprec.models.gpt import GPT
from mixprec.precision.fsdp import ShardedPolicy, after_steps
from mixprec.runtime import dist
from mixprec.train import checkpoint, parallel
from mixprec.train.loop import LoopState
from mixprec.train.step import backward_and_step


CPU = torch.device("cpu")


HSDP = (2, 1)   # 2 ranks: 2 replicas, each rank a whole copy (its replica's only shard)


FP32 = PrecisionConfig(name="fp32")


AMP = PrecisionConfig(name="amp", autocast_dtype="float16", loss_scale="dynamic",
                      init_scale=1024.0, growth_interval=1000)


FP8 = PrecisionConfig(name="fp8", autocast_dtype="bfloat16", fp8_recipe="tensorwise")


def _gpt(cfg, shape, seed=0):
    """The tiny GPT built as the job builds it (policy, shard over `shape`, AdamW, the FP8 scales'
    step hook); its policy, model and optimizer."""
    torch.manual_seed(seed)
    policy = ShardedPolicy(cfg, CPU)
    model = parallel.shard(policy.prepare_model(GPT(64, 2, 2, 32, 16)), cfg, CPU, shape)
    optimizer = torch.optim.AdamW(policy.optimizer_params(model), lr=1e-2)
    after_steps(model, optimizer, policy.fp8)
    return policy, model, optimizer


def _step(model, policy, optimizer, seed, poison=lambda: None):
    """One step of the tiny GPT on batch `seed` (each rank its own); its loss and whether the
    scaler skipped it. poison: called between backward and the step."""
    x = torch.randint(0, 64, (16, 4), generator=torch.Generator().manual_seed(seed))
    out, _ = model(x)
    loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, 64), x.reshape(-1))
    skipped = backward_and_step(loss, policy, optimizer, 1.0, after_backward=poison)
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), bool(skipped)


def _hsdp_on_rank(rank, folder):
    """What HSDP's 2 ranks show: placements, held bytes after a step on different batches, the
    replicas' spread, the portable fp32 state dict, fp16 loss scaling with an overflow in rank 1's
    gradient, FP8 scales, and a checkpoint written on the 1-D mesh resumed on HSDP's."""
    seen = {}
    policy, model, optimizer = _gpt(FP32, HSDP)
    weight = next(model.parameters())
    seen["placements"] = [repr(p) for p in weight.placements]
    seen["mesh"] = list(weight.device_mesh.shape)
    x = torch.randint(0, 64, (16, 4), generator=torch.Generator().manual_seed(rank))
    out, _ = model(x)   # the bytes with the gradients there, as HeldPeak measures them
    torch.nn.functional.cross_entropy(out.float().reshape(-1, 64), x.reshape(-1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))   # the loop's clip
    whole = torch.stack([p.grad.full_tensor().norm() for p in model.parameters()]).norm()
    seen["norm"] = [float(norm.full_tensor() if isinstance(norm, DTensor) else norm), float(whole)]
    optimizer.step()
    seen["held"] = parallel.held_bytes(model, optimizer)
    local = [parallel.local(p).detach() for p in model.parameters()]
    seen["spread"] = dist.spread(local, dist.Ranks(rank=rank, world=2))
    full = policy.fp32_state_dict(model)
    seen["full_ok"] = rank != 0 or all(
        torch.equal(full[k], v.full_tensor()) for k, v in model.state_dict().items())
    seen["amp"] = _overflow(rank)
    seen["fp8"] = _fp8_scales()
    seen["resume"] = _resume_on_hsdp(rank, folder / "hsdp_ckpt")
    (folder / f"hsdp.{rank}").write_text(json.dumps(seen))


def _overflow(rank):
    """fp16 steps on HSDP; at step 2 only rank 1's copy of one gradient is inf."""
    policy, model, optimizer = _gpt(AMP, HSDP)
    first = next(model.parameters())
    out = []
    for step in (1, 2, 3):
        poison = lambda: step == 2 and rank == 1 and parallel.local(first.grad).fill_(torch.inf)  # noqa: B023,E731
        _, skipped = _step(model, policy, optimizer, step, poison)
        out.append([skipped, policy.scale_value])
    return out


def _fp8_scales():
    """Each float8 weight's precomputed scale after an HSDP step, against 448 / its amax."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    policy, model, optimizer = _gpt(FP8, HSDP)
    _step(model, policy, optimizer, 1)
    ok = []
    for name in policy.fp8["float8_layers"]:
        weight = model.get_submodule(name).weight
        local = weight._local_tensor
        expected = torch.finfo(torch.float8_e4m3fn).max / weight.full_tensor().abs().max().double()
        ok.append(isinstance(local, WeightWithDynamicFloat8CastTensor)
                  and torch.equal(local._precomputed_scale, expected.float()))
    return ok


def _resume_on_hsdp(rank, folder):
    """2 steps on the 1-D mesh, a checkpoint, 2 more steps; a model built on HSDP's mesh from
    another seed, restored from it, writes its own checkpoint and takes the same 2 steps; a 1-D
    model restored from HSDP's checkpoint takes them too: DCP reshards between the meshes."""
    ranks = dist.Ranks(rank=rank, world=2)
    if ranks.main:
        folder.mkdir()
    ranks.barrier()
    meta = {"config": {}, "device_type": "cpu"}
    policy, model, optimizer = _gpt(FP32, None)
    saver = checkpoint.Checkpointer(folder, meta, ranks=ranks, sharded=True)
    saver.parts.update(model=model, optimizer=optimizer)
    for seed in (1, 2):
        _step(model, policy, optimizer, seed + 10 * rank)
    saver.save(LoopState())
    straight = [_step(model, policy, optimizer, seed + 10 * rank)[0] for seed in (3, 4)]
    ranks.barrier()
    policy, model, optimizer = _gpt(FP32, HSDP, seed=1)
    saver = checkpoint.Checkpointer(folder, meta, ranks=ranks, sharded=True)
    saver.parts.update(model=model, optimizer=optimizer)
    saver.restore(checkpoint.read(folder, {}, "cpu", world=2), LoopState())
    saver.save(LoopState())   # HSDP's shards
    on_hsdp = [_step(model, policy, optimizer, seed + 10 * rank)[0] for seed in (3, 4)]
    policy, model, optimizer = _gpt(FP32, None, seed=2)
    saver = checkpoint.Checkpointer(folder, meta, ranks=ranks, sharded=True)
    saver.parts.update(model=model, optimizer=optimizer)
    saver.restore(checkpoint.read(folder, {}, "cpu", world=2), LoopState())
    back = [_step(model, policy, optimizer, seed + 10 * rank)[0] for seed in (3, 4)]
    return [straight, on_hsdp, back]
