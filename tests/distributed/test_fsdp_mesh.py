"""trainer.replicate: FSDP2's device mesh, 1-D (every rank shards) or HSDP's 2-D (replicate,
shard) that shards within a replica (a node, by default) and replicates across replicas. The mesh
shape from torchrun's and submitit's variables, the one-line refusals, the records; on 2 spawned
gloo ranks HSDP's replicas, bytes, FP8 scales, loss scaling and checkpoints; under torchrun (slow)
a replicated job against one process, and two simulated nodes on this machine."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, TINY, compose_config, run_tiny
from helpers.configs import GPT_TINY, SGD
from helpers.distributed import assert_same_weights, free_port, job, rows, weights
from helpers.hsdp_ranks import CPU
from mixprec.config import ConfigError, validate
from mixprec.models.gpt import GPT
from mixprec.report.analyse import sharded_cell, sweep_rows
from mixprec.report.console import format_table
from mixprec.runtime import dist

FSDP = ["trainer.strategy=fsdp"]


def torchrun_env(monkeypatch, world, per_node):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))


def test_mesh_shape_from_torchruns_variables(monkeypatch):
    """auto: one replica per node (WORLD_SIZE / LOCAL_WORLD_SIZE), sharded over its ranks; one node
    (or nodes unknown) is the 1-D mesh of plain FSDP; an explicit degree N gives N replicas of
    world / N ranks, 1 the 1-D mesh, the world size pure replication."""
    torchrun_env(monkeypatch, 8, 4)
    ranks = dist.from_env()
    assert (ranks.world, ranks.nodes) == (8, 2)
    assert dist.mesh_shape("auto", ranks) == (2, 4)
    assert dist.mesh_shape(4, ranks) == (4, 2)
    assert dist.mesh_shape(8, ranks) == (8, 1)
    assert dist.mesh_shape(1, ranks) == (8,)
    torchrun_env(monkeypatch, 8, 8)
    assert dist.mesh_shape("auto", dist.from_env()) == (8,)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")   # not torchrun's: nodes unknown, one
    assert dist.mesh_shape("auto", dist.from_env()) == (8,)
    torchrun_env(monkeypatch, 6, 4)   # nodes of different sizes: unknown
    assert dist.from_env().nodes == 1
    assert dist.mesh_shape("auto", dist.SINGLE) == (1,)


def test_mesh_shape_from_a_submitit_slurm_job(monkeypatch):
    """hydra.launcher.nodes=2 tasks_per_node=8: submitit's JobEnvironment gives 16 tasks on 2
    nodes, so auto is 2 replicas of 8."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "gpu1")   # from_env sets them only where unset
    monkeypatch.setenv("MASTER_PORT", "29500")
    for name, value in (("SUBMITIT_EXECUTOR", "slurm"), ("SLURM_JOB_ID", "123"),
                        ("SLURM_NTASKS", "16"), ("SLURM_JOB_NUM_NODES", "2"),
                        ("SLURM_PROCID", "9"), ("SLURM_LOCALID", "1"),
                        ("SLURM_JOB_NODELIST", "gpu[1-2]")):
        monkeypatch.setenv(name, value)
    ranks = dist.from_env()
    assert (ranks.rank, ranks.world, ranks.local_rank, ranks.nodes) == (9, 16, 1, 2)
    assert dist.mesh_shape("auto", ranks) == (2, 8)


def test_a_degree_that_does_not_divide_the_ranks_is_one_line_before_any_work():
    eight = dist.Ranks(rank=0, world=8, nodes=2)
    with pytest.raises(ConfigError) as e:
        dist.mesh_shape(3, eight)
    assert str(e.value) == ("trainer.replicate=3: 3 replicas do not divide the 8 rank(s) (each "
                            "replica shards over world size / replicas ranks); use a divisor of "
                            "8, or trainer.replicate=auto (one replica per node)")
    with pytest.raises(ConfigError, match=r"^trainer.replicate=4: 4 replicas do not divide the 2 "):
        dist.check(8, False, CPU, dist.Ranks(rank=0, world=2), sharded=True, replicate=4)
    assert dist.check(8, False, CPU, dist.Ranks(rank=0, world=2), sharded=True, replicate=2) == 4


