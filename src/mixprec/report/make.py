"""make_report: the records under the inputs -> report.md, report.html (plots embedded),
report.json, plots/*.png.

load -> analyse -> plots -> render, each job's numbers read from its summary.json and metrics.jsonl
(never W&B). scripts/make_report.py and the sweep callback (callbacks.py, report=true) call it.
"""
from __future__ import annotations

from pathlib import Path

from ..records import write_json_atomic, write_text_atomic
from . import reference
from .analyse import analyse
from .load import ReportError, find_summaries, load_jobs
from .plots import make_plots
from .probe_plots import numerics_figures
from .published import load_sources
from .render import document


def default_out(inputs: list[str]) -> Path:
    return (
        Path(inputs[0]) / "report"
        if len(inputs) == 1 and Path(inputs[0]).is_dir()
        else Path("outputs/report")
    )


def make_report(inputs: list[str], out: Path | None = None, published: Path | None = None) -> dict:
    """Read the jobs under `inputs`, write report.md, report.html (plots embedded), report.json and
    plots/*.png into `out`, and return the report's data (with "out" and the paths written)."""
    inputs = [str(i) for i in inputs]
    jobs, problems = load_jobs(find_summaries(reference.job_inputs(inputs)))
    if not jobs:
        raise ReportError("no readable summary.json: " + "; ".join(problems))
    sources = load_sources(published)
    data = analyse(jobs, sources, problems, inputs)
    # results folders side by side (scripts/reproduce.py)
    data["reference"] = reference.section(inputs, sources)
    out = Path(out or default_out(inputs))
    out.mkdir(parents=True, exist_ok=True)
    for exp in data["experiments"]:
        # jobs run with probe=ranges
        exp["plots"] = make_plots(exp, sources, out) + numerics_figures(
            [(j.dir, f"{g.label}, {j.precision}") for g in exp["_groups"] for j in g.jobs],
            out / "plots",
        )
    written = {Path(f["path"]).resolve() for exp in data["experiments"] for f in exp["plots"]}
    for old in (out / "plots").glob("*.png"):
        if old.resolve() not in written:
            # a figure of an earlier report of this folder that this one no longer has
            old.unlink()
    doc = document(data)
    write_text_atomic(out / "report.md", doc.markdown(out))
    write_text_atomic(out / "report.html", doc.html("mixprec reproduction report"))
    for exp in data["experiments"]:
        exp.pop("_groups", None)
    write_json_atomic(out / "report.json", data)
    data["out"] = str(out)
    data["_jobs"] = jobs
    return data
