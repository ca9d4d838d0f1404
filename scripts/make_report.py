"""Make the reproduction report from jobs' records (summary.json + metrics.jsonl; never W&B).

    python scripts/make_report.py outputs/sweeps/<time>                  # ->
    outputs/sweeps/<time>/report/ python scripts/make_report.py 'outputs/sweeps/*' --out
    outputs/report python scripts/make_report.py outputs/sweeps/<time> --wandb          # also a W&B
    Report, when online

Writes report.md, report.html (self-contained: plots embedded), report.json and plots/*.png into
--out.
"""
from __future__ import annotations

import sys
from pathlib import Path


from mixprec.tools import cli
from mixprec.report.load import ReportError
from mixprec.report.make import make_report
from mixprec.report.published import SourceError


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="make_report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIRS",
        help="sweep or job folders, summary.json files, or globs",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="output folder (default: RUN_DIR/report for one folder, else outputs/report)",
    )
    ap.add_argument(
        "--published",
        type=Path,
        help="folder of published-number YAMLs (default: src/mixprec/published)",
    )
    ap.add_argument(
        "--wandb",
        action="store_true",
        help="also build the report as a W&B Report in the runs' project",
    )
    args = ap.parse_args(argv)
    try:
        data = make_report(args.runs, out=args.out, published=args.published)
    except (ReportError, SourceError) as e:
        print(f"make_report: {e}", file=sys.stderr)
        return 2
    n_exp = len(data["experiments"])
    missing = sum(
        1
        for e in data["experiments"]
        for c in e["comparisons"]
        for r in c["rows"]
        if r["group"] is None
    )
    others = len(data["sources_without_runs"])
    print(
        f"report: {data['jobs']} jobs in {n_exp} experiment(s); {missing} published value(s) of "
        "these experiments without a run"
        + (f" ({others} other published source(s) name no experiment run here: report.json's "
           "sources_without_runs)" if others else "")
        + (f"; {len(data['problems'])} unreadable summary file(s)" if data["problems"] else "")
    )
    print(f"report: {Path(data['out']) / 'report.html'}")
    print(f"report: {Path(data['out']) / 'report.md'}")
    if args.wandb:
        from mixprec.report.wandb_report import publish

        url, message = publish(data, data["_jobs"])
        print(f"W&B report: {url}  ({message})" if url else
              f"W&B report not made: {message}; the local report above is complete")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("make_report", main, known=(ReportError, SourceError)))
