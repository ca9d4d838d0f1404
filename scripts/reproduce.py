"""Reproduce every article on this machine's GPU within a time budget, into one folder to share.

    python scripts/reproduce.py [train.py overrides, e.g. gpu=h100 dataset.data_dir=/data] [--budget
    60m] python scripts/reproduce.py --plan --budget 30m          # calibration jobs, then the plan;
    no sweep python scripts/reproduce.py --only page_ladder,torch_amp  # some articles (or sweeps)
    only python scripts/reproduce.py --smoke                       # the whole plan at tiny sizes: a
    CPU proof python scripts/reproduce.py --plan-file src/mixprec/tools/plan_cpu.yaml --only
    torch_amp dataset.data_dir=/data
                                                              # accuracy at CPU sizes, fp16/bf16
                                                              emulated

The plan is src/mixprec/tools/plan.yaml. First a calibration times a few steps of each sweep's jobs
on this device (warm-up excluded, synthetic stand-in data of the real shapes) and predicts each
sweep's minutes; with --budget the plan is cut to fit (each sweep's `cuts`, the longest sweep first)
and printed before anything runs. The sweeps run as `python train.py -m ... trainer.resume=auto`
into <out>/runs/<sweep>: run the same command again after a crash, Ctrl-C or kill -9 and finished
jobs are skipped, interrupted ones resume from their checkpoints; a calibration stopped part-way
continues likewise (<out>/calibration.json, its jobs also with trainer.resume=auto). A failing sweep
is recorded and the next one runs. <out> (default outputs/reference/<gpu>-<date>/) ends with
report/, ENVIRONMENT.md, COMMANDS.md and plan.md (predicted against actual minutes).
"""
from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from mixprec.tools import cli
from mixprec.config import ModelConfig, plain_config, validate
from mixprec.tools.plan import (
    PLAN_FILE,
    JobCost,
    PlanError,
    cost_from_summary,
    fit,
    job_wall_s,
    load_plan,
    markdown_table,
    mean_cost,
    merge_overrides,
    minutes,
    override_keys,
    parse_duration,
    predict_job,
    steps_per_epoch,
    table,
    untimed_reason,
)
from mixprec import records
from mixprec.records import write_json_atomic, write_text_atomic
from mixprec.report.load import sweep_jobs

ROOT = Path(__file__).resolve().parents[1]


FINAL = ("completed", "diverged", "failed")
STATE = "plan.json"
CALIBRATION = "calibration.json"   # the calibration so far (calibrate): a killed one continues
REPORT_S = 60.0   # the report's minutes, kept aside from a --budget
# the folder's report is made once, at the end
FIXED = ["hydra.callbacks.sweep_table.report=false"]


def log(msg: str) -> None:
    print(f"reproduce: {msg}", flush=True)


# --------------------------------------------------------------------------------------- the folder


def environment() -> dict:
    # lazy: torch (which these import) is slow to import; the launcher and --help need it not
    import torch
    from mixprec.runtime.hardware import describe, select_device

    device = select_device("auto")   # the build's accelerator (torch.accelerator), else the CPU
    env = describe(device)
    env["gpus"] = (
        []
        if device.type == "cpu"
        else [
            torch.get_device_module(device).get_device_name(i)
            for i in range(torch.accelerator.device_count())
        ]
    )
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["driver"] = (
            out.stdout.strip().splitlines()[0]
            if out.returncode == 0 and out.stdout.strip()
            else None
        )
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def default_out(env: dict, args) -> Path:
    name = (
        "cpu" if not env["gpus"] else re.sub(r"[^a-z0-9]+", "-", env["gpus"][0].lower()).strip("-")
    )
    profile = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("gpu=")), None)
    if profile and profile != "auto":
        name += f"-{profile}"
    date = datetime.date.today().isoformat()
    return ROOT / "outputs" / ("smoke" if args.smoke else "reference") / f"{name}-{date}"


def write_environment(out: Path, env: dict, args) -> None:
    rows = [
        ("GPU", ", ".join(env["gpus"]) or "none (CPU)"),
        ("driver", env.get("driver") or "-"),
        ("torch", env["torch"]),
        ("CUDA", env["cuda"] or "-"),
        ("cuDNN", env["cudnn"] or "-"),
        (
            "commit",
            f"{env['git_commit']}"
            + (" (with uncommitted changes)" if env.get("git_dirty") else ""),
        ),
        ("python", env["python"]),
        ("platform", env["platform"]),
        ("host", env["hostname"]),
        ("CPU cores", env["cpu_count"]),
        ("GPU memory (GB)", env.get("gpu_memory_gb") or "-"),
        ("capability", env.get("capability") or "-"),
        ("overrides", " ".join(args.overrides) or "-"),
        ("written", time.strftime("%Y-%m-%d %H:%M:%S %z")),
    ]
    text = "# Environment\n\n" + markdown_table(["", ""], [[k, v] for k, v in rows]) + "\n"
    write_text_atomic(out / "ENVIRONMENT.md", text)
    write_json_atomic(out / "environment.json", env)


