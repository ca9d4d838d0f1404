"""Benchmarks of the harness itself and of models x precisions.

  python scripts/benchmark.py overhead [train.py overrides] [--compile MODE]   e.g. model=resnet18
  precision=amp
      mixprec's training loop (loop.fit through mixprec.job.train_and_record, records and all)
      against the loop a user would write by hand for the same job: same model, batch, data on the
      device, optimizer (class and optimizer.impl kernels), schedule, autocast/GradScaler, grad
      clipping, channels_last and compile mode; a job the hand loop cannot mirror (low-precision
      weights, master weights, a static loss scale, any trick, augmented or non-synthetic data,
      on_nonfinite=skip) is refused with the reason. --steps timed steps (300) after --warmup; one
      discarded round, then --repeats rounds, each running both loops in a random order (--seed);
      reports each loop's median, the ratio mixprec / hand of the medians, and the spread (min..max)
      of the per-round ratios. --compile MODE compiles both (trainer.compile=MODE; compilation is
      untimed in both).
  python scripts/benchmark.py table --models resnet18,resnet50 --precisions
  fp32,tf32,amp,amp_bf16,half,bf16
          --batches 64,256 --compiles none,default [overrides] --out DIR
      the speed table, one cell per (image model, precision, batch, compile mode): each model
      is built once, each cell trains a copy of it the way a job does (the precision policy,
      channels_last, optimizer, compile mode) and steps it with a job's loop (loop.fit: the
      step.py's step, the log window and its one flush, the training clock, the busy meter) on
      one synthetic batch on the device, in the job's memory layout: --warmup steps out of the
      steady clock (10; compilation and cuDNN autotuning fall there), then --steps steady steps
      (30), a few of them sampled for the GPU's own time (busy.py, CUDA only). Per cell:
      samples/s (the job's steady throughput), speed-up against the fp32 cell of the same model,
      batch and compile mode, step time, GPU busy fraction (host-bound below 0.8), peak memory
      (max allocated on the accelerator; '-' on a CPU) and the cell's own seconds. A cell that
      fails (an OOM, a compile error) is recorded with its error, dynamo and the device's cache
      are reset, and the table goes on. --out DIR: table.json and
      table.md. Language models are not in it (their speed: train.py
      experiment=transformer_precision).

Both run on the CPU too (use small sizes there: model=small_cnn trainer.batch_size=32
dataset.image_size=16). What overhead times: the same thing for both loops: training steps only
(batch slicing and normalisation on the device, forward, loss, backward, optimizer step, loss-scale
update), after --warmup steps, with the device synchronized before each clock reading; no
evaluation, no data generation.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from mixprec.runtime import busy, hardware
from mixprec.tools import cli
from mixprec.train.loop import Loop, LoopState, fit
from mixprec.train.compile import GraphWatch, compile_model, reset_compile_state
from mixprec.config import Config, ConfigError, plain_config, validate
from mixprec.data import synthetic_images
from mixprec.data.pipelines import in_layout
from mixprec.job import JobDir, train_and_record
from mixprec.models import build_model
from mixprec.train.optim import build_optimizer, build_schedule
from mixprec.precision import emulation, modes
from mixprec.precision.modes import DTYPES, emulates
from mixprec.records import write_json_atomic, write_text_atomic
from mixprec.train import image_steps
from mixprec.train.build import build_trained

ROOT = Path(__file__).resolve().parents[1]


def compose(overrides: list[str]) -> tuple[Config, dict]:
    """The validated config, and the summary fields a job gets from Hydra (choices, overrides,
    config)."""
    # speed only: no W&B, no final weights written
    cfg = cli.compose(["logger=none", "trainer.save_weights=false", *overrides],
                      return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    config = validate(cfg)
    modes.check_installed(config.precision)   # fp8's torchao, before any cell is timed
    return config, {"choices": choices, "overrides": overrides, "config": plain_config(cfg)}


def sized(overrides: list[str], steps: int, warmup: int) -> list[str]:
    """One epoch of exactly warmup + steps batches, no augmentation, the smallest eval split."""
    config, _ = compose(overrides)
    b = config.trainer.batch_size
    return [*overrides, f"dataset.train_size={(warmup + steps) * b}", f"dataset.test_size={b}",
            "dataset.augment=false", "trainer.epochs=1", f"trainer.warmup_steps={warmup}",
            f"trainer.log_every={max(steps, 1)}", "trainer.max_steps=null"]


def mixprec_throughput(overrides: list[str]) -> dict:
    """Steady samples/s of a full mixprec job (records written to a temp dir)."""
    config, fields = compose(overrides)
    with tempfile.TemporaryDirectory() as out:
        summary = train_and_record(config, {"status": "failed", **fields}, JobDir(Path(out)))
    if summary["status"] != "completed":
        raise SystemExit(
            "benchmark: the mixprec job did not complete: "
            f"{summary.get('error') or summary.get('reason')}"
        )
    m = summary["metrics"]
    if m["throughput_includes_warmup"]:
        raise SystemExit("benchmark: too few steps for a steady-state measurement; raise --steps")
    return {
        "samples_per_s": m["throughput"],
        "mfu": m.get("mfu"),
        "device": summary["env"]["device_name"],
        "peak_memory_mb": m["peak_memory_mb"],
    }


def refusal(config: Config) -> str | None:
    """Why the hand-written loop cannot mirror this job (None when it can)."""
    p, tr, t = config.precision, config.trainer, config.trick
    if p.param_dtype != "float32" or p.master_weights or p.loss_scale not in ("dynamic", "none"):
        return (
            "the hand-written loop covers the autocast family (fp32, tf32, amp, amp_bf16, o0, "
            f"o1), not precision={p.name} (low-precision weights, master weights or a static loss "
            "scale)"
        )
    if t != type(t)():
        return (
            f"the hand-written loop has no tricks; trick={t.name} changes the step (use trick=none)"
        )
    if config.model.bn_eval or config.model.arch == "resnet9":
        return ("the hand-written loop trains a plain model; resnet9 and bn_eval are tricks of "
                "Page's ladder")
    if tr.on_nonfinite == "skip":
        return (
            "the hand-written loop has no loss check before backward; use trainer.on_nonfinite=stop"
        )
    if (
        config.dataset.name != "synthetic"
        or config.dataset.augment
        or config.dataset.pipeline != "device"
    ):
        return ("the hand-written loop reads synthetic images from the device, unaugmented "
                "(dataset=synthetic)")
    return None


def hand_throughput(overrides: list[str]) -> dict:
    """The loop a user would write by hand for the same job: the same model, optimizer (torch.optim
    class and kernels, optimizer.impl), schedule, autocast and GradScaler, gradient clipping,
    channels_last, resize and compile mode; no mixprec code in the timed part
    (build_optimizer/build_schedule are a torch.optim constructor and a LambdaLR, made before the
    clock)."""
    config, _ = compose(overrides)
    p, tr = config.precision, config.trainer
    device = hardware.select_device(tr.device)
    modes.configure(device, tr, p, config.seed)
    data = synthetic_images(config.dataset)
    x_all, y_all = data.train_x.to(device), data.train_y.to(device)
    mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1) * 255
    std = torch.tensor(data.std, device=device).view(1, -1, 1, 1) * 255
    size = config.dataset.image_size
    model = build_model(config.model, data.num_classes).to(device)
    if tr.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = build_optimizer(config.optimizer, list(model.parameters()))
    b, warmup = tr.batch_size, tr.warmup_steps
    steps = len(x_all) // b
    schedule = build_schedule(config.schedule, opt, steps)
    net = model if tr.compile == "none" else torch.compile(model, mode=tr.compile)
    scaler = torch.amp.GradScaler(device.type, enabled=p.loss_scale == "dynamic")
    amp_dtype = DTYPES[p.autocast_dtype] if p.autocast_dtype else None
    perm = torch.randperm(len(x_all), device=device)
    t0 = None
    for i in range(steps):
        if i == warmup:
            hardware.synchronize(device)
            t0 = time.perf_counter()
        idx = perm[i * b:(i + 1) * b]
        x = x_all[idx].float()
        if size != x.shape[-1]:
            x = F.interpolate(
                x,
                size=(size, size),
                mode="bilinear",
                align_corners=False,
                antialias=size < x.shape[-1],
            )
        x = (x - mean) / std
        if tr.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(
            device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None
        ):
            out = net(x)
        loss = F.cross_entropy(out.float(), y_all[idx])
        scaler.scale(loss).backward()
        if tr.grad_clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        scaler.step(opt)
        scaler.update()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    hardware.synchronize(device)
    return {"samples_per_s": (steps - warmup) * b / (time.perf_counter() - t0)}


def overhead(args) -> dict:
    """Both loops, --repeats rounds after one discarded round, each round's two runs in a random
    order; the median of each loop, the ratio of the medians and the spread of the per-round
    ratios."""
    extra = [f"trainer.compile={args.compile}"] if args.compile != "none" else []
    overrides = sized([*args.overrides, *extra], args.steps, args.warmup)
    why = refusal(compose(overrides)[0])
    if why:
        raise SystemExit(f"benchmark: {why}")
    loops = {"mixprec": mixprec_throughput, "hand": hand_throughput}
    runs = {"mixprec": [], "hand": []}
    order = random.Random(args.seed)
    # round 0 is discarded: process-level first-use costs (and compilation caches)
    for r in range(args.repeats + 1):
        names = list(loops)
        order.shuffle(names)
        for name in names:
            value = loops[name](overrides)["samples_per_s"]
            if r > 0:
                runs[name].append(value)
    ours, hand = runs["mixprec"], runs["hand"]
    ratios = sorted(m / h for m, h in zip(ours, hand))
    m, h = statistics.median(ours), statistics.median(hand)
    result = {
        "overrides": args.overrides,
        "compile": args.compile,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
        "mixprec_samples_per_s": ours,
        "hand_samples_per_s": hand,
        "median_mixprec": m,
        "median_hand": h,
        "ratio": m / h,
        "overhead": h / m - 1,
        "round_ratios": ratios,
        "spread": [ratios[0], ratios[-1]],
    }
    print(f"{'loop':10s} {'samples/s (median of ' + str(args.repeats) + ')':>28s}  runs")
    print(f"{'mixprec':10s} {m:>28.1f}  {', '.join(f'{v:.1f}' for v in ours)}")
    print(f"{'hand':10s} {h:>28.1f}  {', '.join(f'{v:.1f}' for v in hand)}")
    print(
        f"ratio mixprec / hand: {m / h:.3f} (per-round ratios {ratios[0]:.3f} .. {ratios[-1]:.3f}; "
        f"compile={args.compile}, {args.steps} timed steps after {args.warmup})"
    )
    print(f"harness overhead: {100 * result['overhead']:+.2f}% (hand / mixprec - 1)")
    return result


# -- the speed table: each model built once, each (model, precision, batch, compile) cell timed in
# seconds ----

class CellSteps(image_steps.ImageSteps):
    """A job's image steps (image_steps.ImageSteps: the same step), without evaluation: a cell times
    training only."""

    def evaluate(self, state: LoopState, loop: Loop, final: bool) -> dict:
        return {}


def build_base(config: Config, device: torch.device) -> tuple[torch.nn.Module, tuple, int]:
    """The model in fp32 on the device (built once per model; each cell trains a copy), its image
    shape and number of classes."""
    shape = (3, config.dataset.image_size, config.dataset.image_size)
    classes = 100 if "100" in config.dataset.name else 10
    torch.manual_seed(config.seed)
    return build_model(config.model, classes).to(device), shape, classes


def cell_config(config: Config, warmup: int, steps: int) -> Config:
    """The cell's config: one epoch of warmup + steps steps, the first `warmup` out of the steady
    clock."""
    trainer = dataclasses.replace(config.trainer, epochs=1, max_steps=warmup + steps,
                                  warmup_steps=warmup)
    return dataclasses.replace(config, trainer=trainer)


def cell_parts(config: Config, base: torch.nn.Module, device: torch.device) -> tuple:
    """What a job of this cell's config trains with (parts.image_parts' policy, model preparation,
    channels_last, optimizer, compile mode and its refusal of an emulated compile; its busy meter),
    on a copy of the base model; returns the cell's steps and loop, the loop's state, and the
    GraphWatch that counts a compiled cell's graphs and eager calls."""
    tr = config.trainer
    modes.configure(device, tr, config.precision, config.seed)
    modes.refuse_emulated_compile(
        config.precision, tr.compile, modes.emulates(config.precision, device)
    )
    built = build_trained(copy.deepcopy(base), config, device, channels_last=tr.channels_last)
    model, policy, optimizer = built.model, built.policy, built.optimizer
    schedule = build_schedule(config.schedule, optimizer, tr.max_steps)
    steps = CellSteps(compile_model(model, tr.compile, options=policy.compile_options()),
                      schedule, None)
    watch = GraphWatch(model, tr.compile, optimizer)   # the cell's graphs, eager calls
    loop = Loop(policy, optimizer, tr, tr.max_steps, progress=False, busy=busy.meter_for(device))
    return steps, loop, LoopState(), watch


