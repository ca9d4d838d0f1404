"""The report's analysis: jobs grouped by experiment and by model x variant x precision, each
published value compared with the runs it matches, the per-job sweep rows and Page's ladder rows. It
returns plain data (written as report.json); render.py turns it into the report, console.py into the
end-of-sweep console tables, plots.py into figures.

Within an experiment (summary["name"]) the variant is whatever else differs between its jobs: a
trick, an optimizer, a ladder step; seeds are not a variant: repeated seeds are summarised as mean
and spread (stats()). Speed-ups are sweep_rows's: fp32 training time / the job's, for the fp32 job
with the same other overrides.
"""
from __future__ import annotations

import functools
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from .. import records
from ..precision import modes
from ..runtime import busy
from ..tools.plan import PlanError, full_command, load_plan
from ..runtime.versions import differences
from .load import Job, number
from .published import Published, Source, apex_ppl_values, matches, noise_verdict, page_ladder

# choice groups and overrides that never make a variant: they are the axes of the report, or change
# no result
_AXES = ("model", "precision", "experiment", "logger", "hydra")
_NOT_VARIANT = ("seed", "logger", "hydra", "trainer.device", "name", "experiment")
MAX_VARIANT = 28


def precision_key(p: str) -> tuple:
    """Where a precision sorts in tables and plots: its place in precision.modes.MODES, then any
    other mode by name."""
    return (modes.MODES.index(p), p) if p in modes.MODES else (len(modes.MODES), str(p))


def stats(values: list) -> dict | None:
    """Mean and spread (sample standard deviation, min, max) of the numbers among `values`; None if
    none."""
    xs = [float(v) for v in values if number(v) is not None]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


@dataclass
class Group:
    model: str
    variant: str
    precision: str
    jobs: list

    @property
    def label(self) -> str:
        return f"{self.model} {self.variant}".strip()

    def stats(self, metric: str) -> dict | None:
        return stats([j.metric(metric) for j in self.jobs])


def by_experiment(jobs: list[Job]) -> dict[str, list[Job]]:
    """Jobs per experiment, each with its sweep_rows row, fp32 partner and variant label."""
    out: dict[str, list[Job]] = {}
    for j in jobs:
        out.setdefault(j.experiment, []).append(j)
    for exp_jobs in out.values():
        summaries = [j.summary for j in exp_jobs]
        for j, row, swept in zip(exp_jobs, sweep_rows(summaries), swept_values(summaries)):
            j.row = dict(row, swept=swept)
        fp32 = fp32_partners(summaries)
        described = [_describe(j.summary) for j in exp_jobs]
        keys = sorted({k for d in described for k in d})
        varying = _independent(
            [k for k in keys if len({d.get(k) for d in described}) > 1], described
        )
        names: dict[str, str] = {}
        for j, d in zip(exp_jobs, described):
            j.fp32 = fp32.get(records.baseline_key(j.summary))
            j.variant_full = ",".join(f"{k}={d[k]}" for k in varying if k in d)
            # a long one (unlike sweeps read together) gets a short name
            if j.variant_full not in names:
                short = sum(1 for v in names.values() if v.startswith("[v"))
                names[j.variant_full] = (
                    j.variant_full if len(j.variant_full) <= MAX_VARIANT else f"[v{short + 1}]"
                )
            j.variant = names[j.variant_full]
    return out


def swept_values(summaries: list[dict]) -> list[str]:
    """Per job, `key=value` of every override whose value differs between the jobs (a sweep's swept
    keys, seed included), but model and precision (columns of their own): what tells rows apart
    that would otherwise read alike (a `dataset=` sweep)."""
    parsed = [dict(o.lstrip("+~").partition("=")[::2] for o in records.overrides(s))
              for s in summaries]
    keys = [k for k in dict.fromkeys(k for d in parsed for k in d)
            if k not in ("model", "precision") and len({d.get(k) for d in parsed}) > 1]
    return [",".join(f"{k}={d[k]}" for k in keys if k in d) for d in parsed]


