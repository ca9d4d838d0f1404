"""The reproduction report: jobs' records beside the published numbers, as report.md, report.html and report.json.

It reads summary.json and metrics.jsonl files only (never W&B), groups jobs by experiment (summary["name"]) and,
within one, by model x variant x precision (the variant is whatever else differs between its jobs: a trick, an
optimizer, a ladder step; seeds are not a variant: repeated seeds are summarised as mean and spread). Speed-ups
are tables.sweep_rows's: fp32 training time / the job's, for the fp32 job with the same other overrides.
"""
from __future__ import annotations

import base64
import glob
import html
import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import plots, probe_plots, reference
from .records import METRICS, SUMMARY, atomic_file, read_summary, write_json_atomic
from .sources import DERIVED, Published, Source, load_sources, matches
from .tables import baseline_key, sweep_rows

# choice groups and overrides that never make a variant: they are the axes of the report, or change no result
_AXES = ("model", "precision", "experiment", "logger", "hydra")
_NOT_VARIANT = ("seed", "logger", "hydra", "trainer.device", "name", "experiment")
MAX_VARIANT = 28


class ReportError(ValueError):
    """Bad input to the report (nothing to read): one line for the user."""


@dataclass
class Job:
    dir: Path
    summary: dict
    row: dict = field(default_factory=dict)       # its tables.sweep_rows row
    fp32: dict | None = None                      # the completed fp32 job with the same other overrides
    variant: str = ""          # what else sets it apart in its experiment (short form)
    variant_full: str = ""
    _rows: list | None = None

    @property
    def experiment(self) -> str:
        return str(self.summary.get("name") or (self.summary.get("config") or {}).get("name") or "default")

    @property
    def model(self) -> str:
        return str((self.summary.get("choices") or {}).get("model", "?"))

    @property
    def precision(self) -> str:
        return str((self.summary.get("choices") or {}).get("precision", "?"))

    @property
    def status(self) -> str:
        return str(self.summary.get("status", "unknown"))

    @property
    def seed(self):
        return self.summary.get("seed", (self.summary.get("config") or {}).get("seed"))

    def rows(self) -> list[dict]:
        """metrics.jsonl rows (an incomplete last line, as a killed job may leave, is skipped)."""
        if self._rows is None:
            self._rows = []
            path = self.dir / METRICS
            if path.exists():
                for line in path.read_text().splitlines():
                    try:
                        self._rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        return self._rows

    def metric(self, name: str):
        """The run's value of a metric (sources.DERIVED or a summary["metrics"] key); None where it has none.
        Numbers come from completed runs only: a diverged run's time is not a training time."""
        if name == "status":
            return self.status
        if self.status != "completed":
            return None
        m = self.summary.get("metrics") or {}
        f = (self.fp32 or {}).get("metrics") or {}
        if name in ("speedup", "loss_gap"):
            return self.row.get(name)
        if name == "test_ppl":   # apex's main.py reports the test perplexity of its best-validation model
            for key in ("test_ppl_at_best_valid", "final_test_ppl"):
                if _num(m.get(key)) is not None:
                    return m[key]
            return math.exp(m["final_test_loss"]) if _num(m.get("final_test_loss")) is not None else None
        if name == "test_acc_pct":
            return 100 * m["final_test_acc"] if _num(m.get("final_test_acc")) is not None else None
        if name == "acc_change_vs_fp32":
            a, b = _num(m.get("final_test_acc")), _num(f.get("final_test_acc"))
            return None if a is None or b is None else 100 * (a - b)
        if name == "batch_gain":
            a, b = _num(m.get("max_batch_size")), _num(f.get("max_batch_size"))
            return None if a is None or not b else a / b
        return _num(m.get(name))


def _num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


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


def stats(values: list) -> dict | None:
    """Mean and spread (sample standard deviation, min, max) of the numbers among `values`; None if none."""
    xs = [float(v) for v in values if _num(v) is not None]
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


# ---------------------------------------------------------------------------------------------------- reading


