"""The numerics probe: what fp16/bf16 do inside a training run, layer by layer (conf/probe).

The training loop makes these calls per step; `build_probe` gives it one of two objects:

    probe.before_step(step, policy)                 hooks armed on a probed step (step 1, every
    probe.every) probe.see_batch(step, x, y, policy)             step 1 only (image models): the
    input checks (events.py) probe.after_backward(step, loss, policy, replay)  gradients as the
    backward left them (scaled) and unscaled probe.after_step(step, policy, skipped)         weight
    updates; skip attribution; rows written; hooks removed probe.on_nonfinite(step[, replay]) -> str
    the first non-finite value in time order, as a line

`Attribution` (probe=none) registers no hooks and does nothing on a normal step: its only work is at
an event. A step the dynamic loss scale skipped: which parameters had non-finite gradients, and the
scale (the flag is the one train/step.py's backward_and_step returns, the gradients are still
there); a fused step's flag stays on the device until the loop's log flush (defer=True: no
sync per step), which records its skip with the scale it used and `nonfinite_grads` None, the
gradients being gone by then (record_deferred_skip; Ranges reads the flag at once). A non-finite
loss or weight found by the loop's check: `replay()` runs the forward of the loop's current batch
again under forward hooks, with no gradient and the BatchNorm statistics restored afterwards, and
the first module in forward order whose weights or output are non-finite is named ("first
non-finite: step 3 forward, layer3.1.bn2 output: NaN"). The name is exact when the weights the bad
forward used are still there (a skipped step under a dynamic scale; trainer.on_nonfinite=skip);
otherwise the update of the bad step has already spread NaN: the event is "optimizer update by step
N, <module> weights" (for Adam, its state says whether that update was 0/0), and job.py replays the
run under probe=ranges (train/replay.py). `Ranges` (probe=ranges) checks the loss of every step
before the update (one host sync per step: a diagnostic mode), and its first event is read from the
rows in time order (events.first_in_rows): a step's forward outputs, then its backward's tensors as
produced, then its updates. An fp16/bf16 row that is the step's first non-finite one, with finite
weights entering the step, came from a finite computation: its infs count as overflow.

`Ranges` measures, on probed steps and on every skipped or non-finite step (probe_stats.py has the
arithmetic):
  forward     every submodule's output (each tensor of a tuple output, e.g. nn.LSTM's (out, (h, c)))
  act_grad    the gradient of the loss w.r.t. each output (the paper's activation gradients), as the
  backward
              produced it, i.e. at the loss scale used; act_grad_unscaled: divided by the scale
              (scaled runs only)
  grad        each parameter's gradient as produced (scaled); grad_unscaled likewise
  update      each stepped weight's update dw and its stall: of the elements with a non-zero
  gradient, those whose
              weight did not move in the stepped dtype, and for fp32-stepped weights those whose
              update fp16 / bf16 would lose (w + dw == w once w lives there: why .half() weights
              stall and apex O2 keeps fp32 masters)
One row per tensor to numerics.jsonl, plus one "(model)" row per kind pooling the step's tensors.
`summary()` is the job's `numerics` block: the first forward output that overflows fp16, the worst
layers for fp16 overflow and underflow, the pooled activation-gradient fractions that fp16 loses
(rounds to 0) or keeps only as subnormals, unscaled and at the scale used, and the fraction exactly
zero as produced (in a pure fp16 run the lost values are zeros already), and the update stalls.
Tensors are measured on their device and copied to the host once per probed step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from . import events as ev
from . import probe_stats as ps
from ..config import ProbeConfig

NUMERICS = "numerics.jsonl"
MODEL = "(model)"


def build_probe(cfg: ProbeConfig, model: nn.Module, out_dir: Path | None) -> "Attribution":
    """probe=none: attribution only; probe=ranges: the full probe. out_dir None (ranks other than
    0): no records."""
    if cfg.name == "ranges" and out_dir is not None:
        return Ranges(model, cfg, Path(out_dir) / NUMERICS)
    return Attribution(model, cfg)


def flat_tensors(out) -> list[torch.Tensor]:
    """The floating tensors of a module's output, in order (tuples and lists flattened: nn.LSTM's
    (out, (h, c)))."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    return []


