"""A plan's sweeps as commands (scripts/reproduce.py): each sweep's overrides (the plan's, the smoke
sizes, the user's), its `train.py -m` or max_batch.py command, its jobs' composed configs; running
one command as a child that dies with its parent; and reading a sweep folder's summaries."""
from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

from . import cli
from ..config import plain_config
from ..records import SUMMARY, job_order, read_summaries
from .folder import ROOT
from .plan import merge_overrides, override_keys

# the folder's report is made once, at the end
FIXED = ["hydra.callbacks.sweep_table.report=false"]


def exclude_keys(overrides: list[str], grid: dict) -> str:
    """Job dir names carry only the grid's values (every other override is the same for all the
    sweep's jobs)."""
    keys = ["logger.mode", "trainer.device", "trainer.resume"]
    keys += [k for k in override_keys(overrides) if k not in grid]
    return "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(dict.fromkeys(keys)) + "]"


def smoke_parts(sweep) -> tuple[list[str], list[str]]:
    """A sweep's smoke list as (overrides: key=value, script options: --flag value ...)."""
    over = [o for o in sweep.smoke if "=" in o and not o.startswith("--")]
    return over, [o for o in sweep.smoke if o not in over]


def sweep_overrides(plan, sweep, args) -> list[str]:
    """The overrides of the sweep's real run (grid aside): plan, smoke sizes, then the user's."""
    smoke = list(plan.smoke_common) + smoke_parts(sweep)[0] if args.smoke else []
    return merge_overrides(sweep.overrides, smoke, args.overrides)


def script_options(sweep, args) -> list[str]:
    return smoke_parts(sweep)[1] if args.smoke else []


def train_command(overrides: list[str], grid: dict, sweep_dir: Path, extra=()) -> list[str]:
    over = merge_overrides(overrides, extra, FIXED)
    return [sys.executable, str(ROOT / "train.py"), "-m", *over,
            *[f"{k}={','.join(v)}" for k, v in grid.items()],
            f"hydra.sweep.dir={sweep_dir}", exclude_keys(over, grid)]


def run_command(plan, sweep, args, out: Path) -> list[str]:
    runs = out / "runs" / sweep.name
    over = sweep_overrides(plan, sweep, args)
    if sweep.command == "max_batch":
        precisions = ",".join(sweep.grid.get("precision", ("fp32", "amp")))
        return [
            sys.executable,
            str(ROOT / "scripts" / "max_batch.py"),
            *over,
            f"precision={precisions}",
            "--records",
            str(runs),
            *script_options(sweep, args),
        ]
    return train_command(over, sweep.grid, runs, ["trainer.resume=auto"])


@lru_cache(maxsize=None)
def compose(overrides: tuple) -> dict:
    """A job's resolved config (Hydra's compose API; hydra.* overrides left out); a bad override:
    ConfigError."""
    return plain_config(
        cli.compose([o for o in overrides if not o.lstrip("+~").startswith("hydra")])
    )


def check_overrides(plan, args) -> None:
    """The user's overrides composed with the first job of each sweep before anything runs: an
    unknown option or key is one line now (ConfigError), not a failed calibration later. Values are
    checked by each job, which records a bad one as a failed job and the plan goes on."""
    for s in plan.sweeps:
        if s.command == "train" and s.jobs:
            compose(
                tuple(
                    merge_overrides(
                        sweep_overrides(plan, s, args), [f"{k}={v}" for k, v in s.jobs[0].items()]
                    )
                )
            )


def job_configs(plan, sweep, args) -> list[dict]:
    over = sweep_overrides(plan, sweep, args)
    return [
        compose(tuple(merge_overrides(over, [f"{k}={v}" for k, v in job.items()])))
        for job in sweep.jobs
    ]


def _die_with_parent():   # a kill -9 of reproduce.py takes its running sweep with it (Linux)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(
    cmd: list[str], out: Path, name: str, timeout_s=None, tick=None
) -> tuple[int | str, float]:
    """Run one command, its output appended to <out>/logs/<name>.log; tick() is called every second.
    Returns (exit code or 'timeout', wall seconds)."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    env.pop("WANDB_SERVICE", None)
    t0 = time.monotonic()
    with (out / "logs" / f"{name}.log").open("a") as logf:
        logf.write(f"\n$ {shlex.join(cmd)}\n")
        logf.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_die_with_parent)
        try:
            while proc.poll() is None:
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    proc.kill()
                    proc.wait()
                    return "timeout", time.monotonic() - t0
                if tick:
                    tick()
                time.sleep(1.0)
        except KeyboardInterrupt:   # Ctrl-C reached the job too: it checkpoints and exits
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return proc.returncode, time.monotonic() - t0


def sweep_summaries(folder: Path) -> list[tuple[Path, dict]]:
    """(job folder, summary) of each readable job of a sweep folder (one folder per job, directly
    under it), in job order."""
    read, _ = read_summaries(sorted(Path(folder).glob(f"*/{SUMMARY}"), key=job_order))
    return [(path.parent, summary) for path, summary in read]


def summaries(folder: Path) -> list[dict]:
    """The readable summaries of a sweep folder's jobs."""
    return [summary for _, summary in sweep_summaries(folder)]
