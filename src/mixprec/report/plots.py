"""The report's figures (matplotlib, Agg): make_plots picks each experiment's series from the
analysis; each drawing function takes plain data, writes one PNG (atomically) and returns its path.

Every axis says what it shows and in which unit; colours follow the precision, so a reader can
follow fp32 or amp from one figure to the next.
"""
from __future__ import annotations

import functools
import re
import statistics
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import font_manager  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .. import records  # noqa: E402
from ..precision import modes  # noqa: E402
from ..runtime.hardware import CPU_PEAK_KINDS  # noqa: E402
from ..runtime.jobdirs import shorten  # noqa: E402
from ..records import atomic_file  # noqa: E402
from ..records import metrics  # noqa: E402
from .analyse import Group, precision_key, stats  # noqa: E402
from .load import number  # noqa: E402
from .published import Source, ladder_steps, matches  # noqa: E402

# one colour per precision.modes.MODES entry, in its order: tab10, then fp8 black, mxfp8 grey,
# fastai_fp16 olive, apex_fp16 teal, apex_fp16_2018 navy; then tab20b's for the modes named after
# them
_PALETTE = plt.get_cmap("tab10").colors + (
    (0.0, 0.0, 0.0),
    (0.5, 0.5, 0.5),
    (0.45, 0.45, 0.0),
    (0.0, 0.45, 0.45),
    (0.1, 0.1, 0.45),
) + plt.get_cmap("tab20b").colors
DPI = 110
# fonts that have CJK glyphs, tried in turn after matplotlib's DejaVu Sans (which has none: a
# Chinese or Japanese experiment name would be drawn as empty boxes); only those installed are named
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Source Han Sans SC", "WenQuanYi Zen Hei",
             "WenQuanYi Micro Hei", "Droid Sans Fallback", "AR PL UMing CN", "IPAexGothic",
             "IPAGothic", "Hiragino Sans", "PingFang SC", "Microsoft YaHei", "SimHei", "MS Gothic")


def font_families() -> list[str]:
    """matplotlib's font.family for the report: DejaVu Sans, then the installed CJK fonts, in
    CJK_FONTS' order (matplotlib falls back glyph by glyph along the list)."""
    installed = {f.name for f in font_manager.fontManager.ttflist}
    return ["DejaVu Sans", *(f for f in CJK_FONTS if f in installed)]


plt.rcParams["font.family"] = font_families()
EMULATED_CAPTION = (" Hatched, (emulated): fp16/bf16 rounding emulated on fp32 kernels "
                    "(precision.emulate), so those bars are fp32 time and memory on their device, "
                    "not the precision's (as the runs table marks them).")
PLAIN_FP32_CAPTION = (" Hatched, (fp32 arithmetic): a TF32 mode on a device without TF32 (a CPU) "
                      "ran fp32's arithmetic: its bar is an fp32 job's time, and a gap to fp32 is "
                      "noise or one-time costs, not a speed-up.")
EMULATED_LADDER = (" Dashed, (emulated): fp16/bf16 rounding emulated on fp32 kernels, so that "
                   "staircase is an fp32 time on its device, not the precision's.")


def color(precision: str):
    """The precision's colour: its place's in precision.modes.MODES; a mode not named there takes
    one that no named mode has, picked by its name (crc32: the same in every process)."""
    if precision in modes.MODES:
        return _PALETTE[modes.MODES.index(precision) % len(_PALETTE)]
    free = _PALETTE[len(modes.MODES):] or _PALETTE
    return free[zlib.crc32(str(precision).encode()) % len(free)]