def _independent(keys: list[str], described: list[dict]) -> list[str]:
    """Leave out a key whose value a finer key's value always implies (a case that sets its
    optimizer)."""
    n = {k: len({d.get(k) for d in described}) for k in keys}

    def implies(a: str, b: str) -> bool:
        seen: dict = {}
        return all(seen.setdefault(d.get(a), d.get(b)) == d.get(b) for d in described)

    return [k for k in keys if not any(n[k2] > n[k] and implies(k2, k) for k2 in keys)]


def _describe(summary: dict) -> dict:
    """What sets a job apart besides model, precision and seed: its other choices and value
    overrides."""
    choices = records.choices(summary)
    d = {k: str(v) for k, v in choices.items() if v is not None and not k.startswith(_AXES)}
    for o in records.overrides(summary):
        k, _, v = o.lstrip("+~").partition("=")
        if k not in choices and not k.startswith(_NOT_VARIANT):
            # a sweep's override reads False, a job's false
            d[k] = v.lower() if v in ("True", "False") else v
    return d


def groups_of(jobs: list[Job]) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for j in jobs:
        key = (j.model, j.variant, j.precision)
        groups.setdefault(key, Group(*key, jobs=[])).jobs.append(j)
    models = list(dict.fromkeys((g.model, g.variant) for g in groups.values()))
    return sorted(
        groups.values(),
        key=lambda g: (models.index((g.model, g.variant)), precision_key(g.precision)),
    )


def compare(value: Published, groups: list[Group]) -> list[dict]:
    """One row per group with runs matching the published value; one 'missing' row where none
    match."""
    rows = []
    for g in groups:
        jobs = [j for j in g.jobs if matches(value.match, j.summary)]
        if not jobs:
            continue
        row = {
            "group": g.label,
            "precision": g.precision,
            "runs": len(jobs),
            "devices": _devices(jobs),
            "software": _software(jobs),
            "reproduced": None,
            "ratio": None,
            "difference": None,
            "verdict": None,
        }
        if value.metric == "status":
            seen = [j.status for j in jobs]
            agree = seen.count(value.value)
            row["reproduced"] = {"statuses": seen}
            row["verdict"] = (
                "agrees"
                if agree == len(seen)
                else ("differs" if agree == 0 else f"{agree}/{len(seen)} agree")
            )
        else:
            st = stats([j.metric(value.metric) for j in jobs])
            row["reproduced"] = st
            if st is None:
                row["verdict"] = "no value (" + ", ".join(sorted({j.status for j in jobs})) + ")"
            elif value.compare == "difference":
                ref = sum(value.value) / 2 if isinstance(value.value, tuple) else value.value
                row["difference"] = st["mean"] - ref
                row["noise"] = noise_verdict(value, st["mean"])
            elif isinstance(value.value, tuple):
                lo, hi = value.value
                row["ratio"] = [st["mean"] / hi, st["mean"] / lo] if lo > 0 else None
                row["verdict"] = (
                    "within range"
                    if lo <= st["mean"] <= hi
                    else ("below" if st["mean"] < lo else "above")
                )
            elif value.value:
                row["ratio"] = st["mean"] / value.value
                row["noise"] = noise_verdict(value, st["mean"])
        rows.append(row)
    return rows or [
        {
            "group": None,
            "verdict": "missing: no run yet",
            "reproduced": None,
            "ratio": None,
            "difference": None,
            "runs": 0,
        }
    ]


def _devices(jobs: list[Job]) -> list[str]:
    out = []
    for j in jobs:
        e = records.env(j.summary)
        if e:
            cap = f", sm_{''.join(map(str, e['capability']))}" if e.get("capability") else ""
            out.append(f"{e.get('device_name')} ({e.get('device')}{cap})")
    return sorted(set(out))


def _software(jobs: list[Job]) -> list[str]:
    envs = [records.env(j.summary) for j in jobs]
    return sorted(
        {f"torch {e.get('torch')}, CUDA {e.get('cuda')}, cuDNN {e.get('cudnn')}" for e in envs if e}
    )


