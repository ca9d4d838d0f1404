"""The report as Markdown and self-contained HTML: Doc (the blocks and their two renderings) and
document(), one function per section, over analyse.analyse's data (report.md, report.html; readme.py
and wandb_report.py reuse the blocks and cells). Only formatting here: the numbers are analyse.py's,
the cells the report shares with the console's tables rows.py's.
"""
from __future__ import annotations

import base64
import html
import os
import re
from pathlib import Path

from ..runtime import busy
from .published import DERIVED
from .reference import NOT_PLANNED
from .rows import HOST_BOUND_NOTE, LADDER_COLUMNS, ladder_cells, mean_sd, memory_kinds, row_cells


def format_ratio(r: dict) -> str:
    if r.get("difference") is not None:
        return f"{r['difference']:+.3g} (difference)"
    if isinstance(r.get("ratio"), list):
        return f"{r['ratio'][0]:.2f}-{r['ratio'][1]:.2f}"
    if r.get("ratio") is not None:
        return f"{r['ratio']:.2f}"
    return "-"


def format_reproduced(c: dict, r: dict) -> str:
    rep = r.get("reproduced")
    if rep is None:
        return "-"
    if "statuses" in rep:
        seen = rep["statuses"]
        return ", ".join(f"{s} ({seen.count(s)}/{len(seen)})" for s in dict.fromkeys(seen))
    return mean_sd(rep, unit=c["unit"], of=r["runs"])


# Latin fonts first, then CJK ones (a Chinese or Japanese experiment name, title or path draws in
# the first font that has its glyphs), then the generic family
FONT_STACK = ('system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC",'
              '"Noto Sans CJK JP","Source Han Sans SC","PingFang SC","Hiragino Sans",'
              '"Microsoft YaHei",sans-serif')


class Doc:
    """Blocks (heading, paragraph, table, image, list) rendered to Markdown and to self-contained
    HTML."""

    def __init__(self):
        self.blocks: list[tuple] = []

    def h(self, level: int, text: str):
        self.blocks.append(("h", level, text))

    def p(self, text: str):
        self.blocks.append(("p", text))

    def table(self, headers: list[str], rows: list[list]):
        self.blocks.append(("table", headers, [[str(c) for c in r] for r in rows]))

    def image(self, path: str, caption: str):
        self.blocks.append(("img", path, caption))

    def bullets(self, items: list[str]):
        self.blocks.append(("ul", items))

    def markdown(self, base: Path | None = None) -> str:
        out = []
        for b in self.blocks:
            if b[0] == "h":
                out.append("#" * b[1] + " " + b[2])
            elif b[0] == "p":
                out.append(b[1])
            elif b[0] == "table":
                cell = lambda c: c.replace("|", "\\|").replace("\n", " ")  # noqa: E731
                out.append(
                    "\n".join(
                        ["| " + " | ".join(map(cell, b[1])) + " |", "|" + "---|" * len(b[1])]
                        + ["| " + " | ".join(map(cell, r)) + " |" for r in b[2]]
                    )
                )
            elif b[0] == "img":
                # the caption once, under the figure; the alt text is the figure's name
                out.append(f"![{Path(b[1]).stem}]({os.path.relpath(b[1], base) if base else b[1]})"
                           f"\n\n*{b[2]}*")
            elif b[0] == "ul":
                out.append("\n".join(f"- {i}" for i in b[1]))
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        e = html.escape
        out = [
            f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{e(title)}</title><style>'
            f"body{{font-family:{FONT_STACK};max-width:1250px;margin:auto;padding:1em;"
            "color:#222}"
            # a long command wraps inside the page rather than widening it (a scrollbar)
            "code{white-space:pre-wrap;overflow-wrap:anywhere}td,li,p{overflow-wrap:break-word}"
            "table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid "
            "#ccc;"
            "padding:3px 7px;text-align:left;vertical-align:top}th{background:#f2f2f2}"
            "figure{margin:1em 0}img{max-width:100%;border:1px solid "
            "#eee}figcaption{font-size:13px;color:#555}"
            "</style></head><body>"
        ]
        for b in self.blocks:
            if b[0] == "h":
                out.append(f"<h{b[1]}>{_inline(b[2])}</h{b[1]}>")
            elif b[0] == "p":
                out.append(f"<p>{_inline(b[1])}</p>")
            elif b[0] == "table":
                out.append(
                    "<table><tr>"
                    + "".join(f"<th>{e(h)}</th>" for h in b[1])
                    + "</tr>"
                    + "".join(
                        "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>"
                        for r in b[2]
                    )
                    + "</table>"
                )
            elif b[0] == "img":
                data = base64.b64encode(Path(b[1]).read_bytes()).decode("ascii")
                out.append(f"<figure><img alt=\"{e(Path(b[1]).stem)}\" "
                           f"src=\"data:image/png;base64,{data}\">"
                           f"<figcaption>{e(b[2])}</figcaption></figure>")
            elif b[0] == "ul":
                out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b[1]) + "</ul>")
        out.append("</body></html>\n")
        return "\n".join(out)


