"""The Hydra callback (conf/config.yaml: hydra.callbacks.sweep_table): at the end of a multirun,
print the table of every job and, for a sweep over Page's ladder, the ladder table: the rows the
report is made from (load.sweep_jobs -> analyse.by_experiment / ladder_rows ->
console.format_table); with report=true, also the sweep's report."""
from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .. import records
from ..runtime.dist import from_env
from ..runtime.signals import resume_hint
from .analyse import by_experiment, ladder_rows
from .load import sweep_jobs
from .console import format_table, sweep_note, sweep_tables
from .rows import LADDER_COLUMNS, ladder_cells


class SweepTable(Callback):
    def __init__(self, report: bool = False):
        # also write the sweep's report (scripts/make_report.py) into <sweep dir>/report
        self.report = report

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        # `torchrun ... train.py -m`: rank 0 prints the table (jobs under a launcher
        if not from_env().main:
            return                # end in the submitting process, which has no rank)
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs, problems = sweep_jobs(sweep_dir)
        summaries = [j.summary for j in jobs]
        print(f"\nsweep {sweep_dir}: {len(jobs)} jobs")
        if jobs:
            by_experiment(jobs)   # each job's sweep row, as the report has it
            print(sweep_tables([j.row for j in jobs]))
            note = sweep_note(summaries)
            if note:
                print(note)
        ladder = ladder_rows(summaries)
        if ladder:  # a sweep over Page's ladder steps: per step, beside the article's V100 times
            print(
                "\nPage's ladder (article: one V100, each step's fixed-schedule time, step 1's "
                "with its data preparation: time+prep s; statistics over all runs):\n"
                + format_table([ladder_cells(r) for r in ladder], LADDER_COLUMNS)
            )
        for p in problems:
            print(f"unreadable: {p}")
        if self.report and jobs:
            sweep_report(sweep_dir)
        failed = [s for s in summaries if records.status(s) not in ("completed", "diverged")]
        if failed or problems:
            print(
                f"{len(failed) + len(problems)} job(s) did not complete; see their summary.json",
                file=sys.stderr,
            )
            print(
                f"to retry them (completed jobs are skipped): {resume_hint(None, sweep_dir)}",
                file=sys.stderr,
            )
            raise SystemExit(1)


def sweep_report(sweep_dir: Path) -> None:
    """The sweep's report, made by the same code as scripts/make_report.py; a failure here is
    reported in one line and never fails the sweep (its jobs' records are what counts)."""
    try:
        from .make import make_report   # matplotlib is imported only when a report is asked for

        data = make_report([str(sweep_dir)], out=sweep_dir / "report")
        print(f"report      {Path(data['out']) / 'report.html'} (and report.md)")
    except Exception as e:
        print(
            f"mixprec: the sweep's report was not made ({type(e).__name__}: {e}); the jobs' "
            "records are intact; "
            f"retry with: python scripts/make_report.py {sweep_dir}",
            file=sys.stderr,
        )
