"""Compiled jobs in one process (a Hydra sweep: the basic launcher runs its jobs one after another
in the same process) and stop signals during compilation: each job compiles its own graphs and runs
none of its calls eagerly, and a SIGTERM to the job's process group while it compiles ends it
`interrupted` and stops the sweep."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixprec.train import compile
from mixprec import job
from mixprec.train import parts
from helpers import ROOT, run_cli, run_tiny
from helpers.configs import GPT_JOB, SMALL
from mixprec.runtime import dist
from mixprec.records import SUMMARY

PRECISIONS = ["fp32", "tf32", "amp_bf16", "bf16", "amp", "half"]
# precision.emulate=false: native CPU fp16/bf16 kernels (emulated precisions run eagerly)
REPLACED = ("trainer.deterministic", "dataset.train_size", "dataset.test_size")
SWEEP = [o for o in SMALL if not o.startswith(REPLACED)] + [
    "trainer.max_steps=2", "dataset.train_size=64", "dataset.test_size=24",
    "trainer.compile=default", "precision.emulate=false"]


def eager_backend(monkeypatch) -> None:
    """trainer.compile through the real compile_model with dynamo's eager backend."""
    monkeypatch.setattr(parts, "compile_model",
                        lambda net, mode, **options: compile.compile_model(net, mode,
                                                                          backend="eager"))


def assert_compiled(s: dict) -> None:
    assert s["status"] == "completed", s.get("error")
    m = s["metrics"]
    assert m["compiled_graphs"] > 0 and m["eager_calls"] == 0, (s["choices"]["precision"], m)


@pytest.mark.slow
def test_each_job_of_a_compiled_sweep_compiles_its_own_graphs(tmp_path, monkeypatch):
    """The six precisions one after another in this process, as the sweep's jobs run (dynamo through
    the real compile_model with the eager backend: the same graphs and recompilations, without
    inductor's C++ compiles). Without a reset between jobs, each added its graphs to the earlier
    jobs' until dynamo's recompile limit (8), and from then on jobs ran eagerly while their summary
    said trainer.compile=default (from the 5th job with dynamic shapes, the 3rd with static
    ones)."""
    eager_backend(monkeypatch)
    for p in PRECISIONS:
        assert_compiled(run_tiny(tmp_path / p, f"precision={p}", base=SWEEP))


@pytest.mark.slow
def test_the_gpt_sweep_of_the_speed_check_compiles_fp8_too(tmp_path, monkeypatch):
    """scripts/gpu_speed.py's GPT sweep (fp32, amp_bf16, fp8) in one process: fp8 had run its
    evaluation eagerly."""
    eager_backend(monkeypatch)
    for p in ["fp32", "amp_bf16", "fp8"]:
        assert_compiled(run_tiny(tmp_path / p, f"precision={p}", "precision.emulate=false",
                                 "trainer.max_steps=8", "trainer.compile=default",
                                 "dataset.train_size=400", "dataset.test_size=100", base=GPT_JOB))


@pytest.mark.slow
def test_the_six_precision_compiled_sweep_compiles_every_job(tmp_path):
    """The issue's sweep itself, through train.py -m and CPU inductor: every job with graphs of its
    own, no call after its warm-up eager, and the sweep table without an eager note."""
    sweep = tmp_path / "sweep"
    r = run_cli("-m", *SWEEP, f"precision={','.join(PRECISIONS)}", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob(f"*/{SUMMARY}"))]
    assert sorted(s["choices"]["precision"] for s in summaries) == sorted(PRECISIONS)
    for s in summaries:
        assert_compiled(s)
    assert "eager calls" not in r.stdout and "ran eagerly" not in r.stderr


def test_reset_compile_state_forgets_the_earlier_graphs():
    """After the reset, a module compiled again compiles anew (dynamo's caches are empty), and the
    call count of the graph counter goes on (a job's count is a difference)."""
    net = torch.nn.Linear(3, 2)
    fn = compile.compile_model(net, "default", backend="eager")
    fn(torch.randn(4, 3))
    before = compile.dynamo_graphs()
    fn(torch.randn(4, 3))
    assert compile.dynamo_graphs() == before   # cached
    compile.reset_compile_state(torch.device("cpu"))
    fn(torch.randn(4, 3))
    assert compile.dynamo_graphs() == before + 1