def analyse(jobs: list[Job], sources: list[Source], problems: list[str], inputs: list[str]) -> dict:
    """Everything the report shows, as plain data (written as report.json; the renderers read only
    this)."""
    experiments = by_experiment(jobs)
    present = set(experiments)
    data = {"generated": time.strftime("%Y-%m-%d %H:%M:%S %z"), "inputs": [str(i) for i in inputs],
            "jobs": len(jobs), "problems": problems, "experiments": [], "sources_without_runs": []}
    for name, exp_jobs in experiments.items():
        groups = groups_of(exp_jobs)
        applicable = [s for s in sources if name in s.experiments]
        exp = {
            "name": name,
            "jobs": len(exp_jobs),
            "sources": [s.id for s in applicable],
            "env": _env_table(exp_jobs),
            "groups": [_group_data(g) for g in groups],
            "comparisons": [
                dict(_published_data(v, s), rows=compare(v, groups))
                for s in applicable
                for v in s.values
            ],
            "not_completed": [_problem_data(j) for j in exp_jobs if j.status != "completed"],
            "verdicts": [_verdict_data(j) for j in exp_jobs if j.summary.get("verdict")],
            "variants": {
                j.variant: j.variant_full for j in exp_jobs if j.variant != j.variant_full
            },
            # the sweep's console ladder table, the same rows
            "ladder": ladder_rows([j.summary for j in exp_jobs]),
            "parity": parity_rows(groups),
            "perplexity": perplexity_rows(groups),
            "fsdp": fsdp_rows([j.summary for j in exp_jobs]),
        }
        exp["unmatched_sources"] = [_unmatched(s) for s in applicable if not any(
            r["group"] for c in exp["comparisons"] if c["source"] == s.id for r in c["rows"])]
        exp["_groups"] = groups  # for the plots; not serialised
        data["experiments"].append(exp)
    for s in sources:
        if not present & set(s.experiments):
            values = [_published_data(v, s) for v in s.values]
            data["sources_without_runs"].append(
                dict(_unmatched(s), url=s.url, experiments=list(s.experiments), values=values))
    return data


def _unmatched(s: Source) -> dict:
    """A source no job of the report matches: what the report says of it in one line."""
    return {"id": s.id, "title": s.title, "n_values": len(s.values), "commands": run_commands(s),
            "file": s.path.name}


@functools.cache
def _plan_sweeps() -> dict[str, tuple[str, ...]]:
    """Per article of the reproduction plan (plan.yaml), its sweeps' full-fidelity commands."""
    try:
        return {a.id: tuple(full_command(s) for s in a.sweeps) for a in load_plan().articles}
    except PlanError:
        return {}


def run_commands(source: Source) -> list[str]:
    """The commands that run the jobs a source's values are compared with: its article's sweeps
    in the reproduction plan; none for a source the plan does not hold (a user's own file)."""
    return list(_plan_sweeps().get(source.id, ()))


# two-sided 95% quantiles of Student's t by degrees of freedom (more than 30: the normal's 1.96,
# near enough)
T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}


def t975(df: int) -> float:
    return T975[min((k for k in T975 if k >= df), default=30)] if df <= 30 else 1.96


def paired_difference(diffs: list) -> dict | None:
    """Mean of per-seed differences against fp32 and its 95% confidence interval (t, n - 1 degrees
    of freedom); the verdict says whether the interval excludes 0. None with fewer than 2 pairs."""
    st = stats(diffs)
    if st is None or st["n"] < 2:
        return None
    half = t975(st["n"] - 1) * st["std"] / math.sqrt(st["n"])
    lo, hi = st["mean"] - half, st["mean"] + half
    verdict = (
        "worse than fp32"
        if hi < 0
        else ("better than fp32" if lo > 0 else "no difference detected")
    )
    return {**st, "ci95": [lo, hi], "verdict": verdict}


