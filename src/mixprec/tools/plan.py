"""The reproduction plan (plan.yaml beside this file): load it, predict each sweep's minutes from a
calibration, cut it to a time budget, and render it as a table. scripts/reproduce.py runs it.

A sweep's jobs are the cartesian product of its `grid`; each job's time is predicted as
    overhead + steps x seconds per step + evaluations x seconds per evaluation
with seconds per step from the calibration's steady throughput (warm-up steps excluded), steps from
the job's epochs and the real split's size (plan `datasets`), evaluation time scaled from the
stand-in's test split.
"""
from __future__ import annotations

import datetime
import itertools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from .. import records

PLAN_FILE = Path(__file__).parent / "plan.yaml"
CUT_KINDS = ("epochs", "max_steps", "grid")


class PlanError(ValueError):
    """A plan file that is not as described in plan.yaml's header; the message names the field."""


@dataclass(frozen=True)
class Sweep:
    article: str
    name: str
    command: str                      # train | max_batch
    overrides: tuple
    grid: dict                        # key -> tuple of values, in command-line order
    cuts: tuple                       # ({"epochs": 1}, {"grid": {...}}, "drop", ...)
    stand_in: tuple = ()
    smoke: tuple = ()
    dataset: str | None = None
    predicted_s: float | None = None  # a fixed estimate (max_batch)
    applied: tuple = ()               # the cuts applied, as said in the plan table
    dropped: bool = False

    @property
    def jobs(self) -> list[dict]:
        keys = list(self.grid)
        return [dict(zip(keys, vals)) for vals in itertools.product(*(self.grid[k] for k in keys))]

    def grid_overrides(self) -> list[str]:
        return [f"{k}={','.join(map(str, v))}" for k, v in self.grid.items()]


@dataclass(frozen=True)
class Article:
    id: str
    title: str
    sweeps: tuple
    not_reproduced: dict = field(default_factory=dict)
    measured: str = ""
    stand_ins: dict = field(default_factory=dict)   # published value id -> {match: {...}, why: str}


@dataclass(frozen=True)
class Plan:
    articles: tuple
    datasets: dict
    calibration: dict
    smoke_common: tuple
    path: Path

    @property
    def sweeps(self) -> list[Sweep]:
        return [s for a in self.articles for s in a.sweeps]

    def only(self, names: list[str]) -> "Plan":
        """The articles named (article ids or sweep names); a name that is neither is an error."""
        known = {a.id for a in self.articles} | {s.name for s in self.sweeps}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise PlanError(f"--only {','.join(unknown)}: not an article or sweep of the plan; "
                            f"known: {', '.join(sorted(known))}")
        arts = []
        for a in self.articles:
            if a.id in names:
                arts.append(a)
            elif any(s.name in names for s in a.sweeps):
                arts.append(replace(a, sweeps=tuple(s for s in a.sweeps if s.name in names)))
        return replace(self, articles=tuple(arts))

    def smoked(self) -> "Plan":
        """The same plan with every sweep's smoke overrides: a grid key given there (key=a,b)
        narrows the grid."""
        arts = []
        for a in self.articles:
            sweeps = []
            for s in a.sweeps:
                grid, extra, said = dict(s.grid), [], []
                for o in s.smoke:
                    key, _, val = o.partition("=")
                    if key in grid:
                        new = tuple(v for v in val.split(",") if v)
                        said.append(f"smoke: {key} {len(grid[key])}->{len(new)} ({','.join(new)})")
                        grid[key] = new
                    else:
                        extra.append(o)
                sweeps.append(replace(s, grid=grid, smoke=tuple(extra), applied=tuple(said)))
            arts.append(replace(a, sweeps=tuple(sweeps)))
        return replace(self, articles=tuple(arts))


def _flat(x) -> tuple:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(y for e in x for y in _flat(e))
    return (str(x),)