def time_cell(config: Config, base, shape: tuple, classes: int, device: torch.device, warmup: int,
              steps: int) -> dict:
    """One cell, stepped as a job steps (loop.fit: the log window and its flush, the training
    clock, the busy meter's sampled steps) on one synthetic batch on the device, in the layout a
    job's pipeline gives (data.pipelines.in_layout): `warmup` steps out of the steady clock
    (compilation and autotuning fall there), then `steps` steady ones. Speed: the job's steady
    throughput; GPU busy: the job's (busy.py, CUDA only; the steady steps it samples:
    busy.SAMPLE_AT). Peak memory: the accelerator's over the cell (None on a CPU)."""
    config = cell_config(config, warmup, steps)
    b, tr = config.trainer.batch_size, config.trainer
    emulated = emulates(config.precision, device)
    with emulation.numerics(emulated):
        cell, loop, state, watch = cell_parts(config, base, device)
        x = in_layout(torch.randn(b, *shape, device=device), tr.channels_last)
        y = torch.randint(0, classes, (b,), device=device)
        result = fit(cell, [(x, y)] * tr.max_steps, loop, state)
    if result["status"] != "completed":
        raise RuntimeError(f"the cell's training {result['status']}: {result['reason']}")
    m = result["metrics"]
    peak = None if device.type == "cpu" else hardware.memory_metrics(device)["peak_memory_mb"]
    graphs = watch.finish()   # compiled cells: compiled_graphs, eager_calls
    return {**graphs, "samples_per_s": m["throughput"], "step_ms": 1e3 * b / m["throughput"],
            "gpu_step_ms": m.get("gpu_step_ms"), "gpu_busy_fraction": m["gpu_busy_fraction"],
            "host_bound": m["host_bound"], "skipped_steps": m["skipped_steps"],
            "peak_memory_mb": peak, "emulated": emulated}


