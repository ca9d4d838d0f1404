"""The numerics probe's figures (matplotlib, Agg): layer x step heatmaps of fp16 overflow and
underflow, and the paper-style histogram of activation-gradient magnitudes against fp16's ranges
(Micikevicius et al. 2018, Fig. 3), unscaled against scaled. make_report adds them for every probed
job (a job dir with numerics.jsonl); scripts/numerics.py draws its histogram with the same function.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from ..numerics import probe_stats as ps
from ..numerics.probe import MODEL, NUMERICS
from ..records import read_jsonl
from .plots import color, plt, save

FP16 = ps.FORMATS["fp16"]
SHADES = [  # (from log2, to log2, colour, label): fp16's ranges on a log2-magnitude axis
    (ps.LO, np.log2(FP16.lost_at), "#d62728", "lost: rounds to 0 in fp16"),
    (np.log2(FP16.lost_at), np.log2(FP16.min_normal), "#ff7f0e", "fp16 subnormal (precision lost)"),
    (np.log2(FP16.min_normal), np.log2(FP16.overflow_at), "#2ca02c", "fp16 normal range"),
    (np.log2(FP16.overflow_at), ps.HI, "#9467bd", "overflows fp16"),
]


def magnitude_histogram(path: Path, title: str, hists: list[tuple[str, dict, int]]) -> Path:
    """hists: (label, sparse histogram, log2 shift: the scale applied to the values)."""
    fig, ax = plt.subplots(figsize=(9.0, 4.6))
    draw_histogram(ax, title, hists)
    return save(fig, path)


def draw_histogram(ax, title: str, hists: list[tuple[str, dict, int]]) -> None:
    """Fraction of non-zero values per power of two, fp16's ranges shaded; the legend says how many
    values were exactly zero."""
    spans = [(h["lo"] + k, h["lo"] + k + len(h["counts"])) for _, h, k in hists if h["counts"]]
    lo = min([s[0] for s in spans] + [-30]) - 2
    hi = max([s[1] for s in spans] + [17]) + 2
    for a, b, c, label in SHADES:
        if b > lo and a < hi:
            ax.axvspan(max(a, lo), min(b, hi), color=c, alpha=0.12, label=label)
    styles = ["-", "--", ":", "-."]
    for i, (label, h, k) in enumerate(hists):
        if not h["counts"]:
            continue
        total = sum(h["counts"]) + h["zero"]
        xs = np.arange(len(h["counts"]) + 1) + h["lo"] + k
        fr = np.array(h["counts"] + [0]) / max(sum(h["counts"]), 1)
        zero = f", {100 * h['zero'] / max(total, 1):.0f}% exactly 0" if h["zero"] else ""
        ax.step(
            xs,
            fr,
            where="post",
            ls=styles[i % len(styles)],
            lw=2,
            color=plt.get_cmap("tab10").colors[i],
            label=f"{label}{zero}",
        )
    ax.set_xlim(lo, hi)
    ax.set_xlabel("log2 |value| (bin e holds 2^e <= |x| < 2^(e+1))")
    ax.set_ylabel("fraction of non-zero values")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def layer_heatmap(path: Path, title: str, rows: list[dict]) -> Path | None:
    """Two panels, layers (forward order) x probed steps: the fraction of forward outputs that would
    overflow fp16, and the fraction of (unscaled) activation gradients that would underflow it
    (subnormal or rounded to 0)."""
    steps = sorted({r["step"] for r in rows})
    layers = sorted(
        {(r["order"], r["name"]) for r in rows if r["kind"] == "forward" and r["name"] != MODEL}
    )
    if not steps or not layers:
        return None
    names = [n for _, n in layers]
    fig, axes = plt.subplots(
        1,
        2,
        figsize=(min(16.0, 6 + 0.5 * len(steps) * 2), max(4.0, 0.16 * len(names) + 2)),
        sharey=True,
    )
    for ax, (kind, value, label) in zip(axes, heatmap_panels(rows)):
        grid = np.full((len(names), len(steps)), np.nan)
        for r in rows:
            if r["kind"] == kind and r["name"] in names:
                grid[names.index(r["name"]), steps.index(r["step"])] = value(r)
        heatmap_panel(fig, ax, grid, steps, label)
    axes[0].set_yticks(range(len(names)), names, fontsize=6 if len(names) > 30 else 8)
    fig.suptitle(title)
    return save(fig, path)


def fp16_overflow(r: dict) -> float:
    """A probe row's fraction of values that would overflow fp16."""
    return r["fp16"]["overflow"]


def fp16_underflow(r: dict) -> float:
    """A probe row's fraction of values below fp16's normal range (subnormal or rounded to 0)."""
    return r["fp16"]["subnormal"] + r["fp16"]["lost"]