def find_summaries(inputs: list[str]) -> list[Path]:
    """summary.json files under the given sweep/job folders, files or globs, each once, in a stable order."""
    if not inputs:
        raise ReportError("give at least one run folder (a sweep dir, a job dir, several, or a glob)")
    found = []
    for arg in inputs:
        p = Path(arg)
        if p.is_file():
            if p.name != SUMMARY:
                raise ReportError(f"{arg}: not a {SUMMARY} nor a folder of runs")
            found.append(p)
        elif p.is_dir():
            found += sorted(p.rglob(SUMMARY), key=_job_order)
        elif glob.has_magic(arg):
            hits = sorted(glob.glob(arg))
            if not hits:
                raise ReportError(f"{arg}: matches no file or folder")
            found += find_summaries(hits)
        else:
            raise ReportError(f"{arg}: no such file or folder")
    unique = list({p.resolve(): p for p in found}.values())
    if not unique:
        raise ReportError(f"no {SUMMARY} under {', '.join(inputs)}: run jobs first (python train.py ...)")
    return unique


def _job_order(path: Path) -> tuple:
    """Sweep jobs in job-number order (their folders start with it), others by name."""
    head = path.parent.name.split("_", 1)[0]
    return (str(path.parent.parent), int(head) if head.isdigit() else 10**9, path.parent.name)


def load_jobs(paths: list[Path]) -> tuple[list[Job], list[str]]:
    """The jobs, in the order of `paths`, and the summary files that could not be read."""
    jobs, problems = [], []
    for path in paths:
        try:
            jobs.append(Job(path.parent, read_summary(path)))
        except (ValueError, OSError) as e:
            problems.append(str(e))
    return jobs, problems


def by_experiment(jobs: list[Job]) -> dict[str, list[Job]]:
    """Jobs per experiment, each with its sweep_rows row, fp32 partner and variant label."""
    out: dict[str, list[Job]] = {}
    for j in jobs:
        out.setdefault(j.experiment, []).append(j)
    for exp_jobs in out.values():
        for j, row in zip(exp_jobs, sweep_rows([j.summary for j in exp_jobs])):
            j.row = row
        fp32 = {baseline_key(j.summary): j.summary for j in exp_jobs
                if j.precision == "fp32" and j.status == "completed"}
        described = [_describe(j.summary) for j in exp_jobs]
        keys = sorted({k for d in described for k in d})
        varying = _independent([k for k in keys if len({d.get(k) for d in described}) > 1], described)
        names: dict[str, str] = {}
        for j, d in zip(exp_jobs, described):
            j.fp32 = fp32.get(baseline_key(j.summary))
            j.variant_full = ",".join(f"{k}={d[k]}" for k in varying if k in d)
            if j.variant_full not in names:  # a long one (unlike sweeps read together) gets a short name
                short = sum(1 for v in names.values() if v.startswith("[v"))
                names[j.variant_full] = j.variant_full if len(j.variant_full) <= MAX_VARIANT else f"[v{short + 1}]"
            j.variant = names[j.variant_full]
    return out


def _independent(keys: list[str], described: list[dict]) -> list[str]:
    """Leave out a key whose value a finer key's value always implies (a case that sets its optimizer)."""
    n = {k: len({d.get(k) for d in described}) for k in keys}

    def implies(a: str, b: str) -> bool:
        seen: dict = {}
        return all(seen.setdefault(d.get(a), d.get(b)) == d.get(b) for d in described)

    return [k for k in keys if not any(n[k2] > n[k] and implies(k2, k) for k2 in keys)]


def _describe(summary: dict) -> dict:
    """What sets a job apart besides model, precision and seed: its other choices and value overrides."""
    choices = summary.get("choices") or {}
    d = {k: str(v) for k, v in choices.items() if v is not None and not k.startswith(_AXES)}
    for o in summary.get("overrides") or []:
        k, _, v = o.lstrip("+~").partition("=")
        if k not in choices and not k.startswith(_NOT_VARIANT):
            d[k] = v
    return d


def groups_of(jobs: list[Job]) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for j in jobs:
        key = (j.model, j.variant, j.precision)
        groups.setdefault(key, Group(*key, jobs=[])).jobs.append(j)
    models = list(dict.fromkeys((g.model, g.variant) for g in groups.values()))
    return sorted(groups.values(), key=lambda g: (models.index((g.model, g.variant)), plots.precision_key(g.precision)))


# ---------------------------------------------------------------------------------------------------- analysis