GITIGNORE_UNFINISHED = """\
# Written by scripts/reproduce.py: this results folder is not complete (a --plan, or a run still
# going or stopped), so git leaves all of it out. The run that completes it (its report made)
# replaces this file with one that keeps the results and leaves out only the weights, checkpoints,
# W&B files and the calibration's jobs.
*
"""
GITIGNORE_FINISHED = """\
# Written by scripts/reproduce.py when this folder's run completed: commit the folder
# (runs/*/*/summary.json and metrics.jsonl, report/, ENVIRONMENT.md, COMMANDS.md, plan.md,
# plan.json, calibration.json, logs/); git leaves out:
*.pt
wandb/
.submitit/
calibration/
replaced/
"""


def write_gitignore(out: Path, finished: bool) -> None:
    """<out>/.gitignore (for a folder inside the repository): everything until the run is complete,
    then the heavy files only."""
    if out.resolve().is_relative_to(ROOT):
        write_text_atomic(
            out / ".gitignore", GITIGNORE_FINISHED if finished else GITIGNORE_UNFINISHED
        )


def record_command(out: Path, what: str, cmd: list[str]) -> None:
    """COMMANDS.md gets the command as it starts (a killed session's command is listed too),
    record_exit its end."""
    path = out / "COMMANDS.md"
    if not path.exists():
        path.write_text(
            "# Commands run\n\nEvery command this folder's results came from, in order (run from "
            "the repository root; the commands of a resumed plan are listed again, a command with "
            "no exit line was stopped).\n"
        )
    with path.open("a") as f:
        f.write(
            f"\n## {time.strftime('%Y-%m-%d %H:%M:%S')} {what}\n\n```bash\n{shlex.join(cmd)}\n```\n"
        )


def record_exit(out: Path, rc, wall: float) -> None:
    with (out / "COMMANDS.md").open("a") as f:
        f.write(f"exit code {rc}, {wall / 60:.1f} min\n")


# ----------------------------------------------------------------------------------------- commands


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


# ---------------------------------------------------------------------------------------- processes


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


def summaries(folder: Path) -> list[dict]:
    """The readable summaries of a sweep folder's jobs."""
    return [j.summary for j in sweep_jobs(folder)[0]]


# -------------------------------------------------------------------------------------- calibration


def _job_key(summary: dict, keys: list[str]) -> tuple:
    return tuple(str(records.lookup(summary, k)) for k in keys)


def calibration_key(args) -> dict:
    """What a calibration depends on: the plan's options except the budget (a new budget re-cuts the
    same timings)."""
    return {k: v for k, v in state_key(args).items() if k != "budget"}


