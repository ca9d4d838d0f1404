"""Evaluate a finished job's saved fp32 weights on its test split, in an fp32 model with fp32 math.

    python scripts/evaluate.py outputs/runs/<time>      [--device cpu]

Whatever precision the job trained in (half, o2, amp ...), it saved model_fp32.pt; this loads it
into a fresh fp32 model rebuilt from the job's summary.json and prints the accuracy beside the one
the job recorded.
"""
import json
import sys
from pathlib import Path

from mixprec.tools import cli
from mixprec.train.checkpoint import CheckpointError
from mixprec.config import ConfigError
from mixprec.data.files import DataError
from mixprec.tools.evaluate import evaluate_saved

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    if not (args.run_dir / "summary.json").is_file():
        print(
            f"evaluate: {args.run_dir}: no summary.json there; give the folder of a finished "
            "train.py job "
            "(outputs/runs/<time>, or a job folder of a sweep)",
            file=sys.stderr,
        )
        return 2
    try:
        r = evaluate_saved(args.run_dir, args.device)
    except (CheckpointError, ConfigError, DataError) as e:
        print(f"evaluate: {e}".replace("trainer.device", "--device"), file=sys.stderr)
        return 2
    print(
        f"trained in {r['precision']}; fp32 evaluation of model_fp32.pt: test acc "
        f"{r['test_acc']:.4f} (the job recorded {r['recorded_test_acc']:.4f}), test loss "
        f"{r['test_loss']:.4f} (recorded {r['recorded_test_loss']:.4f})"
    )
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("evaluate", main))