def test_replicate_on_one_rank_is_refused_in_the_jobs_record(tmp_path):
    """A sharded job on one rank with 2 replicas: one config error line, nothing trained."""
    with pytest.raises(SystemExit) as e:
        run_tiny(tmp_path, *FSDP, "trainer.replicate=2")
    assert e.value.code == 2
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["error"].startswith("config error: trainer.replicate=2: 2 replicas do not divide "
                                 "the 1 rank(s)")
    assert "metrics" not in s and "traceback" not in s


def test_replicate_is_a_sharded_jobs_choice():
    """trainer.replicate: auto by default (DDP too); a number only under trainer.strategy=fsdp, at
    least 1; each refusal one line."""
    assert validate(compose_config(*TINY)).trainer.replicate == "auto"
    assert validate(compose_config(*TINY, *FSDP, "trainer.replicate=2")).trainer.replicate == 2
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*TINY, "trainer.replicate=2"))
    assert str(e.value) == ("trainer.replicate=2: the replicate degree of FSDP's device mesh, only "
                            "for trainer.strategy=fsdp; DDP replicates over every rank (leave "
                            "trainer.replicate=auto)")
    with pytest.raises(ConfigError, match=r"^trainer.replicate=0: must be an integer >= 1$"):
        validate(compose_config(*TINY, *FSDP, "trainer.replicate=0"))


def _summary(mesh, world):
    return {"status": "completed", "config": {"precision": {"name": "fp32"}},
            "choices": {"precision": "fp32", "model": "gpt"},
            "metrics": {"train_time_s": 1.0},
            "distributed": {"strategy": "fsdp", "world_size": world, "param_dtype": "float32",
                            "reduce_dtype": "float32", "mesh": mesh,
                            "held_bytes": [{"params": 2**20, "grads": 2**20,
                                            "optimizer": 2**21}] * world}}


def test_the_sweep_tables_strategy_cell_shows_an_hsdp_mesh():
    """2 replicas of 4: "fsdp x8 hsdp 2x4"; a 1-D mesh (one replica) and a summary written before
    the mesh was recorded read as before."""
    hsdp = _summary({"replicate": 2, "shard": 4}, 8)
    assert sharded_cell(hsdp) == "fsdp x8 hsdp 2x4 float32/reduce float32"
    assert sharded_cell(_summary({"replicate": 1, "shard": 8}, 8)) == \
        "fsdp x8 float32/reduce float32"
    assert sharded_cell(_summary(None, 8)) == "fsdp x8 float32/reduce float32"
    assert "fsdp x8 hsdp 2x4 float32/reduce float32" in format_table(sweep_rows([hsdp]))


# ---- 2 spawned gloo ranks (tests/helpers/fsdp_ranks.py's checks_on_rank: conftest.py's ranks_ran)


@pytest.mark.slow   # reads the session's spawn of 2 gloo ranks (ranks_ran: about 25 s)
def test_hsdp_replicas_hold_whole_copies_that_stay_equal(ranks_ran):
    """Mesh (2, 1) on 2 ranks: each parameter is a DTensor (Replicate(), Shard(0)) whose local part
    is the whole tensor, so each rank holds one process's bytes of parameters, gradients and AdamW
    state; after a step on different batches the replicas are equal (the gradients all-reduced
    across replicas), and the portable fp32 state dict is the whole weights."""
    n = sum(p.numel() for p in {id(p): p for p in GPT(64, 2, 2, 32, 16).parameters()}.values())
    for rank in (0, 1):
        seen = json.loads((ranks_ran / f"hsdp.{rank}").read_text())
        assert seen["mesh"] == [2, 1]
        assert seen["placements"] == ["Replicate()", "Shard(dim=0)"]
        assert seen["held"] == {"params": 4 * n, "grads": 4 * n, "optimizer": 2 * 4 * n}
        assert seen["spread"] == 0.0 and seen["full_ok"]
        norm, whole = seen["norm"]   # clip_grad_norm_'s global norm counts each element once
        assert norm == pytest.approx(whole, rel=1e-6)