def calibrate(plan, args, out: Path) -> dict:
    """Time each train sweep's jobs ('first': one job per sweep) for a few steps on this device.
    Returns {sweep: {"costs": {job key: cost}, "wall_s", "status"}}.

    Resumable as the sweeps are: each sweep's timings go to <out>/calibration.json as soon as it is
    calibrated, and its jobs run with trainer.resume=auto, so after a crash, Ctrl-C or kill -9 the
    same command keeps the sweeps calibrated before and the jobs finished before, and times the
    rest. A calibration made with other options is moved to <out>/replaced/ first (its job folders
    would be taken for finished jobs of this one)."""
    cal = dict(plan.calibration)
    if args.smoke:
        cal = {"warmup_steps": 1, "timed_steps": 1}
    steps = cal["warmup_steps"] + cal["timed_steps"]
    path, key = out / CALIBRATION, calibration_key(args)
    saved = json.loads(path.read_text()) if path.exists() else None
    if saved is None or saved.get("key") != key:
        set_aside(
            out,
            "calibration",
            "it was made with other options"
            if saved
            else "no calibration.json says how it was made",
        )
        saved = {"key": key, "sweeps": {}, "seconds": 0.0}
        # before the first job: a kill from now on leaves a calibration to continue
        write_json_atomic(path, saved)
    result, before, t_start = dict(saved["sweeps"]), saved["seconds"], time.monotonic()
    if result:
        log(
            f"continuing the calibration in {out / 'calibration'}: {len(result)} sweep(s) "
            "calibrated before, kept"
        )
    for s in plan.sweeps:
        if s.command != "train" or s.name in result:
            continue
        grid = s.grid if args.calibrate == "all" else {k: v[:1] for k, v in s.grid.items()}
        data = (list(plan.smoke_common) + smoke_parts(s)[0]) if args.smoke else list(s.stand_in)
        # synthetic: no files
        user = [o for o in args.overrides if override_keys([o])[0] != "dataset.data_dir"]
        over = merge_overrides(
            s.overrides,
            user,
            data,
            [
                f"trainer.max_steps={steps}",
                f"trainer.warmup_steps={cal['warmup_steps']}",
                "logger=none",
            ],
        )
        folder = out / "calibration" / s.name
        cmd = train_command(over, grid, folder, ["trainer.resume=auto"])
        n = math.prod(len(v) for v in grid.values())
        # smoke jobs are tiny: never stopped
        limit = None if args.smoke else args.calibrate_timeout * n + 60
        record_command(out, f"calibration of {s.name}", cmd)
        started = time.time()
        rc, wall = spawn(cmd, out, f"calibration_{s.name}", timeout_s=limit)
        record_exit(out, rc, wall)
        costs, untimed, jobs = {}, {}, sweep_jobs(folder)[0] if folder.exists() else []
        for summ in (j.summary for j in jobs):
            # job_key, not key: that is the calibration's own, written below
            cost, job_key = cost_from_summary(summ), "|".join(_job_key(summ, list(s.grid)))
            if cost is not None:
                costs[job_key] = cost.__dict__
            else:
                untimed[job_key] = untimed_reason(summ)
        # not skipped
        ran = [j.summary for j in jobs if (j.dir / records.SUMMARY).stat().st_mtime >= started]
        # the process, once per sweep
        startup = max(0.0, wall - sum(job_wall_s(x) or 0.0 for x in ran))
        result[s.name] = {
            "costs": costs,
            "wall_s": wall,
            "status": "timeout" if rc == "timeout" else rc,
            "jobs": n,
            "timeout_s": args.calibrate_timeout,
            "steps": steps,
            "startup_s": startup,
            "untimed": untimed,   # job -> why it gave no time (untimed_reason)
        }
        write_json_atomic(
            path, {"key": key, "sweeps": result, "seconds": before + time.monotonic() - t_start}
        )
        log(f"calibrated {s.name}: {len(costs)}/{n} job(s) timed in {wall:.0f} s"
            + (" (stopped: too slow here)" if rc == "timeout" else "")
            + "".join(f"; not timed: {k or 'the job'}: {why}" for k, why in untimed.items()))
    return {
        "sweeps": result,
        "seconds": before + time.monotonic() - t_start,
        "mode": args.calibrate,
    }


def set_aside(out: Path, name: str, why: str) -> None:
    """<out>/<name> moved to <out>/replaced/<name>-<time>."""
    if not (out / name).exists():
        return
    dest = out / "replaced" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.parent.mkdir(exist_ok=True)
    (out / name).rename(dest)
    log(f"{name}: {why}; moved to {dest}")


def predictor(plan, args, calibration: dict):
    """predict(sweep) -> (seconds, job configs, how: 'calibrated' | 'estimate' | '>='), cached per
    sweep state."""
    all_costs = [
        JobCost(**c) for v in calibration["sweeps"].values() for c in v["costs"].values()
    ]

    cache = {}

    def predict(sweep):
        key = (sweep.name, sweep.overrides, tuple(sweep.grid.items()), sweep.dropped)
        if key not in cache:
            cache[key] = _predict(sweep)
        return cache[key]

    def _predict(sweep):
        if sweep.command != "train":
            return (10.0 if args.smoke else float(sweep.predicted_s or 120)), [], "estimate"
        configs = job_configs(plan, sweep, args)
        cal = calibration["sweeps"].get(sweep.name, {})
        costs = {k: JobCost(**c) for k, c in cal.get("costs", {}).items()}
        fallback, how = mean_cost(list(costs.values())), "calibrated"
        if fallback is None and cal.get("status") == "timeout":
            per_step = cal["timeout_s"] * cal["jobs"] / cal["steps"]
            fallback, how = JobCost(per_step, 0.0, 0.0), ">="
        elif fallback is None:
            fallback, how = mean_cost(all_costs) or JobCost(1.0, 0.0, 10.0), "estimate"
        total = cal.get("startup_s", 0.0)
        for job, cfg in zip(sweep.jobs, configs):
            total += predict_job(cfg, costs.get("|".join(job.values()), fallback), plan.datasets)
        return total, configs, how

    return predict