def param_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters in the order PrecisionPolicy keeps them (model_params /
    master_params)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def nonfinite(t: torch.Tensor) -> bool:
    return not bool(torch.isfinite(t).all())


def module_type(model: nn.Module | None, name: str | None) -> str | None:
    """The class name of the module a row is about: a module ('relu#2', 'rnn[1]') or a parameter's
    owner."""
    if model is None or name is None:
        return None
    base = name.split("#")[0].split("[")[0]
    mods = dict(model.named_modules())
    m = mods.get(base, mods.get(base.rpartition(".")[0]))
    return type(m).__name__ if m is not None else None


class ForwardTrace:
    """Forward hooks on every submodule, for one forward: calls `seen(name, module, tensors)` in
    completion order (a module called twice, e.g. torchvision's shared ReLU, is `name#2` the second
    time). Use as a context."""

    def __init__(self, model: nn.Module, seen):
        self.model, self.seen, self.handles, self.calls = model, seen, [], {}

    def __enter__(self):
        for name, m in self.model.named_modules():
            if name:
                self.handles.append(m.register_forward_hook(self._hook(name)))
        return self

    def _hook(self, name: str):
        def hook(module, args, out):
            k = self.calls[name] = self.calls.get(name, 0) + 1
            self.seen(name if k == 1 else f"{name}#{k}", module, flat_tensors(out))
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()


