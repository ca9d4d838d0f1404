"""A sharded checkpoint on 2 spawned gloo ranks (helpers/fsdp_ranks.py's checks_on_rank): every
rank saves its shards and resumes exactly; ranks that see different checkpoints fail alike."""
import json
import shutil

import torch

from mixprec.config import PrecisionConfig
from mixprec.models.gpt import GPT
from mixprec.precision.fsdp import ShardedPolicy
from mixprec.runtime import dist
from mixprec.train import checkpoint, parallel
from mixprec.train.loop import LoopState


FP32 = PrecisionConfig(name="fp32")


def _step(model, optimizer, seed):
    """One AdamW step of the tiny GPT on batch `seed`; its loss."""
    x = torch.randint(0, 64, (16, 4), generator=torch.Generator().manual_seed(seed))
    out, _ = model(x)
    loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, 64), x.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _sharded_gpt(seed):
    torch.manual_seed(seed)
    model = parallel.shard(GPT(64, 2, 2, 32, 16), FP32, torch.device("cpu"))
    return model, torch.optim.AdamW(ShardedPolicy(FP32, torch.device("cpu")).optimizer_params(
        model), lr=1e-2)


def _save_and_resume_on_rank(rank, folder):
    """2 steps, a checkpoint, 2 more steps; then a model built from another seed restored from the
    checkpoint takes the same 2 steps."""
    ranks = dist.Ranks(rank=rank, world=2)
    meta = {"config": {}, "device_type": "cpu"}
    model, optimizer = _sharded_gpt(0)
    saver = checkpoint.Checkpointer(folder, meta, ranks=ranks, sharded=True)
    saver.parts.update(model=model, optimizer=optimizer)
    for seed in (1, 2):
        _step(model, optimizer, seed)
    saver.save(LoopState())
    straight = [_step(model, optimizer, seed) for seed in (3, 4)]
    whole = {k: v.full_tensor() for k, v in model.state_dict().items()}
    ranks.barrier()
    model, optimizer = _sharded_gpt(1)
    saver = checkpoint.Checkpointer(folder, meta, ranks=ranks, sharded=True)
    saver.parts.update(model=model, optimizer=optimizer)
    saver.restore(checkpoint.read(folder, {}, "cpu", world=2), LoopState())
    resumed = [_step(model, optimizer, seed) for seed in (3, 4)]
    same = all(torch.equal(v.full_tensor(), whole[k]) for k, v in model.state_dict().items())
    (folder / f"resume.{rank}").write_text(json.dumps([straight, resumed, same]))


def _unshared_on_rank(rank, folder):
    """After _save_and_resume_on_rank: rank 0 reads the 2-rank checkpoint in `folder`, rank 1 a job
    dir of its own (a node without the shared file system): empty, then with checkpoint.pt and a
    shards folder that lacks rank 0's file. What each rank's read_agreed raised."""
    ranks, node = dist.Ranks(rank=rank, world=2), folder / "node1"
    lines = []
    for second in (False, True):
        if rank == 1 and second:   # a copy without __0_0.distcp
            name = torch.load(folder / checkpoint.CHECKPOINT, weights_only=True)["shards"]
            shutil.copy(folder / checkpoint.CHECKPOINT, node)
            shutil.copytree(folder / name, node / name, ignore=shutil.ignore_patterns("__0_*"))
        if rank == 1:   # (rank 0 making it raced rank 1's look for it)
            node.mkdir(exist_ok=True)
        try:
            checkpoint.read_agreed(folder if rank == 0 else node, {}, "cpu", ranks)
            lines.append(None)
        except checkpoint.CheckpointError as e:
            lines.append(str(e))
    (folder / f"unshared.{rank}").write_text(json.dumps(lines))
