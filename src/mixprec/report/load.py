"""Reading the records: the summary.json files under the report's inputs (sweep or job folders,
files, globs), each as a Job: its summary, its metrics.jsonl rows, and the value of a metric the
report compares.

Every field of a summary is read through mixprec.records' accessors (the summary-format contract).
"""
from __future__ import annotations

import glob
import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import records
from ..records import METRICS, SUMMARY, job_order, read_jsonl, read_summaries


class ReportError(ValueError):
    """Bad input to the report (nothing to read): one line for the user."""


def number(x):
    """x when it is a finite number (not a bool), else None."""
    return (
        x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None
    )


@dataclass
class Job:
    dir: Path
    summary: dict
    row: dict = field(default_factory=dict)       # its analyse.sweep_rows row
    # the completed fp32 job with the same other overrides
    fp32: dict | None = None
    variant: str = ""          # what else sets it apart in its experiment (short form)
    variant_full: str = ""
    _rows: list | None = None

    @property
    def experiment(self) -> str:
        return records.experiment(self.summary)

    @property
    def model(self) -> str:
        return str(records.choices(self.summary).get("model", "?"))

    @property
    def precision(self) -> str:
        return str(records.choices(self.summary).get("precision", "?"))

    @property
    def status(self) -> str:
        return str(records.status(self.summary) or "unknown")

    @property
    def plotted(self) -> bool:
        """Whether its rows go into the figures: not a killed job's (its records stop anywhere)."""
        return self.status != "killed"

    @property
    def seed(self):
        return records.seed(self.summary)

    def rows(self) -> list[dict]:
        """metrics.jsonl rows (an incomplete last line, as a killed job may leave, is skipped)."""
        if self._rows is None:
            self._rows = read_jsonl(self.dir / METRICS)
        return self._rows

    def metric(self, name: str):
        """The run's value of a metric (published.DERIVED or a summary["metrics"] key); None where
        it has none. Numbers come from completed runs only: a diverged run's time is not a training
        time."""
        if name == "status":
            return self.status
        if self.status != "completed":
            return None
        m = records.metrics(self.summary)
        f = records.metrics(self.fp32 or {})
        if name in ("speedup", "loss_gap"):
            return self.row.get(name)
        # apex's main.py reports the test perplexity of its best-validation model
        if name == "test_ppl":
            if not records.is_language_model(self.summary):
                return None   # an image model's test loss is no perplexity
            for key in ("test_ppl_at_best_valid", "final_test_ppl"):
                if number(m.get(key)) is not None:
                    return m[key]
            return (
                math.exp(m["final_test_loss"])
                if number(m.get("final_test_loss")) is not None
                else None
            )
        if name == "test_acc_pct":
            return (
                100 * m["final_test_acc"] if number(m.get("final_test_acc")) is not None else None
            )
        if name == "acc_change_vs_fp32":
            a, b = number(m.get("final_test_acc")), number(f.get("final_test_acc"))
            return None if a is None or b is None else 100 * (a - b)
        if name == "batch_gain":
            a, b = number(m.get("max_batch_size")), number(f.get("max_batch_size"))
            return None if a is None or not b else a / b
        return number(m.get(name))


def find_summaries(inputs: list[str]) -> list[Path]:
    """summary.json files under the given sweep/job folders, files or globs, each once, in a stable
    order."""
    if not inputs:
        raise ReportError(
            "give at least one run folder (a sweep dir, a job dir, several, or a glob)"
        )
    found = []
    for arg in inputs:
        p = Path(arg)
        if p.is_file():
            if p.name != SUMMARY:
                raise ReportError(f"{arg}: not a {SUMMARY} nor a folder of runs")
            found.append(p)
        elif p.is_dir():
            found += sorted(p.rglob(SUMMARY), key=job_order)
        elif glob.has_magic(arg):
            hits = sorted(glob.glob(arg))
            if not hits:
                raise ReportError(f"{arg}: matches no file or folder")
            found += find_summaries(hits)
        else:
            raise ReportError(f"{arg}: no such file or folder")
    unique = list({p.resolve(): p for p in found}.values())
    if not unique:
        raise ReportError(
            f"no {SUMMARY} under {', '.join(inputs)}: run jobs first (python train.py ...)"
        )
    return unique


def load_jobs(paths: list[Path]) -> tuple[list[Job], list[str]]:
    """The jobs, in the order of `paths`, and the summary files that could not be read."""
    read, problems = read_summaries(paths)
    return [Job(path.parent, summary) for path, summary in read], problems


def sweep_jobs(sweep_dir: Path) -> tuple[list[Job], list[str]]:
    """A sweep's jobs (one folder each, directly under sweep_dir), in job order, and its unreadable
    summaries."""
    return load_jobs(sorted(Path(sweep_dir).glob(f"*/{SUMMARY}"), key=job_order))
