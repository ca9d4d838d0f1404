"""Hydra callbacks: at the end of a multirun, print the table of every job from its summary.json."""
from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .records import SUMMARY, read_summary
from .tables import format_table, sweep_note, sweep_rows


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
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summaries, problems = collect(sweep_dir)
        print(f"\nsweep {sweep_dir}: {len(summaries)} jobs")
        if summaries:
            print(format_table(sweep_rows(summaries)))
            if sweep_note(summaries):
                print(sweep_note(summaries))
        for p in problems:
            print(f"unreadable: {p}")
        failed = [s for s in summaries if s.get("status") not in ("completed", "diverged")]
        if failed or problems:
            print(f"{len(failed) + len(problems)} job(s) did not complete; see their summary.json", file=sys.stderr)
            raise SystemExit(1)
