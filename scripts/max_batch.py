"""The largest batch that trains (forward, backward, optimizer step) without running out of GPU memory, per
precision, by doubling then binary search; with the ratio against the first precision given.

    python scripts/max_batch.py model=resnet50 precision=fp32,amp [any train.py override ...] [--limit 65536]

The fastai article saw about 1.8x larger batches fit with fp16. Needs a CUDA GPU: without one it says so and
exits non-zero. Each probe builds a fresh model, policy and optimizer and runs two full steps on random data of
the dataset's shape; memory is released between probes.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mixprec.search import largest_fitting  # noqa: E402


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from mixprec.config import validate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return validate(hydra_compose("config", overrides=overrides))


def make_probe(config, device):
    """fits(batch) -> True when two training steps at that batch size run without CUDA OOM."""
    import torch.nn.functional as F
    from mixprec.models import build_model
    from mixprec.optim import build_optimizer
    from mixprec.precision import PrecisionPolicy

    ds = config.dataset
    shape = (3, ds.image_size, ds.image_size)

    def fits(batch: int) -> bool:
        model = policy = opt = x = y = None
        try:
            policy = PrecisionPolicy(config.precision, device)
            model = policy.prepare_model(build_model(config.model, ds.num_classes))
            if config.trainer.channels_last:
                model = model.to(memory_format=torch.channels_last)
            opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
            x = torch.randn(batch, *shape, device=device)
            y = torch.randint(0, ds.num_classes, (batch,), device=device)
            for _ in range(2):
                with policy.autocast():
                    out = model(policy.cast_input(x))
                policy.backward(F.cross_entropy(out.float(), y))
                policy.step(opt)
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del model, policy, opt, x, y
            gc.collect()
            torch.cuda.empty_cache()

    return fits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="train.py overrides; precision=a,b,... lists the precisions")
    parser.add_argument("--limit", type=int, default=65536, help="largest batch size tried")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)

    precisions, rest = ["fp32", "amp"], []
    for o in args.overrides:
        if o.startswith("precision="):
            precisions = o.split("=", 1)[1].split(",")
        else:
            rest.append(o)
    if not torch.cuda.is_available():
        print("max_batch: no CUDA GPU is visible here; the search measures GPU memory, so it needs one",
              file=sys.stderr)
        return 2
    from mixprec.config import ConfigError

    device = torch.device("cuda")
    results = []
    for p in precisions:
        try:
            config = compose([f"precision={p}", *rest])
        except ConfigError as e:
            print(f"max_batch: config error: {e}", file=sys.stderr)
            return 2
        best, probes = largest_fitting(make_probe(config, device), limit=args.limit)
        results.append({"precision": p, "max_batch": best, "probes": probes})
        print(f"{p:10s} max batch {best} ({len(probes)} probes)", flush=True)
    base = results[0]["max_batch"]
    print(f"\nmodel={compose(rest).model.arch} on {torch.cuda.get_device_name(device)}")
    print(f"{'precision':10s} {'max batch':>10s} {'vs ' + results[0]['precision']:>10s}")
    for r in results:
        r["ratio"] = r["max_batch"] / base if base else None
        print(f"{r['precision']:10s} {r['max_batch']:>10d} {r['ratio']:>10.2f}")
    if args.out:
        args.out.write_text(json.dumps({"overrides": rest, "device": torch.cuda.get_device_name(device),
                                        "torch": torch.__version__, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