# ------------------------------------------------------------------------------------ FLOP estimate

MFU = 0.3   # the model FLOP utilisation assumed by --estimate (small CIFAR models often reach less)


@lru_cache(maxsize=None)
def _flops(model_json: str, num_classes: int, image_size: int | None) -> float:
    """Forward FLOPs per sample (image) or per token (language model) of the model config."""
    # lazy: torch (which these import) is slow to import; only --estimate needs it
    import torch
    from mixprec.models import build_model, forward_flops

    fields = json.loads(model_json)
    # FLOPs do not depend on the weights: no ImageNet download to count them
    if "pretrained" in fields:
        fields.update(pretrained=False, freeze_body=False)
    model = build_model(ModelConfig(**fields), num_classes)
    if image_size is None:
        return float(model.flops_per_token())
    return forward_flops(model, torch.zeros(1, 3, image_size, image_size)) or 0.0


def flop_seconds(plan, args, sweep, peaks: dict) -> dict:
    """Seconds of one sweep on each profile of `peaks` from FLOPs at MFU of the profile's dense peak
    for the job's precision; a cut sweep's too (fewer epochs, a max_steps, a smaller grid; dropped:
    0). Training and evaluation FLOPs only."""
    from mixprec.precision.modes import peak_kind   # lazy: torch, as _flops

    secs = {p: 0.0 for p in peaks}
    if sweep.dropped:
        return secs
    if sweep.command != "train":
        return {p: float(sweep.predicted_s or 0) for p in peaks}
    for job in sweep.jobs:
        plain = compose(tuple(merge_overrides(sweep.overrides, args.overrides,
                                              [f"{k}={v}" for k, v in job.items()])))
        c = validate(OmegaConf.create(plain))
        text = c.dataset.name in ("wikitext2", "synthetic_text")
        sizes = plan.datasets.get(c.dataset.name) or {
            "train": c.dataset.train_size,
            "test": c.dataset.test_size,
        }
        f = _flops(
            json.dumps(c.model.__dict__, default=list),
            33278 if text else c.dataset.num_classes,
            None if text else c.dataset.image_size,
        )
        # a max_steps cut trains part of the epochs, each begun one evaluated
        epochs = c.trainer.epochs if c.trainer.max_steps is None else min(
            c.trainer.epochs, c.trainer.max_steps / steps_per_epoch(plain, plan.datasets))
        work = epochs * sizes["train"] * 3 * f + math.ceil(epochs) * sizes["test"] * f
        for p in peaks:
            peak = peaks[p].get(peak_kind(c.precision)) or peaks[p]["fp32"]
            secs[p] += work / (peak * 1e12 * MFU)
    return secs


class FlopPredict:
    """plan.fit's predict(sweep) from FLOPs on one GPU profile: (seconds, job configs, "estimate"),
    kept per sweep state (fit asks again for each cut it weighs)."""

    def __init__(self, plan, args, peaks: dict, profile: str):
        self.plan, self.args, self.peaks, self.profile, self.seen = plan, args, peaks, profile, {}

    def __call__(self, sweep):
        key = (sweep.name, sweep.overrides, tuple(sweep.grid.items()), sweep.dropped)
        if key not in self.seen:
            configs = job_configs(self.plan, sweep, self.args) if sweep.command == "train" else []
            self.seen[key] = (flop_seconds(self.plan, self.args, sweep, self.peaks)[self.profile],
                              configs, "estimate")
        return self.seen[key]


def estimate_cuts(plan, args, peaks: dict, profile: str, budget_s: float) -> str:
    """What --budget would cut where on `profile`, by the FLOP estimate: the plan's cuts applied as
    a --plan applies them to its calibrated minutes (plan.fit), the report's minute kept aside."""
    predict = FlopPredict(plan, args, peaks, profile)
    full = sum(predict(s)[0] for s in plan.sweeps)
    cut = fit(plan.sweeps, predict, budget_s - REPORT_S)
    rows = [[s.article, s.name, 0 if s.dropped else len(s.jobs), minutes(predict(s)[0]),
             "; ".join(s.applied) or "none (full fidelity)"] for s in cut]
    total = sum(predict(s)[0] for s in cut)
    over = total > budget_s - REPORT_S
    return (
        f"\n--budget {args.budget} on {profile}: {total / 60:.1f} min after cuts (of "
        f"{full / 60:.1f} uncut; + report ~{REPORT_S / 60:.0f} min; a GPU's --plan also spends its "
        "calibration)" + ("; OVER BUDGET: every cut the plan allows is made" if over else "")
        + "\n" + table(["article", "sweep", "jobs", f"{profile} min", "cut"], rows)
    )