def heatmap_panels(rows: list[dict]) -> list[tuple]:
    """The heatmap's two panels as (row kind, value of a row, title): forward outputs overflowing
    fp16, activation gradients (unscaled where the probe recorded them so) below its normal
    range."""
    grad = (
        "act_grad_unscaled" if any(r["kind"] == "act_grad_unscaled" for r in rows) else "act_grad"
    )
    return [
        ("forward", fp16_overflow, "forward output: fraction overflowing fp16"),
        (
            grad,
            fp16_underflow,
            "activation gradient"
            + (" (unscaled)" if grad == "act_grad_unscaled" else "")
            + ": fraction below fp16's normal range",
        ),
    ]


def heatmap_panel(fig, ax, grid, steps: list[int], label: str) -> None:
    """One panel of layer_heatmap: grid (layers x steps) as colours from 0, a colour bar beside."""
    im = ax.imshow(
        grid,
        aspect="auto",
        cmap="magma_r",
        vmin=0,
        vmax=max(np.nanmax(grid, initial=0), 1e-3),
        interpolation="nearest",
    )
    ax.set_xticks(
        range(len(steps)),
        [str(s) for s in steps],
        rotation=90 if len(steps) > 12 else 0,
        fontsize=7,
    )
    ax.set_xlabel("optimizer step")
    ax.set_title(label, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)


def act_grad_hists(rows: list[dict], step: int) -> list[tuple[str, dict, int]]:
    """The whole model's activation-gradient histograms at `step`: unscaled, and at the scale the
    run used."""
    pooled = {r["kind"]: r for r in rows if r["name"] == MODEL and r["step"] == step}
    if "act_grad_unscaled" in pooled:
        scale = pooled["act_grad"]["scale"]
        return [("unscaled", pooled["act_grad_unscaled"]["hist"], 0),
                (f"at the run's loss scale 2^{np.log2(scale):.0f}", pooled["act_grad"]["hist"], 0)]
    if "act_grad" in pooled:
        h = pooled["act_grad"]["hist"]
        k = ps.smallest_scale(h)
        out = [("unscaled (the run used no loss scale)", h, 0)]
        return out + (
            [(f"x 2^{k} (the smallest scale lifting 99% into fp16's normal range)", h, k)]
            if k
            else []
        )
    return []


def numerics_figures(jobs: list[tuple[Path, str]], pdir: Path) -> list[dict]:
    """For each probed job (its dir, its label): its heatmap and its first probed step's
    activation-gradient histogram."""
    figs = []
    for d, label in jobs:
        d = Path(d)
        if not (d / NUMERICS).exists():
            continue
        rows = read_jsonl(d / NUMERICS)
        slug = re.sub(
            r"[^A-Za-z0-9_.-]+",
            "_",
            f"{d.name[:40]}_{hashlib.sha1(str(d).encode()).hexdigest()[:8]}",
        )
        p = layer_heatmap(
            pdir / f"numerics_heatmap_{slug}.png", f"fp16 ranges per layer: {label}", rows
        )
        if p is not None:
            figs.append(
                {
                    "path": str(p),
                    "caption": f"{label}: per layer and probed step, the fraction of "
                    "forward outputs that would overflow fp16 and of activation gradients below "
                    "its normal range "
                    "(blank: no gradient reaches that output)",
                }
            )
        steps = sorted({r["step"] for r in rows if r["kind"] == "act_grad"})
        hists = act_grad_hists(rows, steps[0]) if steps else []
        if hists:
            p = magnitude_histogram(pdir / f"numerics_hist_{slug}.png",
                                    f"activation gradients at step {steps[0]}: {label}", hists)
            figs.append(
                {
                    "path": str(p),
                    "caption": f"{label}: activation-gradient magnitudes of the whole "
                    f"model at step {steps[0]} against fp16's ranges (Micikevicius et al. 2018, "
                    "Fig. 3), "
                    "unscaled and scaled",
                }
            )
    return figs


def advisor_figure(path: Path, title: str, layers: list[str], errors: dict, hists: list) -> Path:
    """scripts/numerics.py: per-layer forward relative error of each precision against fp32
    (non-finite: x at the top), and the fp32 run's activation-gradient histogram against fp16's
    ranges, unscaled and at the advised scale."""
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(9.0, 0.12 * len(layers) + 4), 10.0))
    for precision, errs in errors.items():
        ys = [e if e is not None and np.isfinite(e) and e > 0 else np.nan for e in errs]
        a1.plot(range(len(layers)), ys, marker=".", color=color(precision), label=precision)
        bad = [i for i, e in enumerate(errs) if e is not None and not np.isfinite(e)]
        if bad:
            a1.plot(
                bad,
                [1.0] * len(bad),
                "x",
                color=color(precision),
                ms=8,
                label=f"{precision}: non-finite",
            )
    a1.set_yscale("log")
    a1.set_xticks(range(len(layers)), layers, rotation=90, fontsize=6 if len(layers) > 30 else 8)
    a1.set_ylabel("forward relative error vs fp32")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a1.set_title("per layer, forward order: ||y - y_fp32|| / ||y_fp32||")
    draw_histogram(a2, title, hists)
    return save(fig, path)
