"""Benchmarks of the harness itself and of models x precisions.

  python scripts/benchmark.py overhead [train.py overrides] [--compile MODE]   e.g. model=resnet18 precision=amp
      mixprec's training loop (engine.fit through mixprec.run.train_and_record, records and all) against the loop a
      user would write by hand for the same job: same model, batch, data on the device, optimizer (class and
      optimizer.impl kernels), schedule, autocast/GradScaler, grad clipping, channels_last and compile mode; a job
      the hand loop cannot mirror (low-precision weights, master weights, a static loss scale, any trick, augmented
      or non-synthetic data, on_nonfinite=skip) is refused with the reason. --steps timed steps (300) after
      --warmup; one discarded round, then --repeats rounds, each running both loops in a random order (--seed);
      reports each loop's median, the ratio mixprec / hand of the medians, and the spread (min..max) of the
      per-round ratios. --compile MODE compiles both (trainer.compile=MODE; compilation is untimed in both).
  python scripts/benchmark.py table --models resnet18,resnet50 --precisions fp32,tf32,amp,amp_bf16 [overrides]
      steady-state samples/s per model and precision, speed-up over fp32, and model FLOP utilisation against the
      GPU profile's peak (pass gpu=h100 etc.; gpu=auto has no peaks).

Both run on the CPU too (use small sizes there: model=small_cnn trainer.batch_size=32 dataset.image_size=16). What is
timed: the same thing for both loops: training steps only (batch slicing and normalisation on the device,
forward, loss, backward, optimizer step, loss-scale update), after --warmup steps, with the device synchronized
before each clock reading; no evaluation, no data generation.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mixprec import cli, hardware  # noqa: E402
from mixprec.config import Config, ConfigError, plain_config, validate  # noqa: E402
from mixprec.data import synthetic_images  # noqa: E402
from mixprec.models import build_model  # noqa: E402
from mixprec.optim import build_optimizer, build_schedule  # noqa: E402
from mixprec.precision import DTYPES  # noqa: E402
from mixprec.records import write_json_atomic  # noqa: E402


def compose(overrides: list[str]) -> tuple[Config, dict]:
    """The validated config, and the summary fields a job gets from Hydra (choices, overrides, config)."""
    cfg = cli.compose(["logger=none", *overrides], return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    return validate(cfg), {"choices": choices, "overrides": overrides, "config": plain_config(cfg)}


def sized(overrides: list[str], steps: int, warmup: int) -> list[str]:
    """One epoch of exactly warmup + steps batches, no augmentation, the smallest eval split."""
    config, _ = compose(overrides)
    b = config.trainer.batch_size
    return [*overrides, f"dataset.train_size={(warmup + steps) * b}", f"dataset.test_size={b}",
            "dataset.augment=false", "trainer.epochs=1", f"trainer.warmup_steps={warmup}",
            f"trainer.log_every={max(steps, 1)}", "trainer.max_steps=null"]


def mixprec_throughput(overrides: list[str]) -> dict:
    """Steady samples/s of a full mixprec job (records written to a temp dir)."""
    from mixprec.run import train_and_record

    config, fields = compose(overrides)
    with tempfile.TemporaryDirectory() as out:
        summary = train_and_record(config, {"status": "failed", **fields}, Path(out))
    if summary["status"] != "completed":
        raise SystemExit(f"benchmark: the mixprec job did not complete: {summary.get('error') or summary.get('reason')}")
    m = summary["metrics"]
    if m["throughput_includes_warmup"]:
        raise SystemExit("benchmark: too few steps for a steady-state measurement; raise --steps")
    return {"samples_per_s": m["throughput"], "mfu": m.get("mfu"), "device": summary["env"]["device_name"],
            "peak_memory_mb": m["peak_memory_mb"]}


def refusal(config: Config) -> str | None:
    """Why the hand-written loop cannot mirror this job (None when it can)."""
    p, tr, t = config.precision, config.trainer, config.trick
    if p.param_dtype != "float32" or p.master_weights or p.loss_scale not in ("dynamic", "none"):
        return (f"the hand-written loop covers the autocast family (fp32, tf32, amp, amp_bf16, o0, o1), not "
                f"precision={p.name} (low-precision weights, master weights or a static loss scale)")
    if t != type(t)():
        return f"the hand-written loop has no tricks; trick={t.name} changes the step (use trick=none)"
    if config.model.bn_eval or config.model.arch == "resnet9":
        return "the hand-written loop trains a plain model; resnet9 and bn_eval are tricks of Page's ladder"
    if tr.on_nonfinite == "skip":
        return "the hand-written loop has no loss check before backward; use trainer.on_nonfinite=stop"
    if config.dataset.name != "synthetic" or config.dataset.augment or config.dataset.pipeline != "device":
        return "the hand-written loop reads synthetic images from the device, unaugmented (dataset=synthetic)"
    return None


def hand_throughput(overrides: list[str]) -> dict:
    """The loop a user would write by hand for the same job: the same model, optimizer (torch.optim class and
    kernels, optimizer.impl), schedule, autocast and GradScaler, gradient clipping, channels_last, resize and
    compile mode; no mixprec code in the timed part (build_optimizer/build_schedule are a torch.optim constructor
    and a LambdaLR, made before the clock)."""
    config, _ = compose(overrides)
    p, tr = config.precision, config.trainer
    device = hardware.select_device(tr.device)
    hardware.configure(device, tr, p, config.seed)
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
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=size < x.shape[-1])
        x = (x - mean) / std
        if tr.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
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
    """Both loops, --repeats rounds after one discarded round, each round's two runs in a random order; the
    median of each loop, the ratio of the medians and the spread of the per-round ratios."""
    extra = [f"trainer.compile={args.compile}"] if args.compile != "none" else []
    overrides = sized([*args.overrides, *extra], args.steps, args.warmup)
    why = refusal(compose(overrides)[0])
    if why:
        raise SystemExit(f"benchmark: {why}")
    loops = {"mixprec": mixprec_throughput, "hand": hand_throughput}
    runs = {"mixprec": [], "hand": []}
    order = random.Random(args.seed)
    for r in range(args.repeats + 1):   # round 0 is discarded: process-level first-use costs (and compilation caches)
        names = list(loops)
        order.shuffle(names)
        for name in names:
            value = loops[name](overrides)["samples_per_s"]
            if r > 0:
                runs[name].append(value)
    ours, hand = runs["mixprec"], runs["hand"]
    ratios = sorted(m / h for m, h in zip(ours, hand))
    m, h = statistics.median(ours), statistics.median(hand)
    result = {"overrides": args.overrides, "compile": args.compile, "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats, "seed": args.seed, "mixprec_samples_per_s": ours, "hand_samples_per_s": hand,
              "median_mixprec": m, "median_hand": h, "ratio": m / h, "overhead": h / m - 1,
              "round_ratios": ratios, "spread": [ratios[0], ratios[-1]]}
    print(f"{'loop':10s} {'samples/s (median of ' + str(args.repeats) + ')':>28s}  runs")
    print(f"{'mixprec':10s} {m:>28.1f}  {', '.join(f'{v:.1f}' for v in ours)}")
    print(f"{'hand':10s} {h:>28.1f}  {', '.join(f'{v:.1f}' for v in hand)}")
    print(f"ratio mixprec / hand: {m / h:.3f} (per-round ratios {ratios[0]:.3f} .. {ratios[-1]:.3f}; "
          f"compile={args.compile}, {args.steps} timed steps after {args.warmup})")
    print(f"harness overhead: {100 * result['overhead']:+.2f}% (hand / mixprec - 1)")
    return result


def table(args) -> dict:
    rows = []
    for model in args.models.split(","):
        base = None
        for prec in args.precisions.split(","):
            overrides = sized([f"model={model}", f"precision={prec}", *args.overrides], args.steps, args.warmup)
            r = mixprec_throughput(overrides)
            base = r["samples_per_s"] if prec == "fp32" else base
            rows.append({"model": model, "precision": prec, **r,
                         "speedup": r["samples_per_s"] / base if base else None})
            row = rows[-1]
            mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}"
            print(f"{model:10s} {prec:9s} {row['samples_per_s']:>10.1f} samples/s  x{speedup} vs fp32  "
                  f"MFU {mfu}  peak {row['peak_memory_mb']:.0f} MB", flush=True)
    return {"overrides": args.overrides, "steps": args.steps, "warmup": args.warmup, "rows": rows}


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="benchmark.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("what", choices=["overhead", "table"])
    parser.add_argument("overrides", nargs="*", help="train.py overrides")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=5, help="overhead: rounds (each runs both loops, in random order)")
    parser.add_argument("--seed", type=int, default=0, help="overhead: seed of the rounds' random order")
    parser.add_argument("--compile", default="none", choices=["none", "default", "max-autotune", "reduce-overhead"],
                        help="overhead: compile both loops' models in this torch.compile mode (trainer.compile)")
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--precisions", default="fp32,tf32,amp,amp_bf16")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    try:
        result = overhead(args) if args.what == "overhead" else table(args)
    except ConfigError as e:
        print(f"benchmark: config error: {e}", file=sys.stderr)
        return 2
    result.update(torch=torch.__version__, command=" ".join(["python scripts/benchmark.py", *sys.argv[1:]]))
    if args.out:
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("benchmark", main))
