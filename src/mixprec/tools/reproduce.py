"""scripts/reproduce.py's run: the plan loaded and checked, then --estimate's FLOP minutes, or the
plan calibrated, cut to the budget, printed and run sweep by sweep (a failing sweep is recorded and
the next one runs; Ctrl-C or a kill leaves a folder the same command continues), and the folder's
report made once, at the end. The parts: folder.py (the results folder), sweeps.py (the commands),
calibrate.py (the calibration and its predictions), state.py (plan.json, plan.md), estimate.py
(--estimate); the plan itself: plan.py and plan.yaml."""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from .. import records
from . import cli
from .estimate import estimate
from .folder import (
    ROOT,
    default_out,
    environment,
    log,
    record_command,
    record_exit,
    write_environment,
    write_gitignore,
)
from .plan import PlanError, load_plan, parse_duration, table
from .state import load_or_plan, plan_rows, plan_summary, write_plan_md
from .sweeps import check_overrides, spawn, summaries

FINAL = ("completed", "diverged", "failed")


def main(args, argv: list[str]) -> int:
    """Run the parsed `args` of scripts/reproduce.py (`argv`: its arguments as given, for the
    command that continues the run); the exit status. A PlanError ends it with one line."""
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
        return reproduce(plan, args, argv)
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
        interrupted(args.out, state, progress, resume)
        return 130
    return finish(args.out, state, progress, failed, resume)


def interrupted(out: Path, state: dict, progress, resume: str) -> None:
    """A Ctrl-C between or during the sweeps: the plan says so, and the command to continue."""
    state["elapsed_s"] = progress.elapsed()
    for e in state["sweeps"]:
        if e["status"] == "running":
            e["status"] = "interrupted"
    write_plan_md(out, state)
    print(
        f"\nreproduce: interrupted; to continue (finished jobs are skipped): {resume}",
        file=sys.stderr,
    )


def finish(out: Path, state: dict, progress, failed: list[str], resume: str) -> int:
    """After the sweeps: the report (when any ran), the folder's .gitignore, the last line."""
    ran = any(not e["dropped"] for e in state["sweeps"])
    rc = make_report(out) if ran else 0
    write_gitignore(out, finished=ran and rc == 0)
    if not ran:
        log(
            "every sweep was cut to fit the budget: nothing ran (see plan.md); give a larger "
            "--budget"
        )
    state["elapsed_s"] = progress.elapsed()
    write_plan_md(out, state)
    log(
        f"{sum(1 for e in state['sweeps'] if e['status'] == 'done')} sweep(s) done, {len(failed)} "
        "failed"
        + (f" ({', '.join(failed)}); to retry them: {resume}" if failed else "")
        + f"; {state['elapsed_s'] / 60:.1f} min in all; folder to share: {out}"
    )
    return 1 if failed or rc else 0


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
