"""One-batch numerics advisor: same weights, same batch, fp32 against each candidate precision,
layer by layer.

    python scripts/numerics.py model=resnet18                              # candidates amp,
    amp_bf16, half python scripts/numerics.py model=lstm dataset=synthetic_text
    precision=amp,o2,half python scripts/numerics.py model=resnet50 dataset=cifar10
    trainer.device=cuda --out outputs/numerics/r50

The arguments are train.py's overrides (Hydra-composed from conf/, as train.py), except `precision=`
which lists the candidates. For each: the forward output and the activation gradient (the gradient
of the loss w.r.t. each module's output, unscaled) of every module, relative to fp32's (||y -
y_fp32|| / ||y_fp32||); from the fp32 run, the fraction of each that fp16 / bf16 would overflow or
lose; the smallest power-of-two loss scale that lifts 99% of the non-zero activation gradients into
fp16's normal range (--tolerance), and the largest that keeps them below fp16's max; a verdict per
precision. Writes numerics.md and numerics.png into --out (default outputs/numerics/<time>/) and
prints the verdicts.

On a CPU, fp16/bf16 run PyTorch's slow reference kernels: unless given, the batch is 8 (images at 8
px, a 64-image synthetic set); a GPU takes the config's own. Language models run with
model.dropout=0 so that every precision sees the same masks.
Every module is in training mode (BatchNorm on batch statistics), as in a training step.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from mixprec.tools import cli
from mixprec.runtime import hardware
from mixprec.numerics import probe_stats as ps
from mixprec.config import Config, ConfigError, validate
from mixprec.models import build_model
from mixprec.train.build import build_trained
from mixprec.numerics.probe import ForwardTrace, param_names
from mixprec.records import write_text_atomic
from mixprec.train import step
from mixprec.precision import modes

ROOT = Path(__file__).resolve().parents[1]


CPU_IMAGES = {"trainer.batch_size": "8", "dataset.image_size": "8"}
CPU_SYNTHETIC = {"dataset.train_size": "64", "dataset.test_size": "8"}
CPU_TEXT = {"trainer.batch_size": "8", "dataset.train_size": "4000", "dataset.test_size": "400"}


def compose(overrides: list[str]) -> tuple[Config, dict[str, Config]]:
    """The fp32 reference config and one config per candidate precision (same everything else)."""
    def make(extra: list[str]) -> Config:
        return validate(cli.compose(["logger=none", *extra]))

    candidates = ["amp", "amp_bf16", "half"]
    rest = []
    for o in overrides:
        if o.startswith("precision="):
            candidates = [c for c in o.split("=", 1)[1].split(",") if c]
        else:
            rest.append(o)
    base = make(rest)
    given = {o.split("=", 1)[0].lstrip("+") for o in rest}
    defaults = {}
    if base.model.is_language_model:
        defaults["model.dropout"] = "0.0"
    if hardware.select_device(base.trainer.device).type == "cpu":
        defaults.update(CPU_TEXT if base.dataset.is_text else CPU_IMAGES)
        if base.dataset.name == "synthetic":
            defaults.update(CPU_SYNTHETIC)
    rest += [f"{k}={v}" for k, v in defaults.items() if k not in given]
    return make(rest + ["precision=fp32"]), {c: make(rest + [f"precision={c}"]) for c in candidates}


def one_batch(config: Config, device: torch.device):
    """The first training batch: (x, y, classes) for images, (x, y, vocabulary) for a language
    model."""
    if config.dataset.is_text:
        from mixprec.data.wikitext import TokenWindows, batchify, load_text_corpus
        corpus = load_text_corpus(config.dataset)
        x, y = next(
            iter(
                TokenWindows(
                    batchify(corpus.train, config.trainer.batch_size, device), config.dataset.bptt
                )
            )
        )
        return x, y, corpus.vocab_size
    from mixprec.data import build_image_data, image_loaders
    data = build_image_data(config.dataset)
    train, _ = image_loaders(data, config.dataset, config.trainer, device, seed=config.seed)
    x, y = next(iter(train))
    return x, y, data.num_classes


def run_precision(reference, config: Config, batch, device: torch.device) -> dict:
    """Forward and backward of the batch under config.precision on a copy of `reference`; every
    module's first output and its activation gradient (unscaled, fp32), every parameter's unscaled
    gradient."""
    x, y, _ = batch
    built = build_trained(copy.deepcopy(reference), config, device)
    model, policy = built.model, built.policy
    model.train()
    scale = policy.scale_value or 1.0
    outs, grads, order = {}, {}, []

    def seen(name, module, tensors):
        if not tensors:
            return
        order.append(name)
        outs[name] = tensors[0].detach().float().clone()
        if tensors[0].requires_grad:
            tensors[0].register_hook(
                lambda g, name=name: grads.__setitem__(name, g.detach().float() / scale)
            )

    torch.manual_seed(config.seed)
    with ForwardTrace(model, seen):
        if config.model.is_language_model:
            loss = step.lm_forward(model, x, y, model.init_hidden(x.size(1)), policy)[0]
        else:
            loss = step.image_forward(model, x, y, policy)[0]
    policy.scaler.scale(loss).backward()   # the step's scaled backward, no optimizer step
    pgrads = {
        n: p.grad.float() / scale
        for n, p in zip(param_names(model), policy.model_params)
        if p.grad is not None
    }
    return {
        "order": order,
        "out": outs,
        "act_grad": grads,
        "grad": pgrads,
        "loss": loss.item(),
        "scale": scale,
        "param_dtype": config.precision.param_dtype,
    }


def measure(t: torch.Tensor) -> dict:
    counts, absmax = ps.tensor_counts(t)
    return ps.describe(counts.tolist(), absmax.item())


def rel_error(a: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    if a is None or ref is None or a.shape != ref.shape:
        return None
    if not torch.isfinite(a).all():
        return float("inf")
    norm = ref.norm().item()
    return (
        (a - ref).norm().item() / norm
        if norm > 0
        else (0.0 if a.norm().item() == 0 else float("inf"))
    )


def zeroed(a: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    """Fraction of the reference's non-zero values that are exactly zero in `a` (lost to
    underflow)."""
    if a is None or ref is None or a.shape != ref.shape:
        return None
    nz = ref != 0
    return ((a == 0) & nz).sum().item() / max(nz.sum().item(), 1)


def reference_ranges(ref: dict, tolerance: float) -> dict:
    """From the fp32 run: what fp16/bf16 would do per layer, and the loss-scale window for fp16."""
    fwd = {n: measure(ref["out"][n]) for n in ref["order"]}
    act = {n: measure(ref["act_grad"][n]) for n in ref["order"] if n in ref["act_grad"]}
    grads = {n: measure(g) for n, g in ref["grad"].items()}
    pooled = ps.pool(list(act.values()))
    return {"forward": fwd, "act_grad": act, "grad": grads, "pooled_act": pooled,
            "k_min": ps.smallest_scale(pooled["hist"], tolerance=tolerance),
            "k_max_act": ps.largest_scale(pooled["absmax"]),
            "k_max_grad": ps.largest_scale(max((g["absmax"] for g in grads.values()), default=0.0))}


def verdict(name: str, config: Config, ranges: dict, run: dict, errors: dict) -> str:
    """One line: what this precision needs, from the fp32 run's ranges and this run's errors."""
    p = config.precision
    low = p.autocast_dtype or p.param_dtype
    fmt = {"float16": "fp16", "bfloat16": "bf16"}.get(low)
    worst = max(((e, n) for n, e in errors["forward"].items() if e is not None), default=(0.0, "-"))
    err = f"worst forward error {worst[0]:.2g} at {worst[1]}"
    if fmt is None:
        return f"{name}: fp32 storage ({'TF32 matmuls' if p.tf32 else 'fp32 math'}); {err}"
    over = [n for n, r in ranges["forward"].items() if r[fmt]["overflow"] > 0]
    keep = (
        f"; keep {', '.join(over[:4])}{' ...' if len(over) > 4 else ''} in fp32 (output beyond "
        f"{fmt}'s max)"
        if over
        else ""
    )
    if fmt == "bf16":
        lost = [n for n, r in ranges["act_grad"].items() if r["bf16"]["lost"] > 0]
        out = (
            "no layer out of range"
            if not over and not lost
            else f"{len(over) + len(lost)} layer(s) out of range"
        )
        return f"{name}: bf16: {out}{keep}; {err}"
    k_min = ranges["k_min"]
    k_max = ranges["k_max_grad"] if p.param_dtype == "float16" else ranges["k_max_act"]
    k_max = min(k_max, ranges["k_max_act"]) if k_max is not None else ranges["k_max_act"]
    below = ranges["pooled_act"]["fp16"]
    if k_min <= 0:
        need = "fp16 needs no loss scale (activation gradients are in range)"
    elif k_max is not None and k_min > k_max:
        need = f"fp16: no single loss scale fits (needs >= 2^{k_min}, overflows above 2^{k_max})"
    else:
        need = f"fp16 needs a loss scale of at least 2^{k_min}" + (
            f" (at most 2^{k_max})" if k_max is not None else ""
        )
    if p.loss_scale == "dynamic":
        has = (
            "the dynamic scale (GradScaler) finds it"
            if k_min > 0
            else "its dynamic scale is harmless"
        )
    elif p.loss_scale == "none":
        has = (
            (
                "it has none: of the non-zero activation gradients "
                f"{100 * below['subnormal']:.1f}% are fp16 subnormals and "
                f"{100 * below['lost']:.1f}% round to 0 ({100 * (errors['zeroed'] or 0):.1f}% "
                "observed zeroed in this run)"
            )
            if k_min > 0
            else "it has none"
        )
    else:
        k = torch.log2(torch.tensor(float(p.loss_scale))).item()
        has = f"its static scale 2^{k:.0f} is {'enough' if k >= k_min else 'too small'}"
    return f"{name}: {need}; {has}{keep}; {err}"


def compare(ref: dict, run: dict) -> dict:
    zero = [zeroed(run["act_grad"].get(n), ref["act_grad"].get(n)) for n in ref["order"]]
    zero = [z for z in zero if z is not None]
    return {
        "forward": {n: rel_error(run["out"].get(n), ref["out"][n]) for n in ref["order"]},
        "act_grad": {
            n: rel_error(run["act_grad"].get(n), ref["act_grad"].get(n)) for n in ref["order"]
        },
        "grad": rel_error(
            torch.cat([g.flatten() for g in run["grad"].values()]),
            torch.cat([g.flatten() for g in ref["grad"].values()]),
        ),
        "zeroed": sum(zero) / len(zero) if zero else None,
    }


def markdown(
    command: str, config: Config, device, ranges: dict, results: dict, verdicts: list[str], png: str
) -> str:
    def f(v):
        return "-" if v is None else f"{v:.2g}"
    lines = [
        f"# Numerics advisor: {config.model.arch} on {config.dataset.name}",
        "",
        f"`{command}`",
        "",
        f"One batch of {config.trainer.batch_size} on {device}, same weights (seed {config.seed}); "
        "errors are relative to fp32: ||y - y_fp32|| / ||y_fp32||. fp16 columns: what fp16 would "
        "do to the fp32 run's "
        "values (overflow beyond 65504; lost = rounds to 0, below 2^-25).",
        "",
        "## Verdicts",
        "",
    ]
    lines += [f"- {v}" for v in verdicts]
    k = ranges["k_min"]
    lines += [
        "",
        f"Loss scale for fp16: at least 2^{k} lifts 99% of the non-zero activation gradients into "
        "fp16's "
        f"normal range; at most 2^{ranges['k_max_act']} keeps the largest below 65504.",
        "",
        f"![numerics]({png})",
        "",
    ]
    for name, (run, err) in results.items():
        lines += [
            f"## {name}",
            "",
            f"loss {run['loss']:.4g} (fp32 {ranges['loss']:.4g}), parameter-gradient "
            f"error {f(err['grad'])}, loss scale {run['scale']:g}",
            "",
            "| layer | forward error | act-grad error | fp16 overflow (fwd) | fp16 lost (act grad) "
            "|",
            "|---|---|---|---|---|",
        ]
        for n in ranges["forward"]:
            a = ranges["act_grad"].get(n)
            lines.append(
                f"| {n} | {f(err['forward'][n])} | {f(err['act_grad'][n])} | "
                f"{f(ranges['forward'][n]['fp16']['overflow'])} | {f(a and a['fp16']['lost'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = cli.ArgumentParser(
        prog="numerics.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "overrides", nargs="*", help="train.py overrides; precision=a,b,c lists the candidates"
    )
    ap.add_argument("--out", type=Path, help="output folder (default outputs/numerics/<time>)")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="fraction of activation gradients allowed to stay "
        "below fp16's normal range at the advised scale",
    )
    args = ap.parse_args(argv)
    try:
        ref_config, candidates = compose(args.overrides)
    except ConfigError as e:
        print(f"numerics: config error: {e}", file=sys.stderr)
        return 2
    from mixprec.report.probe_plots import advisor_figure

    device = hardware.select_device(ref_config.trainer.device)
    modes.configure(device, ref_config.trainer, ref_config.precision, ref_config.seed)
    batch = one_batch(ref_config, device)
    torch.manual_seed(ref_config.seed)
    reference = build_model(ref_config.model, batch[2])
    t0 = time.perf_counter()
    ref = run_precision(reference, ref_config, batch, device)
    ranges = {**reference_ranges(ref, args.tolerance), "loss": ref["loss"]}
    results, verdicts = {}, []
    for name, config in candidates.items():
        modes.configure(device, config.trainer, config.precision, config.seed)
        run = run_precision(reference, config, batch, device)
        results[name] = (run, compare(ref, run))
        verdicts.append(verdict(name, config, ranges, run, results[name][1]))
    out = args.out or ROOT / "outputs" / "numerics" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    k = ranges["k_min"]
    hists = [("fp32 activation gradients, unscaled", ranges["pooled_act"]["hist"], 0)]
    hists += (
        [(f"x 2^{k} (the advised fp16 loss scale)", ranges["pooled_act"]["hist"], k)]
        if k > 0
        else []
    )
    advisor_figure(
        out / "numerics.png",
        f"{ref_config.model.arch}: activation gradients of one batch vs fp16",
        ref["order"],
        {n: [e["forward"][m] for m in ref["order"]] for n, (_, e) in results.items()},
        hists,
    )
    command = " ".join(
        ["python scripts/numerics.py", *(argv if argv is not None else sys.argv[1:])]
    )
    write_text_atomic(
        out / "numerics.md",
        markdown(command, ref_config, device, ranges, results, verdicts, "numerics.png"),
    )
    for v in verdicts:
        print(v)
    print(
        f"numerics: {time.perf_counter() - t0:.1f} s on {device}; {out / 'numerics.md'}, "
        f"{out / 'numerics.png'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("numerics", main))
