"""The verdict: a few rules that read the probe's measurements and name, in one line, the mechanism
of what went wrong, with the rows it came from (shown in the job's console block, the sweep table's
note, report.md and the W&B summary; docs/numerics.md has a worked example of each).

`judge(numerics, rows, ctx)` reads the job's `numerics` block (probe.py: the first non-finite event
in time order, the skipped steps, the step-1 input findings), the rows of numerics.jsonl
(probe=ranges; [] under probe=none) and `ctx` (`context(config, status, steps)`: the precision,
optimizer and BatchNorm mode). The rules, first match wins; each needs its measurement, none is
taken from the config alone:

  backward_overflow_fp16  the first event is an overflow in the backward of a float16 run that has
  neither a
                          dynamic loss scale nor fp32 master gradients
  bn_eval_half            the first event is a forward overflow / NaN at a float16 BatchNorm in eval
  mode forward_overflow        the first event is a forward overflow (a named layer's output passed
  the format's max) adam_eps_zero           the first event is a non-finite Adam update from a
  finite gradient (0/0), or NaN weights
                          whose second moment is 0, with an eps that rounds to 0 in the stepped
                          dtype
  scale_backoff           the dynamic loss scale skipped every step from some step to the run's end,
  5 or more
                          (a healthy run's first skips end once the scale fits): non-finite at every
                          scale tried
  grad_underflow          a float16 run without a dynamic scale whose activation gradients are for a
  quarter or
                          more below fp16's normal range (they lose bits, the smaller ones are
                          already 0); it says which power-of-two loss scale would have lifted them
                          (probe_stats.smallest_scale)
  updates_rounded_away    the weights are stepped in bfloat16 with round-to-nearest (no fp32
                          masters, no stochastic rounding) and, on the last probed step, half
                          or more of the elements with a non-zero gradient did not move (the
                          update row's stall.stepped, pooled over the layers by size): each
                          update below half a unit in the last place of its weight rounded
                          away; it names the worst layer
  blank_inputs            nothing else fits, and step 1's batch, labels or first layer output were
  degenerate

Any rule's line also names the step-1 input findings. A run with a non-finite event that no rule
explains gets "no rule fits: <the event>" (mechanism None); a run with nothing to explain gets no
verdict (None).
"""
from __future__ import annotations

import torch

from . import events as ev
from . import probe_stats as ps
from .probe import MODEL

STREAK = 5          # consecutive skipped steps that make a backing-off scale a verdict
UNDERFLOW = 0.25    # fraction of non-zero activation gradients below fp16's normal range
ROUNDED_AWAY = 0.5  # fraction of a step's bf16 weight updates that left the weight unchanged


def context(config, status: str, steps: int | None) -> dict:
    """What the rules need of a job's config (mixprec.config.Config) and outcome."""
    p, o = config.precision, config.optimizer
    return {
        "precision": p.name,
        "param_dtype": p.param_dtype,
        "autocast_dtype": p.autocast_dtype,
        "master_weights": p.master_weights,
        "loss_scale": p.loss_scale,
        "keep_bn_fp32": p.keep_bn_fp32,
        "optimizer": o.name,
        "eps": o.eps,
        "stochastic_round": o.stochastic_round,
        "bn_eval": config.model.bn_eval,
        "status": status,
        "steps": steps,
    }


def judge(numerics: dict | None, rows: list[dict], ctx: dict) -> dict | None:
    """The verdict (mechanism, line, step, pass, module, cites, fix), or None when there is nothing
    to explain."""
    n = numerics or {}
    e = n.get("first_nonfinite")
    for rule in RULES:
        v = rule(e, n, rows, ctx)
        if v is not None:
            return finish(v, n)
    if e is not None or ctx.get("status") == "diverged":
        where = ev.line(e) or "no non-finite value was attributed"
        hint = "" if rows else "; rerun with probe=ranges probe.every=1 to time it"
        cites = [cite(e, rows)] if e and e.get("module") else []
        return finish(verdict(None, f"no rule fits: {where}{hint}", e, cites, None), n)
    return None


def verdict(mechanism, line: str, e: dict | None, cites: list[str], fix: str | None) -> dict:
    e = e or {}
    return {"mechanism": mechanism, "line": line, "step": e.get("step"), "pass": e.get("pass"),
            "module": e.get("module"), "cites": cites, "fix": fix}