def cell_error(error: BaseException) -> str:
    """The error of a failed cell in one line: its type and its message's first line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def run_cell(cfg: Config, bases: dict, model: str, device: torch.device, args) -> dict:
    """One cell's figures, or {"error": ...} when it fails (an OOM, a compile error, any Exception;
    a KeyboardInterrupt ends the table): its traceback goes to stderr, and the table goes on after a
    reset."""
    try:
        if model not in bases:
            bases[model] = build_base(cfg, device)
        figures = time_cell(cfg, *bases[model], device, args.warmup, args.steps)
        return {**figures, "error": None}
    except Exception as e:
        if not isinstance(e, ConfigError):   # a refusal is its one line; else its traceback too
            traceback.print_exc()
        return {"error": cell_error(e)}
    finally:
        reset_compile_state(device)   # a clean start for the next cell, after an OOM too


def table_plan(args) -> list[tuple[str, str, int, str, Config]]:
    """Every cell's (model, precision, batch, compile mode, config), composed before any is timed:
    a bad override or name ends the table at once, in one line."""
    cells = [(model, prec, batch, mode) for model in args.models.split(",")
             for batch, mode, prec in itertools.product(args.batches, args.compiles,
                                                        args.precisions.split(","))]
    return [(model, prec, batch, mode,
             compose([f"model={model}", f"precision={prec}", *args.overrides,
                      f"trainer.batch_size={batch}", f"trainer.compile={mode}"])[0])
            for model, prec, batch, mode in cells]


def table_cells(args, save=lambda rows, device: None) -> tuple[list[dict], torch.device]:
    """Every cell, model by model (each built once), with its speed-up against fp32 at the same
    batch and compile mode (None without a timed fp32 cell, or for an emulated one: its time is an
    fp32 time). A failed cell is recorded with its error. save(rows, device) after each cell: a run
    stopped by its time limit keeps the cells it timed."""
    rows, bases, device = [], {}, None
    for model, prec, batch, mode, cfg in table_plan(args):
        device = hardware.select_device(cfg.trainer.device)
        if model not in bases:
            bases.clear()   # the model before is freed (run_cell builds this one)
        t = time.perf_counter()
        row = {"model": model, "precision": prec, "batch": batch, "compile": mode,
               **run_cell(cfg, bases, model, device, args)}
        row["cell_s"] = time.perf_counter() - t
        rows.append(row)
        fp32 = next((r for r in rows if not r["error"] and r["precision"] == "fp32"
                     and (r["model"], r["batch"], r["compile"]) == (model, batch, mode)), None)
        row["speedup"] = (row["samples_per_s"] / fp32["samples_per_s"]
                          if fp32 and not row["error"] and not row["emulated"] else None)
        print(cell_line(row), flush=True)
        save(rows, device)
    return rows, device


def cell_line(r: dict) -> str:
    fmt = benchmark_fmt
    head = f"{r['model']:10s} {r['precision']:9s} b{r['batch']:<5d} {r['compile']:15s}"
    if r["error"]:
        return f"{head} failed: {r['error']}  ({r['cell_s']:.1f} s)"
    return (f"{head} {r['samples_per_s']:>10.1f} samples/s  x{fmt(r['speedup'], '.2f')} vs fp32  "
            f"GPU busy {fmt(r['gpu_busy_fraction'], '.2f')}  "
            f"peak {fmt(r['peak_memory_mb'], '.0f')} MB  ({r['cell_s']:.1f} s)")


def benchmark_fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


TABLE_HEADS = [
    "model",
    "precision",
    "batch",
    "compile",
    "samples/s",
    "vs fp32",
    "step ms",
    "GPU busy",
    "peak MB",
    "note",
]
CELL_KEYS = ("model", "precision", "batch", "compile")


def failed_cells(rows: list[dict]) -> list[dict]:
    """The cells that failed, each named (model, precision, batch, compile) with its error."""
    return [{k: r[k] for k in (*CELL_KEYS, "error")} for r in rows if r["error"]]


def table_row(r: dict) -> str:
    """One markdown row: a timed cell's figures, or a failed cell's dashes."""
    if r["error"]:
        cells = [*(r[k] for k in CELL_KEYS), *["-"] * 5, "failed"]
    else:
        note = ("emulated: an fp32 time" if r["emulated"] else
                "host-bound" if r["host_bound"] else "")
        cells = [*(r[k] for k in CELL_KEYS), f"{r['samples_per_s']:.1f}",
                 benchmark_fmt(r["speedup"], ".2f"), f"{r['step_ms']:.2f}",
                 benchmark_fmt(r["gpu_busy_fraction"], ".2f"),
                 benchmark_fmt(r["peak_memory_mb"], ".0f"), note]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_markdown(result: dict) -> str:
    """The table as markdown, with what was timed, the host-bound cells and the failed cells
    named."""
    rows = result["rows"]
    lines = [f"# Speed table ({result['device']}, torch {result['torch']})", "",
             f"{result['warmup']} untimed steps (compilation included), then {result['steps']} "
             "timed steps per cell, synthetic batch on the device in the job's memory layout, "
             "stepped as a job steps (loop.fit: the log window and its flush, the training "
             "clock). GPU busy: the GPU's own time for a step over its wall time (docs/speed.md); "
             f"'-': not measured (CPU). {len(rows)} cells in {result['total_s']:.1f} s"
             + ("." if result["complete"] else " (incomplete: stopped before the last cell)."), "",
             "| " + " | ".join(TABLE_HEADS) + " |", "|" + "---|" * len(TABLE_HEADS)]
    lines += [table_row(r) for r in rows]
    if any(r["host_bound"] for r in rows if not r["error"]):
        lines += ["", f"Host-bound cells (GPU busy < {busy.HOST_BOUND}): their speed-ups measure "
                      f"Python, not the precision; use {busy.ADVICE}."]
    failed = failed_cells(rows)
    if failed:
        lines += ["", f"Failed cells ({len(failed)}): the table went on after each (their "
                      "tracebacks: the run's stderr).", ""]
        lines += [f"- {f['model']} {f['precision']} batch {f['batch']} compile {f['compile']}: "
                  f"{f['error']}" for f in failed]
    return "\n".join(lines) + "\n"


class TableFile:
    """The table's JSON and markdown under --out, rewritten after every cell (save)."""

    def __init__(self, args):
        self.out, self.t0 = args.out, time.perf_counter()
        self.result = {
            "overrides": args.overrides,
            "steps": args.steps,
            "warmup": args.warmup,
            "batches": args.batches,
            "compiles": args.compiles,
            "torch": torch.__version__,
        }

    def save(self, rows: list, device: torch.device, done: bool = False) -> None:
        if "device" not in self.result:
            self.result["device"] = hardware.describe(device)["device_name"]
        self.result.update(rows=rows, failed=failed_cells(rows),
                           total_s=time.perf_counter() - self.t0, complete=done)
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.out / "table.json", self.result)
            write_text_atomic(self.out / "table.md", table_markdown(self.result))


