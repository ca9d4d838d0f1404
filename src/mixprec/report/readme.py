"""The README's section of committed results, made from results folders (scripts/reproduce.py's), never typed:

    python -m mixprec.report.readme outputs/reference/cpu-emulated-2026-11-25

prints the markdown for every folder under the given one (each holds plan.json and report/report.json);
tests/test_reference_results.py checks that the README holds exactly this text, so its numbers are the folders'.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .render import PARITY_HEADS, PPL_HEADS, Doc, parity_cells, ppl_cells

ROOT = Path(__file__).resolve().parents[3]


def folders(root: Path) -> list[Path]:
    """The completed results folders under root (a report made), in plan order of their articles."""
    found = [p for p in sorted(Path(root).iterdir()) if (p / "plan.json").is_file()
             and (p / "report" / "report.json").is_file()]
    order = {a: i for i, a in enumerate(("torch_amp", "half_pitfalls", "fastai_2080ti", "page_ladder", "apex_word_lm"))}
    return sorted(found, key=lambda p: order.get(p.name, len(order)))


def _load(folder: Path) -> tuple[dict, dict, dict]:
    read = lambda name: json.loads((folder / name).read_text())  # noqa: E731
    return read("plan.json"), read("environment.json"), read("report/report.json")


def _link(folder: Path) -> str:
    """The folder's report, linked from the README (a path relative to the repository)."""
    f = folder.resolve()
    rel = f.relative_to(ROOT).as_posix() if f.is_relative_to(ROOT) else f.as_posix()
    return f"[{folder.name}]({rel}/report/report.md)"


def section(root: Path) -> str:
    """The markdown: an overview of the folders (jobs, epochs, CPU minutes), then per folder the published values
    beside ours, the accuracy against fp32 seed by seed, or a language model's perplexity per epoch."""
    loaded = [(f, *_load(f)) for f in folders(root)]
    if not loaded:
        return ""
    d = Doc()
    rows, total = [], 0.0
    for f, state, _, _ in loaded:
        minutes = state["elapsed_s"] / 60
        total += minutes
        art = state["articles"][0]
        runs = [e for e in state["sweeps"] if not e["dropped"]]
        rows.append([_link(f), art["title"], sum(e["jobs"] for e in runs),
                     ", ".join(sorted({str(e["epochs"]) for e in runs})),
                     "; ".join(sorted({e["status"] for e in runs})), f"{minutes:.1f}"])
    env = loaded[0][2]
    d.p(f"Measured on a {env['cpu_count']}-core CPU ({env['device_name']}, no GPU), torch {env['torch']}, with "
        "the GPU's fp16/bf16 rounding emulated on fp32 kernels (`precision.emulate=auto`, docs/numerics.md): "
        "accuracy, perplexity and divergence are as on a GPU; no time here is a GPU's, so no speed-up is reported. "
        f"Sizes are cut to fit a CPU (src/mixprec/plan_cpu.yaml says each and why). Total CPU time {total:.0f} min.")
    d.table(["folder (report)", "what ran", "jobs", "epochs", "status", "CPU min"], rows)
    for f, state, _, report in loaded:
        _article(d, f, state, report)
    return d.markdown().strip() + "\n"


def _article(d: Doc, folder: Path, state: dict, report: dict) -> None:
    art = state["articles"][0]
    d.p(f"**{art['title']}** ({_link(folder)})")
    rows, skipped = [], 0
    for a in report["reference"]["articles"]:
        for r in a["rows"] if a["id"] == art["id"] else []:
            if r["cells"][0].startswith("missing:") or "[not comparable:" in r["cells"][0]:
                skipped += 1
            else:
                rows.append([r["label"], r["published"], r["cells"][0]])
    if rows:
        d.table(["published value", "published", "ours"], rows)
    if skipped:
        d.p(f"{skipped} more published value(s) (times, speed-ups, other datasets) are not measured here; the "
            "report says why for each.")
    for exp in report["experiments"]:
        if exp.get("parity") and (any(r["acc"] for r in exp["parity"]) or not exp.get("perplexity")):
            d.table(PARITY_HEADS, [parity_cells(r) for r in exp["parity"]])
        elif exp.get("verdicts"):   # cases run once each, some meant to fail: each run with the probe's verdict
            _cases(d, exp)
        if exp.get("perplexity"):
            d.table(PPL_HEADS, [ppl_cells(r) for r in exp["perplexity"]])
        shown = {r["group"] for r in exp.get("parity") or exp.get("perplexity") or []}
        legend = {k: v for k, v in exp["variants"].items() if any(k in g for g in shown)}
        if legend:
            d.p("Variants: " + "; ".join(f"{k} = `{v}`" for k, v in legend.items()) + ".")


def _cases(d: Doc, exp: dict) -> None:
    verdicts = {(v["model"], v["precision"]): v["verdict"] for v in exp["verdicts"]}
    rows = []
    for g in exp["groups"]:
        acc = g["metrics"]["final_test_acc"]
        verdict = verdicts.get((g["label"], g["precision"]), "none: nothing to explain")
        rows.append([g["label"], g["precision"], ", ".join(f"{n} {s}" for s, n in g["statuses"].items()),
                     "-" if acc is None else f"{100 * acc['mean']:.2f}", verdict])
    d.table(["case", "precision", "runs", "test acc (%)", "the probe's verdict"], rows)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python -m mixprec.report.readme <folder of results folders>")
    print(section(Path(sys.argv[1])), end="")