def parity_rows(groups: list[Group]) -> list[dict]:
    """Accuracy against fp32, seed by seed: per group with 2+ seeds, the accuracy's mean and spread
    and the paired difference from the fp32 job of the same seed and settings (points), with its 95%
    interval. Empty when no group has two seeds."""
    if not any(len({j.seed for j in g.jobs}) > 1 for g in groups):
        return []
    rows = []
    for g in groups:
        acc = stats([j.metric("test_acc_pct") for j in g.jobs])
        diff = (
            None
            if g.precision == "fp32"
            else paired_difference([j.metric("acc_change_vs_fp32") for j in g.jobs])
        )
        statuses = [j.status for j in g.jobs]
        rows.append(
            {
                "group": g.label,
                "precision": g.precision,
                "runs": len(g.jobs),
                "statuses": {s: statuses.count(s) for s in dict.fromkeys(statuses)},
                "acc": acc,
                "diff": diff,
            }
        )
    return rows


def perplexity_rows(groups: list[Group]) -> list[dict]:
    """A language model's perplexity after each epoch (metrics.jsonl epoch rows): per group and
    epoch, the mean over the group's completed runs of the validation and test perplexity. Empty for
    models without them."""
    rows = []
    for g in groups:
        per_epoch: dict[int, list[dict]] = {}
        for j in g.jobs:
            if j.status == "completed":
                for r in j.rows():
                    if r.get("kind") == "epoch" and number(r.get("valid_ppl")) is not None:
                        per_epoch.setdefault(r["epoch"], []).append(r)
        for epoch, rs in sorted(per_epoch.items()):
            rows.append(
                {
                    "group": g.label,
                    "precision": g.precision,
                    "epoch": epoch,
                    "runs": len(rs),
                    "valid_ppl": stats([r["valid_ppl"] for r in rs]),
                    "test_ppl": stats([r.get("test_ppl") for r in rs]),
                }
            )
    return rows


def _group_data(g: Group) -> dict:
    statuses = [j.status for j in g.jobs]
    return {
        "model": g.model,
        "variant": g.variant,
        "precision": g.precision,
        "label": g.label,
        "runs": len(g.jobs),
        "statuses": {s: statuses.count(s) for s in dict.fromkeys(statuses)},
        "seeds": [j.seed for j in g.jobs],
        "dirs": [str(j.dir) for j in g.jobs],
        "metrics": {
            m: g.stats(m)
            for m in (
                "train_time_s",
                "speedup",
                "throughput",
                "final_test_acc",
                "best_test_acc",
                "time_to_target_s",
                "peak_memory_mb",
                "mfu",
                "loss_gap",
                "test_ppl",
                "gpu_busy_fraction",
            )
        },
        "batch": sorted({str(records.lookup(j.summary, "trainer.batch_size")) for j in g.jobs}),
        "compile": sorted({str(records.lookup(j.summary, "trainer.compile")) for j in g.jobs}),
        "emulated": any(records.emulated(j.summary) for j in g.jobs),
        "fp32_arithmetic": any(records.fp32_arithmetic(j.summary) for j in g.jobs),
        "language_model": any(records.is_language_model(j.summary) for j in g.jobs),
        "skipped": [skipped_cell(records.metrics(j.summary), flag=" (most: did not train)")
                    for j in g.jobs],
        "peak_memory_kind": sorted(
            {records.metrics(j.summary).get("peak_memory_kind") or "?" for j in g.jobs}
        ),
        "devices": _devices(g.jobs),
        "software": _software(g.jobs),
    }


def _published_data(v: Published, s: Source) -> dict:
    return {"source": s.id, "source_title": s.title, "url": s.url, "id": v.id, "label": v.label,
            "metric": v.metric, "value": list(v.value) if isinstance(v.value, tuple) else v.value,
            "published": v.format_value(), "unit": v.unit, "hardware": v.hardware, "quote": v.quote,
            "match": v.match, "compare": v.compare}


def _problem_data(j: Job) -> dict:
    s = j.summary
    why = records.reason(s) or "no reason recorded"
    return {
        "dir": str(j.dir),
        "job": records.job_num(s),
        "model": j.model,
        "precision": j.precision,
        "variant": j.variant,
        "seed": j.seed,
        "status": j.status,
        "reason": str(why).splitlines()[0],
        "step": (s.get("nonfinite") or {}).get("step"),
    }


