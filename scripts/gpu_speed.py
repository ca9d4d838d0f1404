"""The GPU speed check: its questions in order of value, within 8 minutes on one H100/H200, each
step under a budget of its own. The steps, most valuable first:

  fp8_wide        FP8 against amp_bf16 where torchao's float8 gains begin (K, N >= 4096): a 2 x 4096
                  GPT, compiled; MXFP8 too on a GPU with MXFP8 tensor cores (compute capability
                  10.0+: B200), whose third job adds MX_S to the budget (elsewhere torchao would
                  emulate it: PyTorch casts, not an MXFP8 time, so the question is not asked)
  table_eager     the speed table, eager: resnet18 and resnet50 x six precisions x batch 64 and 256
  table_compiled  the speed table, compiled: resnet18 x fp32, amp x batch 256 x default and
                  reduce-overhead
  page10          Page's step 10, eager and under reduce-overhead (CUDA graphs)
  gpt             the GPT (12 x 768) in fp32, amp_bf16 and fp8, eager

A step's budget is its estimated running time plus, for each graph it compiles, an estimated compile
time (the graphs a step compiles are counted in the CPU dry run: see below); the budgets add up to
at most BUDGET_S (8 minutes). Each step runs under `timeout` with its budget plus whatever the steps
before it left unused; a step that runs out is recorded as timed out and keeps what it wrote (the
tables are saved after every cell), and the next step runs. Data: nothing is downloaded. Without
CIFAR-10 Page's step runs on dataset=synthetic at CIFAR-10's sizes (its times stand; its accuracy is
skipped); without Wikitext-2 the GPT runs on dataset=synthetic_text at Wikitext-2's sizes; the 2 x
4096 GPT always runs on synthetic tokens in whole windows (speed only, and every window shape is one
more graph to compile). Each says so in one line. logger=none and trainer.save_weights=false
throughout (the 2 x 4096 GPT's weights alone are 4.3 GB): each job keeps its records (summary.json,
metrics.jsonl, train.log), no weights.

  python scripts/gpu_speed.py [--out DIR] [train.py overrides, e.g. dataset.data_dir=/data]
  python scripts/gpu_speed.py --dry-run [--out DIR]   # the same steps at tiny sizes on the CPU

The default folder is outputs/reference/<gpu>-speed-<date>/, which git keeps (commit it: env.json
and SUMMARY.md name the device and the command). budget.md says each step's budget, limit, graphs,
seconds and outcome; SUMMARY.md answers the questions and gathers the tables. The dry run compiles
in the GPU run's modes through a backend that counts dynamo's graphs instead of compiling them
(--count-compiles), at tiny sizes whose shapes repeat the GPU run's (whole or partial last batches),
and fails when a step's count differs from the graphs its budget assumes. Exit status 1 when a file
the folder should hold is missing or a dry-run count is off, else 0."""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from mixprec.tools import cli
from mixprec.config import validate
from mixprec.train.warmup import split_shapes
from mixprec.records import write_json_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parents[1]


PY = [sys.executable]
BUDGET_S = 480           # 8 minutes: the sum of the steps' budgets may not exceed it
MX_S = 60                # the MXFP8 job of fp8_wide, where MXFP8 is native: on top of BUDGET_S
START_S = 10             # a step's process start: python, torch (torchao) and Hydra's compose
DRY_LIMIT_S = 600        # a dry-run step's limit on a small CPU (GPU budgets: shown, not enforced)
TABLE_PRECISIONS = "fp32,tf32,amp,amp_bf16,half,bf16"
GPT_PRECISIONS = "fp32,amp_bf16,fp8"
WIKITEXT_TOKENS = (2088628, 217646)   # Wikitext-2's train and valid tokens: the stand-in's sizes
WIKITEXT_VOCAB = 33278
CIFAR_SIZES = (50000, 10000)
PAGE_EVAL_BATCH = 500    # divides CIFAR-10's 10,000 test images: no partial batch
LOCATION = ("dataset.data_dir=", "dataset.download=")   # keys a synthetic dataset does not have
DRY = ["trainer.device=cpu"]
DRY_COMPILED = [*DRY, "precision.emulate=false"]   # compiled: the CPU's own low-precision kernels
DRY_IMAGE = ["model.width=8", "dataset.image_size=8", *DRY]
PAGE_SKIPPED = "Page's accuracy: skipped (CIFAR-10 absent: the jobs ran on dataset=synthetic)."


