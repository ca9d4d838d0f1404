"""The numerics probe's events: the first non-finite value of a run in time order, and inputs that
are not what they seem (probe.py records them; verdicts.py reads them).

An event is a dict: `step`, `pass` ("forward", "backward" or "optimizer update"), `module`, `tensor`
(the row kind: forward output, act_grad, grad, update; or "weights" when a replay finds weights an
earlier update made non-finite), `what` ("overflow": inf in a tensor computed from finite values,
past `limit`, the largest finite value of `dtype`; "NaN"; "0/0": a non-finite update from a finite
gradient), `limit`, `dtype`, and `row` (the numerics.jsonl row it was read from: step, kind, name;
None for a replay). Time order: a step's forward rows in completion order, then its backward's rows
as the backward produced them, then its updates.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PASSES = {
    "forward": "forward",
    "act_grad": "backward",
    "act_grad_unscaled": "backward",
    "grad": "backward",
    "grad_unscaled": "backward",
    "update": "optimizer update",
}
LOW = ("float16", "bfloat16")


def limit_of(dtype: str | None) -> float | None:
    """The largest finite value of a float dtype named by its torch name ('float16' -> 65504)."""
    dt = getattr(torch, dtype or "", None)
    return (
        float(torch.finfo(dt).max) if isinstance(dt, torch.dtype) and dt.is_floating_point else None
    )


def what_of(kind: str, dtype: str | None, inf: int, nan: int, grad_finite: bool = False) -> str:
    """'0/0' for a non-finite update from a finite gradient that has NaN; 'overflow' for inf; else
    'NaN'."""
    if kind == "update" and grad_finite and nan:
        return "0/0"
    return "overflow" if inf else "NaN"


def event(
    step: int, kind: str, module: str, dtype: str | None, what: str, row: dict | None = None
) -> dict:
    return {"step": step, "pass": PASSES.get(kind, kind), "module": module,
            "tensor": "output" if kind == "forward" else kind, "what": what,
            "limit": limit_of(dtype) if what == "overflow" else None, "dtype": dtype,
            "row": {"step": row["step"], "kind": row["kind"], "name": row["name"]} if row else None}


def first_in_rows(rows: list[dict]) -> tuple[dict, dict] | None:
    """(the first non-finite row of one step's rows in time order, its event), or None when all are
    finite."""
    grads = {r["name"]: r for r in rows if r["kind"] == "grad_unscaled"}
    grads.update({r["name"]: r for r in rows if r["kind"] == "grad" and r["name"] not in grads})
    for r in rows:
        if r["nonfinite"] > 0:
            g = grads.get(r["name"]) if r["kind"] == "update" else None
            what = what_of(r["kind"], r.get("dtype"), r["hist"]["inf"], r["hist"]["nan"],
                           grad_finite=g is not None and g["nonfinite"] == 0)
            return r, event(r["step"], r["kind"], r["name"], r.get("dtype"), what, r)
    return None


def line(e: dict | None) -> str:
    """'first non-finite: step 1 backward, layer2.pool act_grad: overflow past 65504 (float16)'."""
    if e is None:
        return ""
    if e.get("module") is None:
        return "first non-finite: no module on replaying the batch (the forward was finite)"
    if e["tensor"] == "weights":
        return f"first non-finite: optimizer update by step {e['step']}, {e['module']} weights"
    what = {
        "overflow": f"overflow past {e['limit']:.6g} ({e['dtype']})"
        if e.get("limit")
        else "overflow to inf",
        "0/0": "0/0 (non-finite update from a finite gradient)",
    }.get(e["what"], e["what"])
    return f"first non-finite: step {e['step']} {e['pass']}, {e['module']} {e['tensor']}: {what}"


# -- inputs that are not what they seem ------------------------------------------------------------

@torch.no_grad()
def batch_findings(x: torch.Tensor, y: torch.Tensor | None) -> list[dict]:
    """What is wrong with a training batch (after augmentation): all zeros, constant, every sample
    constant, one label only. One host sync."""
    flat = x.detach().reshape(len(x), -1).float()
    lo, hi = flat.amin(1), flat.amax(1)
    stats = torch.stack([lo.min(), hi.max(), (hi - lo).max()]).tolist()
    labels = torch.stack([y.min(), y.max()]).tolist() if y is not None and y.numel() > 1 else None
    found = []
    if stats[0] == stats[1] == 0:
        found.append(
            {"what": "batch all zeros", "detail": "every input value is 0 after augmentation"}
        )
    elif stats[0] == stats[1]:
        found.append({"what": "batch constant", "detail": f"every input value is {stats[0]:.4g}"})
    elif stats[2] == 0:
        found.append({"what": "every image constant", "detail": "each sample holds one value"})
    if labels is not None and labels[0] == labels[1]:
        found.append({"what": "labels constant", "detail": f"every label is {labels[0]}"})
    return found


def first_layer(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The first module (in registration order) that has parameters of its own: the network's first
    layer."""
    return next(
        (
            (n, m)
            for n, m in model.named_modules()
            if n and any(True for _ in m.parameters(recurse=False))
        ),
        None,
    )


def warn(findings: list[dict], step: int) -> None:
    for f in findings:
        log.warning(
            f"mixprec: warning: step {step}: {f['what']} ({f['detail']}): the run will not learn "
            "from this input; check the data and augmentation (dataset.cutout, crop) settings"
        )