def table(args) -> dict:
    file = TableFile(args)
    file.save(*table_cells(args, file.save), done=True)
    return file.result


def main(argv=None) -> int:
    parser = cli.ArgumentParser(
        prog="benchmark.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("what", choices=["overhead", "table"])
    parser.add_argument("overrides", nargs="*", help="train.py overrides")
    parser.add_argument(
        "--steps", type=int, help="timed steps per measurement (overhead 300, table 30)"
    )
    parser.add_argument("--warmup", type=int, help="untimed steps first (overhead 10, table 10)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="overhead: rounds (each runs both loops, in random order)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="overhead: seed of the rounds' random order"
    )
    parser.add_argument(
        "--compile",
        default="none",
        choices=["none", "default", "max-autotune", "reduce-overhead"],
        help="overhead: compile both loops' models in this torch.compile mode (trainer.compile)",
    )
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--precisions", default="fp32,tf32,amp,amp_bf16")
    parser.add_argument(
        "--batches",
        type=int_list,
        default=[64, 256],
        help="table: batch sizes (trainer.batch_size)",
    )
    parser.add_argument(
        "--compiles",
        type=lambda s: s.split(","),
        default=["none"],
        help="table: compile modes, e.g. none,default,reduce-overhead (trainer.compile)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="overhead: write the results as JSON to this file; table: the folder "
        "that gets table.json and table.md",
    )
    args = parser.parse_intermixed_args(argv)
    args.steps = (300 if args.what == "overhead" else 30) if args.steps is None else args.steps
    args.warmup = 10 if args.warmup is None else args.warmup
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    try:
        result = overhead(args) if args.what == "overhead" else table(args)
    except ConfigError as e:
        print(f"benchmark: config error: {e}", file=sys.stderr)
        return 2
    result.update(
        torch=torch.__version__, command=" ".join(["python scripts/benchmark.py", *sys.argv[1:]])
    )
    if args.out and args.what == "overhead":
        write_json_atomic(args.out, result)
    return 0


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give comma-separated integers, e.g. 64,256"
        ) from None


if __name__ == "__main__":
    sys.exit(cli.run("benchmark", main))
