"""Emulated fp16/bf16 (precision.emulate, precision/emulation.py) against fp32 on this device:
training step time.

  python scripts/bench_emulation.py [--models resnet18,lstm] [--precisions amp,half,amp_bf16]
  [--steps 10]
                                    [--native-steps 0] [--out FILE]

What is timed: training steps only, the job's step (train/step.py: forward under the precision's
policy, fp32 cross-entropy, backward, optimizer step, loss-scale update), on fixed synthetic batches
already in memory, after --warmup untimed steps; each round times every precision once, in a random
order, --repeats rounds; the median step time per precision and its ratio to fp32's median.
Sizes: ResNet-18 (CIFAR stem) at 32 px, batch 64; the LSTM of PyTorch's word_language_model
example (emsize 200, nhid 200, 2 layers, vocabulary 33,278 as Wikitext-2), bptt 35, batch 20.
--native-steps N also times N steps of the CPU's own fp16/bf16 kernels (precision.emulate=false;
slow: ~150x fp32 for ResNet-18).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from mixprec.tools import cli
from mixprec.config import validate
from mixprec.models import build_model
from mixprec.precision import emulation
from mixprec.train import step
from mixprec.train.build import build_trained
from mixprec.records import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


MODELS = {
    "resnet18": ["model=resnet18", "dataset.image_size=32", "trainer.batch_size=64"],
    "lstm": ["model=lstm", "dataset=synthetic_text", "trainer.batch_size=20", "dataset.bptt=35"],
}
VOCAB = 33278


class Job:
    """One model under one precision, built as a job builds it, ready to take timed steps."""

    def __init__(self, model: str, precision: str, emulate: bool):
        config = validate(
            cli.compose(
                [
                    *MODELS[model],
                    f"precision={precision}",
                    f"precision.emulate={emulate}",
                    "trainer.device=cpu",
                    "logger=none",
                ]
            )
        )
        kind = "" if precision == "fp32" else " (emulated)" if emulate else " (native)"
        self.name, self.lm = f"{precision}{kind}", model == "lstm"
        self.emulated = emulate and precision != "fp32"
        torch.manual_seed(0)
        with emulation.numerics(self.emulated):
            built = build_trained(
                build_model(config.model, VOCAB if self.lm else 10),
                config,
                torch.device("cpu"),
                channels_last=not self.lm and config.trainer.channels_last,
            )
            self.policy, self.model, self.opt = built.policy, built.model, built.optimizer
        b = config.trainer.batch_size
        if self.lm:
            bptt = config.dataset.bptt
            self.x, self.y = torch.randint(VOCAB, (bptt, b)), torch.randint(VOCAB, (bptt, b))
            self.hidden = self.model.init_hidden(b)
        else:
            self.x = torch.randn(b, 3, 32, 32).contiguous(memory_format=torch.channels_last)
            self.y = torch.randint(10, (b,))

    def step(self) -> None:
        with emulation.numerics(self.emulated):
            # the job's step (train/step.py): a window from the same hidden state each time
            if self.lm:
                loss = step.lm_forward(self.model, self.x, self.y, self.hidden, self.policy)[0]
            else:
                loss = step.image_forward(self.model, self.x, self.y, self.policy)[0]
            step.backward_and_step(loss, self.policy, self.opt)
            self.opt.zero_grad(set_to_none=True)

    def time(self, steps: int) -> float:
        start = time.perf_counter()   # CPU: each step returns when its work is done
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - start) / steps


def bench(model: str, precisions: list[str], args) -> dict:
    jobs = [Job(model, "fp32", False)] + [Job(model, p, True) for p in precisions]
    for job in jobs:
        job.time(args.warmup)
    times = {job.name: [] for job in jobs}
    rng = random.Random(args.seed)
    for r in range(args.repeats):
        for job in rng.sample(jobs, len(jobs)):
            times[job.name].append(job.time(args.steps))
        print(f"  {model}: round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    if args.native_steps:
        for p in precisions:
            job = Job(model, p, False)
            times[job.name] = [job.time(args.native_steps)]
    base = statistics.median(times[jobs[0].name])
    return {
        name: {
            "median_step_s": statistics.median(t),
            "steps_timed": len(t) * (args.steps if "native" not in name else args.native_steps),
            "rounds": [round(v, 4) for v in t],
            "vs_fp32": statistics.median(t) / base,
        }
        for name, t in times.items()
    }


def main(argv=None) -> int:
    parser = cli.ArgumentParser(
        prog="bench_emulation.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--models", default="resnet18,lstm")
    parser.add_argument("--precisions", default="amp,half,amp_bf16")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per precision per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds, each timing every precision in a random order",
    )
    parser.add_argument(
        "--native-steps",
        type=int,
        default=0,
        help="also time N steps of the native fp16/bf16 kernels",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_intermixed_args(argv)
    models, precisions = args.models.split(","), args.precisions.split(",")
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    if min(args.steps, args.warmup, args.repeats) < 1 or args.native_steps < 0:
        parser.error("--steps, --warmup and --repeats must be >= 1, --native-steps >= 0")
    result = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "command": " ".join(["python scripts/bench_emulation.py", *sys.argv[1:]]),
        "models": {},
    }
    for m in models:
        result["models"][m] = r = bench(m, precisions, args)
        print(f"{m} ({' '.join(MODELS[m])}), {torch.get_num_threads()} threads:")
        for name, v in r.items():
            print(
                f"  {name:22s} {1000 * v['median_step_s']:9.1f} ms/step  {v['vs_fp32']:6.2f}x fp32"
            )
    if args.out:
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("bench_emulation", main))
