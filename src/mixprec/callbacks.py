"""Hydra callbacks: at the end of a multirun, print the table of every job from its summary.json."""
from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .signals import resume_hint
from .dist import from_env
from .records import SUMMARY, read_summary
from .tables import LADDER_COLUMNS, format_table, ladder_rows, sweep_note, sweep_rows


def collect(sweep_dir: Path) -> tuple[list[dict], list[str]]:
    """Every job's summary under sweep_dir, in job order, and the problems found (unreadable files)."""
    summaries, problems = [], []
    for path in sorted(Path(sweep_dir).glob(f"*/{SUMMARY}"), key=lambda p: _job_num(p.parent.name)):
        try:
            summaries.append(read_summary(path))
        except ValueError as e:
            problems.append(str(e))
    return summaries, problems


def _job_num(name: str) -> tuple:
    head = name.split("_", 1)[0]
    return (int(head), name) if head.isdigit() else (10**9, name)


class SweepTable(Callback):
    def __init__(self, report: bool = False):
        self.report = report   # also write the sweep's report (scripts/make_report.py) into <sweep dir>/report

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if not from_env().main:   # `torchrun ... train.py -m`: rank 0 prints the table (jobs under a launcher
            return                # end in the submitting process, which has no rank)
        sweep_dir = Path(config.hydra.sweep.dir)
        summaries, problems = collect(sweep_dir)
        print(f"\nsweep {sweep_dir}: {len(summaries)} jobs")
        if summaries:
            print(format_table(sweep_rows(summaries)))
            if sweep_note(summaries):
                print(sweep_note(summaries))
        ladder = ladder_rows(summaries)
        if ladder:  # a sweep over Page's ladder steps: per step, beside the article's V100 times
            print(f"\nPage's ladder (article: one V100, time to 94%):\n{format_table(ladder, LADDER_COLUMNS)}")
        for p in problems:
            print(f"unreadable: {p}")
        if self.report and summaries:
            sweep_report(sweep_dir)
        failed = [s for s in summaries if s.get("status") not in ("completed", "diverged")]
        if failed or problems:
            print(f"{len(failed) + len(problems)} job(s) did not complete; see their summary.json", file=sys.stderr)
            print(f"to retry them (completed jobs are skipped): {resume_hint(None, sweep_dir)}", file=sys.stderr)
            raise SystemExit(1)


def sweep_report(sweep_dir: Path) -> None:
    """The sweep's report, made by the same code as scripts/make_report.py; a failure here is reported in one
    line and never fails the sweep (its jobs' records are what counts)."""
    try:
        from .report import make_report

        data = make_report([str(sweep_dir)], out=sweep_dir / "report")
        print(f"report      {Path(data['out']) / 'report.html'} (and report.md)")
    except Exception as e:
        print(f"mixprec: the sweep's report was not made ({type(e).__name__}: {e}); the jobs' records are intact; "
              f"retry with: python scripts/make_report.py {sweep_dir}", file=sys.stderr)
