"""The largest batch that trains (forward, backward, optimizer step) without running out of GPU
memory, per precision, by doubling then binary search; with the ratio against the first precision
given.

    python scripts/max_batch.py model=resnet50 precision=fp32,amp [any train.py override ...]
    [--limit 65536] python scripts/max_batch.py ... --records DIR    # also
    DIR/<precision>/summary.json, for the report

The fastai article saw about 1.8x larger batches fit with fp16. Needs a GPU: without one it says so
and exits non-zero. Each probe builds a fresh model, policy and optimizer and runs two full steps on
random data of the dataset's shape, under the job's hardware flags (cudnn.benchmark, TF32); an
allocation failure of the caching allocator, cuBLAS or cuDNN means "does not fit", and the memory is
back at its baseline before the next probe (tests/gpu/test_gpu.py checks it).
`--device cpu` runs the same probes on the CPU, where nothing runs out of memory: the search stops
at --limit (a check that the probes run, not a measurement).
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

from mixprec.tools import cli
from mixprec.runtime import hardware
from mixprec.records import write_json_atomic
from mixprec.tools.search import largest_fitting
from mixprec.precision import modes

ROOT = Path(__file__).resolve().parents[1]


def compose(overrides: list[str]):
    from mixprec.config import validate

    return validate(cli.compose(overrides))


OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def out_of_memory(e: BaseException) -> bool:
    """A failure to get memory: torch.OutOfMemoryError (the caching allocator), or a library's own
    allocation failing (cuBLAS/cuDNN raise RuntimeError with their status names)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in OOM_MESSAGES)


def two_steps(config, device, batch: int) -> None:
    """Two training steps at `batch` (fresh model, policy, optimizer, random data); every tensor is
    local to this frame, so all of it is garbage once the call is over, even when it raised."""
    from mixprec.models import build_model
    from mixprec.train.build import build_trained
    from mixprec.train.step import backward_and_step, image_forward

    ds = config.dataset
    built = build_trained(build_model(config.model, ds.num_classes), config, device,
                          channels_last=config.trainer.channels_last)
    model, policy, opt = built.model, built.policy, built.optimizer
    x = torch.randn(batch, 3, ds.image_size, ds.image_size, device=device)
    y = torch.randint(0, ds.num_classes, (batch,), device=device)
    for _ in range(2):
        backward_and_step(image_forward(model, x, y, policy)[0], policy, opt)
        opt.zero_grad(set_to_none=True)
    hardware.synchronize(device)


def make_probe(config, device):
    """fits(batch) -> True when two training steps at that batch size run without running out of
    memory. The job's hardware flags (cudnn.benchmark, TF32, determinism) are applied first, as
    train.py would. Memory is released after the exception is gone (its traceback holds the failed
    step's frames and tensors)."""
    modes.configure(device, config.trainer, config.precision, config.seed)

    def fits(batch: int) -> bool:
        ok = True
        try:
            two_steps(config, device, batch)
        except Exception as e:
            if not out_of_memory(e):
                raise
            ok = False
        gc.collect()
        torch.accelerator.empty_cache()
        return ok

    return fits


def write_record(
    job_dir: Path, overrides: list[str], device, best: int, probes: list, limit: int, t0: float
):
    """A summary.json like a training job's, so the report pairs each precision's max batch with
    fp32's (`config.measure` keeps these records apart from training jobs of the same config)."""
    from mixprec.config import plain_config
    from mixprec.runtime.hardware import describe
    from mixprec.records import Recorder

    cfg = cli.compose(overrides, return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    config = dict(plain_config(cfg), measure="max_batch")
    Recorder(job_dir).write_summary(
        {
            "status": "completed",
            "choices": dict(choices, measure="max_batch"),
            "overrides": overrides,
            "job": {"name": "max_batch", "num": None, "output_dir": str(job_dir)},
            "config": config,
            "name": config.get("name"),
            "seed": config.get("seed"),
            "env": describe(device),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0)),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "metrics": {
                "max_batch_size": best,
                "probes": probes,
                "limit": limit,
                "limited": best >= limit,
                "search_time_s": time.time() - t0,
            },
        }
    )


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="max_batch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "overrides", nargs="*", help="train.py overrides; precision=a,b,... lists the precisions"
    )
    parser.add_argument("--limit", type=int, default=65536, help="largest batch size tried")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--records",
        type=Path,
        help="also write RECORDS/<precision>/summary.json (name, choices, "
        "config, env, metrics.max_batch_size), which the report reads",
    )
    parser.add_argument("--device", default="auto", help="auto (the GPU), cuda, cuda:N or cpu; "
                        "cpu: run the probes on the CPU (never out of memory: stops at --limit)")
    args = parser.parse_args(argv)

    precisions, rest = ["fp32", "amp"], []
    for o in args.overrides:
        if o.startswith("precision="):
            precisions = o.split("=", 1)[1].split(",")
        else:
            rest.append(o)
    from mixprec.config import ConfigError

    try:
        device = hardware.select_device(args.device, option="--device")
    except ConfigError as e:   # e.g. --device cuda:3 on a one-GPU machine
        print(f"max_batch: {e}".replace("trainer.device", "--device"), file=sys.stderr)
        return 2
    if device.type == "cpu" and args.device != "cpu":
        print(
            "max_batch: no GPU is visible here; the search measures GPU memory, so it needs one "
            "(--device cpu runs the probes on the CPU, as a check that they run)",
            file=sys.stderr,
        )
        return 2

    name = (
        hardware.describe(device)["device_name"]
        if device.type != "cpu"
        else "the CPU (no memory limit: --limit)"
    )
    results = []
    for p in precisions:
        try:
            config = compose([f"precision={p}", *rest])
        except ConfigError as e:
            print(f"max_batch: config error: {e}", file=sys.stderr)
            return 2
        t0 = time.time()
        # from 2: BatchNorm in training mode needs more than one value per channel (fastai's head
        # has BatchNorm1d)
        best, probes = largest_fitting(make_probe(config, device), start=2, limit=args.limit)
        results.append({"precision": p, "max_batch": best, "probes": probes})
        print(f"{p:10s} max batch {best} ({len(probes)} probes)", flush=True)
        if args.records:
            write_record(
                args.records / p, [f"precision={p}", *rest], device, best, probes, args.limit, t0
            )
    base = results[0]["max_batch"]
    print(f"\nmodel={compose(rest).model.arch} on {name}")
    print(f"{'precision':10s} {'max batch':>10s} {'vs ' + results[0]['precision']:>10s}")
    for r in results:
        r["ratio"] = r["max_batch"] / base if base else None
        print(f"{r['precision']:10s} {r['max_batch']:>10d} {r['ratio']:>10.2f}")
    if args.out:
        write_json_atomic(
            args.out,
            {"overrides": rest, "device": name, "torch": torch.__version__, "results": results},
        )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("max_batch", main))
