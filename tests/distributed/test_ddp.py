"""DDP under torchrun (gloo, CPU) and sweeps through hydra-submitit-launcher's local executor: real
tiny jobs."""
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import mixprec.job
import mixprec.train.parts
from helpers import ROOT, TINY, run_tiny
from mixprec.train import checkpoint
from mixprec.runtime import dist
from mixprec.data import pipelines
from mixprec.config import ConfigError
from mixprec.train.loop import LoopState
from torch.optim.optimizer import register_optimizer_step_post_hook

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
    build = mixprec.train.parts.build_model

    def recording(cfg, n, **kw):
        model = build(cfg, n, **kw)
        built.append({k: v.clone() for k, v in model.state_dict().items()})
        return model

    monkeypatch.setattr(mixprec.train.parts, "build_model", recording)
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


# A job of 2 gloo ranks in forked processes, each running mixprec.job.run_job as a torchrun rank
# would (its variables set); a global optimizer-step hook acts on one rank at one step: it raises
# (a failure of that rank alone) or signals its own process (a SIGTERM to one rank).
RANKED = [*TINY, "trainer.max_steps=8", "trainer.log_every=2"]


class ActAtStep:
    """A global optimizer-step hook: at rank act_rank's second optimizer step, `act` (raise, or
    SIGTERM its own process)."""

    def __init__(self, rank, act_rank, act):
        self.rank, self.act_rank, self.act, self.calls = rank, act_rank, act, 0

    def __call__(self, optimizer, args, kwargs):
        self.calls += 1
        if self.rank == self.act_rank and self.calls == 2:
            if self.act == "raise":
                raise ValueError(f"injected failure on rank {self.rank}")
            os.kill(os.getpid(), signal.SIGTERM)


def _jobs_on_rank(rank, port, out, jobs, act_rank, act, own_dirs):
    """Rank `rank` of 2 runs `jobs` (each a list of overrides) in turn as one sweep's jobs (a
    process that returns from a job goes on to the next, as Hydra's sweep does); what it returned
    is noted in out/returned.<rank>. own_dirs: each rank's job dir its own, <job>/rank<rank> (nodes
    without a shared file system)."""
    from helpers import compose_config
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    register_optimizer_step_post_hook(ActAtStep(rank, act_rank, act))
    for num, overrides in enumerate(jobs):
        job_dir = out / f"{num}_job" / (f"rank{rank}" if own_dirs else "")
        cfg = compose_config(*overrides, output_dir=job_dir)
        if len(jobs) > 1:
            with open_dict(cfg):
                cfg.hydra.mode, cfg.hydra.sweep.dir, cfg.hydra.job.num = RunMode.MULTIRUN, out, num
        HydraConfig.instance().set_config(cfg)
        status = mixprec.job.run_job(cfg)["status"]
        with open(out / f"returned.{rank}", "a") as f:
            f.write(f"{num} {status}\n")


def on_two_ranks(out, jobs, act_rank=None, act=None, own_dirs=False, timeout=90) -> list:
    """Run _jobs_on_rank on 2 forked ranks; their exit codes (None: still running at `timeout`,
    then killed)."""
    ctx = torch.multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_jobs_on_rank,
                         args=(rank, port, out, jobs, act_rank, act, own_dirs))
             for rank in (0, 1)]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(end - time.monotonic(), 0.1))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    return codes


def test_a_failure_on_one_rank_ends_every_ranks_sweep_at_once(tmp_path):
    """Job 0 of a 2-job sweep fails on rank 1 alone, at its second step, while rank 0 waits for it
    in the next collective: both ranks end their sweep at once with exit status 1 (rank 1 used to
    go on to job 1 and rank 0 to wait there until the 10-minute timeout); the summary names
    rank 1 and its error; job 1 never starts."""
    start = time.monotonic()
    codes = on_two_ranks(tmp_path, [RANKED, [*RANKED, "seed=1"]], act_rank=1, act="raise")
    assert codes == [1, 1], codes
    assert time.monotonic() - start < 60
    s = json.loads((tmp_path / "0_job" / "summary.json").read_text())
    assert s["status"] == "failed" and s["failed_rank"] == 1, s.get("error")
    assert s["error"] == "rank 1: ValueError: injected failure on rank 1"
    assert not (tmp_path / "1_job").exists()
    assert not list(tmp_path.glob("returned.*"))   # no rank went on with the sweep