def compare(value: Published, groups: list[Group]) -> list[dict]:
    """One row per group with runs matching the published value; one 'missing' row where none match."""
    rows = []
    for g in groups:
        jobs = [j for j in g.jobs if matches(value.match, j.summary)]
        if not jobs:
            continue
        row = {"group": g.label, "precision": g.precision, "runs": len(jobs), "devices": _devices(jobs),
               "software": _software(jobs), "reproduced": None, "ratio": None, "difference": None, "verdict": None}
        if value.metric == "status":
            seen = [j.status for j in jobs]
            agree = seen.count(value.value)
            row["reproduced"] = {"statuses": seen}
            row["verdict"] = "agrees" if agree == len(seen) else ("differs" if agree == 0 else f"{agree}/{len(seen)} agree")
        else:
            st = stats([j.metric(value.metric) for j in jobs])
            row["reproduced"] = st
            if st is None:
                row["verdict"] = "no value (" + ", ".join(sorted({j.status for j in jobs})) + ")"
            elif value.compare == "difference":
                ref = sum(value.value) / 2 if isinstance(value.value, tuple) else value.value
                row["difference"] = st["mean"] - ref
            elif isinstance(value.value, tuple):
                lo, hi = value.value
                row["ratio"] = [st["mean"] / hi, st["mean"] / lo] if lo > 0 else None
                row["verdict"] = "within range" if lo <= st["mean"] <= hi else ("below" if st["mean"] < lo else "above")
            elif value.value:
                row["ratio"] = st["mean"] / value.value
        rows.append(row)
    return rows or [{"group": None, "verdict": "missing: no run yet", "reproduced": None, "ratio": None,
                     "difference": None, "runs": 0}]


def _env(job: Job) -> dict:
    return job.summary.get("env") or {}


def _devices(jobs: list[Job]) -> list[str]:
    out = []
    for j in jobs:
        e = _env(j)
        if e:
            cap = f", sm_{''.join(map(str, e['capability']))}" if e.get("capability") else ""
            out.append(f"{e.get('device_name')} ({e.get('device')}{cap})")
    return sorted(set(out))


def _software(jobs: list[Job]) -> list[str]:
    return sorted({f"torch {_env(j).get('torch')}, CUDA {_env(j).get('cuda')}, cuDNN {_env(j).get('cudnn')}"
                   for j in jobs if _env(j)})


def analyse(jobs: list[Job], sources: list[Source], problems: list[str], inputs: list[str]) -> dict:
    """Everything the report shows, as plain data (written as report.json; the renderers read only this)."""
    experiments = by_experiment(jobs)
    present = set(experiments)
    data = {"generated": time.strftime("%Y-%m-%d %H:%M:%S %z"), "inputs": [str(i) for i in inputs],
            "jobs": len(jobs), "problems": problems, "experiments": [], "sources_without_runs": []}
    for name, exp_jobs in experiments.items():
        groups = groups_of(exp_jobs)
        applicable = [s for s in sources if name in s.experiments]
        exp = {
            "name": name, "jobs": len(exp_jobs), "sources": [s.id for s in applicable],
            "env": _env_table(exp_jobs),
            "groups": [_group_data(g) for g in groups],
            "comparisons": [dict(_published_data(v, s), rows=compare(v, groups)) for s in applicable for v in s.values],
            "not_completed": [_problem_data(j) for j in exp_jobs if j.status != "completed"],
            "variants": {j.variant: j.variant_full for j in exp_jobs if j.variant != j.variant_full},
        }
        exp["_groups"] = groups  # for the plots; not serialised
        data["experiments"].append(exp)
    for s in sources:
        if not present & set(s.experiments):
            data["sources_without_runs"].append({"id": s.id, "title": s.title, "url": s.url,
                                                 "experiments": list(s.experiments),
                                                 "values": [_published_data(v, s) for v in s.values]})
    return data


