"""Reproduce every article on this machine's GPU within a time budget, into one folder to share.

    python scripts/reproduce.py [train.py overrides, e.g. gpu=h100 dataset.data_dir=/data] [--budget
    60m] python scripts/reproduce.py --plan --budget 30m          # calibration jobs, then the plan;
    no sweep python scripts/reproduce.py --only page_ladder,torch_amp  # some articles (or sweeps)
    only python scripts/reproduce.py --smoke                       # the whole plan at tiny sizes: a
    CPU proof python scripts/reproduce.py --plan-file src/mixprec/tools/plan_cpu.yaml --only
    torch_amp dataset.data_dir=/data
                                                              # accuracy at CPU sizes, fp16/bf16
                                                              emulated

The plan is src/mixprec/tools/plan.yaml. First a calibration times a few steps of each sweep's jobs
on this device (warm-up excluded, synthetic stand-in data of the real shapes) and predicts each
sweep's minutes; with --budget the plan is cut to fit (each sweep's `cuts`, the longest sweep first)
and printed before anything runs. The sweeps run as `python train.py -m ... trainer.resume=auto`
into <out>/runs/<sweep>: run the same command again after a crash, Ctrl-C or kill -9 and finished
jobs are skipped, interrupted ones resume from their checkpoints; a calibration stopped part-way
continues likewise (<out>/calibration.json, its jobs also with trainer.resume=auto). A failing sweep
is recorded and the next one runs. <out> (default outputs/reference/<gpu>-<date>/) ends with
report/, ENVIRONMENT.md, COMMANDS.md and plan.md (predicted against actual minutes).

This script parses the arguments; the run is mixprec.tools.reproduce (src/mixprec/tools/).
"""
from __future__ import annotations

import sys
from pathlib import Path

from mixprec.tools import cli
from mixprec.tools import reproduce
from mixprec.tools.plan import PlanError


def parse(argv):
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0], prog="reproduce.py")
    ap.add_argument("overrides", nargs="*",
                    help="train.py overrides for every job, e.g. gpu=h100 dataset.data_dir=/data")
    ap.add_argument(
        "--budget", help="time for the whole plan, e.g. 60m, 1h30m (default: full fidelity, uncut)"
    )
    ap.add_argument(
        "--plan", action="store_true",
        help="calibrate, print the plan and exit; the calibration runs jobs (a few timed steps of "
             "each sweep's jobs: minutes on a GPU, about 11 min on a 2-core CPU); --estimate "
             "runs none")
    ap.add_argument(
        "--only",
        help="comma-separated article ids or sweep names (see src/mixprec/tools/plan.yaml)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="every sweep at tiny sizes on the CPU (synthetic data)"
    )
    ap.add_argument(
        "--out", type=Path, help="the results folder (default outputs/reference/<gpu>-<date>)"
    )
    ap.add_argument(
        "--replan",
        action="store_true",
        help="plan again in a folder that holds a plan (sweeps whose "
        "command changed start over; their earlier runs go to replaced/)",
    )
    ap.add_argument(
        "--calibrate",
        choices=("all", "first"),
        help="time every job, or the first job of each sweep (default: all on a GPU, first on a "
             "CPU)",
    )
    ap.add_argument(
        "--calibrate-timeout",
        type=float,
        default=30.0,
        help="seconds per calibration job before a sweep's calibration is stopped as too slow",
    )
    ap.add_argument(
        "--estimate",
        metavar="PROFILES",
        help="print the full plan's minutes on these GPU profiles (e.g. h100,v100) from FLOPs, and "
             "exit, running no job; with --budget also what the plan's cuts would make of it on "
             "each profile (each sweep's minutes and cuts)",
    )
    ap.add_argument(
        "--plan-file",
        type=Path,
        help="another plan (default src/mixprec/tools/plan.yaml); "
        "src/mixprec/tools/plan_cpu.yaml: the accuracy half of every article at CPU sizes, "
        "fp16/bf16 emulated",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return reproduce.main(parse(argv), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(cli.run("reproduce", main, known=(PlanError,)))