def _verdict_data(j: Job) -> dict:
    v = j.summary["verdict"]
    return {
        "job": records.job_num(j.summary)
        if records.job_num(j.summary) is not None
        else Path(j.dir).name,
        "model": f"{j.model} {j.variant}".strip(),
        "precision": j.precision,
        "status": j.status,
        "verdict": v["line"],
        "cites": v["cites"],
        "mechanism": v["mechanism"],
    }


def _env_table(jobs: list[Job]) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for j in jobs:
        e = records.env(j.summary)
        if not e:
            continue   # failed before its environment was recorded (a config error)
        unpinned = differences(e.get("versions"))  # versions other than constraints.txt's pins
        key = tuple(
            str(e.get(k))
            for k in ("device_name", "capability", "torch", "cuda", "cudnn", "git_commit")
        )
        key += (bool(e.get("versions")), str(e.get("tf32_matmul")), str(e.get("tf32_cudnn")),
                *unpinned)
        row = seen.setdefault(
            key,
            {
                "device": _devices([j])[0],
                "torch": e.get("torch"),
                "unpinned": unpinned,
                "pinned": "not recorded"
                if not e.get("versions")
                else "differ: " + ", ".join(unpinned)
                if unpinned
                else "as constraints.txt",
                "cuda": e.get("cuda"),
                "cudnn": e.get("cudnn"),
                "python": e.get("python"),
                "git_commit": (e.get("git_commit") or "")[:10]
                + ("+dirty" if e.get("git_dirty") else ""),
                "tf32": f"matmul {e.get('tf32_matmul')}, cudnn {e.get('tf32_cudnn')}"
                + (" (no effect on a CPU)" if str(e.get("device")).startswith("cpu") else ""),
                "jobs": 0,
            },
        )
        row["jobs"] += 1
    return list(seen.values())


# ------------------------------------------------------------------------------------- per-job rows

# per experiment: the precision options that are its article's columns; the sweep's other precisions
# are labelled "modern column" (fastai's article compared fp32 with fastai 1.0's to_fp16; amp, tf32,
# amp_bf16 came later)
ARTICLE_PRECISIONS = {"fastai_cifar100": ("fp32", "fastai_fp16")}


def column_note(summary: dict) -> str:
    """"article's column " / "modern column " for a job of an experiment whose article had fewer
    precisions."""
    article = ARTICLE_PRECISIONS.get(records.experiment(summary))
    if not article:
        return ""
    return (
        "[article's column] "
        if records.choices(summary).get("precision") in article
        else "[modern column] "
    )


def fp32_partners(summaries: list[dict]) -> dict[str, dict]:
    """records.baseline_key -> the completed fp32 job with that key: the job a speed-up is measured
    against."""
    return {records.baseline_key(s): s for s in summaries
            if records.choices(s).get("precision") == "fp32" and records.completed(s)}


def sweep_rows(summaries: list[dict]) -> list[dict]:
    """One row per job; speedup = fp32 train time / this job's train time, for the fp32 job whose
    config is the same but for precision (None where the sweep has no such fp32 job); loss_gap
    (language models) = this job's final validation loss - that fp32 job's, when both ran the same
    number of steps."""
    fp32 = fp32_partners(summaries)
    rows = []
    for s in summaries:
        m = records.metrics(s)
        partner = fp32.get(records.baseline_key(s))
        f = records.metrics(partner or {})
        base = f.get("train_time_s")
        t = m.get("train_time_s")
        rows.append(
            {
                "job": records.job_num(s),
                "model": records.choices(s).get("model"),
                "precision": precision_label(s),
                "status": records.status(s),
                "epochs": m.get("epochs"),
                "train_time_s": t,
                "samples_per_s": m.get("throughput"),
                "speedup": base / t
                if base and t and records.completed(s) and not records.no_speedup(s)
                else None,
                "skipped": skipped_cell(m),
                "test_acc": m.get("final_test_acc"),
                "lm": records.is_language_model(s),
                "valid_ppl": m.get("best_valid_ppl"),
                "test_ppl": m.get("test_ppl_at_best_valid"),
                "published": published_ppl(s),
                "loss_gap": loss_gap(m, f),
                "mfu": m.get("mfu"),
                "peak_mem_mb": m.get("peak_memory_mb"),
                "peak_mem_kind": m.get("peak_memory_kind"),
                "bytes_per_param": records.memory(s).get("bytes_per_param"),
                "act_mb_per_sample": records.memory(s).get("activation_mb_per_sample"),
                "batch": records.lookup(s, "trainer.batch_size"),
                "compile": compile_cell(s),
                "busy": m.get("gpu_busy_fraction"),
                "strategy": sharded_cell(s),
                "held_mb": held_cell(s),
                "note": row_note(s, m, f, partner not in (None, s)),
            }
        )
    return rows