def finish(v: dict, n: dict) -> dict:
    """The input findings are named beside every verdict (and its cites), the short form for a
    table's note."""
    found = n.get("inputs") or []
    if found and v["mechanism"] != "blank_inputs":
        v["line"] += "; inputs at step 1: " + ", ".join(f["what"] for f in found)
        v["cites"] += [f"step 1 inputs: {f['what']} ({f['detail']})" for f in found]
    v["line"] += f"; fix: {v['fix']}" if v["fix"] else ""
    where_ = ", ".join(str(v[k]) for k in ("step", "pass", "module") if v[k] is not None)
    v["short"] = f"{v['mechanism'] or 'no rule fits'}" + (f" (step {where_})" if where_ else "")
    return v


def cite(e: dict, rows: list[dict]) -> str:
    """'numerics.jsonl step 1 act_grad layer2.pool (absmax 6.55e+04, non-finite 0.787)', or the
    replay's event."""
    r = e.get("row")
    if not r:
        return f"replay at step {e['step']}: {e['module']} {e['tensor']}" + (
            f" (Adam state: v == 0 at {e['adam_state']['v_zero']:.0%} of its non-finite elements)"
            if e.get("adam_state") else "")
    full = next(
        (x for x in rows if (x["step"], x["kind"], x["name"]) == (r["step"], r["kind"], r["name"])),
        None,
    )
    extra = f" (absmax {full['absmax']:.3g}, non-finite {full['nonfinite']:.3g})" if full else ""
    return f"numerics.jsonl step {r['step']} {r['kind']} {r['name']}{extra}"


def where(e: dict) -> str:
    return f"step {e['step']}, {e['pass']}, {e['module']} {e['tensor']}"


def fp16_run(ctx: dict) -> bool:
    return "float16" in (ctx.get("param_dtype"), ctx.get("autocast_dtype"))


def backward_overflow_fp16(e, n, rows, ctx):
    if not e or e["pass"] != "backward" or e["what"] != "overflow" or e.get("dtype") != "float16":
        return None
    if (
        ctx.get("loss_scale") == "dynamic"
        or ctx.get("master_weights")
        or ctx.get("param_dtype") != "float16"
    ):
        return None
    line = (
        f"backward overflow in pure fp16 ({where(e)}): a gradient passed {e['limit']:.6g} with "
        "neither fp32 master gradients nor a loss scale that backs off"
    )
    return verdict("backward_overflow_fp16", line, e, [cite(e, rows)],
                   "fp32 master gradients and a dynamic loss scale (precision=amp or precision=o2)")


def bn_eval_half(e, n, rows, ctx):
    if (
        not e
        or e["pass"] != "forward"
        or e["what"] not in ("overflow", "NaN")
        or not ctx.get("bn_eval")
    ):
        return None
    if not str(e.get("module_type", "")).startswith("BatchNorm") or e.get("dtype") not in ev.LOW:
        return None
    went = "overflowed" if e["what"] == "overflow" else "went NaN"
    line = (
        f"BatchNorm in half precision in eval mode ({where(e)}): its output {went} in "
        f"{e['dtype']}, normalised by running statistics it does not update"
    )
    return verdict(
        "bn_eval_half",
        line,
        e,
        [cite(e, rows)],
        "keep BatchNorm in fp32 (precision.keep_bn_fp32=true) or train it in train mode "
        "(model.bn_eval=false)",
    )


def forward_overflow(e, n, rows, ctx):
    if not e or e["pass"] != "forward" or e["what"] != "overflow":
        return None
    kind = f" ({e['module_type']})" if e.get("module_type") else ""
    line = (f"forward overflow at {e['module']}{kind} ({where(e)}): its output passed "
            f"{e['limit']:.6g} ({e['dtype']})")
    return verdict(
        "forward_overflow",
        line,
        e,
        [cite(e, rows)],
        f"keep {e['module']} in fp32 or bf16 (autocast does for the ops it lists), or scale its "
        "input down",
    )


