"""--estimate of scripts/reproduce.py: the plan's minutes on named GPU profiles from FLOPs, running
no job (a rough figure, not a measurement: a GPU's --plan replaces it), and with --budget what the
plan's cuts would make of it on each profile."""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from ..config import ModelConfig, validate
from .folder import ROOT
from .plan import PlanError, fit, merge_overrides, minutes, parse_duration, steps_per_epoch, table
from .state import REPORT_S
from .sweeps import compose, job_configs

MFU = 0.3   # the model FLOP utilisation assumed by --estimate (small CIFAR models often reach less)


@lru_cache(maxsize=None)
def _flops(model_json: str, num_classes: int, image_size: int | None) -> float:
    """Forward FLOPs per sample (image) or per token (language model) of the model config."""
    # lazy: torch (which these import) is slow to import; only --estimate needs it
    import torch
    from ..models import build_model, forward_flops

    fields = json.loads(model_json)
    # FLOPs do not depend on the weights: no ImageNet download to count them
    if "pretrained" in fields:
        fields.update(pretrained=False, freeze_body=False)
    model = build_model(ModelConfig(**fields), num_classes)
    if image_size is None:
        return float(model.flops_per_token())
    return forward_flops(model, torch.zeros(1, 3, image_size, image_size)) or 0.0


def flop_seconds(plan, args, sweep, peaks: dict) -> dict:
    """Seconds of one sweep on each profile of `peaks` from FLOPs at MFU of the profile's dense peak
    for the job's precision; a cut sweep's too (fewer epochs, a max_steps, a smaller grid; dropped:
    0). Training and evaluation FLOPs only."""
    from ..precision.modes import peak_kind   # lazy: torch, as _flops

    secs = {p: 0.0 for p in peaks}
    if sweep.dropped:
        return secs
    if sweep.command != "train":
        return {p: float(sweep.predicted_s or 0) for p in peaks}
    for job in sweep.jobs:
        plain = compose(tuple(merge_overrides(sweep.overrides, args.overrides,
                                              [f"{k}={v}" for k, v in job.items()])))
        c = validate(OmegaConf.create(plain))
        text = c.dataset.name in ("wikitext2", "synthetic_text")
        sizes = plan.datasets.get(c.dataset.name) or {
            "train": c.dataset.train_size,
            "test": c.dataset.test_size,
        }
        f = _flops(
            json.dumps(c.model.__dict__, default=list),
            33278 if text else c.dataset.num_classes,
            None if text else c.dataset.image_size,
        )
        # a max_steps cut trains part of the epochs, each begun one evaluated
        epochs = c.trainer.epochs if c.trainer.max_steps is None else min(
            c.trainer.epochs, c.trainer.max_steps / steps_per_epoch(plain, plan.datasets))
        work = epochs * sizes["train"] * 3 * f + math.ceil(epochs) * sizes["test"] * f
        for p in peaks:
            peak = peaks[p].get(peak_kind(c.precision)) or peaks[p]["fp32"]
            secs[p] += work / (peak * 1e12 * MFU)
    return secs


class FlopPredict:
    """plan.fit's predict(sweep) from FLOPs on one GPU profile: (seconds, job configs, "estimate"),
    kept per sweep state (fit asks again for each cut it weighs)."""

    def __init__(self, plan, args, peaks: dict, profile: str):
        self.plan, self.args, self.peaks, self.profile, self.seen = plan, args, peaks, profile, {}

    def __call__(self, sweep):
        key = (sweep.name, sweep.overrides, tuple(sweep.grid.items()), sweep.dropped)
        if key not in self.seen:
            configs = job_configs(self.plan, sweep, self.args) if sweep.command == "train" else []
            self.seen[key] = (flop_seconds(self.plan, self.args, sweep, self.peaks)[self.profile],
                              configs, "estimate")
        return self.seen[key]


def estimate_cuts(plan, args, peaks: dict, profile: str, budget_s: float) -> str:
    """What --budget would cut where on `profile`, by the FLOP estimate: the plan's cuts applied as
    a --plan applies them to its calibrated minutes (plan.fit), the report's minute kept aside."""
    predict = FlopPredict(plan, args, peaks, profile)
    full = sum(predict(s)[0] for s in plan.sweeps)
    cut = fit(plan.sweeps, predict, budget_s - REPORT_S)
    rows = [[s.article, s.name, 0 if s.dropped else len(s.jobs), minutes(predict(s)[0]),
             "; ".join(s.applied) or "none (full fidelity)"] for s in cut]
    total = sum(predict(s)[0] for s in cut)
    over = total > budget_s - REPORT_S
    return (
        f"\n--budget {args.budget} on {profile}: {total / 60:.1f} min after cuts (of "
        f"{full / 60:.1f} uncut; + report ~{REPORT_S / 60:.0f} min; a GPU's --plan also spends its "
        "calibration)" + ("; OVER BUDGET: every cut the plan allows is made" if over else "")
        + "\n" + table(["article", "sweep", "jobs", f"{profile} min", "cut"], rows)
    )


def estimate(plan, args, profiles: list[str]) -> int:
    """Minutes of the full-fidelity plan on named GPU profiles from FLOPs at MFU of each profile's
    dense peak for the job's precision: a rough figure, not a measurement (a GPU's --plan replaces
    it). With --budget, what the plan's cuts would make of it on each profile."""
    known = sorted(f.stem for f in (ROOT / "conf" / "gpu").glob("*.yaml") if f.stem != "auto")
    for p in profiles:
        if p not in known:
            raise PlanError(
                f"--estimate {p}: no GPU profile of that name (conf/gpu/); choose from: "
                f"{', '.join(known)}"
            )
    if not profiles:
        raise PlanError(
            "--estimate: name one or more GPU profiles, e.g. --estimate h100,v100 "
            f"({', '.join(known)})"
        )
    peaks = {p: yaml_load(ROOT / "conf" / "gpu" / f"{p}.yaml")["peak_tflops"] for p in profiles}
    rows, totals = [], {p: 0.0 for p in profiles}
    for s in plan.sweeps:
        secs = flop_seconds(plan, args, s, peaks)
        rows.append([s.article, s.name, len(s.jobs)] + [minutes(secs[p]) for p in profiles])
        for p in profiles:
            totals[p] += secs[p]
    rows.append(
        ["total", "", sum(len(s.jobs) for s in plan.sweeps)]
        + [minutes(totals[p]) for p in profiles]
    )
    print(
        f"FLOP estimate (not measured): minutes of the full-fidelity plan at {MFU:.0%} of each "
        "profile's dense peak for the job's precision (fp32 where the profile has no peak for "
        "it); training and evaluation FLOPs only (no data loading, start-up, launch overhead)\n"
    )
    print(table(["article", "sweep", "jobs", *[f"{p} min" for p in profiles]], rows))
    for p in profiles if args.budget else []:
        print(estimate_cuts(plan, args, peaks, p, parse_duration(args.budget)))
    return 0


def yaml_load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())
