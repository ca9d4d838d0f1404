"""The GPU speed check, within 8 minutes on one H100/H200: one folder with the speed table (resnet18 and
resnet50 x six precisions x batch 64 and 256, eager; resnet18 compiled with default and reduce-overhead), Page's
step 10 twice, mixprec's loop against a hand-written one at batch 64 and 256, the GPT (12 x 768) in fp32,
amp_bf16 and fp8, eager and compiled, and a 2 x 4096 GPT in amp_bf16 and fp8, compiled (the width at which
torchao's float8 benchmarks show a gain). Each step runs under its own `timeout` (its limit, or what is left of
--budget if less); a step that hits it keeps what it wrote (the table is saved after every cell). budget.md says
each step's limit, seconds and outcome; SUMMARY.md gathers the results. logger=none throughout; the jobs' saved
weights (*.pt) are deleted, the rest of their records kept (summary.json, metrics.jsonl, train.log).

  python scripts/gpu_speed.py [--out DIR] [--budget 450] [train.py overrides for the jobs, e.g. dataset.data_dir=/data]
  python scripts/gpu_speed.py --dry-run --out DIR     # the same steps at tiny sizes on the CPU (the test suite's)

The order is the order of importance: what is cheap and decisive first, compilation last (its cost varies). The
dry run replaces each compile mode by `none` (inductor on a small CPU takes minutes per graph) and records the
mode a GPU run requests. Exit status 1 when a file the folder should hold is missing (listed), else 0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mixprec import cli  # noqa: E402
from mixprec.records import write_json_atomic, write_text_atomic  # noqa: E402

PY = [sys.executable]
TABLE_PRECISIONS = "fp32,tf32,amp,amp_bf16,half,bf16"
GPT_PRECISIONS = ("fp32", "amp_bf16", "fp8")
# tiny sizes for the CPU dry run (the same steps, seconds each)
DRY_IMAGE = ["model.width=8", "dataset.image_size=8", "trainer.device=cpu"]
DRY_LADDER = ["dataset=synthetic", "dataset.train_size=64", "dataset.test_size=32", "dataset.image_size=16",
              "trainer.batch_size=32", "trainer.eval_batch_size=32", "trainer.max_steps=2",
              "model.channels=[8,16,32,64]", "trainer.device=cpu"]
DRY_GPT = ["dataset=synthetic_text", "dataset.vocab_size=64", "dataset.train_size=2000", "dataset.test_size=400",
           "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "trainer.batch_size=4",
           "trainer.eval_batch_size=4", "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.device=cpu"]


def table_step(name: str, out: Path, dry: bool, compiles: list[str]) -> list[str]:
    if dry:
        sizes = ["--models", "small_cnn", "--precisions", "fp32,amp_bf16", "--batches", "4,8", "--steps", "2",
                 "--warmup", "1", *DRY_IMAGE]
    elif name == "table_eager":
        sizes = ["--models", "resnet18,resnet50", "--precisions", TABLE_PRECISIONS, "--batches", "64,256",
                 "--steps", "30", "--warmup", "10"]
    else:   # compiled cells: resnet18, the fp32 baseline and the fastest mixed precision of the eager table
        sizes = ["--models", "resnet18", "--precisions", "fp32,amp_bf16", "--batches", "64,256", "--steps", "30",
                 "--warmup", "10"]
    modes = ["none"] * len(compiles) if dry else compiles
    return [*PY, "scripts/benchmark.py", "table", *sizes, "--compiles", ",".join(dict.fromkeys(modes)),
            "--out", str(out / name)]   # benchmark.py composes with logger=none itself


def overhead_step(batch: int, out: Path, dry: bool) -> list[str]:
    sizes = (["model=small_cnn", *DRY_IMAGE, "precision=amp_bf16", f"trainer.batch_size={batch // 32}", "--steps",
              "2", "--warmup", "1", "--repeats", "1"] if dry else
             ["model=resnet18", "precision=amp", f"trainer.batch_size={batch}", "--steps", "50", "--warmup", "10",
              "--repeats", "2"])
    return [*PY, "scripts/benchmark.py", "overhead", *sizes, "--out", str(out / f"overhead_b{batch}.json")]


def train_step(name: str, overrides: list[str], out: Path) -> list[str]:
    return [*PY, "train.py", "-m", *overrides, "logger=none", f"hydra.sweep.dir={out / name}"]


def plan(out: Path, dry: bool, extra: list[str]) -> list[dict]:
    """The steps in order: name, command, own limit (s), and the files it must leave (relative to out)."""
    page = ["experiment=page_ladder", "trick=page_10_tta", "seed=0,1", *(DRY_LADDER if dry else extra)]
    gpt = ["experiment=transformer_precision", f"precision={','.join(GPT_PRECISIONS)}",
           *(DRY_GPT if dry else ["trainer.max_steps=40", *extra])]
    gpt_compile = "none" if dry else "default"
    # torchao's float8 gains start where a Linear's K and N reach 4096 (its README: 0.80x at M, K, N = 1024, 2048,
    # 1024; 1.39x at 4096, 8192, 16384): the 12 x 768 GPT is below that, a 2 x 4096 one (MLP 4096 -> 16384, 8192
    # tokens a step) within it
    wide = ["experiment=transformer_precision", "precision=amp_bf16,fp8",
            *(DRY_GPT if dry else ["model.n_layer=2", "model.n_head=32", "model.n_embd=4096", "trainer.max_steps=30",
                                   *extra])]
    return [
        {"name": "table_eager", "cmd": table_step("table_eager", out, dry, ["none"]), "limit": 110,
         "files": [("table_eager/table.json", 1), ("table_eager/table.md", 1)]},
        {"name": "page10", "cmd": train_step("page10", page, out), "limit": 60, "files": jobs("page10", 2)},
        {"name": "overhead_b64", "cmd": overhead_step(64, out, dry), "limit": 40, "files": [("overhead_b64.json", 1)]},
        {"name": "overhead_b256", "cmd": overhead_step(256, out, dry), "limit": 45, "files": [("overhead_b256.json", 1)]},
        {"name": "gpt_eager", "cmd": train_step("gpt_eager", [*gpt, "trainer.compile=none"], out), "limit": 60,
         "files": jobs("gpt_eager", 3)},
        {"name": "table_compiled", "cmd": table_step("table_compiled", out, dry, ["default", "reduce-overhead"]),
         "limit": 150, "files": [("table_compiled/table.json", 1), ("table_compiled/table.md", 1)],
         "requested": "trainer.compile=default,reduce-overhead"},
        {"name": "gpt_compiled", "cmd": train_step("gpt_compiled", [*gpt, f"trainer.compile={gpt_compile}"], out),
         "limit": 90, "files": jobs("gpt_compiled", 3), "requested": "trainer.compile=default"},
        {"name": "gpt_wide_compiled", "cmd": train_step("gpt_wide_compiled", [*wide, f"trainer.compile={gpt_compile}"],
                                                        out),
         "limit": 120, "files": jobs("gpt_wide_compiled", 2), "requested": "trainer.compile=default"},
    ]


def jobs(name: str, n: int) -> list[tuple]:
    return [(f"{name}/*/summary.json", n)]


def run_step(step: dict, out: Path, left: float) -> dict:
    """One step under `timeout` (its limit or what is left of the budget); its output in logs/<name>.log."""
    limit = int(min(step["limit"], left))
    if limit < 10:
        return {"name": step["name"], "limit_s": limit, "seconds": 0.0, "outcome": "skipped: out of budget"}
    log = out / "logs" / f"{step['name']}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(step["cmd"]) + "\n")
        f.flush()
        rc = subprocess.run(["timeout", "--kill-after=10", str(limit), *step["cmd"]], cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    for weights in (out / step["name"]).glob("*/*.pt"):   # a job's saved weights (the GPT's: 0.5 GB): not kept
        weights.unlink()
    outcome = "ok" if rc == 0 else ("timed out" if rc in (124, 137) else f"failed (exit {rc})")
    return {"name": step["name"], "limit_s": limit, "seconds": round(seconds, 1), "outcome": outcome,
            "requested": step.get("requested")}


def budget_markdown(rows: list[dict], budget: float, total: float, dry: bool) -> str:
    lines = [f"# Time budget ({'CPU dry run, tiny sizes' if dry else 'GPU'}): {total:.0f} s of {budget:.0f} s", "",
             "| step | limit s | seconds | outcome | note |", "|---|---|---|---|---|"]
    for r in rows:
        note = (f"a GPU run requests {r['requested']}; the dry run ran eager" if dry and r.get("requested")
                else (r.get("requested") or ""))
        lines.append(f"| {r['name']} | {r['limit_s']} | {r['seconds']} | {r['outcome']} | {note} |")
    return "\n".join(lines) + "\n"


def missing(out: Path, steps: list[dict]) -> list[str]:
    """The files (patterns with their counts) the folder should hold and does not."""
    want = [("env.json", 1), ("budget.json", 1), ("budget.md", 1), ("SUMMARY.md", 1)]
    want += [(f"logs/{s['name']}.log", 1) for s in steps] + [f for s in steps for f in s["files"]]
    return [f"{pattern} (want {n}, found {len(list(out.glob(pattern)))})" for pattern, n in want
            if len(list(out.glob(pattern))) < n]


def job_rows(out: Path, name: str) -> list[dict]:
    """The jobs of a train.py step, from their summary.json."""
    rows = []
    for path in sorted(out.glob(f"{name}/*/summary.json")):
        s = json.loads(path.read_text())
        m, ch = s.get("metrics", {}), s.get("choices", {})
        rows.append({"precision": ch.get("precision"), "seed": s.get("seed"), "status": s.get("status"),
                     "compile": (s.get("config") or {}).get("trainer", {}).get("compile"),
                     "throughput": m.get("throughput"), "train_time_s": m.get("train_time_s"),
                     "busy": m.get("gpu_busy_fraction"), "acc": m.get("final_test_acc"),
                     "ppl": m.get("final_valid_ppl"), "error": s.get("error")})
    return rows


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def jobs_markdown(title: str, rows: list[dict]) -> list[str]:
    lines = [f"## {title}", "", "| precision | compile | seed | status | train s | samples or tokens /s | "
             "GPU busy | test acc | valid ppl | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['compile']} | {r['seed']} | {r['status']} | "
                     f"{fmt(r['train_time_s'], '.2f')} | {fmt(r['throughput'], '.0f')} | {fmt(r['busy'], '.2f')} | "
                     f"{fmt(r['acc'], '.4f')} | {fmt(r['ppl'], '.1f')} | {(r['error'] or '')[:80]} |")
    return lines + [""]


def summary_markdown(out: Path, env: dict, budget_md: str) -> str:
    """SUMMARY.md: the device, the budget, both speed tables, the jobs and the overhead ratios."""
    lines = [f"# GPU speed check: {env.get('device_name')}, torch {env.get('torch')}, {env.get('date')}", "",
             budget_md]
    for name in ("table_eager", "table_compiled"):
        md = out / name / "table.md"
        lines += [md.read_text().replace("# Speed table", f"## {name}: speed table", 1) if md.exists()
                  else f"## {name}: no table (see logs/{name}.log)", ""]
    lines += jobs_markdown("Page's step 10, seeds 0 and 1", job_rows(out, "page10"))
    lines += jobs_markdown("GPT, eager", job_rows(out, "gpt_eager"))
    lines += jobs_markdown("GPT, compiled", job_rows(out, "gpt_compiled"))
    lines += jobs_markdown("GPT 2 x 4096 (torchao's float8 gains from K, N >= 4096), compiled: fp8 against amp_bf16",
                           job_rows(out, "gpt_wide_compiled"))
    lines += ["## mixprec's loop against a hand-written one", ""]
    for b in (64, 256):
        f = out / f"overhead_b{b}.json"
        r = json.loads(f.read_text()) if f.exists() else None
        lines.append(f"- batch {b}: " + (f"ratio mixprec / hand {r['ratio']:.3f} (rounds {r['spread'][0]:.3f} .. "
                                        f"{r['spread'][1]:.3f}), {r['median_mixprec']:.0f} against "
                                        f"{r['median_hand']:.0f} samples/s" if r else f"no result (logs/overhead_b{b}.log)"))
    return "\n".join(lines) + "\n"


def environment(dry: bool) -> dict:
    from mixprec import hardware

    device = hardware.select_device("cpu" if dry else "auto")
    env = hardware.describe(device)
    env.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), dry_run=dry)
    if device.type == "cpu" and not dry:
        raise SystemExit("gpu_speed: no GPU is visible; use --dry-run for the CPU rehearsal")
    return env


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="gpu_speed.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", help="train.py overrides for the jobs (e.g. dataset.data_dir=/data)")
    parser.add_argument("--out", type=Path, help="the folder (default outputs/gpu_speed/<date>)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all the steps (450: 8 min with the "
                        "environment and start-up)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, compile modes eager")
    args = parser.parse_args(argv)
    out = (args.out or ROOT / "outputs" / "gpu_speed" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = environment(args.dry_run)
    write_json_atomic(out / "env.json", env)
    steps = plan(out, args.dry_run, args.overrides)
    write_json_atomic(out / "plan.json", {"steps": steps, "budget_s": args.budget})
    t0, rows = time.perf_counter(), []
    for step in steps:
        rows.append(run_step(step, out, args.budget - (time.perf_counter() - t0)))
        print(f"gpu_speed: {rows[-1]['name']}: {rows[-1]['outcome']} in {rows[-1]['seconds']} s", flush=True)
    total = time.perf_counter() - t0
    budget_md = budget_markdown(rows, args.budget, total, args.dry_run)
    write_json_atomic(out / "budget.json", {"budget_s": args.budget, "total_s": total, "steps": rows})
    write_text_atomic(out / "budget.md", budget_md)
    write_text_atomic(out / "SUMMARY.md", summary_markdown(out, env, budget_md))
    gone = missing(out, steps)
    print(f"gpu_speed: {out}: {total:.0f} s; " + (f"missing: {'; '.join(gone)}" if gone else "every file is there"))
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(cli.run("gpu_speed", main))