def eps_is_zero(ctx: dict) -> str | None:
    """The stepped dtype in which Adam's eps rounds to 0 (None: it does not, or no Adam)."""
    stepped = "float32" if ctx.get("master_weights") else ctx.get("param_dtype")
    if ctx.get("optimizer") not in ("adam", "adamw") or stepped in (None, "float32"):
        return None
    return (
        stepped if torch.tensor(ctx["eps"], dtype=getattr(torch, stepped)).item() == 0.0 else None
    )


def adam_eps_zero(e, n, rows, ctx):
    stepped = eps_is_zero(ctx)
    if not e or not stepped or e["pass"] != "optimizer update" or e["what"] != "0/0":
        return None
    cites = [cite(e, rows)]
    grad = next((r for r in rows if r["kind"] == "grad" and e.get("row") and r["step"] == e["step"]
                 and r["name"] == e["module"]), None)
    if grad is not None:
        cites.append(
            f"numerics.jsonl step {grad['step']} grad {grad['name']} (finite, absmax "
            f"{grad['absmax']:.3g}, zero {grad['zero']:.3g})"
        )
    line = (
        f"Adam's eps={ctx['eps']:g} is 0 in {stepped} ({where(e)}): the update divided by sqrt(v) "
        "+ eps = 0 where the second moment underflowed to 0 (0/0 = NaN), from a finite gradient "
        f"(foreach and for-loop Adam add eps in {stepped}; fused Adam computes in fp32)"
    )
    return verdict(
        "adam_eps_zero",
        line,
        e,
        cites,
        "optimizer.eps=1e-4, or fp32 optimizer state (precision=amp or o2)",
    )


def skip_streak(skips: list[dict]) -> list[dict]:
    """The last run of consecutive skipped steps."""
    streak: list[dict] = []
    for s in skips:
        streak = streak + [s] if streak and s["step"] == streak[-1]["step"] + 1 else [s]
    return streak


def scale_backoff(e, n, rows, ctx):
    if ctx.get("loss_scale") != "dynamic":
        return None
    skips, steps = n.get("skipped_steps") or [], ctx.get("steps") or 0
    streak = skip_streak(skips)
    # the last streak's skips, recorded or not
    tail = n.get("skipped_total", 0) - (len(skips) - len(streak))
    # it must last to the run's end
    if not streak or tail < STREAK or tail != steps - streak[0]["step"] + 1:
        return None
    a, b = streak[0], streak[-1]
    first = next(
        (
            r
            for r in rows
            if r["step"] == a["step"] and r["nonfinite"] > 0 and r["name"] != "(model)"
        ),
        None,
    )
    module = first["name"] if first else (a["nonfinite_grads"] or [None])[0]
    e = {"step": a["step"], "pass": "backward", "module": module}
    cites = [
        f"summary numerics.skipped_steps: steps {a['step']}-{b['step']} skipped at scales "
        f"{a['scale']:g} .. {b['scale']:g}, "
        + (
            f"non-finite gradients in {len(b['nonfinite_grads'])} parameters"
            if b["nonfinite_grads"] is not None
            else "gradients not attributed (fused steps)"
        )
    ]
    if first:
        cites.append(
            f"numerics.jsonl step {first['step']} {first['kind']} {first['name']} (the step's "
            "first non-finite)"
        )
    named = (
        f"first non-finite in the backward: {module}"
        if first
        else f"non-finite gradient first listed: {module}"
    )
    line = (
        f"the dynamic loss scale keeps backing off (steps {a['step']}-{b['step']} skipped, scale "
        f"{a['scale']:g} -> {b['scale']:g}; {named}): the gradients are non-finite at every scale "
        "tried, so the scale is not the cause"
    )
    return verdict(
        "scale_backoff",
        line,
        e,
        cites,
        "find what makes the gradients non-finite (the module named)",
    )


def grad_underflow(e, n, rows, ctx):
    if e or not fp16_run(ctx) or ctx.get("loss_scale") == "dynamic":
        return None
    act = [
        r
        for r in rows
        if r["kind"] == "act_grad" and r["name"] != MODEL and r.get("dtype") == "float16"
    ]
    for step in sorted({r["step"] for r in act}):
        at = [r for r in act if r["step"] == step]
        nz = sum(r["n"] * (1 - r["zero"] - r["nonfinite"]) for r in at)
        low = sum(
            r["n"] * (1 - r["zero"] - r["nonfinite"]) * (r["fp16"]["subnormal"] + r["fp16"]["lost"])
            for r in at
        )
        if nz and low / nz >= UNDERFLOW:
            return underflow_verdict(step, at, low / nz, rows)
    return None


