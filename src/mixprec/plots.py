"""The report's figures (matplotlib, Agg): each function takes plain data, writes one PNG and returns its path.

Every axis says what it shows and in which unit; colours follow the precision, so a reader can follow fp32 or amp
from one figure to the next.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PRECISION_ORDER = ["fp32", "tf32", "amp", "amp_bf16", "half", "bf16", "o0", "o1", "o2", "o3", "fp8"]
_PALETTE = plt.get_cmap("tab10").colors + ((0.0, 0.0, 0.0),)   # one colour per PRECISION_ORDER entry (fp8: black)
DPI = 110


def precision_key(p: str) -> tuple:
    return (PRECISION_ORDER.index(p), p) if p in PRECISION_ORDER else (len(PRECISION_ORDER), str(p))


def color(precision: str):
    i = PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else sum(map(ord, str(precision)))
    return _PALETTE[i % len(_PALETTE)]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _grouped_bars(ax, labels: list[str], series: dict, ylabel: str, fmt: str = "{:.2f}") -> list[float]:
    """series: precision -> list over labels of (mean, std) or None. The bars a label has sit side by side,
    centred on it; returns, per label, the x of each precision's bar (for markers drawn on top)."""
    present = [[p for p in series if series[p][j] is not None] for j in range(len(labels))]
    width = 0.8 / max(max((len(ps) for ps in present), default=1), 1)
    xpos = {}
    for j, ps in enumerate(present):
        for i, p in enumerate(ps):
            xpos[(j, p)] = j + (i - (len(ps) - 1) / 2) * width
    for p, values in series.items():
        pts = [(xpos[(j, p)], v) for j, v in enumerate(values) if v is not None]
        spread = [v[1] or 0.0 for _, v in pts]
        ax.bar([x for x, _ in pts], [v[0] for _, v in pts], width * 0.95, label=p, color=color(p),
               yerr=spread if any(spread) else None, capsize=3)
        for (x, v), sd in zip(pts, spread):   # the value, above its error bar
            ax.annotate(fmt.format(v[0]), (x, v[0] + sd), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
    long = max(map(len, labels), default=0) > 12
    ax.set_xticks(range(len(labels)), labels, rotation=20 if long else 0, ha="right" if long else "center")
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    return xpos


def speedup_bars(path: Path, title: str, labels: list[str], series: dict, published: list) -> Path:
    """Speed-up of each precision over fp32 per model; published: (label index, precision, value or (lo, hi), text)."""
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 1.4 * len(labels) + 3)), 4.5))
    xpos = _grouped_bars(ax, labels, series, "speed-up over fp32 (x, fp32 time / time)")
    ax.axhline(1.0, color="black", lw=1, ls="--", label="fp32 = 1x")
    for n, (j, precision, value, text) in enumerate(published):
        lo, hi = value if isinstance(value, tuple) else (value, value)
        half = (hi - lo) / 2
        ax.errorbar([xpos.get((j, precision), j)], [(lo + hi) / 2], yerr=[[half], [half]], fmt="D", color="black",
                    ms=7, capsize=4, label="published" if n == 0 else None)
    ax.set_title(title)
    ax.legend(title="precision", fontsize=8)
    return _save(fig, path)


def time_and_memory(path: Path, title: str, labels: list[str], time_series: dict, mem_series: dict,
                    mem_kind: str) -> Path:
    if len(labels) <= 3:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(10.0, 2.4 * len(labels) + 5), 4.4))
    else:   # many models or variants: one above the other, each as wide as a page
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(min(14.0, 1.3 * len(labels) + 4), 9.0))
    _grouped_bars(a1, labels, time_series, "training time (s)", "{:.3g}")
    a1.set_title("training time (eval excluded)")
    _grouped_bars(a2, labels, mem_series, "peak memory (MB)", "{:.0f}")
    a2.set_title(f"peak memory ({mem_kind})" if mem_kind else "peak memory")
    for ax in (a1, a2):
        ax.legend(title="precision", fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def accuracy_curves(path: Path, title: str, curves: list[dict], ylabel: str = "test accuracy (%)",
                    xlabel: str = "epoch") -> Path:
    """curves: {label, precision, epochs: [...], mean: [...], lo: [...], hi: [...]} (lo/hi over seeds); the x
    values ("epochs") may be optimizer steps (xlabel="step")."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = "osD^vP*X"
    models = list(dict.fromkeys(c["model"] for c in curves))
    for c in curves:
        marker = markers[models.index(c["model"]) % len(markers)]
        ax.plot(c["epochs"], c["mean"], marker=marker, color=color(c["precision"]), label=c["label"])
        if c["n"] > 1:
            ax.fill_between(c["epochs"], c["lo"], c["hi"], color=color(c["precision"]), alpha=0.15)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if xlabel == "epoch":
        ax.set_xlim(0.5, max((max(c["epochs"]) for c in curves), default=1) + 0.5)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8, title="model, precision (band: min-max over seeds)", title_fontsize=8)
    return _save(fig, path)


def ladder(path: Path, title: str, steps: list[str], article: list, reproduced: dict, target: str) -> Path:
    """Time to target per ladder step; article: value or (lo, hi) per step; reproduced: precision -> [(mean, std)]."""
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(steps) + 2), 4.8))
    xs = list(range(len(steps)))
    mid = [None if v is None else (sum(v) / 2 if isinstance(v, tuple) else v) for v in article]
    pts = [(x, y) for x, y in zip(xs, mid) if y is not None]
    if pts:
        ax.step([x for x, _ in pts], [y for _, y in pts], where="mid", color="black", lw=2, label="article")
        ax.plot([x for x, _ in pts], [y for _, y in pts], "ko", ms=4)
        for x, v in zip(xs, article):
            if isinstance(v, tuple):   # a published range: its extent
                ax.errorbar([x], [sum(v) / 2], yerr=[[(v[1] - v[0]) / 2], [(v[1] - v[0]) / 2]], color="black", capsize=5)
    for precision, values in reproduced.items():
        got = [(x, v) for x, v in zip(xs, values) if v is not None]
        if got:
            ax.step([x for x, _ in got], [v[0] for _, v in got], where="mid", color=color(precision), lw=2,
                    label=f"reproduced ({precision})")
            ax.errorbar([x for x, _ in got], [v[0] for _, v in got], yerr=[v[1] or 0.0 for _, v in got],
                        fmt="o", color=color(precision), capsize=3)
    ax.set_xticks(xs, steps, rotation=30, ha="right")
    ax.set_xlabel("ladder step (cumulative)")
    ax.set_ylabel(f"training time to {target} (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def loss_scale(path: Path, title: str, traces: list[dict]) -> Path:
    """traces: {label, precision, steps, scales}; the loss scale is a power of two: log2 axis."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = ["-", "--", ":", "-."]
    for i, t in enumerate(traces):
        ax.plot(t["steps"], t["scales"], styles[i % len(styles)], color=color(t["precision"]), label=t["label"],
                drawstyle="steps-post", marker="." if len(t["steps"]) < 30 else None)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (log2 axis)")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)