def load_plan(path: Path | None = None) -> Plan:
    path = Path(path or PLAN_FILE)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PlanError(f"{path}: cannot read the plan ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("articles"), list):
        raise PlanError(f"{path}: expected a mapping with `articles: [...]`")
    articles, names = [], set()
    for i, a in enumerate(data["articles"]):
        where = f"{path}: articles[{i}]"
        if not isinstance(a, dict) or not a.get("id") or not isinstance(a.get("sweeps"), list):
            raise PlanError(f"{where}: needs id and sweeps")
        sweeps = []
        for j, s in enumerate(a["sweeps"]):
            sweeps.append(_sweep(a["id"], s, f"{where}.sweeps[{j}]"))
            if sweeps[-1].name in names:
                raise PlanError(f"{where}.sweeps[{j}].name: {sweeps[-1].name!r} used twice")
            names.add(sweeps[-1].name)
        articles.append(Article(str(a["id"]), str(a.get("title", a["id"])), tuple(sweeps),
                                dict(a.get("not_reproduced") or {}), str(a.get("measured", "")),
                                _stand_ins(a.get("stand_ins"), f"{where}.stand_ins")))
    cal = {"warmup_steps": 2, "timed_steps": 3, **(data.get("calibration") or {})}
    return Plan(
        tuple(articles),
        dict(data.get("datasets") or {}),
        cal,
        _flat(data.get("smoke_common")),
        path,
    )


def _stand_ins(data, where: str) -> dict:
    """A published value compared with other runs than its own `match` (a smaller model, other
    data), and why."""
    data = data or {}
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("match"), dict) and v.get("why")
        for v in data.values()
    ):
        raise PlanError(
            f"{where}: a mapping of published value id -> {{match: {{key: value}}, why: text}}"
        )
    return {str(k): {"match": dict(v["match"]), "why": str(v["why"])} for k, v in data.items()}


def _sweep(article: str, s: dict, where: str) -> Sweep:
    if (
        not isinstance(s, dict)
        or not s.get("name")
        or s.get("command") not in ("train", "max_batch")
    ):
        raise PlanError(f"{where}: needs a name and command: train or max_batch")
    grid = s.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise PlanError(f"{where}.grid: a mapping of key -> non-empty list of values")
    cuts = []
    for c in s.get("cuts") or []:
        if c == "drop":
            cuts.append("drop")
        elif isinstance(c, dict) and len(c) == 1 and next(iter(c)) in CUT_KINDS:
            kind, val = next(iter(c.items()))
            if kind == "grid":
                if not isinstance(val, dict) or any(
                    k not in grid or not set(map(str, v)) <= set(map(str, grid[k]))
                    for k, v in val.items()
                ):
                    raise PlanError(
                        f"{where}.cuts: {c}: a grid cut keeps a subset of the grid's own values"
                    )
                val = {k: tuple(map(str, v)) for k, v in val.items()}
            elif not isinstance(val, int) or val < 1:
                raise PlanError(f"{where}.cuts: {c}: {kind} must be a positive integer")
            cuts.append({kind: val})
        else:
            raise PlanError(f"{where}.cuts: {c!r}; a cut is drop, or one of {', '.join(CUT_KINDS)}")
    return Sweep(
        article=article,
        name=str(s["name"]),
        command=s["command"],
        overrides=_flat(s.get("overrides")),
        grid={k: tuple(map(str, v)) for k, v in grid.items()},
        cuts=tuple(cuts),
        stand_in=_flat(s.get("stand_in")),
        smoke=_flat(s.get("smoke")),
        dataset=s.get("dataset"),
        predicted_s=s.get("predicted_s"),
    )


# ----------------------------------------------------------------------------------------- commands


def merge_overrides(*groups) -> list[str]:
    """Overrides in order, a later value of the same key replacing an earlier one (in the earlier
    one's place)."""
    out: dict[str, str] = {}
    for o in (o for g in groups for o in g):
        out[o.lstrip("+~").partition("=")[0]] = o
    return list(out.values())


def override_keys(overrides: list[str]) -> list[str]:
    return [o.lstrip("+~").partition("=")[0] for o in overrides]


# --------------------------------------------------------------------------------------- prediction


@dataclass
class JobCost:
    """A job's calibrated cost: seconds per training step, per evaluation pass, and fixed per
    job."""
    step_s: float
    eval_s: float
    overhead_s: float