def _group_data(g: Group) -> dict:
    statuses = [j.status for j in g.jobs]
    return {"model": g.model, "variant": g.variant, "precision": g.precision, "label": g.label,
            "runs": len(g.jobs), "statuses": {s: statuses.count(s) for s in dict.fromkeys(statuses)},
            "seeds": [j.seed for j in g.jobs], "dirs": [str(j.dir) for j in g.jobs],
            "metrics": {m: g.stats(m) for m in ("train_time_s", "speedup", "throughput", "final_test_acc",
                                                "best_test_acc", "time_to_target_s", "peak_memory_mb", "mfu",
                                                "loss_gap")},
            "fp8_emulated": any((j.summary.get("fp8") or {}).get("fp8_emulated") for j in g.jobs),
            "peak_memory_kind": sorted({(j.summary.get("metrics") or {}).get("peak_memory_kind") or "?"
                                        for j in g.jobs}),
            "devices": _devices(g.jobs), "software": _software(g.jobs)}


def _published_data(v: Published, s: Source) -> dict:
    return {"source": s.id, "source_title": s.title, "url": s.url, "id": v.id, "label": v.label,
            "metric": v.metric, "value": list(v.value) if isinstance(v.value, tuple) else v.value,
            "published": v.format_value(), "unit": v.unit, "hardware": v.hardware, "quote": v.quote,
            "match": v.match, "compare": v.compare}


def _problem_data(j: Job) -> dict:
    s = j.summary
    why = s.get("reason") or s.get("error") or "no reason recorded"
    return {"dir": str(j.dir), "job": (s.get("job") or {}).get("num"), "model": j.model, "precision": j.precision,
            "variant": j.variant, "seed": j.seed, "status": j.status, "reason": str(why).splitlines()[0],
            "step": (s.get("nonfinite") or {}).get("step")}


def _env_table(jobs: list[Job]) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for j in jobs:
        e = _env(j)
        if not e:
            continue   # failed before its environment was recorded (a config error)
        key = tuple(str(e.get(k)) for k in ("device_name", "capability", "torch", "cuda", "cudnn", "git_commit"))
        row = seen.setdefault(key, {"device": _devices([j])[0], "torch": e.get("torch"),
                                    "cuda": e.get("cuda"), "cudnn": e.get("cudnn"), "python": e.get("python"),
                                    "git_commit": (e.get("git_commit") or "")[:10] + ("+dirty" if e.get("git_dirty") else ""),
                                    "tf32": f"matmul {e.get('tf32_matmul')}, cudnn {e.get('tf32_cudnn')}", "jobs": 0})
        row["jobs"] += 1
    return list(seen.values())


# ---------------------------------------------------------------------------------------------------- plots