@pytest.mark.slow   # reads the session's spawn of 2 gloo ranks (ranks_ran: about 25 s)
def test_hsdp_loss_scaling_fp8_scales_and_a_resume_across_meshes(ranks_ran):
    """On HSDP's mesh: an overflow only rank 1's gradient holds is skipped by both ranks
    (ShardedGradScaler all-reduces the found-inf flag over every rank); each float8 weight's scale,
    precomputed after the step, is 448 / amax of the whole weight; a checkpoint written on the 1-D
    mesh resumes on HSDP's, and one written on HSDP's resumes on the 1-D mesh, each with the same
    next losses, bit for bit."""
    for rank in (0, 1):
        seen = json.loads((ranks_ran / f"hsdp.{rank}").read_text())
        assert seen["amp"] == [[False, 1024.0], [True, 512.0], [False, 512.0]]
        assert len(seen["fp8"]) == 8 and all(seen["fp8"])
        straight, on_hsdp, back = seen["resume"]
        assert on_hsdp == straight and back == straight


# ---- torchrun (slow) ----

@pytest.mark.slow
def test_hsdp_on_two_ranks_equals_one_process_and_holds_whole_copies(tmp_path):
    """trainer.replicate=2 on 2 torchrun ranks: mesh (2, 1), each rank holds one process's bytes;
    the losses and final weights are the 1-D FSDP job's bit for bit (both sum the two ranks'
    gradients in one addition and halve them, exact in binary) and one process's within
    test_fsdp.py's bound for 2 ranks against one (1e-6: two half-batch means averaged against one
    mean; measured 6e-8 relative in the losses, 1.4e-7 in the weights); the sweep table shows the
    mesh."""
    two = job([*GPT_TINY, *SGD, *FSDP, "trainer.replicate=2"], tmp_path / "two", tmp_path)
    flat = job([*GPT_TINY, *SGD, *FSDP], tmp_path / "flat", tmp_path)
    assert flat["distributed"]["mesh"] == {"replicate": 1, "shard": 2}
    assert rows(tmp_path / "two") == rows(tmp_path / "flat")
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "flat"), atol=0)
    d = two["distributed"]
    assert (d["world_size"], d["mesh"]) == (2, {"replicate": 2, "shard": 1})
    solo = run_tiny(tmp_path / "solo", *SGD, *FSDP, base=GPT_TINY)
    assert solo["distributed"]["mesh"] == {"replicate": 1, "shard": 1}
    assert d["held_bytes"] == solo["distributed"]["held_bytes"] * 2
    one = run_tiny(tmp_path / "one", *SGD, base=GPT_TINY)
    assert one["status"] == "completed"
    assert rows(tmp_path / "two") == pytest.approx(rows(tmp_path / "one"), rel=1e-6, abs=0)
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "one"), atol=1e-6)
    assert "fsdp x2 hsdp 2x1 float32/reduce float32" in format_table(sweep_rows([two]))


def node(rank, port, args, cwd):
    """One of 2 simulated nodes: torchrun with one rank on this machine, static rendezvous."""
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MIXPREC_RUN_TIME", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
           "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
           str(ROOT / "train.py"), *args]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


@pytest.mark.slow
def test_two_simulated_nodes_replicate_across_them_by_default(tmp_path):
    """torchrun --nnodes=2 --nproc_per_node=1 twice on this machine (node ranks 0 and 1): each
    rank's LOCAL_WORLD_SIZE is 1 of WORLD_SIZE 2, so trainer.replicate=auto makes 2 replicas (one
    per node) of one shard each."""
    port, out = free_port(), tmp_path / "run"
    args = [*GPT_TINY, *SGD, *FSDP, "trainer.max_steps=2", f"hydra.run.dir={out}"]
    nodes = [node(rank, port, args, tmp_path) for rank in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    d = json.loads((out / "summary.json").read_text())["distributed"]
    assert (d["world_size"], d["mesh"]) == (2, {"replicate": 2, "shard": 1})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="HSDP over NCCL needs 2 GPUs")
def test_gpu_hsdp_on_two_nccl_ranks_equals_one_process(tmp_path):
    """HSDP's 2-D mesh on 2 GPUs (NCCL: the all-reduce across replicas, in reduce_dtype): the
    losses and weights of one process, each rank a whole copy."""
    gpu = [o for o in GPT_TINY if not o.startswith("trainer.device")]
    two = job([*gpu, *SGD, *FSDP, "trainer.replicate=2"], tmp_path / "two", tmp_path)
    d = two["distributed"]
    assert (d["backend"], d["mesh"]) == ("nccl", {"replicate": 2, "shard": 1})
    assert run_tiny(tmp_path / "one", *SGD, base=gpu)["status"] == "completed"
    assert rows(tmp_path / "two") == pytest.approx(rows(tmp_path / "one"), rel=1e-5, abs=0)
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "one"), atol=1e-5)
