"""The calibration of a reproduction (scripts/reproduce.py): a few timed steps of each train
sweep's jobs on this device, kept in <out>/calibration.json sweep by sweep (a killed calibration
continues), and the sweeps' minutes predicted from it."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from .. import records
from ..records import SUMMARY, write_json_atomic
from .folder import log, record_command, record_exit, set_aside
from .plan import (
    PLAN_FILE,
    JobCost,
    cost_from_summary,
    job_wall_s,
    mean_cost,
    merge_overrides,
    override_keys,
    predict_job,
    untimed_reason,
)
from .sweeps import job_configs, smoke_parts, spawn, sweep_summaries, train_command

CALIBRATION = "calibration.json"   # the calibration so far (calibrate): a killed one continues


def state_key(args) -> dict:
    """What a plan depends on: the options it was made with (plan.json's key)."""
    return {
        "smoke": args.smoke,
        "budget": args.budget,
        "only": args.only,
        "overrides": list(args.overrides),
        "calibrate": args.calibrate,
        "plan_file": str(args.plan_file or PLAN_FILE),
    }


def calibration_key(args) -> dict:
    """What a calibration depends on: the plan's options except the budget (a new budget re-cuts the
    same timings)."""
    return {k: v for k, v in state_key(args).items() if k != "budget"}


def _job_key(summary: dict, keys: list[str]) -> tuple:
    return tuple(str(records.lookup(summary, k)) for k in keys)


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
        result[s.name] = calibrate_sweep(plan, s, args, out, cal)
        write_json_atomic(
            path, {"key": key, "sweeps": result, "seconds": before + time.monotonic() - t_start}
        )
        r = result[s.name]
        log(f"calibrated {s.name}: {len(r['costs'])}/{r['jobs']} job(s) timed in "
            f"{r['wall_s']:.0f} s"
            + (" (stopped: too slow here)" if r["status"] == "timeout" else "")
            + "".join(f"; not timed: {k or 'the job'}: {why}" for k, why in r["untimed"].items()))
    return {
        "sweeps": result,
        "seconds": before + time.monotonic() - t_start,
        "mode": args.calibrate,
    }


def calibrate_sweep(plan, s, args, out: Path, cal: dict) -> dict:
    """Run one sweep's calibration jobs (into <out>/calibration/<sweep>) and read their timings:
    the sweep's calibration.json entry."""
    steps = cal["warmup_steps"] + cal["timed_steps"]
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
    jobs = sweep_summaries(folder) if folder.exists() else []
    costs, untimed = timings([summ for _, summ in jobs], list(s.grid))
    # not skipped
    ran = [summ for job_dir, summ in jobs if (job_dir / SUMMARY).stat().st_mtime >= started]
    # the process, once per sweep
    startup = max(0.0, wall - sum(job_wall_s(x) or 0.0 for x in ran))
    return {
        "costs": costs,
        "wall_s": wall,
        "status": "timeout" if rc == "timeout" else rc,
        "jobs": n,
        "timeout_s": args.calibrate_timeout,
        "steps": steps,
        "startup_s": startup,
        "untimed": untimed,   # job -> why it gave no time (untimed_reason)
    }


def timings(summaries: list[dict], keys: list[str]) -> tuple[dict, dict]:
    """({job key: cost}, {job key: why it gave no time}) of a sweep's calibration summaries."""
    costs, untimed = {}, {}
    for summ in summaries:
        # job_key, not key: that is the calibration's own
        cost, job_key = cost_from_summary(summ), "|".join(_job_key(summ, keys))
        if cost is not None:
            costs[job_key] = cost.__dict__
        else:
            untimed[job_key] = untimed_reason(summ)
    return costs, untimed


class CalibratedPredict:
    """plan.fit's predict(sweep) from the calibration: (seconds, job configs, how: 'calibrated' |
    'estimate' | '>='), kept per sweep state (fit asks again for each cut it weighs)."""

    def __init__(self, plan, args, calibration: dict):
        self.plan, self.args, self.calibration, self.seen = plan, args, calibration, {}
        self.all_costs = [
            JobCost(**c) for v in calibration["sweeps"].values() for c in v["costs"].values()
        ]

    def __call__(self, sweep):
        key = (sweep.name, sweep.overrides, tuple(sweep.grid.items()), sweep.dropped)
        if key not in self.seen:
            self.seen[key] = self.predict(sweep)
        return self.seen[key]

    def predict(self, sweep):
        if sweep.command != "train":
            return (10.0 if self.args.smoke else float(sweep.predicted_s or 120)), [], "estimate"
        configs = job_configs(self.plan, sweep, self.args)
        cal = self.calibration["sweeps"].get(sweep.name, {})
        costs = {k: JobCost(**c) for k, c in cal.get("costs", {}).items()}
        fallback, how = mean_cost(list(costs.values())), "calibrated"
        if fallback is None and cal.get("status") == "timeout":
            per_step = cal["timeout_s"] * cal["jobs"] / cal["steps"]
            fallback, how = JobCost(per_step, 0.0, 0.0), ">="
        elif fallback is None:
            fallback, how = mean_cost(self.all_costs) or JobCost(1.0, 0.0, 10.0), "estimate"
        total = cal.get("startup_s", 0.0)
        for job, cfg in zip(sweep.jobs, configs):
            total += predict_job(cfg, costs.get("|".join(job.values()), fallback),
                                 self.plan.datasets)
        return total, configs, how