def estimate(plan, args, profiles: list[str]) -> int:
    """Minutes of the full-fidelity plan on named GPU profiles from FLOPs at MFU of each profile's
    dense peak for the job's precision: a rough figure, not a measurement (a GPU's --plan replaces
    it). With --budget, what the plan's cuts would make of it on each profile."""
    known = sorted(f.stem for f in (ROOT / "conf" / "gpu").glob("*.yaml") if f.stem != "auto")
    for p in profiles:
        if p not in known:
            raise PlanError(
                f"--estimate {p}: no GPU profile of that name (conf/gpu/); choose from: "
                f"{', '.join(known)}"
            )
    if not profiles:
        raise PlanError(
            "--estimate: name one or more GPU profiles, e.g. --estimate h100,v100 "
            f"({', '.join(known)})"
        )
    peaks = {p: yaml_load(ROOT / "conf" / "gpu" / f"{p}.yaml")["peak_tflops"] for p in profiles}
    rows, totals = [], {p: 0.0 for p in profiles}
    for s in plan.sweeps:
        secs = flop_seconds(plan, args, s, peaks)
        rows.append([s.article, s.name, len(s.jobs)] + [minutes(secs[p]) for p in profiles])
        for p in profiles:
            totals[p] += secs[p]
    rows.append(
        ["total", "", sum(len(s.jobs) for s in plan.sweeps)]
        + [minutes(totals[p]) for p in profiles]
    )
    print(
        f"FLOP estimate (not measured): minutes of the full-fidelity plan at {MFU:.0%} of each "
        "profile's dense peak for the job's precision (fp32 where the profile has no peak for "
        "it); training and evaluation FLOPs only (no data loading, start-up, launch overhead)\n"
    )
    print(table(["article", "sweep", "jobs", *[f"{p} min" for p in profiles]], rows))
    for p in profiles if args.budget else []:
        print(estimate_cuts(plan, args, peaks, p, parse_duration(args.budget)))
    return 0


def yaml_load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# ----------------------------------------------------------------------------------------- the plan


def make_state(plan, args, calibration: dict, budget_s) -> dict:
    predict = predictor(plan, args, calibration)
    report_s = REPORT_S
    room = None if budget_s is None else budget_s - calibration["seconds"] - report_s
    sweeps = fit(plan.sweeps, predict, room)
    entries = []
    for s in sweeps:
        secs, configs, how = predict(s)
        epochs = sorted({c["trainer"]["epochs"] for c in configs})
        steps = sorted({c["trainer"]["max_steps"] for c in configs} - {None})
        entries.append(
            {
                "article": s.article,
                "name": s.name,
                "command": None if s.dropped else run_command(plan, s, args, args.out),
                "jobs": 0 if s.dropped else len(s.jobs),
                "planned_jobs": len(s.jobs),
                "grid": {k: list(v) for k, v in s.grid.items()},
                "epochs": "/".join(map(str, epochs)) + (f" (<= {steps[0]} steps)" if steps else "")
                if configs
                else "-",
                "predicted_s": 0.0 if s.dropped else secs,
                "prediction": how,
                # why its calibration timed no job (the first job's reason), where it timed none
                "untimed": next(iter(calibration["sweeps"].get(s.name, {}).get("untimed", {})
                                     .values()), None) if how == "estimate" else None,
                "cuts": list(s.applied),
                "dropped": s.dropped,
                "status": "dropped" if s.dropped else "planned",
                "actual_s": 0.0,
                "rc": None,
            }
        )
    return {
        "key": state_key(args),
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "budget_s": budget_s,
        "smoke": args.smoke,
        "calibration": calibration,
        "report_s": report_s,
        "sweeps": entries,
        "articles": [
            {
                "id": a.id,
                "title": a.title,
                "not_reproduced": a.not_reproduced,
                "stand_ins": a.stand_ins,
                "sweeps": [s.name for s in a.sweeps],
            }
            for a in plan.articles
        ],
        "elapsed_s": calibration["seconds"],
    }


