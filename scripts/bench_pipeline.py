#!/usr/bin/env python
"""Samples/s of the two image pipelines over one training epoch: the device-resident one
(dataset.pipeline=device) against the classic DataLoader (dataset.pipeline=dataloader) with 0, 2,
... worker processes.

    python scripts/bench_pipeline.py                                 # CIFAR-sized synthetic data
    (50,000 images) python scripts/bench_pipeline.py --device cuda --workers 0,4,8
    python scripts/bench_pipeline.py dataset=cifar10 dataset.data_dir=/data dataset.cutout=8

Anything that is not an option is a Hydra override of conf/ (as train.py takes them). Each pipeline
serves the same augmented, normalised batches (crop, flip, cutout, resize as configured). What is
timed: building the loaders (moving the split to the device) and iterating whole epochs with the
device synchronized at the end of each (the model is left out: this is the input pipeline alone).
The first epoch includes worker start-up and allocator warm-up; with --epochs 2 or more, the last
epoch's rate is reported as the steady one.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from mixprec.tools import cli
from mixprec.config import ConfigError, validate
from mixprec.data import build_image_data, image_loaders
from mixprec.data.files import DataError
from mixprec.runtime.hardware import describe, select_device, synchronize

ROOT = Path(__file__).resolve().parents[1]


CIFAR_SIZED = ["dataset=synthetic", "dataset.train_size=50000", "dataset.test_size=1000"]


def bench(data, dataset_cfg, trainer, device, epochs: int) -> dict:
    t0 = time.perf_counter()
    train, _ = image_loaders(data, dataset_cfg, trainer, device, seed=0)
    synchronize(device)
    setup = time.perf_counter() - t0
    times, samples = [], 0
    for _ in range(epochs):
        t0 = time.perf_counter()
        samples = 0
        for x, y in train:
            samples += len(y)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"setup_s": setup, "epoch_s": times, "samples": samples, "batches": len(train),
            "first": samples / times[0], "last": samples / times[-1]}


def main() -> int:
    ap = cli.ArgumentParser(prog="bench_pipeline.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, auto")
    ap.add_argument(
        "--workers", default="0,2", help="DataLoader worker counts to try, comma-separated"
    )
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the main process (default: torch's)",
    )
    args, overrides = ap.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        given = {o.split("=", 1)[0] for o in overrides}
        base = (
            [o for o in CIFAR_SIZED if o.split("=", 1)[0] not in given]
            if "dataset" not in given
            else []
        )
        config = validate(cli.compose([*base, *overrides, f"trainer.batch_size={args.batch_size}"]))
        device = select_device(args.device, option="--device")
        data = build_image_data(config.dataset)
    except (ConfigError, DataError) as e:
        print(f"bench_pipeline: {e}", file=sys.stderr)
        return 2
    cfg = config.dataset
    aug = (
        f"crop (pad {cfg.crop_padding}) + flip" + (f" + cutout {cfg.cutout}" if cfg.cutout else "")
        if cfg.augment
        else "none"
    )
    name = (describe(device)["device_name"] if device.type != "cpu"
            else f"{os.cpu_count()} CPU cores, torch threads: {torch.get_num_threads()}")
    print(
        f"data      {cfg.name}: {len(data.train_y):,} train images, uint8 "
        f"{'x'.join(map(str, data.train_x.shape[1:]))} -> {cfg.image_size}x{cfg.image_size}, "
        f"augment {aug}, normalised"
    )
    print(
        f"batches   {args.batch_size} per step, {args.epochs} epoch(s), "
        f"channels_last={config.trainer.channels_last}"
    )
    print(f"device    {device} ({name}), torch {torch.__version__}")
    runs = [("device", dataclasses.replace(cfg, pipeline="device"))]
    runs += [
        (f"dataloader workers={w}", dataclasses.replace(cfg, pipeline="dataloader", workers=int(w)))
        for w in args.workers.split(",")
        if w != ""
    ]
    print(
        f"{'pipeline':<22} {'setup s':>8} {'epoch s':>16} {'samples/s':>10}"
        + ("  (last epoch)" if args.epochs > 1 else "")
    )
    results = {}
    for label, dcfg in runs:
        r = results[label] = bench(data, dcfg, config.trainer, device, args.epochs)
        epochs = ", ".join(f"{t:.2f}" for t in r["epoch_s"])
        print(f"{label:<22} {r['setup_s']:>8.2f} {epochs:>16} {r['last']:>10,.0f}", flush=True)
    base = results["device"]["last"]
    for label, r in results.items():
        if label != "device":
            print(f"device pipeline vs {label}: {base / r['last']:.1f}x the samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("bench_pipeline", lambda _: main()))