def make_plots(exp: dict, sources: list[Source], out: Path) -> list[dict]:
    """The experiment's figures as [{path, caption}]; a figure with nothing to show is left out."""
    groups: list[Group] = exp["_groups"]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", exp["name"])
    pdir = out / "plots"
    figs = []
    labels = list(dict.fromkeys(g.label for g in groups))
    precisions = sorted({g.precision for g in groups}, key=plots.precision_key)

    def series(metric: str, only=lambda p: True, labs=None) -> tuple[list[str], dict]:
        """(labels with a value, precision -> [(mean, std) or None per label])."""
        table = {(g.label, g.precision): g.stats(metric) for g in groups if only(g.precision)}
        if labs is None:
            labs = [lab for lab in labels if any(table.get((lab, p)) for p in precisions)]
        out_ = {p: [table.get((lab, p)) and (table[(lab, p)]["mean"], table[(lab, p)]["std"]) for lab in labs]
                for p in precisions if any(table.get((lab, p)) for lab in labs)}
        return labs, out_

    speed_labels, speed = series("speedup", only=lambda p: p != "fp32")
    if speed:
        published = []
        for c in exp["comparisons"]:
            if c["metric"] == "speedup":
                for r in c["rows"]:
                    if r["group"] in speed_labels and r["reproduced"] is not None:
                        value = tuple(c["value"]) if isinstance(c["value"], list) else c["value"]
                        published.append((speed_labels.index(r["group"]), r["precision"], value, c["label"]))
        figs.append({"path": plots.speedup_bars(pdir / f"{slug}_speedup.png",
                                                f"{exp['name']}: speed-up over fp32 (training time)",
                                                speed_labels, speed, published),
                     "caption": "Speed-up of each precision over fp32 (fp32 training time / its training time, "
                                "same other settings); error bars: standard deviation over seeds; diamonds: "
                                "published values for the same model and precision."})
    time_labels, times = series("train_time_s")
    _, mems = series("peak_memory_mb", labs=time_labels)
    if times:
        kinds = sorted({k for g in groups for k in _group_data(g)["peak_memory_kind"] if k != "?"})
        what = {"process_peak_rss": "process peak RSS: CPU run",
                "cuda_max_allocated": "max memory allocated by tensors on the GPU"}
        mem_kind = " / ".join(what.get(k, k) for k in kinds)
        figs.append({"path": plots.time_and_memory(pdir / f"{slug}_time_memory.png",
                                                   f"{exp['name']}: training time and peak memory",
                                                   time_labels, times, mems, mem_kind),
                     "caption": "Training time (eval excluded) and peak memory per model and precision, mean over "
                                "completed runs; error bars: standard deviation over seeds."})
    losses = _loss_curves(groups)
    if losses:
        figs.append({"path": plots.accuracy_curves(pdir / f"{slug}_train_loss.png", f"{exp['name']}: training loss",
                                                   losses, "training loss (mean over the logged window)", "step"),
                     "caption": "Training loss at each logged step (metrics.jsonl train rows), every run on one "
                                "plot: the gap between precisions at equal steps; mean over seeds."})
    curves = _curves(groups)
    if curves:
        key, ylabel = curves[0]["key"], curves[0]["ylabel"]
        figs.append({"path": plots.accuracy_curves(pdir / f"{slug}_curves.png",
                                                   f"{exp['name']}: {ylabel.split(' (')[0]} per epoch", curves, ylabel),
                     "caption": f"{ylabel} after each epoch (metrics.jsonl `{key}`), mean over seeds."})
    ladder = _ladder(exp, sources, groups)
    if ladder:
        figs.append({"path": plots.ladder(pdir / f"{slug}_ladder.png", f"{exp['name']}: training time per step",
                                          *ladder),
                     "caption": "Training time per ladder step: the article's staircase against the reproduced one "
                                "(Page's times are each step's whole fixed schedule, eval excluded, with a mean final "
                                "accuracy of the target over his runs; ours: the same time, mean over seeds; the "
                                "ladder table gives the fraction of runs that reached the target)."})
    traces = _loss_scale_traces(groups)
    if traces:
        figs.append({"path": plots.loss_scale(pdir / f"{slug}_loss_scale.png", f"{exp['name']}: loss scale", traces),
                     "caption": "Loss scale at each logged step (metrics.jsonl train rows); a drop is a step "
                                "skipped for non-finite gradients."})
    return [{"path": str(f["path"]), "caption": f["caption"]} for f in figs]


def _curves(groups: list[Group]) -> list[dict]:
    rows = {g.label + g.precision: [r for j in g.jobs for r in j.rows() if r.get("kind") == "epoch"] for g in groups}
    any_acc = any(_num(r.get("test_acc")) is not None for rs in rows.values() for r in rs)
    key, scale, ylabel = ("test_acc", 100.0, "test accuracy (%)") if any_acc else ("test_ppl", 1.0, "test perplexity")
    curves = _mean_curves(groups, lambda r: (r["epoch"], scale * r[key]) if r.get("kind") == "epoch"
                          and _num(r.get(key)) is not None else None)
    return [dict(c, key=key, ylabel=ylabel) for c in curves]


def _loss_curves(groups: list[Group]) -> list[dict]:
    """Training loss per logged step: language-model experiments only (their train rows carry a perplexity),
    where the loss is the comparison between precisions."""
    return _mean_curves(groups, lambda r: (r["step"], r["loss"]) if r.get("kind") == "train" and "ppl" in r
                        and _num(r.get("loss")) is not None else None)


def _mean_curves(groups: list[Group], point) -> list[dict]:
    """Per group, the mean, min and max over its jobs of the metrics.jsonl rows' points (x, y) = point(row)
    (None: not a point), by x."""
    curves = []
    for g in groups:
        per_x: dict = {}
        for j in g.jobs:
            for r in j.rows():
                xy = point(r)
                if xy is not None:
                    per_x.setdefault(xy[0], []).append(xy[1])
        if per_x:
            xs = sorted(per_x)
            curves.append({"label": f"{g.label}, {g.precision}", "model": g.label, "precision": g.precision,
                           "epochs": xs, "mean": [statistics.fmean(per_x[x]) for x in xs],
                           "lo": [min(per_x[x]) for x in xs], "hi": [max(per_x[x]) for x in xs], "n": len(g.jobs)})
    return curves