def _inline(text: str) -> str:
    """Escape, then turn `code` and bare URLs into tags (the only markup the report's text uses)."""
    t = html.escape(text)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    return re.sub(r"(https?://[^\s<]+)", r'<a href="\1">\1</a>', t)


def document(data: dict) -> Doc:
    """The whole report: its opening, the results folders side by side, the unreadable records,
    then each experiment's sections (experiment_section)."""
    d = Doc()
    opening(d, data)
    if data.get("reference"):
        reference_section(d, data["reference"])
    if data["problems"]:
        d.p("Unreadable records (left out):")
        d.bullets(data["problems"])
    stand_ins = has_stand_ins(data.get("reference"))
    for exp in data["experiments"]:
        experiment_section(d, exp, stand_ins)
    return d


def opening(d: Doc, data: dict) -> None:
    """The title, and what the numbers are read from and how they are computed."""
    d.h(1, "mixprec reproduction report")
    d.p(
        f"Generated {data['generated']} from {data['jobs']} job(s) under: "
        + ", ".join(f"`{i}`" for i in data["inputs"])
        + ". Numbers are read from each job's summary.json and metrics.jsonl. Speed-up = fp32 "
          "training time / "
        "the job's training time, against the fp32 job with the same other settings (and seed); "
        "`a ± b (n=k)` is the mean and sample standard deviation over k seeds. Ratio = reproduced "
        "/ published."
    )


def has_stand_ins(reference: dict | None) -> bool:
    """Whether a results folder's plan ran a smaller stand-in for some published value (a cell
    "[stand-in: ...]" of the side-by-side section)."""
    return any(
        "[stand-in:" in c
        for a in (reference or {}).get("articles", [])
        for r in a["rows"]
        for c in r["cells"]
    )


def experiment_section(d: Doc, exp: dict, stand_ins: bool) -> None:
    """One experiment: its sources, environment and runs, then each table its data has, then its
    figures."""
    d.h(2, f"Experiment `{exp['name']}` ({exp['jobs']} jobs)")
    d.p("Published sources: " + (", ".join(exp["sources"]) if exp["sources"] else
                                  "none lists this experiment; reproduced numbers only."))
    environment_section(d, exp)
    runs_section(d, exp)
    if exp.get("ladder"):
        ladder_section(d, exp["ladder"])
    if exp.get("parity"):
        parity_section(d, exp["parity"])
    if exp.get("fsdp"):
        fsdp_section(d, exp["fsdp"])
    if exp.get("perplexity"):
        perplexity_section(d, exp["perplexity"])
    if exp["comparisons"]:
        d.h(3, "Reproduced against published")
        comparisons_section(d, exp, stand_ins)
    if exp["not_completed"]:
        failures_section(d, exp["not_completed"])
    if exp.get("verdicts"):
        verdicts_section(d, exp["verdicts"])
    for fig in exp.get("plots", []):
        d.image(fig["path"], fig["caption"])