def loss_gap(m: dict, f: dict) -> float | None:
    """A job's final validation loss minus its fp32 partner's (metrics m and f), when both ran
    the same number of steps and have one; None otherwise."""
    if (f.get("steps") == m.get("steps") and isinstance(m.get("final_valid_loss"), float)
            and isinstance(f.get("final_valid_loss"), float)):
        return m["final_valid_loss"] - f["final_valid_loss"]
    return None


def row_note(s: dict, m: dict, f: dict, has_partner: bool) -> str:
    """A sweep row's note: the article's column, the pitfall case, then what to read the row's
    numbers beside (skipped steps, fp32 arithmetic, the verdict, why it stopped, a capped
    evaluation, a host-bound GPU); f: the fp32 partner's metrics, has_partner: it is another
    job."""
    return column_note(s) + _case_note(s.get("case")) + "; ".join(
        filter(None, (skipped_note(m), fp32_note(s), records.verdict_short(s), records.reason(s),
                      records.eval_cap(s), host_bound_note(m, f, has_partner)))
    )


def skipped_most(m: dict) -> bool:
    """The job skipped more than half its optimizer steps (non-finite gradients): it hardly
    trained, whatever its time and accuracy say."""
    k, n = m.get("skipped_steps"), m.get("steps")
    return bool(isinstance(k, int) and n and k > n / 2)


def skipped_cell(m: dict, flag: str = "") -> str | None:
    """`skipped/steps` (None where not recorded), with `flag` after it when it skipped most."""
    k, n = m.get("skipped_steps"), m.get("steps")
    if k is None or n is None:
        return None
    return f"{k}/{n}" + (flag if skipped_most(m) else "")


def skipped_note(m: dict) -> str | None:
    """The sweep table's note on a job that skipped most of its steps (skipped_most)."""
    if not skipped_most(m):
        return None
    return f"skipped {m['skipped_steps']} of {m['steps']} steps: did not train"


def fp32_note(summary: dict) -> str | None:
    """Why a tf32 job on a device without TF32 has no speed-up."""
    if not records.fp32_arithmetic(summary):
        return None
    device = (records.env(summary) or {}).get("device", "this device")
    return f"TF32 does nothing on {device}: plain fp32 arithmetic, no speed-up"


def sharded_cell(summary: dict) -> str | None:
    """A sharded job's strategy cell: fsdp, its ranks, its HSDP mesh when it has several replicas
    ("hsdp 2x4": 2 replicas, each sharded over 4 ranks), the dtype it computes in and the one it
    reduces gradients in (None for other jobs)."""
    d = records.sharded(summary)
    if d is None:
        return None
    mesh = d.get("mesh") or {}
    hsdp = f" hsdp {mesh['replicate']}x{mesh['shard']}" if mesh.get("replicate", 1) > 1 else ""
    fp8 = ", fp8 all-gather" if records.fsdp_float8_all_gather(summary) else ""
    return (f"fsdp x{d['world_size']}{hsdp} {d.get('param_dtype', '?')}/"
            f"reduce {d.get('reduce_dtype', '?')}{fp8}")