# the published values that draw a ladder staircase: Page's fixed-schedule training times (train_time_s), or times to
# a target accuracy
LADDER_METRICS = ("train_time_s", "time_to_target_s")


def _ladder(exp: dict, sources: list[Source], groups: list[Group]):
    steps = [v for s in sources if s.id in exp["sources"] for v in s.values if v.metric in LADDER_METRICS]
    hit = [[j for g in groups for j in g.jobs if matches(v.match, j.summary)] for v in steps]
    if not steps or not any(hit):
        return None
    precisions = sorted({j.precision for js in hit for j in js}, key=plots.precision_key)
    reproduced = {}
    for p in precisions:
        vals = [stats([j.metric(v.metric) for j in js if j.precision == p]) for v, js in zip(steps, hit)]
        reproduced[p] = [None if st is None else (st["mean"], st["std"]) for st in vals]
    targets = {(j.summary.get("metrics") or {}).get("target_acc") for js in hit for j in js} - {None}
    target = f"{100 * targets.pop():g}% test accuracy" if len(targets) == 1 else "the target accuracy"
    return [v.label for v in steps], [v.value for v in steps], reproduced, target


def _loss_scale_traces(groups: list[Group], limit: int = 12) -> list[dict]:
    traces = []
    for g in groups:
        for j in g.jobs:
            pts = [(r["step"], r["loss_scale"]) for r in j.rows()
                   if r.get("kind") == "train" and _num(r.get("loss_scale")) and r["loss_scale"] > 0]
            if pts:
                seed = f", seed {j.seed}" if len(g.jobs) > 1 else ""
                traces.append({"label": f"{g.label}, {g.precision}{seed}", "precision": g.precision,
                               "steps": [p[0] for p in pts], "scales": [p[1] for p in pts]})
    return traces[:limit]


# ---------------------------------------------------------------------------------------------------- document


def _f(st: dict | None, spec: str = ".3g", scale: float = 1.0, unit: str = "", of: int = 0) -> str:
    """`mean ± std unit (n=k)`; `of`: how many runs could have had a value (says when some had none)."""
    if st is None:
        return "-"
    s = format(scale * st["mean"], spec)
    if st["n"] > 1:
        s += f" ± {format(scale * st['std'], spec)}"
    s += f" {unit}" if unit else ""
    if of > st["n"]:
        s += f" (n={st['n']} of {of})"
    elif st["n"] > 1:
        s += f" (n={st['n']})"
    return s


def _ratio(r: dict) -> str:
    if r.get("difference") is not None:
        return f"{r['difference']:+.3g} (difference)"
    if isinstance(r.get("ratio"), list):
        return f"{r['ratio'][0]:.2f}-{r['ratio'][1]:.2f}"
    if r.get("ratio") is not None:
        return f"{r['ratio']:.2f}"
    return "-"


def _reproduced(c: dict, r: dict) -> str:
    rep = r.get("reproduced")
    if rep is None:
        return "-"
    if "statuses" in rep:
        seen = rep["statuses"]
        return ", ".join(f"{s} ({seen.count(s)}/{len(seen)})" for s in dict.fromkeys(seen))
    return _f(rep, unit=c["unit"], of=r["runs"])