def state_key(args) -> dict:
    return {
        "smoke": args.smoke,
        "budget": args.budget,
        "only": args.only,
        "overrides": list(args.overrides),
        "calibrate": args.calibrate,
        "plan_file": str(args.plan_file or PLAN_FILE),
    }


def plan_rows(state: dict, actual: bool) -> tuple[list[str], list[list]]:
    heads = ["article", "sweep", "jobs", "epochs", "predicted min"]
    heads += (["actual min", "status"] if actual else []) + ["cut"]
    rows = []
    for e in state["sweeps"]:
        pred = "-" if e["dropped"] else minutes(e["predicted_s"], e["prediction"] == ">=") + \
            (f" (estimate{': ' + e['untimed'] if e.get('untimed') else ''})"
             if e["prediction"] == "estimate" else "")
        jobs = f"{e['jobs']}" + (
            f" of {e['planned_jobs']}" if e["jobs"] != e["planned_jobs"] else ""
        )
        rows.append(
            [e["article"], e["name"], jobs, e["epochs"], pred]
            + ([minutes(e["actual_s"]) if e["actual_s"] else "-", e["status"]] if actual else [])
            + ["; ".join(e["cuts"]) or "none (full fidelity)"]
        )
    return heads, rows


def plan_summary(state: dict) -> str:
    total = sum(e["predicted_s"] for e in state["sweeps"])
    cal = state["calibration"]
    budget = (
        "none (full fidelity)" if state["budget_s"] is None else f"{state['budget_s'] / 60:.0f} min"
    )
    over = state["budget_s"] is not None and total > state["budget_s"]
    return (
        f"budget {budget}; calibration {cal['seconds'] / 60:.1f} min ({cal['mode']} jobs timed); "
        f"sweeps predicted {total / 60:.1f} min + report ~{state['report_s'] / 60:.0f} min; "
        f"{sum(e['jobs'] for e in state['sweeps'])} jobs"
        + (
            "; OVER BUDGET: every cut the plan allows is made (sweeps without a `drop` cut are "
            "kept)"
            if over
            else ""
        )
    )


def write_plan_md(out: Path, state: dict) -> None:
    heads, rows = plan_rows(state, actual=True)
    text = (
        "# Plan: predicted against actual minutes\n\n"
        + plan_summary(state)
        + "\n\n"
        + markdown_table(heads, rows)
        + "\n\nPredicted minutes come from the calibration (a few timed steps "
        "per job on this device, warm-up excluded); `>=` where the calibration was stopped as too "
        "slow, `(estimate)` where no step of the sweep could be timed. Cuts are applied in the "
        "order the plan lists them (src/mixprec/tools/plan.yaml).\n"
    )
    write_text_atomic(out / "plan.md", text)
    write_json_atomic(out / STATE, state)


def load_or_plan(plan, args, env) -> dict:
    path = args.out / STATE
    old = json.loads(path.read_text()) if path.exists() else None
    if old is not None and old["key"] == state_key(args) and not args.replan:
        log(f"continuing the plan in {args.out} (made {old['created']})")
        return old
    if old is not None and not args.replan:
        raise PlanError(
            f"{args.out} holds a plan made with other options ({old['key']}); run the same command "
            "to continue it, add --replan to plan again there, or give --out for a new folder"
        )
    same_cal = old is not None and {k: v for k, v in old["key"].items() if k != "budget"} == \
        {k: v for k, v in state_key(args).items() if k != "budget"}
    calibration = old["calibration"] if same_cal else calibrate(plan, args, args.out)
    budget_s = parse_duration(args.budget) if args.budget else None
    state = make_state(plan, args, calibration, budget_s)
    # the time spent there still counts, less the runs (and calibration) set aside
    if old is not None:
        kept = old["elapsed_s"] - keep_or_set_aside(args.out, old, state)
        state["elapsed_s"] = (
            kept if same_cal else kept - old["calibration"]["seconds"] + calibration["seconds"]
        )
    return state