def underflow_verdict(step: int, at: list[dict], frac: float, rows: list[dict]) -> dict:
    worst = max(at, key=lambda r: r["fp16"]["subnormal"] + r["fp16"]["lost"])
    pooled = next(
        (r for r in rows if (r["step"], r["kind"], r["name"]) == (step, "act_grad", MODEL)), None
    )
    k = ps.smallest_scale(pooled["hist"]) if pooled else None
    e = {"step": step, "pass": "backward", "module": worst["name"], "tensor": "act_grad"}
    scale = (
        f"a loss scale of 2^{k} would have lifted 99% of them into the normal range"
        if k
        else "a loss scale"
    )
    line = (
        f"gradients lost to underflow ({where(e)}): {frac:.0%} of the non-zero activation "
        f"gradients were below fp16's smallest normal 2^-14 (the smaller ones already 0); {scale}"
    )
    cites = [
        f"numerics.jsonl step {step} act_grad {worst['name']} (fp16 subnormal "
        f"{worst['fp16']['subnormal']:.1%})"
    ]
    if pooled:
        cites.append(f"numerics.jsonl step {step} act_grad (model) histogram")
    return verdict(
        "grad_underflow",
        line,
        e,
        cites,
        f"a loss scale (precision.loss_scale={2**k} or dynamic: precision=amp)"
        if k
        else "a loss scale",
    )


def updates_rounded_away(e, n, rows, ctx):
    """Pure bf16's stall (seed 001's pure-half pitfall in its modern form): the probe's update
    rows of bf16-stepped weights, each layer's stall.stepped the fraction of its elements with a
    non-zero gradient (so a non-zero fp32 update) whose weight did not change. Under stochastic
    rounding a single step also leaves most of them in place, but moves each with the probability
    that keeps the update unbiased: not this rule's case."""
    if e or ctx.get("stochastic_round"):
        return None
    ups = [r for r in rows if r["kind"] == "update" and r["name"] != MODEL
           and r.get("dtype") == "bfloat16" and "stall" in r]
    if not ups:
        return None
    step = max(r["step"] for r in ups)
    at = [r for r in ups if r["step"] == step]
    frac = sum(r["n"] * r["stall"]["stepped"] for r in at) / max(sum(r["n"] for r in at), 1)
    if frac < ROUNDED_AWAY:
        return None
    worst = max(at, key=lambda r: (r["stall"]["stepped"], r["n"]))
    e = {"step": step, "pass": "optimizer update", "module": worst["name"], "tensor": "update"}
    line = (
        f"updates rounded away ({where(e)}): {frac:.0%} of the bfloat16 weights' updates (non-zero "
        "gradient) left the weight unchanged, each below half a unit in the last place of its "
        f"weight (worst: {worst['name']}, {worst['stall']['stepped']:.0%}); the run stalls"
    )
    cites = [f"numerics.jsonl step {step} update {r['name']} (stall {r['stall']['stepped']:.1%})"
             for r in sorted(at, key=lambda r: -r["stall"]["stepped"])[:3]]
    return verdict(
        "updates_rounded_away",
        line,
        e,
        cites,
        "stochastic rounding of the update (optimizer.stochastic_round=true) or fp32 master "
        "weights (precision=amp_bf16)",
    )


def blank_inputs(e, n, rows, ctx):
    found = n.get("inputs") or []
    if not found or e is not None:
        return None
    line = "inputs not what they seem at step 1: " + ", ".join(
        f"{f['what']} ({f['detail']})" for f in found
    )
    return verdict(
        "blank_inputs",
        line,
        {"step": 1, "pass": "forward", "module": found[-1].get("module")},
        [f"step 1 inputs: {f['what']}" for f in found],
        "check the data pipeline and augmentation (dataset.cutout, crop)",
    )


RULES = (
    backward_overflow_fp16,
    bn_eval_half,
    forward_overflow,
    adam_eps_zero,
    scale_backoff,
    grad_underflow,
    updates_rounded_away,
    blank_inputs,
)