ENV_HEADS = ["device", "torch", "CUDA", "cuDNN", "python", "TF32", "git commit", "jobs", "versions"]


def environment_section(d: Doc, exp: dict) -> None:
    """Hardware and software: a row per environment the jobs ran in, what ran with other package
    versions than the tested ones, and how many jobs recorded none."""
    d.h(3, "Hardware and software")
    d.table(
        ENV_HEADS,
        [[r["device"], r["torch"], r["cuda"], r["cudnn"], r["python"], r["tf32"], r["git_commit"],
          r["jobs"], r.get("pinned", "-")] for r in exp["env"]],
    )
    unpinned = sum(r["jobs"] for r in exp["env"] if r.get("unpinned"))
    if unpinned:
        d.p(
            f"**Versions:** {unpinned} job(s) ran with package versions other than the tested "
            "ones (constraints.txt; the README's set-up command installs them): see the "
            "versions column."
        )
    unrecorded = exp["jobs"] - sum(r["jobs"] for r in exp["env"])
    if unrecorded:
        d.p(f"{unrecorded} job(s) failed before recording their environment (see below).")


def runs_section(d: Doc, exp: dict) -> None:
    """Runs: the runs tables, the groups a host-bound GPU makes no precision's speed-up, and the
    variants (what else differs between the jobs)."""
    d.h(3, "Runs")
    gs = exp["groups"]
    runs_tables(d, gs)
    bound = [
        g["label"] + " " + g["precision"]
        for g in gs
        if busy.verdict((g["metrics"].get("gpu_busy_fraction") or {}).get("mean"))
        == "host-bound"
    ]
    if bound:
        d.p(f"**Host-bound:** {', '.join(bound)}: {HOST_BOUND_NOTE}.")
    if exp["variants"]:
        d.p("Variants (what else differs between these jobs): "
            + "; ".join(f"{k} = `{v}`" for k, v in exp["variants"].items()))


def ladder_section(d: Doc, rows: list[dict]) -> None:
    """Page's ladder, per step, as the sweep's console table has it (analyse.ladder_rows)."""
    d.h(3, "Ladder")
    d.p(
        "Per ladder step, as the sweep's console table: statistics over all the step's "
        "runs (seeds); Page s and Page ep: the article's V100 time and epochs for that "
        "step (step 1's 75 s on his clock, started before the data's padding and "
        "normalisation: compare it with time+prep s)."
    )
    d.table(
        [h for _, h, _ in LADDER_COLUMNS],
        [row_cells(ladder_cells(r), LADDER_COLUMNS) for r in rows],
    )


def perplexity_section(d: Doc, rows: list[dict]) -> None:
    """Validation and test perplexity per epoch (analyse.perplexity_rows)."""
    d.h(3, "Perplexity per epoch")
    d.p(
        "Validation and test perplexity after each epoch (metrics.jsonl epoch rows), mean "
        "over the completed runs of each model and precision."
    )
    d.table(PPL_HEADS, [ppl_cells(r) for r in rows])


def failures_section(d: Doc, rows: list[dict]) -> None:
    """The runs that diverged or failed: how, why, and at which step a value went non-finite."""
    d.h(3, "Runs that diverged or failed")
    d.table(
        ["job", "model", "precision", "seed", "status", "reason", "non-finite at step"],
        [
            [
                p["job"] if p["job"] is not None else Path(p["dir"]).name,
                f"{p['model']} {p['variant']}".strip(),
                p["precision"],
                p["seed"],
                p["status"],
                p["reason"],
                p["step"] if p["step"] is not None else "-",
            ]
            for p in rows
        ],
    )