def keep_or_set_aside(out: Path, old: dict, state: dict) -> float:
    """After --replan: a sweep whose command is unchanged keeps its progress; one whose command
    changed has its earlier runs moved to <out>/replaced/ (a job dir is named by its grid values
    only, so they would be taken for finished jobs of the new command). Returns the seconds the
    sweeps set aside had run."""
    before, aside = {e["name"]: e for e in old["sweeps"]}, 0.0
    for e in state["sweeps"]:
        prev = before.get(e["name"])
        if prev is None:
            continue
        if prev["command"] == e["command"]:
            e.update(status=prev["status"], actual_s=prev["actual_s"], rc=prev["rc"])
            continue
        # the sweep starts over: its earlier time is not this folder's any more
        aside += prev["actual_s"]
        if (out / "runs" / e["name"]).exists():
            dest = out / "replaced" / f"{e['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
            dest.parent.mkdir(exist_ok=True)
            (out / "runs" / e["name"]).rename(dest)
            log(f"{e['name']}: its command changed; its earlier runs moved to {dest}")
    return aside


# ------------------------------------------------------------------------------------------ running


def jobs_done(out: Path, state: dict) -> int:
    return sum(
        min(
            e["jobs"],
            sum(1 for s in summaries(out / "runs" / e["name"]) if records.status(s) in FINAL),
        )
        for e in state["sweeps"]
        if not e["dropped"]
    )


class Progress:
    """One line: jobs done of planned, minutes elapsed against the budget, the sweep running."""

    def __init__(self, out: Path, state: dict):
        self.out, self.state, self.t0, self.last = out, state, time.monotonic(), None
        self.base = state["elapsed_s"]
        self.planned = sum(e["jobs"] for e in state["sweeps"])
        self.tty = sys.stdout.isatty()

    def elapsed(self) -> float:
        return self.base + time.monotonic() - self.t0

    def __call__(self, sweep: str = "") -> None:
        done = jobs_done(self.out, self.state)
        width = 30
        bar = "#" * (width * done // max(1, self.planned))
        budget = f" of {self.state['budget_s'] / 60:.0f}" if self.state["budget_s"] else ""
        elapsed = f"{self.elapsed() / 60:.1f}{budget} min"
        line = f"[{bar:<{width}}] {done}/{self.planned} jobs | {elapsed} | {sweep}"
        if self.tty:
            print("\r" + line.ljust(100), end="", flush=True)
        elif (done, sweep) != self.last:
            print(line, flush=True)
        self.last = (done, sweep)


def run_sweeps(out: Path, state: dict, progress: Progress) -> list[str]:
    failed = []
    for e in state["sweeps"]:
        if e["dropped"]:
            continue
        if e["status"] == "done":
            continue
        e["status"] = "running"
        write_plan_md(out, state)
        record_command(out, f"sweep {e['name']} ({e['article']})", e["command"])
        started = time.monotonic()
        try:
            rc, wall = spawn(e["command"], out, e["name"], tick=lambda: progress(e["name"]))
        except KeyboardInterrupt:   # the sweep's time so far counts (a replan keeps it)
            e["actual_s"] += time.monotonic() - started
            raise
        record_exit(out, rc, wall)
        e["actual_s"] += wall
        e["rc"] = rc
        e["status"] = "done" if rc == 0 else "failed"
        state["elapsed_s"] = progress.elapsed()
        write_plan_md(out, state)
        progress(e["name"])
        if rc != 0:
            failed.append(e["name"])
            print()
            log(
                f"{e['name']} failed (exit {rc}); its log: {out / 'logs' / (e['name'] + '.log')}; "
                "going on"
            )
    if progress.tty:
        print()
    return failed


def make_report(out: Path) -> int:
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "make_report.py"),
        str(out),
        "--out",
        str(out / "report"),
    ]
    record_command(out, "report", cmd)
    rc, wall = spawn(cmd, out, "report")
    record_exit(out, rc, wall)
    if rc == 0:
        log(f"report: {out / 'report' / 'report.html'} (and report.md, report.json, plots/)")
    else:
        log(f"the report was not made (exit {rc}); see {out / 'logs' / 'report.log'}")
    return rc


# -------------------------------------------------------------------------------------------- entry


