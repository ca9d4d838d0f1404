"""Reference folders (what scripts/reproduce.py writes: runs/, plan.json, environment.json) in the
report.

Given one or more such folders, the report gets a side-by-side section: per article, every published
value with one column per folder (a GPU, or a smoke run), each cell the reproduced number with the
plan's cuts stated beside it, or the reason it has none; and the fastai-style FP32 / mixed-precision
time ratio per model and GPU beside the published figures.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .analyse import by_experiment, compare, groups_of, stats
from .load import ReportError, find_summaries, load_jobs

STATE = "plan.json"
RUNS = "runs"
RATIO_EXPERIMENT = "fastai_cifar100"


def is_reference(path) -> bool:
    return (Path(path) / STATE).is_file()


def job_inputs(inputs: list[str]) -> list[str]:
    """The report's inputs with each reference folder replaced by its runs (its calibration jobs
    left out)."""
    return [str(Path(i) / RUNS) if is_reference(i) else i for i in inputs]


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _column(folder: Path) -> dict:
    state, env = _read(folder / STATE), _read(folder / "environment.json")
    try:
        jobs, _ = load_jobs(find_summaries([str(folder / RUNS)]))
    except ReportError:
        jobs = []
    gpu = ", ".join(env.get("gpus") or []) or "CPU"
    label = f"{gpu} ({folder.name}{', smoke' if state.get('smoke') else ''})"
    sweeps = {e["name"]: e for e in state.get("sweeps", [])}
    return {"label": label, "folder": str(folder), "state": state, "sweeps": sweeps,
            "groups": {name: groups_of(js) for name, js in by_experiment(jobs).items()}}


def _sweep_of(job, col: dict) -> dict:
    return col["sweeps"].get(Path(job.dir).parent.name, {})


def _number(st: dict, unit: str) -> str:
    s = f"{st['mean']:.3g}"
    if st["n"] > 1 and st.get("std") is not None:
        s += f" ± {st['std']:.2g}"
    return s + (f" {unit}" if unit and unit not in ("x",) else ("x" if unit == "x" else "")) + \
        (f" (n={st['n']})" if st["n"] > 1 else "")


def _cell(col: dict, source, value) -> str:
    art = next((a for a in col["state"].get("articles", []) if a["id"] == source.id), {})
    stand_in = (art.get("stand_ins") or {}).get(value.id)
    # the plan compares this value with runs of another size (its `why` says how they differ)
    if stand_in:
        value = replace(value, match=stand_in["match"])
    groups = [g for exp in source.experiments for g in col["groups"].get(exp, [])]
    rows = [r for r in compare(value, groups) if r["group"] is not None]
    if not rows:
        return _reason(col, source, value)
    valued = [r for r in rows if r["reproduced"] is not None]
    # groups the value matches but that have no such number (training jobs for batch_gain)
    rows = valued or rows
    parts = []
    for r in rows:
        rep = r["reproduced"]
        if rep is None:
            text = r["verdict"]
        elif "statuses" in rep:
            text = f"{', '.join(dict.fromkeys(rep['statuses']))} ({r['verdict']})"
        else:
            text = _number(rep, value.unit)
            if r.get("ratio") is not None:
                text += (
                    f", ratio {r['ratio']:.2f}"
                    if not isinstance(r["ratio"], list)
                    else f", {r['verdict']}"
                )
            elif r.get("difference") is not None:
                text += f", {r['difference']:+.2g} vs published"
            if r.get("noise"):
                text += f", {r['noise']}"
        prefix = f"{r['group']}, {r['precision']}: " if len(rows) > 1 else ""
        parts.append(prefix + text)
    hit = {(r["group"], r["precision"]) for r in rows}
    cuts = sorted({c for g in groups if (g.label, g.precision) in hit
                   for j in g.jobs for c in _sweep_of(j, col).get("cuts", [])})
    # a run matches, but measures something else
    caveat = (art.get("not_reproduced") or {}).get(value.id)
    return (
        "; ".join(parts)
        + (f" [cut: {'; '.join(cuts)}]" if cuts else "")
        + (f" [stand-in: {stand_in['why']}]" if stand_in else "")
        + (f" [not comparable: {caveat}]" if caveat else "")
    )


NOT_PLANNED = "missing: not in this folder's plan (--only)"


def _reason(col: dict, source, value) -> str:
    """Why a folder has no number for a published value, from its plan."""
    art = next((a for a in col["state"].get("articles", []) if a["id"] == source.id), None)
    if art is None:
        return NOT_PLANNED
    if value.id in (art.get("not_reproduced") or {}):
        return f"missing: {art['not_reproduced'][value.id]}"
    sweeps = [col["sweeps"][n] for n in art["sweeps"] if n in col["sweeps"]]
    if sweeps and all(s["dropped"] for s in sweeps):
        return "missing: not run (dropped to fit the budget)"
    failed = [
        s["name"] for s in sweeps if s["status"] in ("failed", "interrupted", "running", "planned")
    ]
    cuts = sorted({c for s in sweeps for c in s["cuts"]})
    why = f"missing: no run matches {value.match}"
    if cuts:
        why += f" [cut: {'; '.join(cuts)}]"
    if failed:
        why += f"; sweep(s) not completed: {', '.join(failed)} (see logs/)"
    if col["state"].get("smoke"):
        why += (" (smoke run: tiny sizes, e.g. trainer.epochs=1, a value matched on epochs cannot "
                "match)")
    return why


def _ratios(columns: list[dict], sources) -> dict | None:
    """Per model: FP32 training time / mixed-precision (amp) time in each folder, beside the
    published ones."""
    models = list(
        dict.fromkeys(g.model for c in columns for g in c["groups"].get(RATIO_EXPERIMENT, []))
    )
    if not models:
        return None
    published = [
        v
        for s in sources
        if RATIO_EXPERIMENT in s.experiments
        for v in s.values
        if v.metric == "speedup"
    ]
    rows = []
    for m in models:
        cells = []
        for c in columns:
            gs = [
                g
                for g in c["groups"].get(RATIO_EXPERIMENT, [])
                if g.model == m and g.precision == "amp"
            ]
            st = stats([j.metric("speedup") for g in gs for j in g.jobs])
            cuts = sorted({x for g in gs for j in g.jobs for x in _sweep_of(j, c).get("cuts", [])})
            cells.append(
                "-"
                if st is None
                else f"{st['mean']:.2f}x" + (f" [cut: {'; '.join(cuts)}]" if cuts else "")
            )
        pub = [f"{v.format_value()} ({v.hardware})" for v in published if v.match.get("model") == m]
        if all(c == "-" for c in cells) and not pub:
            continue   # no amp/fp32 pair of this model anywhere (e.g. max_batch's records)
        rows.append({"model": m, "cells": cells, "published": "; ".join(pub) or "-"})
    return {"experiment": RATIO_EXPERIMENT, "rows": rows} if rows else None


def section(inputs: list[str], sources) -> dict | None:
    """The side-by-side data (plain values, for report.json), or None when no input is a reference
    folder."""
    folders = [Path(i) for i in inputs if is_reference(i)]
    if not folders:
        return None
    columns = [_column(f) for f in folders]
    articles = []
    for s in sources:
        rows = [
            {
                "id": v.id,
                "label": v.label,
                "published": v.format_value(),
                "hardware": v.hardware,
                "cells": [_cell(c, s, v) for c in columns],
            }
            for v in s.values
        ]
        articles.append({"id": s.id, "title": s.title, "rows": rows})
    return {"columns": [c["label"] for c in columns], "folders": [c["folder"] for c in columns],
            "articles": articles, "ratios": _ratios(columns, sources)}