def verdicts_section(d: Doc, rows: list[dict]) -> None:
    """The numerics probe's verdicts per job, each with the rows it came from."""
    d.h(3, "Numerics verdicts")
    d.p(
        "What the numerics probe's rules read from each job's measurements "
        "(src/mixprec/numerics/verdicts.py), and the rows each verdict came from."
    )
    d.table(
        ["job", "model", "precision", "status", "verdict", "from"],
        [[v["job"], v["model"], v["precision"], v["status"], v["verdict"], "; ".join(v["cites"])]
         for v in rows],
    )


def runs_tables(d: Doc, gs: list[dict]) -> None:
    """The runs table, one per job kind: image models (samples/s, test accuracy) and language
    models (tokens/s, perplexity, MFU, the loss gap), so that no row sits under another kind's
    columns."""
    kinds = [(lm, [g for g in gs if bool(g.get("language_model")) == lm]) for lm in (False, True)]
    kinds = [(lm, of) for lm, of in kinds if of]
    for lm, of in kinds:
        if len(kinds) > 1:
            d.p(f"**{'Language models' if lm else 'Image models'}:**")
        d.table(*runs_table(of, lm))


def runs_table(gs: list[dict], lm: bool) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of one kind's runs table (runs_tables)."""
    ttt = any(g["metrics"]["time_to_target_s"] for g in gs)
    heads = (["model", "precision", "runs", "train time (s)", "speed-up vs fp32 (x)",
              "tokens/s" if lm else "samples/s",
              "test ppl (best valid epoch)" if lm else "test acc (%)", "skipped steps", "batch",
              "compile", "GPU busy (%)"]
             + (["time to target (s)"] if ttt else [])
             + [f"peak memory (MB, {memory_kinds(gs)})"]
             + (["MFU (%)", "valid loss - fp32's, same steps"] if lm else []))
    rows = []
    for g in gs:
        runs = ", ".join(f"{n} {s}" for s, n in g["statuses"].items())
        if len(g["seeds"]) > 1:
            runs += " (seeds " + ",".join(str(s) for s in g["seeds"]) + ")"
        m = g["metrics"]
        rows.append(
            [g["label"], precision_cell(g), runs, mean_sd(m["train_time_s"], ".3f"),
             mean_sd(m["speedup"], ".2f"), mean_sd(m["throughput"], ".1f"),
             mean_sd(m.get("test_ppl"), ".2f") if lm
             else mean_sd(m["final_test_acc"], ".2f", 100),
             ", ".join(k for k in g.get("skipped", []) if k) or "-",
             ", ".join(g.get("batch", [])) or "-", ", ".join(g.get("compile", [])) or "-",
             mean_sd(m.get("gpu_busy_fraction"), ".0f", 100)]
            + ([mean_sd(m["time_to_target_s"], ".3g", of=g["statuses"].get("completed", 0))]
               if ttt else [])
            + [mean_sd(m["peak_memory_mb"], ".0f")]
            + ([mean_sd(m["mfu"], ".3g", 100), mean_sd(m["loss_gap"], "+.3g")] if lm else []))
    return heads, rows


def precision_cell(g: dict) -> str:
    """A group's precision, and why its time is no time of that precision's arithmetic."""
    if g["emulated"]:
        return g["precision"] + " (emulated: not a low-precision time)"
    if g.get("fp32_arithmetic"):
        return g["precision"] + " (plain fp32 here: TF32 does nothing on this device)"
    return g["precision"]






def unmatched_line(s: dict) -> str:
    """One line for a published source that no job of the report matches: what it is, how many
    values it publishes, and the commands that run its jobs (the plan's sweeps), or where its
    values say which jobs."""
    n = s.get("n_values", len(s.get("values", [])))
    where = s.get("file", s["id"] + ".yaml")
    run = ("run: " + "; ".join(f"`{c}`" for c in s["commands"]) if s.get("commands")
           else f"each value's `match` in {where} names the jobs it needs")
    return f"`{s['id']}` ({s['title']}): no job here matches its {n} published value(s) ({run})"