def parse(argv):
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0], prog="reproduce.py")
    ap.add_argument("overrides", nargs="*",
                    help="train.py overrides for every job, e.g. gpu=h100 dataset.data_dir=/data")
    ap.add_argument(
        "--budget", help="time for the whole plan, e.g. 60m, 1h30m (default: full fidelity, uncut)"
    )
    ap.add_argument(
        "--plan", action="store_true",
        help="calibrate, print the plan and exit; the calibration runs jobs (a few timed steps of "
             "each sweep's jobs: minutes on a GPU, about 11 min on a 2-core CPU); --estimate "
             "runs none")
    ap.add_argument(
        "--only",
        help="comma-separated article ids or sweep names (see src/mixprec/tools/plan.yaml)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="every sweep at tiny sizes on the CPU (synthetic data)"
    )
    ap.add_argument(
        "--out", type=Path, help="the results folder (default outputs/reference/<gpu>-<date>)"
    )
    ap.add_argument(
        "--replan",
        action="store_true",
        help="plan again in a folder that holds a plan (sweeps whose "
        "command changed start over; their earlier runs go to replaced/)",
    )
    ap.add_argument(
        "--calibrate",
        choices=("all", "first"),
        help="time every job, or the first job of each sweep (default: all on a GPU, first on a "
             "CPU)",
    )
    ap.add_argument(
        "--calibrate-timeout",
        type=float,
        default=30.0,
        help="seconds per calibration job before a sweep's calibration is stopped as too slow",
    )
    ap.add_argument(
        "--estimate",
        metavar="PROFILES",
        help="print the full plan's minutes on these GPU profiles (e.g. h100,v100) from FLOPs, and "
             "exit, running no job; with --budget also what the plan's cuts would make of it on "
             "each profile (each sweep's minutes and cuts)",
    )
    ap.add_argument(
        "--plan-file",
        type=Path,
        help="another plan (default src/mixprec/tools/plan.yaml); "
        "src/mixprec/tools/plan_cpu.yaml: the accuracy half of every article at CPU sizes, "
        "fp16/bf16 emulated",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        plan = load_plan(args.plan_file)
        if args.only:
            plan = plan.only([n for n in args.only.split(",") if n])
        if args.smoke:
            plan = plan.smoked()
        if args.budget:
            parse_duration(args.budget)
        check_overrides(plan, args)
        if args.estimate is not None:
            return estimate(plan, args, [p for p in args.estimate.split(",") if p])
        return reproduce(plan, args, argv if argv is not None else sys.argv[1:])
    except PlanError as e:
        print(f"reproduce: {cli.one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\nreproduce: interrupted; run the same command to continue "
            "(finished jobs are skipped)",
            file=sys.stderr,
        )
        return 130


def reproduce(plan, args, argv: list[str]) -> int:
    env = environment()
    args.calibrate = args.calibrate or ("all" if env["gpus"] and not args.smoke else "first")
    args.out = (args.out or default_out(env, args)).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    write_gitignore(args.out, finished=False)
    if not env["gpus"] and not args.smoke:
        log(
            "no GPU here: the plan runs on the CPU, fp16/bf16 emulated on fp32 kernels "
            "(precision.emulate=auto): accuracy as on a GPU, times are CPU times"
        )
    write_environment(args.out, env, args)
    state = load_or_plan(plan, args, env)
    write_plan_md(args.out, state)
    heads, rows = plan_rows(state, actual=False)
    print(f"\nplan for {args.out}\n{plan_summary(state)}\n{table(heads, rows)}\n", flush=True)
    if args.plan:
        log(
            f"plan only: written to {args.out / 'plan.md'}; run the same command without --plan to "
            "run it"
        )
        return 0
    again = [a for a in argv if a != "--plan"] + (
        [] if "--out" in argv else ["--out", str(args.out)]
    )
    resume = "python scripts/reproduce.py " + shlex.join(again)
    progress = Progress(args.out, state)
    try:
        failed = run_sweeps(args.out, state, progress)
    except KeyboardInterrupt:
        state["elapsed_s"] = progress.elapsed()
        for e in state["sweeps"]:
            if e["status"] == "running":
                e["status"] = "interrupted"
        write_plan_md(args.out, state)
        print(
            f"\nreproduce: interrupted; to continue (finished jobs are skipped): {resume}",
            file=sys.stderr,
        )
        return 130
    ran = any(not e["dropped"] for e in state["sweeps"])
    rc = make_report(args.out) if ran else 0
    write_gitignore(args.out, finished=ran and rc == 0)
    if not ran:
        log(
            "every sweep was cut to fit the budget: nothing ran (see plan.md); give a larger "
            "--budget"
        )
    state["elapsed_s"] = progress.elapsed()
    write_plan_md(args.out, state)
    log(
        f"{sum(1 for e in state['sweeps'] if e['status'] == 'done')} sweep(s) done, {len(failed)} "
        "failed"
        + (f" ({', '.join(failed)}); to retry them: {resume}" if failed else "")
        + f"; {state['elapsed_s'] / 60:.1f} min in all; folder to share: {args.out}"
    )
    return 1 if failed or rc else 0


if __name__ == "__main__":
    sys.exit(cli.run("reproduce", main, known=(PlanError,)))