def legend_outside(ax, **kw) -> None:
    """The axes' legend to the right of the plot, where it covers no bar, value label or line."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def save(fig, path: Path) -> Path:
    """Write the figure as a PNG at `path` (all or nothing) and close it."""
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, dpi=DPI, format="png")
    plt.close(fig)
    return path


EMULATED_HATCH = "//"


def _grouped_bars(ax, labels: list[str], series: dict, ylabel: str, fmt: str = "{:.2f}",
                  emulated: frozenset = frozenset(), tag: str = "emulated") -> list[float]:
    """series: precision -> list over labels of (mean, std) or None. The bars a label has sit side
    by side, centred on it; returns, per label, the x of each precision's bar (for markers on top).
    emulated: the (label, precision) bars whose arithmetic was emulated: hatched, and their
    precision's legend entry says so, as the tables mark them (an fp32 time and memory); tag: the
    word it says (emulated, or fp32 arithmetic for TF32 where the device has none)."""
    present = [[p for p in series if series[p][j] is not None] for j in range(len(labels))]
    width = 0.8 / max(max((len(ps) for ps in present), default=1), 1)
    xpos = {}
    for j, ps in enumerate(present):
        for i, p in enumerate(ps):
            xpos[(j, p)] = j + (i - (len(ps) - 1) / 2) * width
    for p, values in series.items():
        pts = [(xpos[(j, p)], v) for j, v in enumerate(values) if v is not None]
        spread = [v[1] or 0.0 for _, v in pts]
        marked = [(labels[j], p) in emulated for j, v in enumerate(values) if v is not None]
        name = f"{p} ({tag})" if all(marked) else f"{p} (hatched: {tag})"
        name = name if any(marked) else p
        bars = ax.bar([x for x, _ in pts], [v[0] for _, v in pts], width * 0.95, label=name,
                      color=color(p), yerr=spread if any(spread) else None, capsize=3)
        for bar, m in zip(bars, marked):
            if m:
                bar.set_hatch(EMULATED_HATCH)
        crowded = len(xpos) > 8   # so many bars that their labels side by side would overlap
        for (x, v), sd in zip(pts, spread):   # the value, above its error bar
            ax.annotate(fmt.format(v[0]), (x, v[0] + sd), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7 if crowded else 8,
                        rotation=90 if crowded else 0)
    long = max(map(len, labels), default=0) > 12
    ax.set_xticks(
        range(len(labels)), labels, rotation=20 if long else 0, ha="right" if long else "center"
    )
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    return xpos


def speedup_bars(path: Path, title: str, labels: list[str], series: dict, published: list) -> Path:
    """Speed-up of each precision over fp32 per model; published: (label index, precision, value or
    (lo, hi), text)."""
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 1.4 * len(labels) + 3)), 4.5))
    xpos = _grouped_bars(ax, labels, series, "speed-up over fp32 (x, fp32 time / time)")
    ax.axhline(1.0, color="black", lw=1, ls="--", label="fp32 = 1x")
    for n, (j, precision, value, text) in enumerate(published):
        lo, hi = value if isinstance(value, tuple) else (value, value)
        half = (hi - lo) / 2
        ax.errorbar(
            [xpos.get((j, precision), j)],
            [(lo + hi) / 2],
            yerr=[[half], [half]],
            fmt="D",
            color="black",
            ms=7,
            capsize=4,
            label="published" if n == 0 else None,
        )
    ax.set_title(title)
    legend_outside(ax, title="precision", fontsize=8)
    return save(fig, path)


def time_and_memory(path: Path, title: str, labels: list[str], time_series: dict, mem_series: dict,
                    mem_kind: str, emulated: frozenset = frozenset(),
                    tag: str = "emulated") -> Path:
    """Training time and peak memory per label and precision; bars that are not their precision's
    arithmetic (emulated, or TF32 that ran as fp32: records.no_speedup) hatched."""
    if len(labels) <= 3:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(10.0, 2.4 * len(labels) + 5), 4.4))
    else:   # many models or variants: one above the other, each as wide as a page
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(min(14.0, 1.3 * len(labels) + 4), 9.0))
    _grouped_bars(a1, labels, time_series, "training time (s)", "{:.3g}", emulated, tag)
    a1.set_title("training time (eval excluded)")
    _grouped_bars(a2, labels, mem_series, "peak memory (MB)", "{:.0f}", emulated, tag)
    a2.set_title(f"peak memory ({mem_kind})" if mem_kind else "peak memory")
    for ax in (a1, a2):
        # a panel with no numbers (e.g. no memory recorded) has no legend
        if ax.get_legend_handles_labels()[0]:
            legend_outside(ax, title="precision", fontsize=8)
    fig.suptitle(title)
    return save(fig, path)


def memory_ledger(path: Path, title: str, jobs: list[tuple[str, dict]]) -> Path:
    """A stacked bar per job: its memory ledger's parts in MB (summary.json's "memory",
    train/memory.py), bottom to top in the ledger's order; a part no job holds is left out."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(jobs) + 3.5), 4.8))
    parts = list(dict.fromkeys(k for _, mem in jobs for k in mem["bytes"]))
    bottom = [0.0] * len(jobs)
    for i, part in enumerate(parts):
        values = [mem["bytes"].get(part, 0) / 2**20 for _, mem in jobs]
        if any(values):
            ax.bar(range(len(jobs)), values, bottom=bottom, label=part,
                   color=plt.get_cmap("tab10").colors[i % 10])
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(jobs)), [label for label, _ in jobs], rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("MB held by one rank")
    ax.set_title(title)
    legend_outside(ax, title="part", fontsize=8)
    return save(fig, path)