def _comparison_cells(c: dict, r: dict) -> list[str]:
    """A row of the reproduced-against-published table: a published value and one group's runs."""
    ratio = [x for x in (format_ratio(r), r["group"] and r.get("verdict"), r.get("noise"))
             if x and x != "-"]
    return [c["source"], c["label"], c["published"], c["hardware"],
            r["group"] and f"{r['group']}, {r['precision']}" or "-",
            r["verdict"] if r["group"] is None else format_reproduced(c, r),
            "; ".join(ratio) or "-",
            "; ".join(r.get("devices") or []) or "-", "; ".join(r.get("software") or []) or "-"]


def comparisons_section(d: Doc, exp: dict, stand_ins: bool) -> None:
    """Published values beside the runs they match, with the quotes they come from; a source none
    of whose values matches a run here is one line (unmatched_line), not a table of missing rows."""
    unmatched = exp.get("unmatched_sources", [])
    shown = [c for c in exp["comparisons"] if c["source"] not in {u["id"] for u in unmatched}]
    rows = [_comparison_cells(c, r) for c in shown for r in c["rows"]]
    if rows:
        d.table(["source", "value", "published", "published on", "our runs", "reproduced",
                 "ratio / verdict", "our device", "our software"], rows)
    missing = sum(1 for c in shown for r in c["rows"] if r["group"] is None)
    if missing:
        d.p(f"{missing} published value(s) have no matching run yet (\"missing\" above): the runs "
            "they need are named by each value's `match` in src/mixprec/published/<source>.yaml."
            + (" Where a results folder's plan runs a smaller stand-in instead, the side-by-side "
               "section above shows it with its reason ([stand-in: ...])." if stand_ins else ""))
    if unmatched:
        d.bullets([unmatched_line(u) for u in unmatched])
    if shown:
        d.p("Where each published value comes from:")
        d.bullets([f"{c['source']} / {c['label']}: {c['quote']} ({c['source_title']}"
                   + (f", {c['url']}" if c["url"] else "") + ")" for c in shown])
    used = sorted({c["metric"] for c in shown} & set(DERIVED))
    if used:   # e.g. test_ppl: the best-validation model's test perplexity, as apex reports it
        d.p("How the reproduced values are read: "
            + "; ".join(f"`{m}`: {DERIVED[m]}" for m in used) + ".")


def parity_section(d: Doc, rows: list[dict]) -> None:
    """Accuracy against fp32 seed by seed (analyse.parity_rows)."""
    d.h(3, "Accuracy against fp32, seed by seed")
    d.p(
        "Test accuracy: mean ± sample standard deviation [min, max] over the seeds that "
        "completed. Difference: each seed's accuracy minus the fp32 job's with the same seed and "
        "settings, in points; its mean and 95% confidence interval (Student's t, n - 1 degrees of "
        "freedom). An interval that excludes 0 is a real difference at these sizes; one that "
        "includes 0 is not evidence of parity beyond its width."
    )
    d.table(PARITY_HEADS, [parity_cells(r) for r in rows])


FSDP_COLUMNS = [
    ("job", "job", "d"), ("precision", "precision", "s"), ("strategy", "strategy", "s"),
    ("valid_loss", "valid loss", ".5f"), ("dloss", "dloss vs fp32 reduce", "+.3g"),
    ("time_s", "time s", ".2f"), ("time_ratio", "time vs fp32 reduce", ".3f"),
    ("held_mb", "MB/rank p+g+o", "s"), ("peak_mem_mb", "peak MB", ".0f"),
]