class Doc:
    """Blocks (heading, paragraph, table, image, list) rendered to Markdown and to self-contained HTML."""

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
                out.append("\n".join(["| " + " | ".join(map(cell, b[1])) + " |", "|" + "---|" * len(b[1])]
                                     + ["| " + " | ".join(map(cell, r)) + " |" for r in b[2]]))
            elif b[0] == "img":
                out.append(f"![{b[2]}]({os.path.relpath(b[1], base) if base else b[1]})\n\n*{b[2]}*")
            elif b[0] == "ul":
                out.append("\n".join(f"- {i}" for i in b[1]))
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        e = html.escape
        out = [f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{e(title)}</title><style>"
               "body{font-family:system-ui,sans-serif;max-width:1250px;margin:auto;padding:1em;color:#222}"
               "table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;"
               "padding:3px 7px;text-align:left;vertical-align:top}th{background:#f2f2f2}"
               "figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}figcaption{font-size:13px;color:#555}"
               "</style></head><body>"]
        for b in self.blocks:
            if b[0] == "h":
                out.append(f"<h{b[1]}>{_inline(b[2])}</h{b[1]}>")
            elif b[0] == "p":
                out.append(f"<p>{_inline(b[1])}</p>")
            elif b[0] == "table":
                out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in b[1]) + "</tr>"
                           + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in b[2])
                           + "</table>")
            elif b[0] == "img":
                data = base64.b64encode(Path(b[1]).read_bytes()).decode("ascii")
                out.append(f"<figure><img alt=\"{e(b[2])}\" src=\"data:image/png;base64,{data}\">"
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
    d = Doc()
    d.h(1, "mixprec reproduction report")
    d.p(f"Generated {data['generated']} from {data['jobs']} job(s) under: " + ", ".join(f"`{i}`" for i in data["inputs"])
        + ". Numbers are read from each job's summary.json and metrics.jsonl. Speed-up = fp32 training time / "
          "the job's training time, against the fp32 job with the same other settings (and seed); "
          "`a ± b (n=k)` is the mean and sample standard deviation over k seeds. Ratio = reproduced / published.")
    if data.get("reference"):
        reference.document(d, data["reference"])
    if data["problems"]:
        d.p("Unreadable records (left out):")
        d.bullets(data["problems"])
    for exp in data["experiments"]:
        d.h(2, f"Experiment `{exp['name']}` ({exp['jobs']} jobs)")
        d.p("Published sources: " + (", ".join(exp["sources"]) if exp["sources"] else
                                      "none lists this experiment; reproduced numbers only."))
        d.h(3, "Hardware and software")
        d.table(["device", "torch", "CUDA", "cuDNN", "python", "TF32", "git commit", "jobs"],
                [[r["device"], r["torch"], r["cuda"], r["cudnn"], r["python"], r["tf32"], r["git_commit"], r["jobs"]]
                 for r in exp["env"]])
        unrecorded = exp["jobs"] - sum(r["jobs"] for r in exp["env"])
        if unrecorded:
            d.p(f"{unrecorded} job(s) failed before recording their environment (see below).")
        d.h(3, "Runs")
        gs = exp["groups"]
        ttt = any(g["metrics"]["time_to_target_s"] for g in gs)
        lm = any(g["metrics"]["loss_gap"] or g["metrics"]["mfu"] for g in gs)   # language models: MFU, loss gap
        heads = ["model", "precision", "runs", "train time (s)", "speed-up vs fp32 (x)", "tokens/s" if lm else "samples/s",
                 "test acc (%)"] + (["time to target (s)"] if ttt else []) + ["peak memory (MB)"] + (
                ["MFU (%)", "valid loss - fp32's, same steps"] if lm else [])
        rows = []
        for g in gs:
            runs = ", ".join(f"{n} {s}" for s, n in g["statuses"].items())
            if len(g["seeds"]) > 1:
                runs += " (seeds " + ",".join(str(s) for s in g["seeds"]) + ")"
            m = g["metrics"]
            done = g["statuses"].get("completed", 0)
            precision = g["precision"] + (" (emulated: not an FP8 time)" if g["fp8_emulated"] else "")
            rows.append([g["label"], precision, runs, _f(m["train_time_s"], ".3f"), _f(m["speedup"], ".2f"),
                         _f(m["throughput"], ".1f"), _f(m["final_test_acc"], ".2f", 100)]
                        + ([_f(m["time_to_target_s"], ".3g", of=done)] if ttt else []) + [_f(m["peak_memory_mb"], ".0f")]
                        + ([_f(m["mfu"], ".3g", 100), _f(m["loss_gap"], "+.3g")] if lm else []))
        d.table(heads, rows)
        if exp["variants"]:
            d.p("Variants (what else differs between these jobs): "
                + "; ".join(f"{k} = `{v}`" for k, v in exp["variants"].items()))
        if exp["comparisons"]:
            d.h(3, "Reproduced against published")
            rows = []
            for c in exp["comparisons"]:
                for r in c["rows"]:
                    rows.append([c["source"], c["label"], c["published"], c["hardware"],
                                 r["group"] and f"{r['group']}, {r['precision']}" or "-",
                                 r["verdict"] if r["group"] is None else _reproduced(c, r),
                                 "; ".join(x for x in (_ratio(r), r["group"] and r.get("verdict")) if x and x != "-") or "-",
                                 "; ".join(r.get("devices") or []) or "-", "; ".join(r.get("software") or []) or "-"])
            d.table(["source", "value", "published", "published on", "our runs", "reproduced", "ratio / verdict",
                     "our device", "our software"], rows)
            missing = sum(1 for c in exp["comparisons"] for r in c["rows"] if r["group"] is None)
            if missing:
                d.p(f"{missing} published value(s) have no matching run yet (\"missing\" above): the runs they "
                    "need are named by each value's `match` in src/mixprec/published/<source>.yaml.")
            d.p("Where each published value comes from:")
            d.bullets([f"{c['source']} / {c['label']}: \"{c['quote']}\" ({c['source_title']}"
                       + (f", {c['url']}" if c["url"] else "") + ")" for c in exp["comparisons"]])
            used = sorted({c["metric"] for c in exp["comparisons"]} & set(DERIVED))
            if used:   # e.g. test_ppl: the best-validation model's test perplexity, as apex's main.py reports it
                d.p("How the reproduced values are read: " + "; ".join(f"`{m}`: {DERIVED[m]}" for m in used) + ".")
        if exp["not_completed"]:
            d.h(3, "Runs that diverged or failed")
            d.table(["job", "model", "precision", "seed", "status", "reason", "non-finite at step"],
                    [[p["job"] if p["job"] is not None else Path(p["dir"]).name, f"{p['model']} {p['variant']}".strip(),
                      p["precision"], p["seed"], p["status"], p["reason"], p["step"] if p["step"] is not None else "-"]
                     for p in exp["not_completed"]])
        for fig in exp.get("plots", []):
            d.image(fig["path"], fig["caption"])
    if data["sources_without_runs"]:
        d.h(2, "Published numbers with no runs yet")
        d.p("No job of these sources' experiments is among the inputs: every value below is missing.")
        for s in data["sources_without_runs"]:
            d.h(3, f"{s['id']}: {s['title']} (experiments: {', '.join(s['experiments'])})")
            d.table(["value", "published", "published on", "compared with runs of", "source"],
                    [[v["label"], v["published"], v["hardware"], ", ".join(f"{k}={v2}" for k, v2 in v["match"].items()),
                      v["quote"]] for v in s["values"]])
    return d


# ---------------------------------------------------------------------------------------------------- entry


def default_out(inputs: list[str]) -> Path:
    return Path(inputs[0]) / "report" if len(inputs) == 1 and Path(inputs[0]).is_dir() else Path("outputs/report")


def make_report(inputs: list[str], out: Path | None = None, published: Path | None = None) -> dict:
    """Read the jobs under `inputs`, write report.md, report.html (plots embedded), report.json and plots/*.png
    into `out`, and return the report's data (with "out" and the paths written)."""
    inputs = [str(i) for i in inputs]
    jobs, problems = load_jobs(find_summaries(reference.job_inputs(inputs)))
    if not jobs:
        raise ReportError("no readable summary.json: " + "; ".join(problems))
    sources = load_sources(published)
    data = analyse(jobs, sources, problems, inputs)
    data["reference"] = reference.section(inputs, sources)   # results folders side by side (scripts/reproduce.py)
    out = Path(out or default_out(inputs))
    out.mkdir(parents=True, exist_ok=True)
    for exp in data["experiments"]:
        exp["plots"] = make_plots(exp, sources, out) + probe_plots.numerics_figures(   # jobs run with probe=ranges
            [(j.dir, f"{g.label}, {j.precision}") for g in exp["_groups"] for j in g.jobs], out / "plots")
    written = {Path(f["path"]).resolve() for exp in data["experiments"] for f in exp["plots"]}
    for old in (out / "plots").glob("*.png"):
        if old.resolve() not in written:
            old.unlink()   # a figure of an earlier report of this folder that this one no longer has
    doc = document(data)
    _write_text(out / "report.md", doc.markdown(out))
    _write_text(out / "report.html", doc.html("mixprec reproduction report"))
    for exp in data["experiments"]:
        exp.pop("_groups", None)
    write_json_atomic(out / "report.json", data)
    data["out"] = str(out)
    data["_jobs"] = jobs
    return data


def _write_text(path: Path, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)
