"""ATen ops dispatched per steady training step of each step of Page's ladder, counted on the CPU
and attributed to the part of the step that dispatched them.

  python scripts/bench_ladder_ops.py [--steps 1-10] [--batch 32] [--measure 10] [--warm 2] [--json
  PATH] [overrides] e.g. python scripts/bench_ladder_ops.py --steps 6,10 trainer.channels_last=false

No GPU is needed: on an accelerator each dispatched op is host-side work and, unless a view, a
kernel launch, so the count tracks what a host-bound eager step costs (docs/sources/page.md has the
figures). Each ladder step is composed as `experiment=page_ladder trick=page_NN_*`, then made small
without changing what is dispatched: synthetic CIFAR-shaped data, ResNet-9 at width 8 in every layer
(the same layers), batch --batch (a multiple of the 16 ghost-BN splits), native fp16
(precision.emulate=false), the device pipeline for every step (step 1's DataLoader pipeline prepares
batches on the CPU, outside the device's op stream; counted here as the device pipeline's ops). The
job's own parts (parts.image_parts: loaders, model, policy, optimizer, schedule, EMA) are driven as
loop.run_epoch drives them: the next batch, ImageSteps.step, and every trainer.log_every steps the
flush (amortised per step). --warm steps run uncounted first (the optimizer's state is made at the
first step). Parts: data (the batch's augmentation and normalisation), forward (of which ghost BN:
GhostBatchNorm.forward), loss, backward, precision (step.py's loss scaler and policy lines: casts,
loss scaling, master copies, clipping), optimizer, ema, schedule, bookkeeping (the step's detached
loss and correct count), flush (the log window's checks, per step), other.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.tools import cli
from mixprec.runtime import dist
from mixprec.train.loop import Loop, LoopState, Window, flush, total_steps
from mixprec.config import ConfigError, validate
from mixprec.models.resnet9 import GhostBatchNorm
from mixprec.precision import emulation
from mixprec.train.parts import JobContext, image_parts

ROOT = Path(__file__).resolve().parents[1]


LADDER = [
    "page_01_baseline",
    "page_02_gpu_preproc",
    "page_03_maxpool_reorder",
    "page_04_label_smoothing",
    "page_05_celu",
    "page_06_ghost_bn",
    "page_07_frozen_bn_scale",
    "page_08_whitening",
    "page_09_ema",
    "page_10_tta",
]

# (file suffix, function names or None for any, part): the innermost frame that matches names the
# part of an op
RULES = [
    ("mixprec/data/pipelines.py", None, "data"),
    ("mixprec/train/tricks.py", {"update"}, "ema"),
    ("mixprec/train/tricks.py", {"cross_entropy"}, "loss"),
    ("torch/optim/lr_scheduler.py", None, "schedule"),
    ("mixprec/train/optim.py", None, "schedule"),
    ("torch/optim/", None, "optimizer"),
    ("torch/_tensor.py", {"backward"}, "backward"),
    ("mixprec/precision/policy.py", None, "precision"),
    ("mixprec/train/step.py", {"backward_and_step"}, "precision"),
    ("mixprec/train/step.py", {"forward"}, "forward"),
    ("mixprec/train/loop.py", {"flush", "check_window", "all_finite", "row"}, "flush"),
    ("mixprec/train/image_steps.py", {"step"}, "bookkeeping"),
    ("mixprec/train/step.py", None, "bookkeeping"),
]
PARTS = [
    "data",
    "forward",
    "ghost_bn",
    "loss",
    "backward",
    "precision",
    "optimizer",
    "ema",
    "schedule",
    "bookkeeping",
    "flush",
    "other",
]


def part_of_stack() -> str:
    """The part of the step whose code dispatched the op being counted (RULES; ghost_bn: inside a
    GhostBatchNorm's own code, its forward in training)."""
    frame = sys._getframe(2)
    while frame is not None:
        name, func = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        if name.endswith("mixprec/models/resnet9.py") and isinstance(
            frame.f_locals.get("self"), GhostBatchNorm
        ):
            return "ghost_bn"
        for suffix, funcs, part in RULES:
            if suffix in name and (funcs is None or func in funcs):
                return part
        frame = frame.f_back
    return "other"


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched while active, by part of the step (part_of_stack)."""

    def __init__(self):
        super().__init__()
        self.parts: Counter = Counter()
        self.ops: Counter = Counter()   # (part, op name)
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        part = part_of_stack()
        self.parts[part] += 1
        self.views += func.is_view   # metadata only: no kernel on a device
        self.ops[part, str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def ladder_config(trick: str, batch: int, measure: int, warm: int, overrides: list[str]):
    return validate(
        cli.compose(
            [
                "logger=none",
                "experiment=page_ladder",
                f"trick={trick}",
                "dataset=synthetic",
                "dataset.pipeline=device",
                f"dataset.train_size={batch * (warm + measure)}",
                f"dataset.test_size={batch}",
                "model.channels=[8,8,8,8]",
                f"trainer.batch_size={batch}",
                f"trainer.eval_batch_size={batch}",
                "trainer.device=cpu",
                "precision.emulate=false",
                "trainer.prewarm_steps=0",
                "trick.whitening_images=64",
                *overrides,
            ]
        )
    )


def count_step_ops(
    trick: str, batch: int = 32, measure: int = 10, warm: int = 2, overrides=()
) -> dict:
    """Ops per steady step of ladder step `trick`, by part (with 'total')."""
    config = ladder_config(trick, batch, measure, warm, list(overrides))
    torch.manual_seed(config.seed)
    device = torch.device("cpu")
    with emulation.numerics(False):
        # one process: each rank's batch is the whole batch
        parts = image_parts(JobContext(config, device, dist.SINGLE, config.trainer.batch_size))
        steps, batches = parts.steps, parts.batches
        loop = Loop(
            parts.policy,
            parts.optimizer,
            config.trainer,
            total_steps(config.trainer, len(batches)),
            progress=False,
        )
        state, counter = LoopState(steps_per_epoch=len(batches)), OpCounter()
        steps.start_epoch(0)
        window, it = Window(), iter(batches)
        for i in range(warm + measure):
            with counter if i >= warm else contextlib.nullcontext():
                x, y = next(it)
                loss, correct, n = steps.step(x, y, loop, state)
            state.step += 1
            window.add(loss, correct, n)
        views = counter.views
        with counter:   # one flush per log_every steps: its ops per step
            flush(steps, window, loop, state)
    flush_ops = counter.parts.pop("flush", 0)
    per_step = {p: counter.parts.get(p, 0) / measure for p in PARTS if p != "flush"}
    per_step["flush"] = flush_ops / config.trainer.log_every
    per_step["total"] = sum(per_step.values())
    # of the total: views (no kernel launched), the flush's left out
    per_step["views"] = views / measure
    return per_step


def parse_steps(text: str) -> list[str]:
    chosen = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        chosen.update(range(int(lo), int(hi or lo) + 1))
    if not chosen <= set(range(1, 11)):
        raise SystemExit(f"--steps {text}: ladder steps are 1..10")
    return [LADDER[i - 1] for i in sorted(chosen)]


def table(rows: dict) -> str:
    head = "| step | " + " | ".join(PARTS) + " | total | of which views |"
    lines = [head, "|" + "---|" * (len(PARTS) + 3)]
    for name, r in rows.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{r[p]:g}" for p in PARTS)
            + f" | {r['total']:g} | {r['views']:g} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="1-10", help="ladder steps, e.g. 1-10 or 6,10")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--measure", type=int, default=10, help="counted steps")
    p.add_argument("--warm", type=int, default=2, help="uncounted steps first")
    p.add_argument("--json", help="also write the rows here")
    args, overrides = p.parse_known_args(argv)
    try:
        rows = {
            t: count_step_ops(t, args.batch, args.measure, args.warm, overrides)
            for t in parse_steps(args.steps)
        }
    except ConfigError as e:  # e.g. a --batch the 16 ghost-BN splits do not divide
        raise SystemExit(f"bench_ladder_ops: {e}") from None
    print(
        f"ATen ops per steady training step (CPU, batch {args.batch}, {args.measure} steps after "
        f"{args.warm}; overrides: {' '.join(overrides) or 'none'})"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