def fsdp_section(d: Doc, rows: list[dict]) -> None:
    """Sharded jobs (analyse.fsdp_rows): what bf16 gradient reduction costs in loss and saves in
    time and memory, each job against its float32-reduce partner."""
    d.h(3, "Sharded jobs (FSDP): bf16 against fp32 gradient reduction")
    d.p(
        "Each sharded job beside the job whose config differs only in precision.reduce_dtype "
        "and reduces in float32: the final validation loss and its difference, the train time "
        "and the time ratio (time per sample, from the steady throughput with the warm-up steps"
        " excluded where both jobs have one; below 1: faster), and the most MB of parameters + "
        "gradients + optimizer state one rank held (1/N of one process's with N ranks). "
        "Gradient bytes do not change with the reduce dtype (each rank keeps an fp32 shard); "
        "what a bf16 reduction halves is the bytes of the reduce-scatter, which shows in time "
        "where the network is the limit (NCCL across GPUs or nodes), not on one CPU's gloo "
        "ranks."
    )
    d.table([h for _, h, _ in FSDP_COLUMNS], [row_cells(r, FSDP_COLUMNS) for r in rows])


def parity_cells(r: dict) -> list[str]:
    """A row of the seed-by-seed table: model, precision, runs, accuracy, difference [95% CI],
    verdict."""
    a, x = r["acc"], r["diff"]
    acc = (
        "-"
        if a is None
        else f"{a['mean']:.2f}"
        + (f" ± {a['std']:.2f} [{a['min']:.2f}, {a['max']:.2f}]" if a["n"] > 1 else "")
    )
    diff = "-" if x is None else f"{x['mean']:+.2f} [{x['ci95'][0]:+.2f}, {x['ci95'][1]:+.2f}]"
    runs = ", ".join(f"{n} {s}" for s, n in r["statuses"].items())
    verdict = "(the baseline)" if r["precision"] == "fp32" else (
        x["verdict"] if x else ("no completed pair" if set(r["statuses"]) - {"completed"} else "-"))
    return [r["group"], r["precision"], runs, acc, diff, verdict]


PPL_HEADS = ["model", "precision", "epoch", "runs", "valid ppl", "test ppl"]


def ppl_cells(r: dict) -> list[str]:
    """A row of the perplexity-per-epoch table (analyse.perplexity_rows)."""
    return [
        r["group"],
        r["precision"],
        str(r["epoch"]),
        str(r["runs"]),
        mean_sd(r["valid_ppl"], ".2f"),
        mean_sd(r["test_ppl"], ".2f"),
    ]


PARITY_HEADS = [
    "model",
    "precision",
    "runs",
    "test acc (%)",
    "minus fp32 (points) [95% CI]",
    "verdict",
]


def reference_section(d: Doc, sec: dict) -> None:
    """The side-by-side section of reference folders (reference.section's data)."""
    cols = sec["columns"]
    d.h(2, "Reproductions side by side")
    d.p(
        "One column per results folder (scripts/reproduce.py): "
        + "; ".join(f"`{f}`" for f in sec["folders"])
        + ". Each cell is the reproduced value (ratio = reproduced / published) with the plan's "
          "cuts in [brackets], "
        "or the reason it has none."
    )
    if sec["ratios"]:
        d.h(3, "FP32 / mixed-precision training time (fastai's ratio), per model and GPU")
        d.table(["model", *cols, "published"],
                [[r["model"], *r["cells"], r["published"]] for r in sec["ratios"]["rows"]])
    # an article no folder planned is one line, not a table of "not in this folder's plan" cells
    planned = [a for a in sec["articles"]
               if any(c != NOT_PLANNED for r in a["rows"] for c in r["cells"])]
    for a in planned:
        d.h(3, f"{a['id']}: {a['title']}")
        d.table(["value", "published", "published on", *cols],
                [[r["label"], r["published"], r["hardware"], *r["cells"]] for r in a["rows"]])
    unplanned = [a["id"] for a in sec["articles"] if a not in planned]
    if unplanned:
        d.p(f"Not in any folder's plan (scripts/reproduce.py --only): {', '.join(unplanned)}; "
            "their published values are in report.json.")
