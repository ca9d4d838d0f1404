"""The report as a W&B Report (wandb-workspaces reports API), in the runs' own project.

`build(data, jobs, entity, project)` makes the objects (no network); `publish(...)` saves them when
W&B can be reached and otherwise returns the one line that says why not. The local report never
depends on this. The runs appear in W&B once uploaded: offline runs (the default) need `wandb sync`
first.
"""
from __future__ import annotations

import os
import socket
from collections import Counter
from urllib.parse import urlparse

from .. import records
from .render import Doc, format_ratio, format_reproduced, unmatched_line

GROUP_BY = ["config.precision.name", "config.model.arch"]
BARS = [("train_time_s", "training time (s)"), ("throughput", "samples/s (steady state)"),
        ("peak_memory_mb", "peak memory (MB)"), ("final_test_acc", "final test accuracy")]


def run_ids(jobs) -> dict[str, list[str]]:
    """W&B run ids per experiment, for the jobs that logged to W&B."""
    out: dict[str, list[str]] = {}
    for j in jobs:
        rid = records.wandb_run_id(j.summary)
        if rid:
            out.setdefault(j.experiment, []).append(rid)
    return out


def project_of(jobs) -> tuple[str | None, str | None]:
    """The (entity, project) most of the W&B-logged jobs used (config.logger)."""
    pairs = Counter(
        (
            records.lookup(j.summary, "logger.entity"),
            records.lookup(j.summary, "logger.project") or "mixprec",
        )
        for j in jobs
        if records.wandb_run_id(j.summary)
    )
    return pairs.most_common(1)[0][0] if pairs else (None, None)


def build(data: dict, jobs, entity: str, project: str, title: str = "mixprec reproduction report"):
    """The wr.Report the local report's data would make: per experiment, the reproduced-vs-published
    table as Markdown and a panel grid over that experiment's runs, grouped by precision and
    model."""
    import wandb_workspaces.reports.v2 as wr   # lazy: optional (the report extra)

    ids = run_ids(jobs)
    blocks = [
        wr.P(
            f"Made by scripts/make_report.py from {data['jobs']} job(s) under "
            f"{', '.join(data['inputs'])}. Speed-up = fp32 training time / the run's, for the fp32 "
            "run with the same other settings."
        )
    ]
    for exp in data["experiments"]:
        if not ids.get(exp["name"]):
            continue
        blocks.append(wr.H2(f"Experiment {exp['name']}"))
        table = _comparison_markdown(exp)
        if table:
            blocks.append(wr.MarkdownBlock(text=table))
        runset = wr.Runset(entity=entity, project=project, name=exp["name"],
                           filters="ID in [" + ", ".join(repr(i) for i in ids[exp["name"]]) + "]",
                           groupby=list(GROUP_BY))
        panels = [
            wr.BarPlot(
                title=t,
                metrics=[m],
                groupby_aggfunc="mean",
                groupby_rangefunc="stddev",
                layout=wr.Layout(x=8 * (i % 3), y=0, w=8, h=6),
            )
            for i, (m, t) in enumerate(BARS)
        ]
        panels += [
            wr.LinePlot(
                title="test accuracy per epoch",
                x="epoch",
                y=["test_acc"],
                groupby_aggfunc="mean",
                groupby_rangefunc="minmax",
                layout=wr.Layout(x=0, y=12, w=12, h=8),
            ),
            wr.LinePlot(
                title="loss scale",
                x="step",
                y=["loss_scale"],
                log_y=True,
                layout=wr.Layout(x=12, y=12, w=12, h=8),
            ),
        ]
        blocks.append(wr.PanelGrid(runsets=[runset], panels=panels))
    return wr.Report(
        project=project,
        entity=entity,
        title=title,
        description="Reproduced numbers beside the published ones, per experiment.",
        blocks=blocks,
    )


def _comparison_markdown(exp: dict) -> str:
    """The published values beside the runs, as the local report has them: a source with no
    matching run is one line."""
    d = Doc()
    unmatched = exp.get("unmatched_sources", [])
    skip = {u["id"] for u in unmatched}
    rows = [
        [
            c["label"],
            c["published"],
            c["hardware"],
            f"{r['group']}, {r['precision']}" if r["group"] else "-",
            r["verdict"] if r["group"] is None else format_reproduced(c, r),
            format_ratio(r),
        ]
        for c in exp["comparisons"]
        if c["source"] not in skip
        for r in c["rows"]
    ]
    if rows:
        d.table(["value", "published", "published on", "our runs", "reproduced", "ratio"], rows)
    if unmatched:
        d.bullets([unmatched_line(u) for u in unmatched])
    return d.markdown(base=None).strip() if d.blocks else ""


def offline_reason() -> str | None:
    """Why W&B cannot be reached from here (None: it looks reachable), without sending anything."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        return f"WANDB_MODE={mode}"
    try:
        import wandb_workspaces.reports.v2  # noqa: F401  (lazy: optional, asked here)
    except ImportError:
        return "wandb-workspaces is not installed (pip install -e \".[report]\")"
    import wandb   # lazy: optional, slow to import

    try:
        wandb.Api()
    except Exception as e:  # wandb.errors.UsageError: no API key
        return f"no W&B login ({str(e).splitlines()[0]})"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=5).close()
    except OSError as e:
        return f"no network: cannot reach {host.hostname} ({e})"
    return None


def publish(data: dict, jobs) -> tuple[str | None, str]:
    """Save the W&B Report; (url, message) when saved, (None, one line why not) otherwise."""
    ids = run_ids(jobs)
    if not ids:
        return (
            None,
            "none of these jobs logged to W&B (logger=none); nothing to put in a W&B report",
        )
    why = offline_reason()
    if why:
        return None, f"offline: {why}"
    import wandb   # lazy: optional, slow to import

    entity, project = project_of(jobs)
    try:
        entity = entity or wandb.Api().default_entity
        report = build(data, jobs, entity, project)
        report.save()
        return report.url, (
            f"saved in {entity}/{project} (offline runs show once uploaded: wandb sync <job "
            "dir>/wandb/offline-run-*)"
        )
    except Exception as e:
        return (
            None,
            f"W&B refused or failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}",
        )