def held_cell(summary: dict) -> str | None:
    """A sharded job's most per-rank MB of parameters + gradients + optimizer state, the largest
    over its ranks (they differ only where a dim 0 does not divide by the ranks)."""
    held = records.held_mb(summary)
    if not held:
        return None
    top = max(held, key=lambda r: sum(r.values()))
    return f"{top['params']:.3g}+{top['grads']:.3g}+{top['optimizer']:.3g}"


def fsdp_rows(summaries: list[dict]) -> list[dict]:
    """The sharded jobs' reduction question: each job beside its float32-reduce partner (the job
    whose config differs only in precision.reduce_dtype): final validation loss and its difference,
    train time, the time ratio (steady_time_ratio), per-rank held MB; rows in precision order, fp32
    reduction first."""
    sharded = [s for s in summaries if records.sharded(s) and records.completed(s)]
    partners = {reduce_key(s): s for s in sharded
                if records.sharded(s).get("reduce_dtype") == "float32"}
    rows = []
    for s in sharded:
        m, base = records.metrics(s), partners.get(reduce_key(s))
        b = records.metrics(base) if base is not None and base is not s else {}
        loss, t = m.get("final_valid_loss"), m.get("train_time_s")
        rows.append({
            "job": records.job_num(s), "precision": precision_label(s), "strategy": sharded_cell(s),
            "valid_loss": loss, "time_s": t, "held_mb": held_cell(s),
            "peak_mem_mb": m.get("peak_memory_mb"),
            "dloss": loss - b["final_valid_loss"] if isinstance(loss, float)
            and isinstance(b.get("final_valid_loss"), float) else None,
            "time_ratio": steady_time_ratio(m, b)})
    return sorted(rows, key=lambda r: (precision_key(r["precision"] or ""), r["strategy"]))


def steady_time_ratio(m: dict, base: dict) -> float | None:
    """This job's time per sample over its partner's, from the steady throughput (warm-up steps
    excluded: the first job of a sweep pays the process's one-time costs there) where both have
    one, else from the whole train time."""
    steady = lambda x: x.get("throughput") and not x.get("throughput_includes_warmup", True)  # noqa: E731
    if steady(m) and steady(base):
        return base["throughput"] / m["throughput"]
    t, b = m.get("train_time_s"), base.get("train_time_s")
    return t / b if t and b else None


def reduce_key(summary: dict) -> str:
    """Jobs of one world size whose resolved configs differ only in precision.reduce_dtype (and the
    case label) share this key."""
    cfg = {k: v for k, v in records.config(summary).items() if k != "case"}
    cfg["world_size"] = (records.sharded(summary) or {}).get("world_size")
    cfg["precision"] = {k: v for k, v in (cfg.get("precision") or {}).items()
                        if k != "reduce_dtype"}
    return json.dumps(cfg, sort_keys=True)


def compile_cell(summary: dict) -> str | None:
    """The job's compile mode, the graph breaks dynamo took when it took some (its compiled
    modules ran in pieces), and how many calls after its warm-up ran eagerly when some did (dynamo
    gave up on them: the job's time is partly an eager time; compile.GraphWatch)."""
    mode = records.lookup(summary, "trainer.compile")
    m = records.metrics(summary)
    said = [f"{m[k]} {name}" for k, name in (("graph_breaks", "graph breaks"),
                                             ("eager_calls", "eager calls")) if m.get(k)]
    return ", ".join([str(mode), *said]) if said else mode


def host_bound_note(m: dict, fp32: dict, compared: bool) -> str | None:
    """"host-bound" when this job, or the fp32 job its speed-up is measured against, kept the GPU
    busy less than busy.HOST_BOUND of a steady step (None where no busy fraction was measured: a CPU
    job)."""
    mine, theirs = m.get("gpu_busy_fraction"), fp32.get("gpu_busy_fraction") if compared else None
    if not any(busy.verdict(b) == "host-bound" for b in (mine, theirs)):
        return None
    return "host-bound: GPU busy " + ", fp32 ".join(
        f"{100 * b:.0f}%" for b in (mine, theirs) if b is not None
    )


