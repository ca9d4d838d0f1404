"""A sharded job's checkpoints (train/checkpoint.py through torch.distributed.checkpoint): every
rank writes its shards of the model and optimizer, a resume continues exactly, SIGTERM ends the job
`interrupted` with a whole checkpoint, a resume on another world size is one line, and the final
fp32 weights load into the unsharded model in a plain process."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp

from helpers import ROOT, TINY, compose_config
from helpers.checkpoint_ranks import _step
from helpers.configs import GPT_TINY
from helpers.distributed import free_port, job, rows, torchrun, weights
from helpers.fakes import on_threads
from mixprec.config import PrecisionConfig, plain_config, validate
from mixprec.models.gpt import GPT
from mixprec.precision.fsdp import ShardedPolicy, after_steps
from mixprec.train import checkpoint, parallel
from mixprec.train.loop import LoopState


@pytest.mark.slow   # reads the session's spawn of 2 gloo ranks (ranks_ran: about 25 s)
def test_two_gloo_ranks_that_see_different_checkpoints_fail_alike(ranks_ran):
    """The agreement above between 2 real gloo ranks (the session's spawn): rank 1 without the
    checkpoint, then with a shards folder that lacks rank 0's file; both ranks raise the line."""
    name = torch.load(ranks_ran / checkpoint.CHECKPOINT, weights_only=True)["shards"]
    step = torch.load(ranks_ran / checkpoint.CHECKPOINT, weights_only=True)["loop"]["step"]
    seen0 = f"rank 0: checkpoint.pt of step {step} and {name}/"
    for rank, node in ((0, ranks_ran), (1, ranks_ran / "node1")):
        first, second = json.loads((ranks_ran / f"unshared.{rank}").read_text())
        path = node / "checkpoint.pt"
        assert first == unshared_line(path, f"{seen0}; rank 1: no checkpoint.pt", name)
        assert second == unshared_line(path, f"{seen0}; rank 1: checkpoint.pt of step {step} "
                                       f"({name}/__0_0.distcp missing)", name)


@pytest.mark.slow   # reads the session's spawn of 2 gloo ranks (ranks_ran: about 25 s)
def test_sharded_checkpoint_every_rank_its_shards_and_an_exact_resume(ranks_ran):
    """2 ranks: checkpoint.pt holds the loop's plain state and names a folder of DCP shards (one
    file per rank, the optimizer's moments included), and a model restored from it takes the same
    steps, bit for bit, as the one that went on."""
    ckpt = torch.load(ranks_ran / checkpoint.CHECKPOINT, weights_only=True)
    assert "model" not in ckpt["parts"] and "optimizer" not in ckpt["parts"]
    folder = ranks_ran / ckpt["shards"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp",
                                                        "__1_0.distcp"]
    assert [p.name for p in ranks_ran.glob(checkpoint.SHARDS + "*")] == [folder.name]
    for rank in (0, 1):
        straight, resumed, same = json.loads((ranks_ran / f"resume.{rank}").read_text())
        assert resumed == straight and same


FP8 = PrecisionConfig(name="fp8", autocast_dtype="bfloat16", fp8_recipe="tensorwise")


def _fp8_gpt(seed):
    """The fp8 GPT sharded as the job builds it (policy, shard, optimizer, scales' step hook)."""
    torch.manual_seed(seed)
    policy = ShardedPolicy(FP8, torch.device("cpu"))
    model = parallel.shard(policy.prepare_model(GPT(64, 2, 2, 32, 16)), FP8, torch.device("cpu"))
    optimizer = torch.optim.AdamW(policy.optimizer_params(model), lr=1e-2)
    after_steps(model, optimizer, policy.fp8)
    return model, optimizer


def test_a_resumed_fp8_all_gather_casts_with_the_loaded_weights_scales(tmp_path):
    """FP8 all-gather (one FSDP rank): the float8 weights' scales are precomputed after each step
    and are no part of any state dict, so a resume computes them from the loaded weights; a model
    built from another seed and restored takes the next steps with the losses of the one that went
    on."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        meta = {"config": {}, "device_type": "cpu"}
        model, optimizer = _fp8_gpt(0)
        saver = checkpoint.Checkpointer(tmp_path, meta, sharded=True)
        saver.parts.update(model=model, optimizer=optimizer)
        for seed in (1, 2):
            _step(model, optimizer, seed)
        saver.save(LoopState())
        straight = [_step(model, optimizer, seed) for seed in (3, 4)]
        model, optimizer = _fp8_gpt(1)
        saver = checkpoint.Checkpointer(tmp_path, meta, sharded=True)
        saver.parts.update(model=model, optimizer=optimizer)
        saver.restore(checkpoint.read(tmp_path, {}, "cpu"), LoopState())
        assert [_step(model, optimizer, seed) for seed in (3, 4)] == straight
    finally:
        tdist.destroy_process_group()


def test_a_resume_with_another_world_size_is_one_line(tmp_path):
    """A checkpoint of 2 ranks read by a job of 1: one line naming both sizes and what to do."""
    two = SimpleNamespace(main=True, rank=0, world=2, gather=lambda obj: [obj, obj])
    saver = checkpoint.Checkpointer(tmp_path, {"config": {}, "device_type": "cpu"}, ranks=two)
    saver.save(LoopState())
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.read(tmp_path, {}, "cpu", world=1)
    assert str(e.value) == (f"{tmp_path / 'checkpoint.pt'}: written by 2 rank(s), this job has 1; "
                            "resume with as many ranks (torchrun --nproc_per_node=2), or delete it "
                            "to start over")
    assert checkpoint.read(tmp_path, {}, "cpu", world=2)["loop"]["step"] == 0


def _checkpoint_in(folder, config: dict) -> str:
    """A 2-rank checkpoint.pt of `config` in `folder`, as rank 0 writes it, naming a folder of DCP
    shards (one process's: .metadata and __0_0.distcp); the folder's name."""
    two = SimpleNamespace(main=True, rank=0, world=2, gather=lambda obj: [obj, obj])
    checkpoint.Checkpointer(folder, {"config": config, "device_type": "cpu"},
                            ranks=two).save(LoopState())
    ckpt = torch.load(folder / checkpoint.CHECKPOINT, weights_only=True)
    ckpt["shards"] = name = checkpoint.SHARDS + "0.1"
    torch.save(ckpt, folder / checkpoint.CHECKPOINT)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=folder / name, no_dist=True)
    return name


def unshared_line(path, saw: str, name: str) -> str:
    return (f"{path}: the ranks do not see the same checkpoint ({saw}); every rank reads it: put "
            "the job dir on a file system that every node shares, or copy checkpoint.pt and "
            f"{name}/ into each node's job dir (or delete them on every node to start over)")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # dcp.save, no_dist
def test_ranks_that_do_not_see_the_same_checkpoint_fail_alike_in_one_line(tmp_path):
    """trainer.resume=auto on 2 ranks (threads whose collectives meet, tests/helpers/fakes.py), each
    with its own job dir (nodes without a shared file system): where rank 1 sees no checkpoint, or
    its shards folder lacks a file, every rank fails in the same one line naming what each rank
    saw and what to do, before any load (rank 0 would load while rank 1 started over, and the
    first collective would pair different calls); a job dir both ranks see resumes on both."""
    cfg = compose_config(*TINY, "trainer.resume=auto")
    plain = plain_config(cfg)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node1.mkdir()
    name = _checkpoint_in(node0, plain)

    def opened(dirs):
        # what train_and_record reads and agrees before any work (mixprec.job)
        return on_threads(lambda ranks: checkpoint.read_agreed(dirs[ranks.rank], plain, "cpu",
                                                               ranks))
    seen0 = f"checkpoint.pt of step 0 and {name}/"
    errors = opened([node0, node1])
    for rank, node in enumerate((node0, node1)):
        assert isinstance(errors[rank], checkpoint.CheckpointError), errors
        assert str(errors[rank]) == unshared_line(
            node / "checkpoint.pt", f"rank 0: {seen0}; rank 1: no checkpoint.pt", name)
    shutil.copy(node0 / checkpoint.CHECKPOINT, node1)
    (node1 / name).mkdir()
    shutil.copy(node0 / name / ".metadata", node1 / name)
    errors = opened([node0, node1])
    assert str(errors[1]) == unshared_line(
        node1 / "checkpoint.pt", f"rank 0: {seen0}; rank 1: checkpoint.pt of step 0 "
        f"({name}/__0_0.distcp missing)", name)
    both = opened([node0, node0])
    assert [r["shards"] for r in both] == [name, name], both


def test_rank_lists_are_short():
    assert checkpoint.rank_list([3]) == "rank 3"
    assert checkpoint.rank_list([0, 2]) == "ranks 0, 2"
    assert checkpoint.rank_list([0, 1, 2, 3, 5, 6]) == "ranks 0-3, 5, 6"


def test_resume_auto_is_a_sharded_jobs_choice():
    config = validate(compose_config(*TINY, "trainer.strategy=fsdp", "trainer.resume=auto"))
    assert config.trainer.resume == "auto"


# 2 epochs of about 60 steps each, a row per step: a signal lands mid-epoch 2
LONG = [*[o for o in GPT_TINY if not o.startswith(("trainer.max_steps", "trainer.epochs",
                                                    "trainer.log_every", "dataset.train_size"))],
        "dataset.train_size=8000", "trainer.epochs=2", "trainer.log_every=1", "optimizer=adamw",
        "optimizer.lr=3e-3", "precision=amp_bf16", "trainer.strategy=fsdp"]


def _signal_in_epoch_2(args, out, cwd, run_dir=None):
    """torchrun a 2-rank job, SIGTERM it (torchrun forwards it to both ranks) once it has logged a
    training row of epoch 2, and wait for it to end; its return code. run_dir: hydra.run.dir when
    it is not `out` (rank 0's job dir)."""
    env_args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                f"--master_port={free_port()}", str(ROOT / "train.py"), *args,
                f"hydra.run.dir={run_dir or out}"]
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    p = subprocess.Popen(env_args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not any(r["epoch"] == 2 for r in _train_rows(out)):
        assert p.poll() is None, p.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    return p.returncode


def _train_rows(out):
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [r for r in map(json.loads, lines[:-1]) if r["kind"] == "train"]


@pytest.mark.slow
def test_sigterm_to_a_sharded_job_and_an_exact_resume(tmp_path):
    """The bf16 GPT on 2 FSDP ranks: SIGTERM mid-epoch 2 ends it `interrupted` with a checkpoint
    whose shards are whole (DCP's metadata and one file per rank); trainer.resume=auto continues
    it, and its losses and final weights are the uninterrupted job's bit for bit; the final fp32
    weights load into the unsharded GPT in a plain process (evaluate.py's loader)."""
    straight = job(LONG, tmp_path / "straight", tmp_path)
    out = tmp_path / "cut"
    _signal_in_epoch_2(LONG, out, tmp_path)
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted_by"] == "SIGTERM", s.get("error")
    ckpt = torch.load(out / checkpoint.CHECKPOINT, weights_only=True)
    assert ckpt["loop"]["epoch"] == 1 and ckpt["loop"]["batch"] > 0   # mid-epoch 2
    assert {p.name for p in (out / ckpt["shards"]).iterdir()} == {".metadata", "__0_0.distcp",
                                                                 "__1_0.distcp"}
    resumed = job([*LONG, "trainer.resume=auto"], out, tmp_path)
    assert resumed["resumed"]["from_step"] == ckpt["loop"]["step"]
    assert rows(out) == rows(tmp_path / "straight")
    assert resumed["metrics"]["final_valid_loss"] == straight["metrics"]["final_valid_loss"]
    a, b = weights(out), weights(tmp_path / "straight")
    assert all(torch.equal(a[k], b[k]) for k in b) and set(a) == set(b)
    assert not list(out.glob(checkpoint.SHARDS + "*")) and not (out / "checkpoint.pt").exists()
    model, config = checkpoint.load_fp32_model(out)
    assert config.trainer.strategy == "fsdp" and not any(
        type(p).__name__ == "DTensor" for p in model.parameters())
    assert all(torch.equal(v, b[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_a_sharded_resume_on_another_world_size_is_refused_in_one_line(tmp_path):
    """A 2-rank job's checkpoint resumed by one process: refused in one line before any work,
    the interrupted job's summary left as it was (it still says how to continue)."""
    out = tmp_path / "cut"
    _signal_in_epoch_2(LONG, out, tmp_path)
    before = (out / "summary.json").read_bytes()
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *LONG, "trainer.resume=auto",
                        f"hydra.run.dir={out}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    line = (f"mixprec: {out / 'checkpoint.pt'}: written by 2 rank(s), this job has 1; resume "
            "with as many ranks (torchrun --nproc_per_node=2), or delete it to start over")
    assert r.returncode == 2 and r.stderr.count(line) == 1, r.stderr[-2000:]
    assert (out / "summary.json").read_bytes() == before
    assert json.loads(before)["status"] == "interrupted"


@pytest.mark.slow
def test_a_sharded_resume_whose_ranks_have_their_own_job_dirs_fails_in_one_line(tmp_path):
    """torchrun with each rank's job dir its own (hydra.run.dir ends in LOCAL_RANK: nodes without a
    shared file system, on one machine). SIGTERM leaves checkpoint.pt and DCP's metadata in rank
    0's dir and rank 1's shard file in rank 1's; trainer.resume=auto then ends both ranks in one
    line, said once by rank 0, instead of rank 0 waiting in the collective load for rank 1."""
    own = f"{tmp_path / 'node'}${{oc.env:LOCAL_RANK}}"
    node0 = tmp_path / "node0"
    _signal_in_epoch_2(LONG, node0, tmp_path, run_dir=own)
    ckpt = torch.load(node0 / checkpoint.CHECKPOINT, weights_only=True)
    name, step = ckpt["shards"], ckpt["loop"]["step"]
    assert (tmp_path / "node1" / name / "__1_0.distcp").exists()
    r = torchrun([*LONG, "trainer.resume=auto", f"hydra.run.dir={own}"], tmp_path, timeout=180)
    line = unshared_line(node0 / "checkpoint.pt", f"rank 0: checkpoint.pt of step {step} "
                         f"({name}/__1_0.distcp missing); rank 1: no checkpoint.pt", name)
    # refused before any work: the interrupted job's summary stays, with the way to continue it
    s = json.loads((node0 / "summary.json").read_text())
    assert r.returncode != 0 and s["status"] == "interrupted"
    assert r.stderr.count(f"mixprec: {line}") == 1, r.stderr[-3000:]
    assert "[rank 1]" not in r.stderr   # rank 1 ends with rank 0's line, saying nothing of its own


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across 2 GPUs needs 2 GPUs")
def test_gpu_two_nccl_ranks_sharded_resume_is_exact(tmp_path):
    """The CPU test's resume on 2 GPUs (NCCL, deterministic): SIGTERM mid-epoch 2, resume, the
    uninterrupted job's losses and weights bit for bit."""
    gpu = [o for o in LONG if not o.startswith("trainer.device")]
    straight = job(gpu, tmp_path / "straight", tmp_path)
    assert straight["distributed"]["backend"] == "nccl"
    out = tmp_path / "cut"
    _signal_in_epoch_2(gpu, out, tmp_path)
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"
    job([*gpu, "trainer.resume=auto"], out, tmp_path)
    assert rows(out) == rows(tmp_path / "straight")
    a, b = weights(out), weights(tmp_path / "straight")
    assert all(torch.equal(a[k], b[k]) for k in b)