def ledger_figure(name: str, groups: list[Group], path: Path) -> list[dict]:
    """The memory ledger's figure ([] when no job has a ledger)."""
    jobs = [(f"{g.label} {g.precision} #{records.job_num(j.summary)}", records.memory(j.summary))
            for g in groups for j in g.jobs if records.memory(j.summary)]
    if not jobs:
        return []
    return [{"path": memory_ledger(path, f"{name}: memory ledger per job", jobs),
             "caption": "What each job's training holds, part by part (summary.json `memory`): "
                        "weights, fp32 masters, gradients and optimizer state from the tensors "
                        "at the end, activations as autograd saved them at one steady step, "
                        "each storage once; on one rank (docs/memory.md)."}]


def accuracy_curves(path: Path, title: str, curves: list[dict], ylabel: str = "test accuracy (%)",
                    xlabel: str = "epoch") -> Path:
    """curves: {label, precision, epochs: [...], mean: [...], lo: [...], hi: [...]} (lo/hi over
    seeds); the x values ("epochs") may be optimizer steps (xlabel="step")."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = "osD^vP*X"
    models = list(dict.fromkeys(c["model"] for c in curves))
    for c in curves:
        marker = markers[models.index(c["model"]) % len(markers)]
        ax.plot(
            c["epochs"], c["mean"], marker=marker, color=color(c["precision"]), label=c["label"]
        )
        if c["n"] > 1:
            ax.fill_between(c["epochs"], c["lo"], c["hi"], color=color(c["precision"]), alpha=0.15)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if xlabel == "epoch":
        ax.set_xlim(0.5, max((max(c["epochs"]) for c in curves), default=1) + 0.5)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    legend_outside(ax, fontsize=8, title="model, precision\n(band: min-max over seeds)",
                   title_fontsize=8)
    return save(fig, path)


def ladder(path: Path, title: str, steps: list[str], article: list, reproduced: dict, target: str,
           emulated: frozenset = frozenset()) -> Path:
    """Time to target per ladder step; article: value or (lo, hi) per step; reproduced: precision ->
    [(mean, std)]; an emulated precision's staircase is dashed and labelled so (an fp32 time)."""
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(steps) + 2), 4.8))
    xs = list(range(len(steps)))
    mid = [None if v is None else (sum(v) / 2 if isinstance(v, tuple) else v) for v in article]
    pts = [(x, y) for x, y in zip(xs, mid) if y is not None]
    if pts:
        ax.step(
            [x for x, _ in pts],
            [y for _, y in pts],
            where="mid",
            color="black",
            lw=2,
            label="article",
        )
        ax.plot([x for x, _ in pts], [y for _, y in pts], "ko", ms=4)
        for x, v in zip(xs, article):
            if isinstance(v, tuple):  # a published range: its extent
                ax.errorbar(
                    [x],
                    [sum(v) / 2],
                    yerr=[[(v[1] - v[0]) / 2], [(v[1] - v[0]) / 2]],
                    color="black",
                    capsize=5,
                )
    for precision, values in reproduced.items():
        got = [(x, v) for x, v in zip(xs, values) if v is not None]
        if got:
            ax.step(
                [x for x, _ in got],
                [v[0] for _, v in got],
                where="mid",
                color=color(precision),
                lw=2,
                ls="--" if precision in emulated else "-",
                label=f"reproduced ({precision}, emulated)"
                if precision in emulated
                else f"reproduced ({precision})",
            )
            ax.errorbar(
                [x for x, _ in got],
                [v[0] for _, v in got],
                yerr=[v[1] or 0.0 for _, v in got],
                fmt="o",
                color=color(precision),
                capsize=3,
            )
    ax.set_xticks(xs, steps, rotation=30, ha="right")
    ax.set_xlabel("ladder step (cumulative)")
    ax.set_ylabel(f"training time to {target} (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    legend_outside(ax, fontsize=8)
    return save(fig, path)


def loss_scale(path: Path, title: str, traces: list[dict]) -> Path:
    """traces: {label, precision, steps, scales}; the loss scale is a power of two: log2 axis."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = ["-", "--", ":", "-."]
    for i, t in enumerate(traces):
        ax.plot(
            t["steps"],
            t["scales"],
            styles[i % len(styles)],
            color=color(t["precision"]),
            label=t["label"],
            drawstyle="steps-post",
            marker="." if len(t["steps"]) < 30 else None,
        )
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (log2 axis)")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    legend_outside(ax, fontsize=8)
    return save(fig, path)


# ----------------------------------------------------------------------------- the report's figures


def make_plots(exp: dict, sources: list[Source], out: Path) -> list[dict]:
    """The experiment's figures as [{path, caption}], in the report's order: speed-up, time and
    memory, memory ledger, training loss, curves per epoch, Page's ladder, loss scale; a figure with
    nothing to show is left out."""
    groups: list[Group] = exp["_groups"]
    # a file name: 255 bytes at most
    slug = shorten(re.sub(r"[^A-Za-z0-9_.-]+", "_", exp["name"]), 100, 60)
    pdir = out / "plots"
    curves = _curves(groups)
    figs = (speedup_figure(exp, groups, pdir / f"{slug}_speedup.png")
            + time_memory_figure(exp["name"], groups, pdir / f"{slug}_time_memory.png")
            + ledger_figure(exp["name"], groups, pdir / f"{slug}_memory_ledger.png")
            + loss_figure(exp["name"], groups, curves, pdir / f"{slug}_train_loss.png")
            + curves_figure(exp["name"], curves, pdir / f"{slug}_curves.png")
            + ladder_figure(exp, sources, groups, pdir / f"{slug}_ladder.png")
            + loss_scale_figure(exp["name"], groups, pdir / f"{slug}_loss_scale.png"))
    return [{"path": str(f["path"]), "caption": f["caption"]} for f in figs]


def series(groups: list[Group], metric: str, only=None, labs: list[str] | None = None
           ) -> tuple[list[str], dict]:
    """A metric's bars: (the labels with a value, precision -> [(mean, std) or None per label]);
    only: the precisions kept (all by default); labs: the labels to show (those with a value by
    default)."""
    labels = list(dict.fromkeys(g.label for g in groups))
    precisions = sorted({g.precision for g in groups}, key=precision_key)
    table = {(g.label, g.precision): g.stats(metric) for g in groups
             if only is None or only(g.precision)}
    if labs is None:
        labs = [lab for lab in labels if any(table.get((lab, p)) for p in precisions)]
    by_precision = {
        p: [
            table.get((lab, p)) and (table[(lab, p)]["mean"], table[(lab, p)]["std"])
            for lab in labs
        ]
        for p in precisions
        if any(table.get((lab, p)) for lab in labs)
    }
    return labs, by_precision


def not_fp32(precision: str) -> bool:
    """The speed-up figure's precisions: all but the baseline, fp32 = 1x."""
    return precision != "fp32"


def speedup_figure(exp: dict, groups: list[Group], path: Path) -> list[dict]:
    """Each precision's speed-up over fp32 per model, beside the published values for the same
    model and precision ([] when no job has a speed-up)."""
    speed_labels, speed = series(groups, "speedup", only=not_fp32)
    if not speed:
        return []
    published = []
    for c in exp["comparisons"]:
        if c["metric"] == "speedup":
            for r in c["rows"]:
                if r["group"] in speed_labels and r["reproduced"] is not None:
                    value = tuple(c["value"]) if isinstance(c["value"], list) else c["value"]
                    published.append(
                        (speed_labels.index(r["group"]), r["precision"], value, c["label"])
                    )
    return [{
        "path": speedup_bars(path, f"{exp['name']}: speed-up over fp32 (training time)",
                             speed_labels, speed, published),
        "caption": "Speed-up of each precision over fp32 (fp32 training time / its "
                   "training time, "
        "same other settings); error bars: standard deviation over seeds; diamonds: "
        "published values for the same model and precision.",
    }]


def time_memory_figure(name: str, groups: list[Group], path: Path) -> list[dict]:
    """Training time and peak memory per model and precision, the bars that are no time of their
    precision's arithmetic hatched ([] when no job has a time)."""
    time_labels, times = series(groups, "train_time_s")
    _, mems = series(groups, "peak_memory_mb", labs=time_labels)
    if not times:
        return []
    kinds = sorted(
        {
            k
            for g in groups
            for j in g.jobs
            for k in [metrics(j.summary).get("peak_memory_kind")]
            if k
        }
    )
    what = {**{k: f"CPU, {v}" for k, v in CPU_PEAK_KINDS.items()},
            "cuda_max_allocated": "max memory allocated by tensors on the GPU"}
    mem_kind = " / ".join(what.get(k, k) for k in kinds)
    emulated = frozenset((g.label, g.precision) for g in groups
                         if any(records.emulated(j.summary) for j in g.jobs))
    plain = frozenset((g.label, g.precision) for g in groups
                      if any(records.fp32_arithmetic(j.summary) for j in g.jobs))
    tag = " or ".join(([] if not emulated else ["emulated"])
                      + ([] if not plain else ["fp32 arithmetic"])) or "emulated"
    return [{
        "path": time_and_memory(path, f"{name}: training time and peak memory", time_labels,
                                times, mems, mem_kind, emulated | plain, tag),
        "caption": "Training time (eval excluded) and peak memory per model and precision, "
                   "mean over "
        "completed runs; error bars: standard deviation over seeds."
        + (EMULATED_CAPTION if emulated else "")
        + (PLAIN_FP32_CAPTION if plain else ""),
    }]


def loss_figure(name: str, groups: list[Group], curves: list[dict], path: Path) -> list[dict]:
    """Training loss at each logged step, every run on one plot: language models' always, image
    models' when their runs have too few epochs for a curve per epoch (curves: _curves')."""
    # a run of one epoch has one point per epoch: its per-step training loss is the curve then
    losses = _loss_curves(groups, all_kinds=max((len(c["epochs"]) for c in curves), default=0) < 2)
    if not losses:
        return []
    return [{
        "path": accuracy_curves(path, f"{name}: training loss", losses,
                                "training loss (mean over the logged window)", "step"),
        "caption": "Training loss at each logged step (metrics.jsonl train rows: every "
                   "`trainer.log_every` steps and at each epoch's end), every run on one "
        "plot: the gap between precisions at equal steps; mean over seeds.",
    }]


def curves_figure(name: str, curves: list[dict], path: Path) -> list[dict]:
    """Test accuracy (or perplexity) after each epoch, mean over seeds ([] with one point per
    run)."""
    if max((len(c["epochs"]) for c in curves), default=0) <= 1:   # one point per run
        return []
    key, ylabel = curves[0]["key"], curves[0]["ylabel"]
    return [{
        "path": accuracy_curves(path, f"{name}: {ylabel.split(' (')[0]} per epoch", curves,
                                ylabel),
        "caption": f"{ylabel} after each epoch (metrics.jsonl `{key}`), mean over seeds.",
    }]


def ladder_figure(exp: dict, sources: list[Source], groups: list[Group], path: Path
                  ) -> list[dict]:
    """Page's staircase of training time per ladder step against the reproduced one ([] when the
    experiment has no ladder source or no job matches a step)."""
    staircase = _ladder(exp, sources, groups)
    if not staircase:
        return []
    return [{
        "path": ladder(path, f"{exp['name']}: training time per step", *staircase),
        "caption": "Training time per ladder step: the article's staircase against the "
                   "reproduced one "
        "(Page's times are each step's whole fixed schedule, eval excluded, with a mean "
        "final accuracy of the target over his runs; ours: the same time, mean over "
        "seeds; the ladder table gives the fraction of runs that reached the target)."
        + (EMULATED_LADDER if staircase[-1] else ""),
    }]


def loss_scale_figure(name: str, groups: list[Group], path: Path) -> list[dict]:
    """The loss scale at each logged step, a trace per run ([] when no run logged one)."""
    traces = _loss_scale_traces(groups)
    if not traces:
        return []
    return [{
        "path": loss_scale(path, f"{name}: loss scale", traces),
        "caption": "Loss scale at each logged step (metrics.jsonl train rows); a drop is a "
                   "step "
        "skipped for non-finite gradients.",
    }]


def _curves(groups: list[Group]) -> list[dict]:
    rows = {
        g.label + g.precision: [r for j in g.jobs if j.plotted for r in j.rows()
                                if r.get("kind") == "epoch"]
        for g in groups
    }
    any_acc = any(number(r.get("test_acc")) is not None for rs in rows.values() for r in rs)
    key, scale, ylabel = (
        ("test_acc", 100.0, "test accuracy (%)")
        if any_acc
        else ("test_ppl", 1.0, "test perplexity")
    )
    curves = _mean_curves(groups, lambda r: (r["epoch"], scale * r[key]) if r.get("kind") == "epoch"
                          and number(r.get(key)) is not None else None)
    return [dict(c, key=key, ylabel=ylabel) for c in curves]


def _loss_curves(groups: list[Group], all_kinds: bool = False) -> list[dict]:
    """Training loss per logged step: language-model experiments (their train rows carry a
    perplexity), where the loss is the comparison between precisions; with all_kinds, image
    models' too (runs too short for a curve per epoch). Left out where no run logged two steps."""
    curves = _mean_curves(groups, functools.partial(_loss_point, all_kinds=all_kinds))
    return curves if any(len(c["epochs"]) > 1 for c in curves) else []


def _loss_point(r: dict, all_kinds: bool) -> tuple | None:
    """A train row's (step, loss) for _loss_curves; None for other rows."""
    if r.get("kind") != "train" or number(r.get("loss")) is None:
        return None
    return (r["step"], r["loss"]) if all_kinds or "ppl" in r else None


def _mean_curves(groups: list[Group], point) -> list[dict]:
    """Per group, the mean, min and max over its jobs of the metrics.jsonl rows' points (x, y) =
    point(row) (None: not a point), by x."""
    curves = []
    for g in groups:
        per_x: dict = {}
        for j in filter(lambda j: j.plotted, g.jobs):
            for r in j.rows():
                xy = point(r)
                if xy is not None:
                    per_x.setdefault(xy[0], []).append(xy[1])
        if per_x:
            xs = sorted(per_x)
            curves.append(
                {
                    "label": f"{g.label}, {g.precision}",
                    "model": g.label,
                    "precision": g.precision,
                    "epochs": xs,
                    "mean": [statistics.fmean(per_x[x]) for x in xs],
                    "lo": [min(per_x[x]) for x in xs],
                    "hi": [max(per_x[x]) for x in xs],
                    "n": len(g.jobs),
                }
            )
    return curves


def _ladder(exp: dict, sources: list[Source], groups: list[Group]):
    steps = ladder_steps(v for s in sources if s.id in exp["sources"] for v in s.values)
    hit = [[j for g in groups for j in g.jobs if matches(v.match, j.summary)] for v in steps]
    if not steps or not any(hit):
        return None
    precisions = sorted({j.precision for js in hit for j in js}, key=precision_key)
    reproduced = {}
    for p in precisions:
        vals = [
            stats([j.metric(v.metric) for j in js if j.precision == p]) for v, js in zip(steps, hit)
        ]
        reproduced[p] = [None if st is None else (st["mean"], st["std"]) for st in vals]
    targets = {metrics(j.summary).get("target_acc") for js in hit for j in js} - {None}
    target = (
        f"{100 * targets.pop():g}% test accuracy" if len(targets) == 1 else "the target accuracy"
    )
    emulated = frozenset(j.precision for js in hit for j in js if records.emulated(j.summary))
    return [v.label for v in steps], [v.value for v in steps], reproduced, target, emulated


def _loss_scale_traces(groups: list[Group], limit: int = 12) -> list[dict]:
    traces = []
    for g in groups:
        for j in filter(lambda j: j.plotted, g.jobs):
            pts = [
                (r["step"], r["loss_scale"])
                for r in j.rows()
                if r.get("kind") == "train" and number(r.get("loss_scale")) and r["loss_scale"] > 0
            ]
            if pts:
                seed = f", seed {j.seed}" if len(g.jobs) > 1 else ""
                traces.append({"label": f"{g.label}, {g.precision}{seed}", "precision": g.precision,
                               "steps": [p[0] for p in pts], "scales": [p[1] for p in pts]})
    return traces[:limit]
