"""DDP under torchrun (gloo, CPU) and sweeps through hydra-submitit-launcher's local executor: real
tiny jobs."""
import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import mixprec.job
from helpers import ROOT, TINY, run_tiny
from mixprec.train import checkpoint
from mixprec.runtime import dist
from mixprec.data import pipelines
from mixprec.config import ConfigError
from mixprec.train.loop import LoopState

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

# BatchNorm in eval mode: its statistics do not depend on how the global batch is split across ranks
# (SyncBatchNorm, trainer.sync_bn=true, is the GPU way), so 2 ranks must give what 1 process gives.
# Augmentation stays on.
SAME = [
    *TINY,
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.deterministic=true",
    "+model.bn_eval=true",
    "schedule=constant",
    "optimizer.lr=0.2",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Put on PYTHONPATH, this sitecustomize makes every rank log its destroy_process_group calls, and
# whether a process group was still alive when the process exited.
WATCH_DESTROY = """
import atexit, os
import torch.distributed as d
log = os.environ["MIXPREC_TEST_PG_LOG"] + "." + os.environ.get("RANK", "launcher")
real = d.destroy_process_group
def destroy(*args, **kwargs):
    open(log, "a").write("destroy\\n")
    return real(*args, **kwargs)
d.destroy_process_group = destroy
atexit.register(lambda: d.is_available() and d.is_initialized()
                and open(log, "a").write("alive at exit\\n"))
"""


def run(args, cwd, timeout=180, torchrun=True, watch_destroy=None):
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if watch_destroy is not None:   # a folder: its sitecustomize.py logs to watch_destroy/pg.<rank>
        (watch_destroy / "sitecustomize.py").write_text(WATCH_DESTROY)
        env.update(PYTHONPATH=os.pathsep.join([str(watch_destroy), env.get("PYTHONPATH", "")]),
                   MIXPREC_TEST_PG_LOG=str(watch_destroy / "pg"))
    env.pop("MIXPREC_RUN_TIME", None)
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
    ]
    return subprocess.run(
        [*(launcher if torchrun else [sys.executable]), str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def rows(job_dir, kind):
    return [
        r
        for r in map(json.loads, (job_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == kind
    ]


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    ddp = run([*SAME, "logger=wandb"], cwd=tmp_path, watch_destroy=tmp_path / "site")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    # the group train.py made (share_run_time) is destroyed once, at the job's end
    for rank in (0, 1):
        assert (tmp_path / "site" / f"pg.{rank}").read_text() == "destroy\n"
    runs = list((tmp_path / "outputs" / "runs").iterdir())
    # both ranks used rank 0's dir (MIXPREC_RUN_TIME)
    assert len(runs) == 1, runs
    job = runs[0]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert (
        summary["distributed"]["world_size"] == 2 and summary["distributed"]["per_rank_batch"] == 8
    )
    assert summary["distributed"]["backend"] == "gloo"
    # max |w_rank0 - w_rank1| over every weight
    assert summary["distributed"]["weight_spread"] == 0.0
    assert len(list((job / "wandb").glob("offline-run-*"))) == 1
    assert ddp.stdout.count("status      completed") == 1  # rank 0 alone reports

    one = run([*SAME, f"hydra.run.dir={tmp_path / 'single'}"], cwd=tmp_path, torchrun=False)
    assert one.returncode == 0, one.stderr[-3000:]
    single = tmp_path / "single"
    s1 = json.loads((single / "summary.json").read_text())
    assert summary["metrics"]["steps"] == s1["metrics"]["steps"] == 4
    for a, b in zip(rows(job, "train"), rows(single, "train"), strict=True):
        assert (
            a["step"] == b["step"]
            and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            and a["acc"] == b["acc"]
        )
    assert summary["metrics"]["final_test_loss"] == pytest.approx(
        s1["metrics"]["final_test_loss"], rel=1e-5
    )
    w_ddp, w_one = (torch.load(d / "model_fp32.pt", weights_only=True) for d in (job, single))
    assert set(w_ddp) == set(w_one)
    for k in w_one:
        torch.testing.assert_close(w_ddp[k], w_one[k], rtol=1e-5, atol=1e-6)
    # the weights moved: every conv/linear weight differs from the job's initial one (the same job
    # in this process, its model's state recorded when built)
    init = initial_weights(tmp_path / "init", monkeypatch, *SAME)
    # the same job: the same end
    w_here = torch.load(tmp_path / "init" / "model_fp32.pt", weights_only=True)
    for k in w_one:
        torch.testing.assert_close(w_here[k], w_one[k], rtol=1e-5, atol=1e-6)
    for k in (k for k in w_one if k.endswith("weight") and w_one[k].dim() > 1):
        assert (w_ddp[k] - init[k]).abs().max() > 1e-3, k


def initial_weights(run_dir, monkeypatch, *overrides):
    """The job's weights as built (before any step): the same job run in this process, its model
    recorded."""
    built = []
    build = mixprec.job.build_model

    def recording(cfg, n, **kw):
        model = build(cfg, n, **kw)
        built.append({k: v.clone() for k, v in model.state_dict().items()})
        return model

    monkeypatch.setattr(mixprec.job, "build_model", recording)
    run_tiny(run_dir, *overrides, base=[])
    return built[0]


OFFSETS = (0.0, 0.5, 3.0)


def _spreads_on_rank(rank, port, out):
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    values = []
    for offset in OFFSETS:  # rank 1's second weight is `offset` higher, its third offset/2 lower
        params = [
            torch.tensor([1.0, 2.0 + rank * offset]),
            torch.tensor([[3.0 - rank * offset / 2]]),
        ]
        values.append(dist.spread(params, dist.Ranks(rank=rank, world=2)))
    torch.distributed.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(values))


def test_weight_spread_is_the_largest_difference_between_ranks(tmp_path):
    """What a DDP job records as `weight_spread` (0.0: both ranks hold identical weights), on two
    real gloo ranks whose weights differ by known amounts."""
    out = tmp_path / "spreads.json"
    torch.multiprocessing.start_processes(
        _spreads_on_rank, args=(free_port(), out), nprocs=2, start_method="fork"
    )
    assert json.loads(out.read_text()) == list(OFFSETS)


def _draws() -> list:
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


def _rng_round_trip_on_rank(rank, port, folder):
    """Seed this rank apart, checkpoint, scramble every RNG, restore: what it draws next, before and
    after."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    saver = checkpoint.Checkpointer(folder, meta={}, ranks=dist.Ranks(rank=rank, world=2))
    seed = lambda s: (random.seed(s), np.random.seed(s), torch.manual_seed(s))   # noqa: E731
    seed(100 + rank)
    fresh = _draws()
    seed(100 + rank)
    saver.save(LoopState())      # every rank calls it (a collective); rank 0 writes the file
    torch.distributed.barrier()
    seed(7)
    saver.restore(torch.load(folder / checkpoint.CHECKPOINT, weights_only=True), LoopState())
    (folder / f"draws.{rank}").write_text(json.dumps({"fresh": fresh, "restored": _draws()}))
    torch.distributed.destroy_process_group()


def test_each_rank_resumes_its_own_rng_states(tmp_path):
    """Two gloo ranks seeded apart: the checkpoint holds one RNG state per rank and each rank
    restores its own (it draws what it drew fresh from its seed, not rank 0's numbers); a job with
    another number of ranks is refused."""
    torch.multiprocessing.start_processes(
        _rng_round_trip_on_rank, args=(free_port(), tmp_path), nprocs=2, start_method="fork"
    )
    draws = [json.loads((tmp_path / f"draws.{rank}").read_text()) for rank in (0, 1)]
    assert draws[0]["fresh"] != draws[1]["fresh"]
    for d in draws:
        assert d["restored"] == d["fresh"]
    ckpt = torch.load(tmp_path / checkpoint.CHECKPOINT, weights_only=True)
    assert len(ckpt["rng"]) == 2
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"written by 2 rank\(s\), this job has 1; resume with as many",
    ):
        checkpoint.Checkpointer(tmp_path, meta={}).restore(ckpt, LoopState())


@pytest.mark.slow
def test_bad_override_under_torchrun_is_one_line(tmp_path):
    r = run(
        [*TINY, "trainer.batch_size=0", f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode != 0
    out = r.stdout + r.stderr
    line = "mixprec: config error: trainer.batch_size=0: must be an integer >= 1"
    # rank 0 says it; rank 1 exits quietly
    assert out.count(line) == 1, out[-3000:]
    assert "mixprec/" not in out and "train.py\", line" not in out   # no traceback from any rank
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_ghost_splits_that_do_not_divide_a_ranks_batch_are_one_line_before_any_work(tmp_path):
    """16 splits divide the global batch of 16 (config.py's check passes) but not each rank's 8."""
    small = [o for o in TINY if not o.startswith("model")]
    small += ["model=resnet9", "model.channels=[8,16,32,64]", "trick.ghost_bn=true"]
    r = run([*small, f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path, timeout=120)
    assert r.returncode != 0, r.stderr[-3000:]   # torchrun exits 1 when a rank fails
    out = r.stdout + r.stderr
    line = ("mixprec: config error: trick.ghost_splits=16: must divide each rank's batch, "
            "trainer.batch_size=16 / 2 ranks = 8")
    assert out.count(line) == 1, out[-3000:]   # rank 0 says it; rank 1 exits quietly
    assert "mixprec/" not in out and "train.py\", line" not in out   # no traceback from any rank
    assert not (tmp_path / "job" / "metrics.jsonl").exists()   # no step ran
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["status"] == "failed"


def test_a_failed_ranks_error_is_said_by_rank_0_or_by_itself():
    store = torch.distributed.HashStore()
    other = dist.Ranks(rank=1, world=2)
    # rank 0 did not fail: rank 1 says its own error
    assert dist.error_said(other, store, wait_s=0.2) is False
    assert dist.error_said(dist.Ranks(rank=0, world=2), store) is True
    # rank 0 said it: rank 1 exits quietly
    assert dist.error_said(other, store, wait_s=0.2) is True
    # no process group
    assert dist.error_said(dist.SINGLE) is True and dist.error_said(other) is False


def test_ranks_checks():
    ranks = dist.Ranks(rank=1, world=2)
    assert dist.check(16, False, torch.device("cpu"), ranks) == 8
    with pytest.raises(
        ConfigError, match="trainer.batch_size=15: the global batch must divide by the 2 ranks"
    ):
        dist.check(15, False, torch.device("cpu"), ranks)
    with pytest.raises(ConfigError, match="trainer.sync_bn=true: SyncBatchNorm runs on GPUs only"):
        dist.check(16, True, torch.device("cpu"), ranks)
    assert dist.check(32, False, torch.device("cpu"), ranks, ghost_splits=16) == 16
    with pytest.raises(ConfigError, match=r"trick.ghost_splits=16: must divide each rank's batch, "
                                          r"trainer.batch_size=16 / 2 ranks = 8 "):
        dist.check(16, False, torch.device("cpu"), ranks, ghost_splits=16)
    # rank 1's slices of a global batch: its samples and its share of the random draws
    assert pipelines.shard_of(torch.arange(16), (1, 2)).tolist() == list(range(8, 16))
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    mean, std = pipelines.norm_tensors((0.5,) * 3, (0.25,) * 3, torch.device("cpu"))
    whole = pipelines.prepare(images, mean, std, pad=2, flip=True, cutout=3, generator=gen())
    half = pipelines.prepare(
        images[8:], mean, std, pad=2, flip=True, cutout=3, generator=gen(), shard=(1, 2)
    )
    assert torch.equal(whole[8:], half)


@pytest.mark.slow
def test_submitit_local_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    r = run(
        [
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=5",
            *TINY,
            "precision=fp32,tf32",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        timeout=240,
        torchrun=False,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 2
    assert {json.loads(p.read_text())["status"] for p in summaries} == {"completed"}
    assert f"sweep {sweep}: 2 jobs" in r.stdout
    table = r.stdout.split(f"sweep {sweep}: 2 jobs")[1]
    assert "fp32" in table and "tf32" in table and table.count("completed") == 2
    assert (sweep / "report" / "report.md").exists()
    assert list(sweep.glob(".submitit/*/*_0_log.out"))   # the jobs ran through submitit