def family(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    children = {}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text() if proc.name.isdigit() else None
        except OSError:
            continue
        if stat is None:
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


@pytest.mark.slow
def test_the_compile_workers_outlive_a_sigterm_to_the_job():
    """Inductor's compile-worker pool (Triton's, on a GPU) is in the job's process group; a SIGTERM
    sent to the group (timeout, scancel) killed it, and the cached pool then failed every later
    compile ("Attempting to use a closed pool"). Started by start_compile_workers, its processes
    block the stop signals: a SIGTERM to each leaves the pool working."""
    pytest.importorskip("triton")   # the pool is the Triton backend's
    from torch._inductor.async_compile import AsyncCompile, shutdown_compile_workers

    shutdown_compile_workers()   # a pool of an earlier test goes: this one is started here
    try:
        compile.start_compile_workers()
        pool = AsyncCompile.process_pool()
        assert pool.submit(AsyncCompile._get_ready).result(timeout=120) == "ready"
        workers = family(pool.process.pid)
        assert len(workers) > 1   # the sidecar and its workers
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        assert pool.submit(AsyncCompile._get_ready).result(timeout=60) == "ready"
        assert all(Path(f"/proc/{pid}").exists() for pid in workers)
    finally:
        shutdown_compile_workers()


# A CPU compiles its kernels in threads; a GPU compiles its Triton kernels in inductor's worker
# pool. This makes the CPU's kernel compiles go through the pool too (a round trip each, created
# lazily on the first), then runs train.py as its main.
POOLED_TRAIN = """
import runpy, sys
from torch._inductor.async_compile import AsyncCompile
cpp_pybinding = AsyncCompile.cpp_pybinding
def through_the_pool(self, *args):
    AsyncCompile.process_pool().submit(AsyncCompile._get_ready).result()
    return cpp_pybinding(self, *args)
AsyncCompile.cpp_pybinding = through_the_pool
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def compile_workers_in(group: int) -> bool:
    """Whether a process of the group is one of inductor's compile workers (it is compiling)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat, cmd = (proc / "stat").read_text(), (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) == group and b"compile_worker" in cmd:
            return True
    return False


def sigterm_while_compiling(*args, pooled: bool) -> tuple[int, str]:
    """train.py in its own session (the pool's round trips added when `pooled`); SIGTERM to its
    process group once the compile workers run; its exit status and stderr."""
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))
    env.pop("WANDB_SERVICE", None)
    lead = [sys.executable, "-c", POOLED_TRAIN] if pooled else [sys.executable]
    p = subprocess.Popen([*lead, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    while not compile_workers_in(p.pid):
        assert p.poll() is None, f"the job ended before it compiled: {p.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    return p.returncode, err


@pytest.mark.slow
def test_sigterm_to_a_compiling_sweep_job_ends_it_interrupted_and_stops_the_sweep(tmp_path):
    """A SIGTERM to the process group while the first job of a compiled sweep compiles kills the
    compile workers (their pool started lazily, as the first Triton compile starts it): the job's
    compile then fails, and it ends `interrupted` by the signal, not `failed`; the sweep stops after
    it instead of failing every next job on the closed pool."""
    pytest.importorskip("triton")
    sweep = tmp_path / "sweep"
    code, err = sigterm_while_compiling("-m", *SWEEP, "precision=fp32,tf32",
                                        f"hydra.sweep.dir={sweep}", pooled=True)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    summaries = [json.loads(p.read_text()) for p in sweep.glob(f"*/{SUMMARY}")]
    assert len(summaries) == 1, [s["status"] for s in summaries]   # the second job never started
    s = summaries[0]
    assert s["status"] == "interrupted", s.get("error")
    assert s["interrupted_by"] == s["stop_signal"] == "SIGTERM"
    assert s["reason"].startswith("SIGTERM received; the job then stopped on ")
    assert "nothing saved since its last checkpoint. To continue: python train.py" in err


@pytest.mark.gpu
@pytest.mark.parametrize("compiling", [["trainer.compile=default"],
                                       ["trainer.compile=none", "optimizer=adamw8bit"]],
                         ids=["model", "torchao_step"])
def test_sigterm_to_a_compiling_gpu_job_ends_it_interrupted_with_its_checkpoint(tmp_path,
                                                                                compiling):
    """On a GPU the compile workers start before the first compile with the stop signals blocked: a
    SIGTERM to the group while they compile leaves them working, the job trains a step and ends
    `interrupted` with its checkpoint. torchao's AdamW compiles its step on CUDA: the workers
    start for it with trainer.compile=none too."""
    from mixprec.train.checkpoint import CHECKPOINT

    gpu = [o for o in SMALL if o not in ("trainer.device=cpu", "trainer.deterministic=true")]
    run_dir = tmp_path / "run"
    code, err = sigterm_while_compiling(*gpu, "trainer.max_steps=50", *compiling,
                                        "precision=amp", f"hydra.run.dir={run_dir}", pooled=False)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    s = json.loads((run_dir / SUMMARY).read_text())
    assert s["status"] == "interrupted" and "error" not in s, s.get("error")
    assert s["interrupted_by"] == "SIGTERM"
    assert s["env"]["device"].startswith("cuda") and (run_dir / CHECKPOINT).is_file()


def test_a_signal_as_a_sweep_job_completes_stops_the_sweep(tmp_path, caplog):
    """A SIGTERM that came as a sweep's job completed (its last step, the final evaluation) is not
    forgotten: the job keeps its status, and the sweep stops with the signal's exit status."""
    summary = {"status": "completed"}
    job.note_signal(summary, "SIGTERM")
    assert summary == {"status": "completed", "stop_signal": "SIGTERM"}
    with pytest.raises(SystemExit) as e:
        job.end_job(summary, job.JobDir(tmp_path / "0_job", tmp_path, dist.SINGLE))
    assert e.value.code == 128 + signal.SIGTERM
    assert "mixprec: SIGTERM as the job ended (completed): the sweep stops here" in caplog.text


def test_compile_workers_not_ready_in_time_is_a_note_on_python_310_too(monkeypatch, caplog):
    """The pool's wait raises concurrent.futures.TimeoutError, which Python 3.10 (pyproject's
    floor) does not alias to the builtin TimeoutError: both are caught, the job compiles in its own
    process after a note. 3.10's class is stood in for here by a class of its own."""
    import concurrent.futures
    from torch._inductor import async_compile

    class FuturesTimeout(Exception):   # Python 3.10's concurrent.futures.TimeoutError
        pass

    def wait(timeout):
        raise FuturesTimeout()

    monkeypatch.setattr(concurrent.futures, "TimeoutError", FuturesTimeout)
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: None)
    monkeypatch.setattr(async_compile.AsyncCompile, "wait_pool_ready", staticmethod(wait))
    with caplog.at_level("WARNING"):
        compile.start_compile_workers()
    assert "compile workers were not ready" in caplog.text


def test_a_sweep_job_that_fails_after_a_stop_signal_ends_interrupted_and_stops_the_sweep(
        tmp_path, monkeypatch):
    """The quick twin of the SIGTERM-while-compiling sweep test above: a SIGTERM reaches the job,
    then its step fails (as the compile pool the signal killed fails it): the job ends
    `interrupted` by the signal with the error kept, and exits with 128 + SIGTERM, which stops a
    sweep (Hydra's basic launcher runs no further job after a SystemExit)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from helpers import TINY, compose_config
    from mixprec.train import image_steps

    def step_after_a_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("Attempting to use a closed pool")

    monkeypatch.setattr(image_steps, "train_step", step_after_a_signal)
    cfg = compose_config(*TINY, output_dir=tmp_path / "sweep" / "0")
    with open_dict(cfg):
        cfg.hydra.mode, cfg.hydra.sweep.dir = RunMode.MULTIRUN, str(tmp_path / "sweep")
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    with pytest.raises(SystemExit) as e:
        job.run_job(cfg)
    assert e.value.code == 128 + signal.SIGTERM
    s = json.loads((tmp_path / "sweep" / "0" / SUMMARY).read_text())
    assert s["status"] == "interrupted" and s["interrupted_by"] == "SIGTERM", s.get("error")
    assert s["reason"].startswith("SIGTERM received; the job then stopped on "), s["reason"]
    assert "closed pool" in s["error"]
