"""The numbers a refactor must not move: a fixed set of fixed-seed CPU jobs, their losses,
accuracies, perplexities, skip counts and verdicts, recorded once and checked after any move.

    python scripts/fixed_numbers.py record outputs/reference/fixed_numbers/numbers.json
    python scripts/fixed_numbers.py check [outputs/reference/fixed_numbers/numbers.json]
        [--only NAME ...]

Each job runs `train.py` in a subprocess on the CPU (fp16/bf16 emulated, as a CPU job always is), so
the check goes through the same entry point a user runs, whatever the modules behind it are called.
What is compared: every value of summary.json's metrics, nonfinite, verdict, numerics, fp8 and
status, and every row of metrics.jsonl, less the keys that measure time, speed or memory (they
differ run to run). Values must be identical: a move changes no arithmetic. Exit status 1 when any
value differs, with one line per difference.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "outputs" / "reference" / "fixed_numbers" / "numbers.json"

SMALL_CNN = ["model=small_cnn", "model.width=8", "dataset.train_size=128", "dataset.test_size=64",
             "trainer.batch_size=16", "trainer.eval_batch_size=32", "trainer.max_steps=12",
             "trainer.log_every=4"]
LSTM = [
    "experiment=apex_word_lm",
    "hydra.mode=RUN",
    "dataset=synthetic_text",
    "dataset.vocab_size=40",
    "dataset.train_size=1200",
    "dataset.test_size=200",
    "model.emsize=8",
    "model.nhid=8",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=5",
    "dataset.bptt=6",
    "trainer.max_steps=12",
    "trainer.log_every=4",
]
GPT = ["model=gpt", "dataset=synthetic_text", "dataset.vocab_size=64", "dataset.train_size=4000",
       "dataset.test_size=400", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
       "model.block_size=16", "dataset.bptt=16", "model.dropout=0", "model.vocab_multiple=1",
       "trainer.batch_size=4", "trainer.eval_batch_size=8", "optimizer=adamw", "optimizer.lr=3e-3",
       "schedule=constant", "trainer.max_steps=12", "trainer.log_every=4"]
PAGE = ["experiment=page_ladder", "hydra.mode=RUN", "trick=page_10_tta", "dataset=synthetic",
        "dataset.train_size=64", "dataset.test_size=32", "dataset.image_size=16",
        "trainer.batch_size=32", "trainer.eval_batch_size=32", "trainer.max_steps=4",
        "model.channels=[8,16,32,64]"]
PITFALL = ["pitfall=adam_fp16", "probe=ranges", "dataset.train_size=64", "dataset.test_size=16",
           "trainer.batch_size=8", "trainer.eval_batch_size=16", "dataset.image_size=8",
           "trainer.max_steps=8", "trainer.log_every=4"]

CASES = {
    "fp32": SMALL_CNN + ["precision=fp32"],
    "amp": SMALL_CNN + ["precision=amp"],
    "amp_bf16": SMALL_CNN + ["precision=amp_bf16"],
    "half": SMALL_CNN + ["precision=half"],
    "o2": SMALL_CNN + ["precision=o2"],
    "fastai_fp16": SMALL_CNN + ["precision=fastai_fp16"],
    "apex_fp16_2018_lstm": LSTM + ["precision=apex_fp16_2018"],
    "fp8_gpt": GPT + ["precision=fp8"],
    "page_step10": PAGE + ["precision=fp32"],
    "adam_fp16_probe": PITFALL,
}
COMMON = ["logger=none", "trainer.device=cpu", "seed=0", "trainer.deterministic=true"]

# Keys that measure time, speed or memory: they differ run to run, and a move may change them.
VOLATILE = re.compile(
    r"time|_s$|throughput|samples_per_s|memory|_mb$|mfu|busy|host_bound|rate|rss|peak"
)


def stable(value):
    """value without its volatile keys, recursively."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if not VOLATILE.search(k)}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def run_case(name: str, out: Path) -> dict:
    """Run one case's job; its stable numbers."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    cmd = [sys.executable, str(ROOT / "train.py"), *CASES[name], *COMMON, f"hydra.run.dir={out}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    summary_file = out / "summary.json"
    if not summary_file.exists():
        raise SystemExit(
            f"fixed_numbers: case {name} wrote no summary.json (exit "
            f"{r.returncode}):\n{r.stderr[-2000:]}"
        )
    summary = json.loads(summary_file.read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    keep = ("status", "nonfinite", "metrics", "verdict", "numerics", "fp8")
    return stable({"summary": {k: summary.get(k) for k in keep}, "rows": rows})


def differences(old, new, path: str = "") -> list[str]:
    """One line per value that differs between two records."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            if k not in new or k not in old:
                out.append(f"{path}.{k}: {'missing after' if k not in new else 'new'}")
            else:
                out += differences(old[k], new[k], f"{path}.{k}")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")
        ]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def run_all(names: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = {}
        for i, name in enumerate(names, 1):
            print(f"[{i}/{len(names)}] {name}", file=sys.stderr, flush=True)
            result[name] = run_case(name, Path(tmp) / name)
        return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["record", "check"])
    p.add_argument("file", type=Path, nargs="?", default=RECORD,
                   help=f"the record (default: {RECORD.relative_to(ROOT)})")
    p.add_argument("--only", nargs="+", choices=list(CASES), help="cases to run (default: all)")
    args = p.parse_args(argv)
    names = args.only or list(CASES)
    if args.action == "record":
        import torch
        record = {
            "command": f"python scripts/fixed_numbers.py record {args.file}",
            "device": "cpu (fp16/bf16 emulated)",
            "torch": torch.__version__,
            "cases": {name: CASES[name] + COMMON for name in names},
            "numbers": run_all(names),
        }
        args.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(args.file)
        print(f"fixed_numbers: {len(names)} cases recorded in {args.file}")
        return 0
    if not args.file.is_file():
        print(f"fixed_numbers: no record at {args.file}; make one with: "
              f"python scripts/fixed_numbers.py record {args.file}", file=sys.stderr)
        return 2
    old = json.loads(args.file.read_text())["numbers"]
    new = run_all(names)
    diffs = [d for name in names for d in differences(old.get(name), new[name], name)]
    print(
        "\n".join(diffs) if diffs else f"fixed_numbers: {len(names)} cases, every number identical"
    )
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
