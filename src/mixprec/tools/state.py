"""The plan of a reproduction (scripts/reproduce.py) as its folder keeps it: plan.json (each sweep's
command, predicted and actual minutes, status) made from the calibration cut to the budget, plan.md
(predicted against actual minutes), and a plan continued, or made again with --replan."""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..records import write_json_atomic, write_text_atomic
from .calibrate import CalibratedPredict, calibrate, state_key
from .folder import log
from .plan import PlanError, fit, markdown_table, minutes, parse_duration
from .sweeps import run_command

STATE = "plan.json"
REPORT_S = 60.0   # the report's minutes, kept aside from a --budget


def make_state(plan, args, calibration: dict, budget_s) -> dict:
    predict = CalibratedPredict(plan, args, calibration)
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