def precision_label(summary: dict) -> str | None:
    """The precision choice, with its static loss scale when it has one (apex's fp16: o2(x128)), and
    marked `(emulated)` when its arithmetic was emulated: fp16/bf16 rounding on fp32 kernels, or fp8
    without FP8 tensor cores (its time is then no fp16/bf16/FP8 time)."""
    choice = records.choices(summary).get("precision")
    scale = records.lookup(summary, "precision.loss_scale")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        choice = f"{choice}(x{scale:g})"
    return f"{choice}(emulated)" if records.emulated(summary) else choice


def _case_note(case: dict | None) -> str:
    if not case:
        return ""
    verdict = (
        "as expected" if case.get("as_expected") else f"NOT as expected ({case.get('expect')})"
    )
    return f"[{case.get('name')}: {verdict}] "


def published_ppl(summary: dict) -> str | None:
    """apex's published test perplexity for a job that is the run it was reported for (its model,
    data, precision and loss scale: the value's match keys in published/apex_word_lm.yaml, at any
    number of epochs), with the epochs it was reported at; None for any other job."""
    for v in apex_ppl_values():
        if matches({k: w for k, w in v.match.items() if k != "trainer.epochs"}, summary):
            return f"{v.value:g} ({v.match.get('trainer.epochs')} epochs)"
    return None


def ladder_rows(summaries: list[dict]) -> list[dict]:
    """One row per ladder step (and per variant: the overrides other than seed and trick that differ
    between the sweep's jobs), in ladder order, every statistic over ALL the step's runs (seeds), as
    Page reported his ladder (bag_of_tricks.ipynb: the fixed-schedule `total time` of Timer and
    `summary(logs)`, the final-epoch accuracy's count, mean, min, max, std over the runs): stats()
    of the fixed-schedule training time (eval excluded; the whitening fit and the untimed prewarm
    are not in it, setup_s is the mean apart), the final accuracy without and with flip TTA; the
    runs that completed and that reached the target (k, n), n counting every run of the step, failed
    or diverged ones too; and the median time to the target over all runs, a run that never reached
    it counting as never (so the median is inf, not reached, when half the runs or more did not).
    Empty when the sweep ran no ladder step."""
    steps = page_ladder()
    jobs = [s for s in summaries if records.choices(s).get("trick") in steps]
    common = set.intersection(*(set(records.overrides(s)) for s in jobs)) if jobs else set()
    groups: dict[tuple, list[dict]] = {}
    for s in jobs:
        variant = ",".join(sorted(o for o in set(records.overrides(s)) - common
                                  if not o.startswith(("seed=", "trick="))))
        groups.setdefault((records.choices(s)["trick"], variant), []).append(s)
    order = list(steps)
    rows = []
    for (step, variant), group in sorted(
        groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])
    ):
        done = [records.metrics(s) for s in group if records.completed(s)]
        to_target = [records.metrics(s).get("time_to_target_s") for s in group]
        _, page_s, page_epochs = steps[step]
        rows.append({
            "step": step, "variant": variant, "runs": (len(done), len(group)),
            "epochs": _mean([m.get("epochs") for m in done]),
            "train_time_s": stats([m.get("train_time_s") for m in done]),
            # + the one-off data preparation
            "page_clock_s": _mean([m.get("page_clock_s") for m in done]),
            "setup_s": _mean([m.get("setup_time_s") for m in done]),
            "acc": stats([m.get("final_test_acc_no_tta", m.get("final_test_acc")) for m in done]),
            "acc_tta": stats([m.get("final_test_acc_tta") for m in done]),
            "reached": (sum(t is not None for t in to_target), len(group)),
            "to_94_s": statistics.median([math.inf if t is None else t for t in to_target]),
            "page_s": page_s, "page_epochs": page_epochs,
            "note": "; ".join(sorted({records.verdict_short(s) for s in group} - {""})
                              + sorted({records.reason(s) for s in group} - {""})),
        })
    return rows


def _mean(values: list) -> float | None:
    st = stats(values)
    return st and st["mean"]