def steps_per_epoch(config: dict, datasets: dict) -> int:
    """Training steps in one epoch of the job's data: the real split's size (plan `datasets`) or the
    synthetic set's own; a text corpus is cut into batch columns walked in bptt windows."""
    ds, tr = config["dataset"], config["trainer"]
    n = (datasets.get(ds["name"]) or {}).get("train") or ds.get("train_size") or 1
    if ds["name"] in ("wikitext2", "synthetic_text"):
        return max(1, math.ceil((n // tr["batch_size"] - 1) / ds.get("bptt", 35)))
    return max(1, n // tr["batch_size"])


def test_size(config: dict, datasets: dict) -> int:
    ds = config["dataset"]
    return (datasets.get(ds["name"]) or {}).get("test") or ds.get("test_size") or 1


def samples_per_step(config: dict) -> int:
    """What the job's throughput counts per step: images, or tokens (batch x bptt) for a language
    model."""
    ds, tr = config["dataset"], config["trainer"]
    return tr["batch_size"] * (
        ds.get("bptt", 35) if ds["name"] in ("wikitext2", "synthetic_text") else 1
    )


def job_wall_s(summary: dict) -> float | None:
    """A job's wall time from its summary's started/finished stamps (one-second resolution)."""
    try:
        f = lambda k: datetime.datetime.strptime(summary[k], "%Y-%m-%dT%H:%M:%S%z")  # noqa: E731
        return (f("finished") - f("started")).total_seconds()
    except (KeyError, TypeError, ValueError):
        return None


def cost_from_summary(summary: dict) -> JobCost | None:
    """A calibration job's cost: None unless it ran with a steady (warm-up excluded) throughput."""
    m, cfg = records.metrics(summary), records.config(summary)
    if not m.get("throughput") or m.get("throughput_includes_warmup"):
        return None
    step_s = samples_per_step(cfg) / m["throughput"]
    steps, spe = m.get("steps") or 1, m.get("steps_per_epoch") or 1
    evals = max(1, math.ceil(steps / spe))
    eval_s = (m.get("eval_time_s") or 0.0) / evals / max(1, test_size(cfg, {}))   # per test sample
    busy = (m.get("train_time_s") or 0.0) + (m.get("eval_time_s") or 0.0)
    # building the model and data, writing records
    overhead = max(0.0, (job_wall_s(summary) or busy) - busy)
    return JobCost(step_s=step_s, eval_s=eval_s, overhead_s=overhead)


def untimed_reason(summary: dict) -> str:
    """Why a calibration job gave no cost (cost_from_summary is None), in a few words: "diverged at
    step 1", "too few steps (2, all warm-up)", "failed: <its error>"..."""
    status, m = records.status(summary), records.metrics(summary)
    if status == "diverged":
        return f"diverged at step {(summary.get('nonfinite') or {}).get('step', '?')}"
    if status in ("failed", "interrupted", "killed"):
        why = (records.reason(summary).splitlines() or [""])[0]
        return f"{status}: {why}" if why else status
    if m.get("throughput_includes_warmup"):
        return (f"too few steps ({m.get('steps')}, with {m.get('warmup_steps')} of warm-up: no "
                "steady step to time)")
    return f"no throughput recorded (status {status})"


def predict_job(config: dict, cost: JobCost, datasets: dict) -> float:
    """Seconds for one job of this config (the run's own epochs and max_steps) at the calibrated
    cost."""
    spe = steps_per_epoch(config, datasets)
    tr = config["trainer"]
    steps = (
        tr["epochs"] * spe
        if tr.get("max_steps") is None
        else min(tr["epochs"] * spe, tr["max_steps"])
    )
    evals = math.ceil(steps / spe)
    return cost.overhead_s + steps * cost.step_s + evals * cost.eval_s * test_size(config, datasets)


def mean_cost(costs: list[JobCost]) -> JobCost | None:
    """The cost of a job of the sweep that was not calibrated itself: the mean of those that
    were."""
    if not costs:
        return None
    n = len(costs)
    return JobCost(sum(c.step_s for c in costs) / n, sum(c.eval_s for c in costs) / n,
                   sum(c.overhead_s for c in costs) / n)


# ------------------------------------------------------------------------------------------ cutting


def apply_cut(sweep: Sweep, cut, configs: list[dict]) -> Sweep | None:
    """The sweep with one more cut, or None when the cut changes nothing (epochs already at most
    that)."""
    if cut == "drop":
        return replace(sweep, dropped=True, applied=sweep.applied + ("dropped",))
    kind, val = next(iter(cut.items()))
    if kind == "grid":
        grid, said = dict(sweep.grid), []
        for k, keep in val.items():
            new = tuple(v for v in grid[k] if v in keep)
            if new and new != grid[k]:
                said.append(f"{k} {len(grid[k])}->{len(new)} ({','.join(new)})")
                grid[k] = new
        return replace(sweep, grid=grid, applied=sweep.applied + tuple(said)) if said else None
    key = "epochs" if kind == "epochs" else "max_steps"
    now = [c["trainer"][key] for c in configs]
    if all(n is not None and n <= val for n in now):
        return None
    was = "/".join(sorted({str(n) for n in now}, key=lambda x: (len(x), x)))
    said = f"epochs {was}->{val}" if kind == "epochs" else f"steps <= {val}"
    over = f"trainer.{key}={val}"
    return replace(
        sweep,
        overrides=tuple(merge_overrides(sweep.overrides, [over])),
        applied=sweep.applied + (said,),
    )


def fit(sweeps: list, predict, budget_s: float | None) -> list:
    """Cut the plan until its predicted seconds fit `budget_s`: the sweep predicted longest takes
    its next cut (in plan order), a sweep is dropped only when no sweep has another kind of cut
    left; until the total fits or no cut is left. predict(sweep) -> (seconds, job configs)."""
    sweeps = list(sweeps)
    if budget_s is None:
        return sweeps
    next_cut = [0] * len(sweeps)
    while True:
        times = [0.0 if s.dropped else predict(s)[0] for s in sweeps]
        if sum(times) <= budget_s:
            return sweeps
        order = sorted(
            (i for i, s in enumerate(sweeps) if not s.dropped and next_cut[i] < len(s.cuts)),
            # drops come last
            key=lambda i: (sweeps[i].cuts[next_cut[i]] == "drop", -times[i]),
        )
        if not order:
            return sweeps
        i = order[0]
        while next_cut[i] < len(sweeps[i].cuts):
            cut = sweeps[i].cuts[next_cut[i]]
            next_cut[i] += 1
            new = apply_cut(sweeps[i], cut, predict(sweeps[i])[1])
            if new is not None:
                sweeps[i] = new
                break


# --------------------------------------------------------------------------------------------- text


def parse_duration(text: str) -> float:
    """'60m', '1h30m', '90s', '2h', '45' (minutes) -> seconds."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t) * 60
    parts = re.fullmatch(
        r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?:in)?)?(?:(\d+(?:\.\d+)?)s)?", t
    )
    if not t or not parts or not any(parts.groups()):
        raise PlanError(f"--budget {text!r}: not a duration; write e.g. 60m, 1h30m, 90s")
    h, m, s = (float(g or 0) for g in parts.groups())
    return h * 3600 + m * 60 + s


def minutes(seconds: float | None, lower_bound: bool = False) -> str:
    if seconds is None:
        return "?"
    return (">= " if lower_bound else "") + (
        f"{seconds / 60:.1f}" if seconds < 6000 else f"{seconds / 60:.0f}"
    )


def table(headers: list[str], rows: list[list]) -> str:
    """A plain aligned text table (the plan as printed)."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(headers: list[str], rows: list[list]) -> str:
    cell = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows])


def full_command(s: Sweep) -> str:
    """The sweep's command at full fidelity, as a user would type it."""
    words = [*s.overrides, *(f"{k}={','.join(v)}" for k, v in s.grid.items())]
    return (
        "python scripts/max_batch.py " if s.command == "max_batch" else "python train.py -m "
    ) + " ".join(words)


def readme_table(plan: Plan) -> str:
    """The README's reproductions table: per article, what it measured and its sweeps' full-fidelity
    commands."""
    rows = [
        [a.title, a.measured, "<br>".join(f"`{full_command(s)}`" for s in a.sweeps)]
        for a in plan.articles
    ]
    return markdown_table(["article", "what it measured", "commands (full fidelity)"], rows)