def step(name: str, question: str, cmd: list[str], files: list[tuple], *, run_s: float,
         graphs: int = 0, compile_s: float = 0.0, **more) -> dict:
    """A step: its command, the files it must leave (patterns and counts, relative to the folder)
    and its budget: run_s (its estimated running time without compilation) + graphs x compile_s
    (seconds a graph)."""
    budget = math.ceil(run_s + graphs * compile_s)
    return {"name": name, "question": question, "cmd": cmd, "files": files, "run_s": run_s,
            "graphs": graphs, "compile_s": compile_s, "budget": budget, **more}


def jobs(name: str, n: int) -> list[tuple]:
    return [(f"{name}/*/summary.json", n)]


def train_cmd(name: str, overrides: list[str], out: Path) -> list[str]:
    return [*PY, "train.py", "-m", *overrides, "logger=none", "trainer.save_weights=false",
            f"hydra.sweep.dir={out / name}"]


def located(extra: list[str]) -> list[str]:
    """The user's overrides less the data location, for a step that runs on synthetic data."""
    return [o for o in extra if not o.lstrip("+").startswith(LOCATION)]


def lm_graphs(train_tokens: int, eval_tokens: int, batch: int, bptt: int) -> int:
    """The graphs one compiled language-model job makes: one per window shape it warms
    (compile.warm_compile; a batchified split of n rows has n - 1 targets per column: full windows
    and a last, shorter one), training and evaluation (valid and test are the same size here)."""
    return (len(split_shapes(train_tokens // batch - 1, bptt))
            + len(split_shapes(eval_tokens // batch - 1, bptt)))


def fp8_wide_step(out: Path, dry: bool, extra: list[str], mxfp8: bool = False) -> dict:
    """FP8 against amp_bf16 at width 4096, compiled. torchao's float8 gains start where a Linear's K
    and N reach 4096 (its README, H100: 0.80x at M, K, N = 1024, 2048, 1024; 1.39x at 4096, 8192,
    16384): the 12 x 768 GPT is below it, a 2 x 4096 one (MLP 4096 -> 16384, 8192 tokens a step)
    within it. Synthetic tokens (Wikitext-2's vocabulary) in whole windows: each job compiles one
    training and one evaluation graph. mxfp8: a third job, precision=mxfp8 (native MXFP8)."""
    precisions = ["amp_bf16", "fp8", *(["mxfp8"] if mxfp8 else [])]
    batch, bptt, steps = (4, 16, 2) if dry else (32, 256, 30)
    # whole windows; training stops mid-epoch (one evaluation, at the end)
    train, evals = batch * (bptt * (steps + 10) + 1), batch * (bptt * 2 + 1)
    size = (["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "dataset.vocab_size=64",
             "trainer.warmup_steps=1", *DRY_COMPILED] if dry else
            ["model.n_layer=2", "model.n_head=32", "model.n_embd=4096",
             f"dataset.vocab_size={WIKITEXT_VOCAB}", *located(extra)])
    overrides = ["experiment=transformer_precision", f"precision={','.join(precisions)}",
                 "dataset=synthetic_text", f"dataset.train_size={train}",
                 f"dataset.test_size={evals}", f"model.block_size={bptt}",
                 f"trainer.batch_size={batch}", f"trainer.eval_batch_size={batch}",
                 f"trainer.max_steps={steps}", "trainer.compile=default", *size]
    n = len(precisions)
    return step("fp8_wide", f"{', '.join(precisions[1:])} against amp_bf16, 2 x 4096 GPT, compiled",
                train_cmd("fp8_wide", overrides, out), jobs("fp8_wide", n), run_s=START_S + n * 15,
                graphs=n * lm_graphs(train, evals, batch, bptt), compile_s=22,
                data="dataset=synthetic_text (Wikitext-2's vocabulary, whole windows): a speed "
                     "question, and each window shape would be one more graph to compile")


def table_cmd(name: str, out: Path, sizes: list[str], compiles: str) -> list[str]:
    return [*PY, "scripts/benchmark.py", "table", *sizes, "--compiles", compiles,
            "--out", str(out / name)]


def table_steps(out: Path, dry: bool) -> list[dict]:
    """The speed table eager (two models, six precisions, two batches) and compiled (resnet18 at
    batch 256, fp32 and amp, each compile mode: one graph a cell, the table resets dynamo after
    each)."""
    tiny = ["--models", "small_cnn", "--steps", "2", "--warmup", "1"]
    eager = (
        [*tiny, "--precisions", "fp32,amp,amp_bf16", "--batches", "4,8", *DRY_IMAGE]
        if dry
        else [
            "--models",
            "resnet18,resnet50",
            "--precisions",
            TABLE_PRECISIONS,
            "--batches",
            "64,256",
            "--steps",
            "30",
            "--warmup",
            "10",
        ]
    )
    precisions, batches = ["fp32", "amp"], ["8"] if dry else ["256"]
    compiled = [*(tiny if dry else ["--models", "resnet18", "--steps", "30", "--warmup", "10"]),
                "--precisions", ",".join(precisions), "--batches", ",".join(batches),
                *(["model.width=8", "dataset.image_size=8", *DRY_COMPILED] if dry else [])]
    modes = ["default", "reduce-overhead"]
    files = lambda name: [(f"{name}/table.json", 1), (f"{name}/table.md", 1)]
    return [step("table_eager", "the ResNet speed table, eager",
                 table_cmd("table_eager", out, eager, "none"), files("table_eager"),
                 run_s=START_S + 60),
            step("table_compiled", "the ResNet-18 speed table, compiled",
                 table_cmd("table_compiled", out, compiled, ",".join(modes)),
                 files("table_compiled"),
                 run_s=START_S + 10, graphs=len(precisions) * len(batches) * len(modes),
                 compile_s=26)]


def page_step(out: Path, dry: bool, extra: list[str], cifar: bool) -> dict:
    """Page's step 10 (seed 0) eager, then under reduce-overhead (its training graph and one
    evaluation graph: the evaluation batch divides the test set). Without CIFAR-10:
    dataset=synthetic at its sizes."""
    test, eval_batch = (40, 20) if dry else (CIFAR_SIZES[1], PAGE_EVAL_BATCH)
    overrides = ["experiment=page_ladder", "trick=page_10_tta", "seed=0",
                 "trainer.compile=none,reduce-overhead", f"trainer.eval_batch_size={eval_batch}"]
    if dry:
        overrides += ["dataset=synthetic", "dataset.train_size=64", f"dataset.test_size={test}",
                      "dataset.image_size=16", "trainer.batch_size=32", "trainer.max_steps=2",
                      "model.channels=[8,16,32,64]", *DRY_COMPILED]
    elif cifar:
        overrides += extra
    else:
        overrides += ["dataset=synthetic", f"dataset.train_size={CIFAR_SIZES[0]}",
                      f"dataset.test_size={test}", *located(extra)]
    note = (None if cifar or dry else "CIFAR-10 not found: runs on dataset=synthetic at CIFAR-10's "
            f"sizes ({CIFAR_SIZES[0]:,} + {CIFAR_SIZES[1]:,} images); its times stand, Page's "
            "accuracy is skipped")
    return step("page10", "Page's step 10, eager and under reduce-overhead",
                train_cmd("page10", overrides, out), jobs("page10", 2), run_s=START_S + 73,
                # training only: step 10 evaluates its EMA eagerly
                graphs=1, compile_s=18, data=note,
                accuracy=cifar and not dry)


def gpt_step(out: Path, dry: bool, extra: list[str], wikitext: bool) -> dict:
    """The GPT (12 x 768) in fp32, amp_bf16 and fp8, eager (compiled, its 12 layers would take
    minutes of compilation a job; the compiled fp8 question is fp8_wide's). Without Wikitext-2:
    synthetic_text at its sizes."""
    overrides = ["experiment=transformer_precision", f"precision={GPT_PRECISIONS}",
                 "trainer.compile=none"]
    if dry:
        overrides += ["dataset=synthetic_text", "dataset.vocab_size=64", "dataset.train_size=2000",
                      "dataset.test_size=400", "model.n_layer=1", "model.n_head=2",
                      "model.n_embd=32", "model.block_size=16", "trainer.batch_size=4",
                      "trainer.eval_batch_size=4",
                      "trainer.max_steps=2", "trainer.warmup_steps=1", *DRY]
    elif wikitext:
        overrides += ["trainer.max_steps=40", *extra]
    else:
        overrides += ["dataset=synthetic_text", f"dataset.vocab_size={WIKITEXT_VOCAB}",
                      f"dataset.train_size={WIKITEXT_TOKENS[0]}",
                      f"dataset.test_size={WIKITEXT_TOKENS[1]}", "trainer.max_steps=40",
                      *located(extra)]
    note = (None if wikitext or dry else "Wikitext-2 not found: runs on dataset=synthetic_text at "
            "Wikitext-2's sizes; its tokens/s stand, its perplexities are the synthetic text's")
    return step("gpt", "the GPT (12 x 768) fp32, amp_bf16, fp8, eager",
                train_cmd("gpt", overrides, out), jobs("gpt", 3), run_s=START_S + 40, data=note)


def plan(out: Path, dry: bool, extra: list[str], present: dict, mxfp8: bool = False
         ) -> list[dict]:
    """The steps in order of value; present: {"cifar10": bool, "wikitext2": bool} (found_data);
    mxfp8: the GPU has MXFP8 tensor cores (native_mxfp8), and fp8_wide times MXFP8 too."""
    steps = [fp8_wide_step(out, dry, extra, mxfp8), *table_steps(out, dry),
             page_step(out, dry, extra, present["cifar10"]),
             gpt_step(out, dry, extra, present["wikitext2"])]
    total, limit = sum(s["budget"] for s in steps), BUDGET_S + (MX_S if mxfp8 else 0)
    if total > limit:
        raise ValueError(f"the steps' budgets add up to {total} s, over {limit} s")
    return steps


def found_data(extra: list[str]) -> tuple[Path, dict]:
    """Where the jobs would read their data (dataset.data_dir among the overrides, else
    $MIXPREC_DATA_DIR, else data/ under the project) and whether CIFAR-10 and Wikitext-2 are there.
    Nothing is downloaded: on an offline GPU machine a download cannot succeed, and elsewhere it
    would spend the budget."""
    from mixprec.data.cifar import SPECS
    from mixprec.data.files import data_root
    from mixprec.data.wikitext import FOLDER, SPLITS

    data_dir = next((o.split("=", 1)[1] for o in reversed(extra)
                     if o.lstrip("+").startswith(LOCATION[0])), None)
    root = data_root(data_dir)
    cifar = SPECS["cifar10"]
    return root, {"cifar10": all((root / cifar.folder / f).is_file() for f in cifar.files)
                  or (root / cifar.archive).is_file(),
                  "wikitext2": all((root / FOLDER / f"{s}.txt").is_file() for s in SPLITS)}


def count_compiles(record: Path, cmd: list[str]) -> int:
    """Run a script (cmd: its path and arguments) in this process with every torch.compile given a
    backend that counts dynamo's graphs (training: traced with grad enabled; inference) and runs
    them uncompiled: a dry run's count of the graphs a GPU run compiles, in seconds where inductor
    on a small CPU takes minutes a graph. The counts go to `record` (JSON)."""
    import runpy

    import torch

    counts = {"graphs": 0, "training": 0, "inference": 0}
    real = torch.compile

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        counts["training" if torch.is_grad_enabled() else "inference"] += 1
        return gm.forward

    def counting(model=None, **kwargs):   # mode and options are inductor's: the backend has none
        return real(model, backend=backend, dynamic=kwargs.get("dynamic"),
                    fullgraph=kwargs.get("fullgraph", False))

    torch.compile = counting
    sys.argv, sys.path[0] = list(cmd), str(Path(cmd[0]).resolve().parent)   # as `python <script>`
    try:
        runpy.run_path(cmd[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        write_json_atomic(record, counts)
    return code


def run_step(step: dict, out: Path, limit: float, dry: bool) -> dict:
    """One step under `timeout` (SIGTERM at limit - 5 s, so that its jobs end `interrupted` with
    their records; SIGKILL at the limit); its output in logs/<name>.log. The dry run counts its
    graphs."""
    limit = round(limit)
    row = {"name": step["name"], "budget_s": step["budget"], "limit_s": limit,
           "graphs": step["graphs"], "graphs_counted": None, "seconds": 0.0}
    if limit < 10:
        return {**row, "outcome": "skipped: out of budget"}
    log = out / "logs" / f"{step['name']}.log"
    counted = out / "logs" / f"{step['name']}.graphs.json"
    cmd = ([*PY, str(Path(__file__)), "--count-compiles", str(counted), *step["cmd"][1:]] if dry
           else step["cmd"])
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(step["cmd"]) + "\n")
        f.flush()
        rc = subprocess.run(["timeout", "--kill-after=5", str(limit - 5), *cmd], cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    row["seconds"] = round(time.perf_counter() - t0, 1)
    if counted.exists():
        row["graphs_counted"] = json.loads(counted.read_text())["graphs"]
    row["outcome"] = ("ok" if rc == 0 else "timed out" if rc in (124, 137)
                      else f"failed (exit {rc})")
    return row


def budget_markdown(rows: list[dict], steps: list[dict], total: float, dry: bool) -> str:
    """Each step's budget (estimated run + graphs x seconds a graph), the limit it ran under, the
    graphs (the dry run's count beside), seconds and outcome."""
    head = ("CPU dry run at tiny sizes: the GPU run's budgets, not enforced here; graphs counted"
            if dry else "GPU")
    lines = [f"# Time budget ({head}): {total:.0f} s; budgets add up to "
             f"{sum(s['budget'] for s in steps)} s of {BUDGET_S} s", "",
             "| step | question | budget s (run + graphs x s) | limit s | graphs "
             "| counted (dry run) | seconds | outcome |", "|---|---|---|---|---|---|---|---|"]
    for r, s in zip(rows, steps):
        plan_s = f"{s['budget']} ({s['run_s']:g} + {s['graphs']} x {s['compile_s']:g})"
        lines.append(f"| {r['name']} | {s['question']} | {plan_s} | {r['limit_s']} | {r['graphs']} "
                     f"| {fmt(r['graphs_counted'], 'd')} | {r['seconds']} | {r['outcome']} |")
    return "\n".join(lines) + "\n"


def missing(out: Path, steps: list[dict]) -> list[str]:
    """The files (patterns with their counts) the folder should hold and does not."""
    want = [("env.json", 1), ("budget.json", 1), ("budget.md", 1), ("SUMMARY.md", 1)]
    want += [(f"logs/{s['name']}.log", 1) for s in steps] + [f for s in steps for f in s["files"]]
    return [f"{pattern} (want {n}, found {len(list(out.glob(pattern)))})" for pattern, n in want
            if len(list(out.glob(pattern))) < n]


def miscounted(rows: list[dict]) -> list[str]:
    """A dry run's steps whose graphs counted differ from the graphs their budgets assume."""
    return [f"{r['name']} compiled {r['graphs_counted']} graphs, its budget assumes {r['graphs']}"
            for r in rows if r["graphs_counted"] != r["graphs"]]


def job_rows(out: Path, name: str) -> list[dict]:
    """The jobs of a train.py step, from their summary.json."""
    rows = []
    for path in sorted(out.glob(f"{name}/*/summary.json")):
        s = json.loads(path.read_text())
        m, ch = s.get("metrics", {}), s.get("choices", {})
        rows.append({"precision": ch.get("precision"), "seed": s.get("seed"),
                     "status": s.get("status"),
                     "compile": (s.get("config") or {}).get("trainer", {}).get("compile"),
                     "throughput": m.get("throughput"), "train_time_s": m.get("train_time_s"),
                     "page_clock_s": m.get("page_clock_s"),
                     "compile_time_s": m.get("compile_time_s"), "busy": m.get("gpu_busy_fraction"),
                     "acc": m.get("final_test_acc"), "ppl": m.get("final_valid_ppl"),
                     "compiled_graphs": m.get("compiled_graphs"),
                     "graph_breaks": m.get("graph_breaks"),
                     "eager_calls": m.get("eager_calls"), "error": s.get("error")})
    return rows


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def jobs_markdown(title: str, rows: list[dict], accuracy: bool = True) -> list[str]:
    head = ["precision", "compile", "seed", "status", "train s", "compile s",
            "graphs / eager calls", "samples or tokens /s", "GPU busy",
            *(["test acc"] if accuracy else []), "valid ppl", "error"]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["precision"], r["compile"], r["seed"], r["status"],
                 fmt(r["train_time_s"], ".2f"), fmt(r["compile_time_s"], ".1f"),
                 f"{fmt(r['compiled_graphs'], 'd')} / {fmt(r['eager_calls'], 'd')}",
                 fmt(r["throughput"], ".0f"), fmt(r["busy"], ".2f"),
                 *([fmt(r["acc"], ".4f")] if accuracy else []), fmt(r["ppl"], ".1f"),
                 (r["error"] or "")[:80]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines + [""]


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def graphs_said(named: dict) -> str:
    """The compiled jobs (or cells) behind a ratio: each one's compiled_graphs, graph_breaks (when
    any) and eager_calls, and a warning where one ran calls eagerly or in pieces between graph
    breaks (its time is partly an eager time, the ratio too). ""
    when none of them was compiled. named: {label: a job row or table cell}."""
    compiled = {k: r for k, r in named.items() if r and r.get("compiled_graphs") is not None}
    if not compiled:
        return ""
    breaks = lambda r: f", {r['graph_breaks']} graph breaks" if r.get("graph_breaks") else ""  # noqa: E731
    said = "; ".join(f"{k} {r['compiled_graphs']} graphs{breaks(r)}, {r['eager_calls']} eager "
                     "calls" for k, r in compiled.items())
    eager = [k for k, r in compiled.items() if r.get("eager_calls") or r.get("graph_breaks")]
    return (f" [{said}]" + (f" PARTLY EAGER ({', '.join(eager)}): this ratio mixes eager and "
                            "compiled time" if eager else ""))


def dry_answer(question: str, device: str) -> str:
    """A dry run's line in place of an answer: its figures are tiny CPU jobs, not a measurement."""
    return f"- {question}: dry run on {device}: not a measurement"


def table_rows(out: Path, name: str) -> dict:
    """The cells of a speed table by (model, precision, batch, compile)."""
    f = out / name / "table.json"
    rows = json.loads(f.read_text()).get("rows", []) if f.exists() else []
    return {(r["model"], r["precision"], r["batch"], r["compile"]): r for r in rows}


def get(rows: dict, key, field: str = "throughput"):
    return (rows.get(key) or {}).get(field)


def table_answers(out: Path, dry_device: str | None = None) -> list[str]:
    """amp / fp32 and amp / tf32 at each table's largest batch (256 on a GPU), with amp's GPU busy
    and each compiled cell's graphs and eager calls; a dry run's line in place of each answer."""
    lines = []
    for name, mode in (("table_eager", "none"), ("table_compiled", "default"),
                       ("table_compiled", "reduce-overhead")):
        cells = table_rows(out, name)
        for model in sorted({k[0] for k in cells}):
            b = max(k[2] for k in cells if k[0] == model)
            s = {p: get(cells, (model, p, b, mode), "samples_per_s")
                 for p in ("fp32", "tf32", "amp")}
            busy = get(cells, (model, "amp", b, mode), "gpu_busy_fraction")
            tf32 = ("" if not any(k[1] == "tf32" for k in cells)   # the compiled table has none
                    else f", amp / tf32 {ratio(s['amp'], s['tf32'])}")
            question = f"{model} batch {b}, compile {mode}"
            if dry_device:
                lines.append(dry_answer(question, dry_device))
                continue
            named = {p: cells.get((model, p, b, mode)) for p in ("fp32", "tf32", "amp")}
            lines.append(f"- {question}: amp / fp32 {ratio(s['amp'], s['fp32'])}{tf32} "
                         f"(target amp >= 1.5x fp32); amp's GPU busy {fmt(busy, '.2f')}"
                         f"{graphs_said(named)}")
    return lines


WIDE_Q = "fp8 / amp_bf16, 2 x 4096 GPT compiled"
MX_Q = "mxfp8 / amp_bf16, 2 x 4096 GPT compiled"
MX_NOT_ASKED = ("not asked: this GPU has no MXFP8 tensor cores (compute capability 10.0+), and "
                "torchao's emulation would time PyTorch's casts, not MXFP8")
PAGE_Q = ("Page's step 10 on his clock (training + data preparation, as dawn.py timed it; his "
          "26 s)")
GPT_Q = "GPT 12 x 768 eager"


def answers(out: Path, steps: dict, dry_device: str | None = None) -> list[str]:
    """The questions' answers in a few lines, each a ratio of two measured figures ("-" where one is
    missing) with its compiled jobs' graphs and eager calls; a dry run (dry_device: the CPU it ran
    on) says in place of each answer that it is not a measurement."""
    mx_asked = "mxfp8" in steps.get("fp8_wide", {}).get("question", "")
    if dry_device:
        return ["## Answers", "", dry_answer(WIDE_Q, dry_device),
                *([dry_answer(MX_Q, dry_device)] if mx_asked else []),
                *table_answers(out, dry_device),
                *[dry_answer(q, dry_device) for q in (PAGE_Q, GPT_Q)], ""]
    by = lambda rows, key: {r[key]: r for r in rows}
    wide = by(job_rows(out, "fp8_wide"), "precision")
    fp8, bf16 = get(wide, "fp8"), get(wide, "amp_bf16")
    lines = ["## Answers", "", f"- {WIDE_Q}: {ratio(fp8, bf16)} "
             f"({fmt(fp8, '.0f')} against {fmt(bf16, '.0f')} tokens/s; target >= 1)"
             f"{graphs_said(wide)}", mx_answer(wide, mx_asked), *table_answers(out)]
    page = by(job_rows(out, "page10"), "compile")
    acc = (f"; test accuracy {fmt(get(page, 'none', 'acc'), '.4f')} eager, "
           f"{fmt(get(page, 'reduce-overhead', 'acc'), '.4f')} under CUDA graphs"
           if steps.get("page10", {}).get("accuracy") else "")
    clock = lambda mode: (f"{fmt(get(page, mode, 'page_clock_s'), '.2f')} s "
                          f"({fmt(get(page, mode, 'train_time_s'), '.2f')} s training)")
    lines.append(f"- {PAGE_Q}: {clock('none')} eager, {clock('reduce-overhead')} under "
                 f"reduce-overhead (target <= 4 s){acc}{graphs_said(page)}")
    gpt = by(job_rows(out, "gpt"), "precision")
    lines.append(f"- {GPT_Q}: amp_bf16 / fp32 "
                 f"{ratio(get(gpt, 'amp_bf16'), get(gpt, 'fp32'))}, fp8 / fp32 "
                 f"{ratio(get(gpt, 'fp8'), get(gpt, 'fp32'))}")
    return lines + [""]


def mx_answer(wide: dict, asked: bool) -> str:
    """MXFP8 against amp_bf16 in the 2 x 4096 GPT, where the GPU runs MXFP8 natively."""
    mx, bf16 = get(wide, "mxfp8"), get(wide, "amp_bf16")
    return f"- {MX_Q}: " + (f"{ratio(mx, bf16)} ({fmt(mx, '.0f')} against {fmt(bf16, '.0f')} "
                            "tokens/s)" if asked else MX_NOT_ASKED)


def native_mxfp8(dry: bool) -> bool:
    """Whether fp8_wide times MXFP8: a GPU with MXFP8 tensor cores (precision/mxfp8.py); the dry
    run rehearses its job on the CPU."""
    if dry:
        return True
    from mixprec.precision.mxfp8 import emulation_reason
    from mixprec.runtime import hardware

    return emulation_reason(hardware.select_device("auto")) is None


def summary_markdown(out: Path, env: dict, steps: list[dict], budget_md: str,
                     data: list[str]) -> str:
    """SUMMARY.md: the device and command, the answers, the budget, the data used, then each step's
    records."""
    by_name = {s["name"]: s for s in steps}
    lines = [f"# GPU speed check: {env.get('device_name')}, torch {env.get('torch')}, "
             f"{env.get('date')}", "", f"`{env.get('command')}`", "",
             *answers(out, by_name, env.get("device_name") if env.get("dry_run") else None),
             budget_md.replace("# Time budget", "## Time budget", 1), *data, ""]
    lines += jobs_markdown("FP8 (and, where native, MXFP8) against amp_bf16: a 2 x 4096 GPT "
                           "(torchao's float8 gains from K, N >= 4096), compiled",
                           job_rows(out, "fp8_wide"))
    for name in ("table_eager", "table_compiled"):
        md = out / name / "table.md"
        lines += [md.read_text().replace("# Speed table", f"## {name}: speed table", 1)
                  if md.exists() else f"## {name}: no table (see logs/{name}.log)", ""]
    accuracy = by_name.get("page10", {}).get("accuracy", False)
    lines += jobs_markdown("Page's step 10, eager and under reduce-overhead",
                           job_rows(out, "page10"), accuracy)
    if not accuracy:
        lines += [PAGE_SKIPPED, ""]
    lines += jobs_markdown("GPT 12 x 768, eager", job_rows(out, "gpt"))
    return "\n".join(lines) + "\n"


def environment(dry: bool) -> dict:
    from mixprec.runtime import hardware

    device = hardware.select_device("cpu" if dry else "auto")
    env = hardware.describe(device)
    env.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), dry_run=dry)
    if device.type == "cpu" and not dry:   # exit 2, as gpu_check.sh's "no GPU" (1: a failure)
        print("gpu_speed: no GPU is visible; use --dry-run for the CPU rehearsal", file=sys.stderr)
        raise SystemExit(2)
    return env


def default_out(env: dict, dry: bool) -> Path:
    """outputs/reference/<gpu>-speed-<date>/ (kept by git), a time added if that exists; a dry run's
    under outputs/gpu_speed_dry/ (ignored)."""
    now = time.strftime("%Y-%m-%d_%H-%M-%S")
    if dry:
        return ROOT / "outputs" / "gpu_speed_dry" / now
    gpu = re.sub(r"[^a-z0-9]+", "-", str(env.get("device_name")).lower()).strip("-")
    out = ROOT / "outputs" / "reference" / f"{gpu}-speed-{now[:10]}"
    return out.with_name(f"{out.name}_{now[11:]}") if out.exists() else out


def data_lines(steps: list[dict], root: Path, dry: bool) -> list[str]:
    """One line per step whose data is not its preset's (the dry run: one line for all)."""
    if dry:
        return ["dry run: every step at tiny sizes on synthetic data on the CPU, compile modes as "
                "a GPU run's, each graph counted instead of compiled"]
    where = lambda s: f" (looked in {root})" if "not found" in s["data"] else ""
    return [f"{s['name']}: {s['data']}{where(s)}" for s in steps if s.get("data")]


def run_steps(steps: list[dict], out: Path, dry: bool) -> list[dict]:
    """Every step in order, each limited to its budget and what the steps before it left unused."""
    t0, rows, allotted = time.perf_counter(), [], 0
    for s in steps:
        allotted += s["budget"]
        limit = DRY_LIMIT_S if dry else allotted - (time.perf_counter() - t0)
        rows.append(run_step(s, out, limit, dry))
        n = rows[-1]["graphs_counted"]
        counted = "" if n is None else f", {n} graph{'' if n == 1 else 's'}"
        print(f"gpu_speed: {s['name']}: {rows[-1]['outcome']} in {rows[-1]['seconds']} s (budget "
              f"{s['budget']} s{counted})", flush=True)
    return rows


def check_overrides(extra: list[str]) -> None:
    """The user's overrides composed and validated, as the image and the GPT jobs would take them,
    before any step: a typo fails here in one line (cli.run), not on the GPU after start-up (and
    the dry run, whose tiny sizes leave most of them out, checks them too)."""
    for base in (["experiment=page_ladder"], ["experiment=transformer_precision"]):
        validate(cli.compose([*base, *extra]))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--count-compiles"] and len(argv) > 2:
        return count_compiles(Path(argv[1]), argv[2:])
    parser = cli.ArgumentParser(prog="gpu_speed.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("overrides", nargs="*",
                        help="train.py overrides for the jobs (e.g. dataset.data_dir=/data)")
    parser.add_argument("--out", type=Path,
                        help="the folder (default outputs/reference/<gpu>-speed-<date>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU, graphs counted")
    args = parser.parse_args(argv)
    check_overrides(args.overrides)
    env = environment(args.dry_run)
    env["command"] = shlex.join(["scripts/gpu_speed.py", *argv])
    out = (args.out or default_out(env, args.dry_run)).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    root, present = found_data(args.overrides)
    steps = plan(out, args.dry_run, args.overrides, present, native_mxfp8(args.dry_run))
    data = data_lines(steps, root, args.dry_run)
    for line in data:
        print(f"gpu_speed: {line}", flush=True)
    env.update(data_root=str(root), data_found=present, budget_s=sum(s["budget"] for s in steps))
    write_json_atomic(out / "env.json", env)
    write_json_atomic(out / "plan.json", {"steps": steps, "budget_s": BUDGET_S})
    t0 = time.perf_counter()
    rows = run_steps(steps, out, args.dry_run)
    total = time.perf_counter() - t0
    budget_md = budget_markdown(rows, steps, total, args.dry_run)
    write_json_atomic(out / "budget.json", {"budget_s": BUDGET_S, "total_s": total, "steps": rows})
    write_text_atomic(out / "budget.md", budget_md)
    write_text_atomic(out / "SUMMARY.md", summary_markdown(out, env, steps, budget_md, data))
    gone, off = missing(out, steps), miscounted(rows) if args.dry_run else []
    print(f"gpu_speed: {out}: {total:.0f} s; "
          + (f"missing: {'; '.join(gone)}" if gone else "every file is there"))
    for line in off:
        print(f"gpu_speed: graphs: {line}: revise its budget (plan in scripts/gpu_speed.py)")
    return 1 if gone or off else 0


if __name__ == "__main__":
    sys.exit(cli.run("gpu_speed", main))