class Attribution:
    """probe=none: no hooks; attribution of skipped steps and non-finite values, at the event
    only."""

    hooks_armed = False
    # a fused step's skip may be read at the log flush (record_deferred_skip); Ranges: at once
    defers_skips = True

    def __init__(self, model: nn.Module | None = None, cfg: ProbeConfig = ProbeConfig()):
        self.model, self.cfg = model, cfg
        self.names = param_names(model) if model is not None else []
        self.scale = 1.0
        self.replay = None   # the forward of the loop's current batch (kept by after_backward)
        self.skipped: list[dict] = []
        self.skipped_total = 0
        # the first non-finite event in time order (events.py)
        self.first_nonfinite: dict | None = None
        # what is wrong with step 1's batch (events.batch_findings)
        self.inputs: list[dict] | None = None
        # set by loop.Loop: Adam's state, read at an event only
        self.optimizer = None

    def before_step(self, step: int, policy) -> None:
        # the scale this step's backward uses (its update may change it)
        self.scale = policy.scale_value or 1.0

    def see_batch(self, step: int, x: torch.Tensor, y: torch.Tensor | None, policy) -> None:
        """At step 1 only (one host sync): a batch that is all zeros or constant, labels that are
        one class, a first layer whose output is all zeros; each is logged as a warning and kept for
        the summary."""
        if step != 1 or self.inputs is not None or self.model is None:
            return
        self.inputs = ev.batch_findings(x, y)
        first = ev.first_layer(self.model)
        if (
            first is not None
            and isinstance(first[1], (nn.Conv2d, nn.Linear))
            and x.is_floating_point()
        ):
            with torch.no_grad(), policy.autocast():
                out = first[1](policy.cast_input(x))
            if not bool(out.any()):
                self.inputs.append({"what": "first layer output all zeros", "module": first[0],
                                    "detail": f"{first[0]} outputs only zeros at step 1"})
        ev.warn(self.inputs, step)

    def after_backward(self, step: int, loss: torch.Tensor, policy, replay) -> None:
        self.replay = replay

    def after_step(self, step: int, policy, skipped: bool) -> None:
        if skipped:
            self.record_skip(step, policy)

    def record_skip(self, step: int, policy) -> dict:
        """The step, the scale it used, and the parameters whose (unscaled) gradients were
        non-finite."""
        self.skipped_total += 1
        grads = [p.grad for p in policy.stepped_params()]
        bad = [n for n, g in zip(self.names, grads) if g is not None and nonfinite(g)]
        event = {"step": step, "scale": self.scale, "nonfinite_grads": bad}
        if len(self.skipped) < self.cfg.max_skips:
            self.skipped.append(event)
        return event

    def record_deferred_skip(self, step: int, scale: float) -> dict:
        """A fused step's skip, read at the log flush: its gradients are gone, so no parameter is
        named."""
        self.skipped_total += 1
        event = {"step": step, "scale": scale, "nonfinite_grads": None}
        if len(self.skipped) < self.cfg.max_skips:
            self.skipped.append(event)
        return event

    def on_nonfinite(self, step: int, replay=None) -> str:
        """'first non-finite: <module> output|weights' after replaying the loop's current batch
        (`replay`, else the one the last after_backward kept), once per run; '' without a model or a
        batch."""
        replay = replay or self.replay
        if self.model is None or replay is None:
            return ""
        if self.first_nonfinite is None:
            self.first_nonfinite = self.replay_attribution(step, replay)
        return ev.line(self.first_nonfinite)

    @torch.no_grad()
    def replay_attribution(self, step: int, replay) -> dict:
        """Run `replay()` (the loop's forward of its current batch) under forward hooks; the event
        of the first module in forward order whose parameters or output are non-finite (weights: an
        earlier update made them so, and Adam's state says whether it was 0/0). BatchNorm statistics
        are restored after."""
        found: list[tuple] = []

        def seen(name, module, tensors):
            if found:
                return
            bad = [p for p in module.parameters(recurse=False) if nonfinite(p)]
            if bad:
                found.append((name, "weights", bad[0]))
            else:
                t = next((t for t in tensors if nonfinite(t)), None)
                if t is not None:
                    found.append((name, "output", t))

        buffers = {k: v.clone() for k, v in self.model.named_buffers()}
        try:
            with ForwardTrace(self.model, seen):
                replay()
        finally:
            self.model.load_state_dict(buffers, strict=False)
        return self.replay_event(step, found[0] if found else None)

    def replay_event(self, step: int, found: tuple | None) -> dict:
        if found is None:
            return {**ev.event(step, "forward", None, None, None), "tensor": None}
        name, tensor, t = found
        if tensor == "output":
            what = ev.what_of(
                "forward", str(t.dtype)[6:], int(torch.isinf(t).sum()), int(torch.isnan(t).sum())
            )
            return {**ev.event(step, "forward", name, str(t.dtype)[6:], what),
                    "module_type": module_type(self.model, name)}
        e = {**ev.event(step, "update", name, str(t.dtype)[6:], None), "tensor": "weights",
             "module_type": module_type(self.model, name)}
        state = self.optimizer.state.get(t) if self.optimizer is not None else None
        # Adam: the non-finite weights' second moment (and first) at 0?
        if state and "exp_avg_sq" in state:
            bad = ~torch.isfinite(t)
            v0, m0 = (float((state[k][bad] == 0).float().mean()) for k in ("exp_avg_sq", "exp_avg"))
            e.update(what="0/0" if v0 == 1.0 else None, adam_state={"v_zero": v0, "m_zero": m0})
        return e

    def rows(self) -> list[dict]:
        """The rows recorded (numerics.jsonl; none without probe=ranges), for the verdict
        (verdicts.py)."""
        return []

    def summary(self) -> dict | None:
        if not self.skipped_total and self.first_nonfinite is None and not self.inputs:
            return None
        return {
            "probe": self.cfg.name,
            "skipped_steps": self.skipped,
            "skipped_total": self.skipped_total,
            "first_nonfinite": self.first_nonfinite,
            "inputs": self.inputs or [],
        }

    def close(self) -> None:
        self.release()

    def release(self) -> None:
        """Drop what the probe holds of the job (the replay's batch, model and policy, the
        optimizer): a closed probe keeps none of them alive in a sweep's process, where they would
        count in the next job's peak memory."""
        self.replay = self.model = self.optimizer = None