def test_a_completed_job_seen_by_one_rank_only_ends_both_in_one_line(tmp_path, capfd):
    """trainer.resume=auto where rank 0's job dir holds a completed job and rank 1's (its node's
    own disk) none: the ranks agree on what they saw before acting, and both end in one line,
    exit status 2 (rank 0 used to skip the job while rank 1 trained it, waiting for rank 0 in its
    first collective); nothing trained."""
    rank0 = tmp_path / "0_job" / "rank0"
    rank0.mkdir(parents=True)
    (rank0 / "summary.json").write_text('{"status": "completed"}')
    codes = on_two_ranks(tmp_path, [[*RANKED, "trainer.resume=auto"]], own_dirs=True)
    assert codes == [2, 2], codes
    line = (f"mixprec: {rank0 / 'summary.json'}: the ranks do not see the same job (rank 0: a "
            "completed job; rank 1: no finished job); under trainer.resume=auto every rank reads "
            "the job dir")
    err = capfd.readouterr().err
    assert err.count(line) == 1, err[-3000:]
    assert (rank0 / "summary.json").read_text() == '{"status": "completed"}'
    assert not list(tmp_path.rglob("metrics.jsonl"))


# Put on PYTHONPATH: rank 1 of a torchrun job raises at its second optimizer step.
FAIL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    import torch.optim.optimizer as o
    calls = []
    def hook(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("injected failure on rank 1")
    o.register_optimizer_step_post_hook(hook)
"""


def failing_torchrun_sweep(tmp_path, overrides: list[str]):
    """A 2-job torchrun sweep whose job 0 fails on rank 1 alone: (the process, its seconds, the
    sweep dir)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAIL_ON_RANK_1)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    env.pop("MIXPREC_RUN_TIME", None)
    sweep = tmp_path / "sweep"
    start = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", str(ROOT / "train.py"), "-m", *overrides,
                          "seed=0,1", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:   # the ranks left waiting (before: until gloo's timeout)
        os.killpg(p.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - start
    return subprocess.CompletedProcess(p.args, p.returncode, "", err), seconds, sweep


@pytest.mark.slow
def test_a_failure_on_one_rank_ends_a_torchrun_sweep_at_once(tmp_path):
    """The quick forked test above under torchrun: job 0 of a 2-job sweep fails on rank 1 alone;
    torchrun stops rank 0 (SIGTERM, not taken for the user's stop), the sweep ends at once (not at
    the 10-minute timeout), job 0's summary names rank 1 and its error, job 1 never starts."""
    r, seconds, sweep = failing_torchrun_sweep(tmp_path, RANKED)
    assert r.returncode == 1 and seconds < 120, r.stderr[-3000:]
    summaries = list(sweep.glob("*/summary.json"))
    assert len(summaries) == 1, summaries   # job 1 never started
    s = json.loads(summaries[0].read_text())
    assert s["status"] == "failed" and s["failed_rank"] == 1, s.get("error")
    assert s["error"] == "rank 1: ValueError: injected failure on rank 1"
    assert r.stderr.count("mixprec: the job failed: rank 1: ValueError: injected failure") == 1, (
        r.stderr[-3000:])


@pytest.mark.gpu
def test_gpu_a_failure_on_one_rank_ends_an_nccl_torchrun_sweep_at_once(tmp_path):
    """The NCCL twin of the test above, on 2 GPUs: the ranks waiting for the failed one sit in a
    CUDA synchronisation no Python handler interrupts, and the failing rank aborts its NCCL group
    (dist.abort): the sweep must still end well before NCCL's 10-minute timeout, job 1 never
    started. The summary's failed_rank is not asserted: torchrun may kill rank 0 before it writes
    it (docs/ddp_slurm.md)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL across 2 GPUs needs 2 GPUs")
    on_gpus = [o for o in RANKED if not o.startswith("trainer.device")] + ["trainer.device=cuda"]
    r, seconds, sweep = failing_torchrun_sweep(tmp_path, on_gpus)
    assert r.returncode != 0 and seconds < 150, r.stderr[-3000:]
    assert len(list(sweep.glob("*/summary.json"))) == 1, r.stderr[-3000:]


def test_a_signal_to_one_rank_ends_every_rank_with_its_exit_status(tmp_path, capfd):
    """The quick twin of the slow test below: a SIGTERM to rank 0 alone stops both ranks after the
    same step, and both exit with 143 (128 + SIGTERM: rank 1 used to exit 1), through the same
    end of the process group as a completed job; the summary says interrupted, and rank 0 gives
    the command that continues it, once."""
    codes = on_two_ranks(tmp_path, [RANKED], act_rank=0, act="signal")
    assert codes == [143, 143], codes
    s = json.loads((tmp_path / "0_job" / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted_by"] == "SIGTERM", s.get("error")
    err = capfd.readouterr().err
    assert err.count("checkpoint saved. To continue: python train.py") == 1, err[-3000:]


# about 64 steps an epoch on 2 ranks: a job still training when its first rows are logged
LASTING = [*TINY, "dataset.train_size=1024", "trainer.max_steps=null", "trainer.epochs=2",
           "trainer.log_every=4"]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def signal_ranks_once_training(job_dir, cwd):
    """A 2-rank torchrun job, every rank sent SIGTERM once it has logged a training row (as
    Slurm's scancel signals every task); torchrun's exit status, the ranks' exit codes its
    report gives, its stderr."""
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MIXPREC_RUN_TIME", None)
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", str(ROOT / "train.py"), *LASTING,
                          f"hydra.run.dir={job_dir}"],
                         cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (job_dir / "metrics.jsonl").exists() or '"train"' not in (
            job_dir / "metrics.jsonl").read_text():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.05)
    for rank in children(p.pid):
        os.kill(rank, signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    return p.returncode, [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", err)], err


@pytest.mark.slow
def test_a_signalled_two_rank_job_exits_with_the_same_code_20_times(tmp_path):
    """SIGTERM to both ranks of a torchrun job, 20 times: each time every rank torchrun reports
    exited 143 (128 + SIGTERM; no rank aborted in gloo's teardown, none killed by torchrun as it
    ended), the job is interrupted with its checkpoint, and the command that continues it is
    said once. (test_a_signal_to_one_rank_ends_every_rank_with_its_exit_status is the quick
    twin.)"""
    for attempt in range(20):
        job_dir = tmp_path / f"job{attempt}"
        rc, codes, err = signal_ranks_once_training(job_dir, tmp_path)
        assert rc == 1 and codes and set(codes) == {143}, (attempt, codes, err[-3000:])
        s = json.loads((job_dir / "summary.json").read_text())
        assert s["status"] == "interrupted" and s["interrupted_by"] == "SIGTERM", attempt
        assert (job_dir / "checkpoint.pt").exists()
        assert err.count("checkpoint saved. To continue: python train.py") == 1, err[-3000:]


def test_a_dataloader_pipeline_on_two_ranks_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                        capsys):
    """Rank 0 of 2 (torchrun's variables, no rendezvous: nothing may need one) with
    dataset.pipeline=dataloader, in the dir of an interrupted job: one line, exit status 2, before
    the process group, the summary block or any work; the interrupted job's records stay."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    records = {"summary.json": '{"status": "interrupted"}', "checkpoint.pt": "its state"}
    for name, text in records.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        run_tiny(tmp_path, "dataset.pipeline=dataloader")
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        "mixprec: config error: dataset.pipeline=dataloader: not sharded across ranks (DDP or "
        "FSDP); use dataset.pipeline=device"]
    assert "status" not in out
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()} == records


def test_the_first_rank_that_failed_is_agreed_through_the_store():
    """Rank 1 fails first and marks itself; rank 0, whose collective then ended in an error, learns
    that rank 1 failed first and with what; no process group: this rank and its own line."""
    store = torch.distributed.HashStore()
    assert dist.first_failure(dist.Ranks(rank=1, world=2), "ValueError: boom", store) == (
        1, "ValueError: boom")
    assert dist.first_failure(dist.Ranks(rank=0, world=2), "RuntimeError: closed", store) == (
        1, "ValueError: boom")
    assert dist.first_failure(dist.Ranks(rank=1, world=2), "x") == (1, "x")


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


def test_the_memory_ledger_under_ddp_counts_a_ranks_whole_replica(tmp_path):
    """DDP replicates: each rank holds the whole model, its gradients and Adam's state, so rank
    0's ledger (summary.json's memory) is the one-process count, 16 bytes a parameter for fp32
    Adam, while its activations are those of its own half of the global batch."""
    from helpers.configs import ADAM
    from helpers.expected import expected_state

    codes = on_two_ranks(tmp_path, [[*RANKED, *ADAM]])
    assert codes == [0, 0], codes
    mem = json.loads((tmp_path / "0_job" / "summary.json").read_text())["memory"]
    want = expected_state("fp32")
    for part in ("weights", "masters", "grads", "optimizer", "buffers"):
        assert mem["bytes"][part] == want[part], (part, mem["bytes"], want)
    assert mem["samples"] == 8 and mem["bytes"]["activations"] > 0   # 16 a step over 2 ranks