class Ranges(Attribution):
    """probe=ranges: the full measurement on probed steps (see the module docstring)."""
    defers_skips = False

    def __init__(self, model: nn.Module, cfg: ProbeConfig, path: Path):
        super().__init__(model, cfg)
        self.path = path
        self.file = open(path, "a")
        self.pending: list[tuple] = []   # kind, name, order, dtype, counts, absmax: in time order
        self.updates: list[tuple[str, torch.Tensor]] = []
        self.trace: ForwardTrace | None = None
        self.order: dict[str, int] = {}
        self.before: list[torch.Tensor] | None = None
        self.pooled: dict[str, list] = {}      # kind -> (step, pooled row) for the summary
        # (kind, name) -> worst fractions over the run, for the summary
        self.layers: dict[tuple, dict] = {}
        self.stalls: dict[str, list] = {}
        # the first module in forward order whose output overflows fp16
        self.first_overflow: dict | None = None

    def probed(self, step: int) -> bool:
        return step == 1 or step % self.cfg.every == 0

    def before_step(self, step: int, policy) -> None:
        super().before_step(step, policy)
        self.hooks_armed = self.probed(step)
        if self.hooks_armed:
            self.trace = ForwardTrace(self.model, self.seen_forward).__enter__()

    def seen_forward(self, name: str, module, tensors) -> None:
        order = self.order.setdefault(name, len(self.order))
        for i, t in enumerate(tensors):
            label = name if i == 0 else f"{name}[{i}]"
            self.measure("forward", label, order, t)
            if t.requires_grad:
                t.register_hook(self.act_grad_hook(label, order))

    def act_grad_hook(self, label: str, order: int):
        def hook(grad):
            self.measure("act_grad", label, order, grad)
            if self.scale != 1.0:
                self.measure("act_grad_unscaled", label, order, grad.float() / self.scale)
        return hook

    def measure(
        self, kind: str, name: str, order: int, t: torch.Tensor, dtype: torch.dtype | None = None
    ) -> None:
        """dtype: the tensor's own when not given (an update is measured in fp32 but lives in the
        stepped dtype)."""
        self.pending.append((kind, name, order, str(dtype or t.dtype)[6:], *ps.tensor_counts(t)))

    def after_backward(self, step: int, loss: torch.Tensor, policy, replay) -> None:
        self.replay = replay
        # before the update spreads it
        if not bool(torch.isfinite(loss)) and self.first_nonfinite is None:
            self.disarm()
            self.first_nonfinite = self.replay_attribution(step, replay)
            self.hooks_armed = True   # the step is recorded in full
        if not self.hooks_armed:
            return
        self.disarm()
        for i, (n, p) in enumerate(zip(self.names, policy.model_params)):
            if p.grad is not None:
                self.measure("grad", n, i, p.grad)
                if self.scale != 1.0:
                    self.measure("grad_unscaled", n, i, p.grad.float() / self.scale)
        self.before = [p.detach().clone() for p in policy.stepped_params()]

    def after_step(self, step: int, policy, skipped: bool) -> None:
        event = self.record_skip(step, policy) if skipped else None
        if self.before is not None:
            stepped = policy.stepped_params()
            what_if = ps.MEASURED if stepped and stepped[0].dtype == torch.float32 else ()
            for i, (n, old, new) in enumerate(zip(self.names, self.before, stepped)):
                dw = new.detach().float() - old.float()
                self.measure("update", n, i, dw, new.dtype)
                self.updates.append((n, ps.stall_counts(old, new.detach(), dw, new.grad, what_if)))
            self.before = None
            self.write(step, event, what_if)
        elif event is not None:   # a skipped step that was not probed: its gradients at least
            for i, (n, g) in enumerate(zip(self.names, (p.grad for p in policy.stepped_params()))):
                if g is not None:
                    self.measure("grad_unscaled", n, i, g)
            self.write(step, event, ())

    def disarm(self) -> None:
        if self.trace is not None:
            self.trace.__exit__()
            self.trace = None

    def write(self, step: int, event: dict | None, what_if: tuple) -> None:
        """One host copy of every measurement of the step; rows to numerics.jsonl; the summary's
        running worst."""
        counts = (
            torch.stack([c for *_, c, _ in self.pending]).cpu().tolist() if self.pending else []
        )
        absmax = torch.stack([a for *_, a in self.pending]).cpu().tolist() if self.pending else []
        stalls = torch.stack([s for _, s in self.updates]).cpu().tolist() if self.updates else []
        rows: dict[str, list] = {}
        base = {"step": step, "scale": self.scale, **({"skipped": True} if event else {})}
        timed = [
            {
                **base,
                "kind": kind,
                "name": name,
                "order": order,
                "dtype": dtype,
                **ps.describe(c, a),
            }
            for (kind, name, order, dtype, *_), c, a in zip(self.pending, counts, absmax)
        ]
        origin = self.note_first(timed, skipped=event is not None)
        for row in timed:
            rows.setdefault(row["kind"], []).append(row)
        for (name, _), s in zip(self.updates, stalls):
            row = next(r for r in rows["update"] if r["name"] == name)
            row["stall"] = {f: v / max(s[0], 1) for f, v in zip(("stepped", *what_if), s[1:])}
            for f, v in zip(("stepped", *what_if), s[1:]):
                self.stalls.setdefault(f, []).append((s[0], v))
        for kind, kind_rows in rows.items():
            for r in kind_rows:
                self.file.write(json.dumps(r) + "\n")
                self.track(r, r is origin)
            pooled = {**base, "kind": kind, "name": MODEL, "order": -1, **ps.pool(kind_rows)}
            self.pooled.setdefault(kind, []).append(pooled)
            self.file.write(json.dumps(pooled) + "\n")
        self.file.flush()
        self.pending, self.updates, self.hooks_armed = [], [], False

    def note_first(self, timed: list[dict], skipped: bool) -> dict | None:
        """The step's first non-finite row in time order while the weights entering the step were
        finite (None else): it came from a finite computation. On a step that was not skipped it is
        the run's first event."""
        f = self.first_nonfinite
        if not timed or (f is not None and f["step"] < timed[0]["step"]):
            return None   # the weights entering this step were already spoiled
        found = ev.first_in_rows(timed)
        if found is None:
            return None
        # this step's replay: its forward, before any backward
        replayed = f is not None and f.get("row") is None
        if not skipped and (
            f is None or replayed and (f["module"] is None or found[1]["pass"] == "forward")
        ):
            self.first_nonfinite = found[1]
            found[1]["module_type"] = module_type(self.model, found[1]["module"])
        return found[0]

    def track(self, r: dict, origin: bool = False) -> None:
        """The worst fp16 overflow and loss (rounding to zero) seen per (kind, layer) over the run;
        the first forward overflow (rows come in forward order). `origin`: the step's first
        non-finite row, computed from finite values: in an fp16/bf16 tensor its inf values are
        overflow too."""
        over = r["fp16"]["overflow"]
        if origin and r.get("dtype") in ev.LOW and r["hist"]["inf"]:
            over = max(over, r["hist"]["inf"] / max(r["n"], 1))
        if r["kind"] == "forward" and over and self.first_overflow is None:
            self.first_overflow = {"layer": r["name"], "step": r["step"], "fp16_fraction": over}
        key = (r["kind"], r["name"])
        worst = self.layers.setdefault(key, {"overflow": (0.0, None), "lost": (0.0, None)})
        for k, v in (("overflow", over), ("lost", r["fp16"]["lost"])):
            if v > worst[k][0]:
                worst[k] = (v, r["step"])

    def worst(self, what: str, kinds: tuple, top: int = 5) -> list[dict]:
        ranked = sorted(
            (
                (v[what][0], v[what][1], k)
                for k, v in self.layers.items()
                if k[0] in kinds and v[what][0]
            ),
            key=lambda x: -x[0],
        )
        return [
            {"kind": k[0], "layer": k[1], "fp16_fraction": f, "step": s} for f, s, k in ranked[:top]
        ]

    def summary(self) -> dict | None:
        out = super().summary() or {"probe": "ranges", "skipped_steps": [], "skipped_total": 0,
                                    "first_nonfinite": None, "inputs": []}
        forward_kinds = ("forward", "act_grad_unscaled", "act_grad", "grad", "grad_unscaled")
        out.update(every=self.cfg.every,
                   probed_steps=sorted({r["step"] for rows in self.pooled.values() for r in rows}),
                   fp16_forward_overflow_first=self.first_overflow,
                   worst_overflow=self.worst("overflow", forward_kinds),
                   worst_underflow=self.worst("lost", forward_kinds))
        act = self.pooled.get("act_grad", [])
        if act:
            scaled, unscaled = ps.pool(act), ps.pool(self.pooled.get("act_grad_unscaled", act))
            out["act_grad_fp16"] = {
                "scales": sorted({r["scale"] for r in act}),
                "zero_as_produced": scaled["zero"],
                **{
                    k: {f: p["fp16"][f] for f in ("lost", "subnormal")}
                    for k, p in (("unscaled", unscaled), ("at_scale_used", scaled))
                },
            }
        if self.stalls:
            out["update_stall"] = {k: sum(s[1] for s in v) / max(sum(s[0] for s in v), 1)
                                   for k, v in self.stalls.items()}
        return out

    def rows(self) -> list[dict]:
        self.file.flush()
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        self.disarm()
        self.file.close()
        self.release()
