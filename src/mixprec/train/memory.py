"""The memory ledger of a job: what its training holds, part by part, counted from the tensors.

Parts (bytes, each storage counted once, by dtype where it varies; docs/memory.md):
  - weights: the model's parameters (a tied weight once; under FSDP this rank's shards);
  - masters: the fp32 master copies the optimizer steps (apex O2: precision.master_weights);
  - grads: one gradient per stepped tensor, in its dtype (the masters' under master weights, where
    the model's fp16 gradients become fp32 one tensor at a time: policy.grads_to_masters); counted
    from the stepped tensors, since the step's zero_grad has freed them by the time it is measured;
  - optimizer: every tensor of the optimizer's state (Adam's moments and its step counters);
  - scaler: the loss scaler's tensors (GradScaler's scale and growth tracker);
  - probe: the tensors the numerics probe holds between steps;
  - buffers: the model's buffers (BatchNorm's running statistics);
  - activations: what autograd saves for backward in one steady training step, counted as it
    saves them (torch.autograd.graph.saved_tensors_hooks), each storage once. Parameters are not
    activations: autograd saves a layer's weight too (a view of the parameter, counted in weights
    already), so a saved tensor whose storage is a parameter's is skipped; a copy of a weight
    (autocast's fp16/bf16 cast, a float8 cast) is counted apart, as weight_copies, since it
    scales with the parameters, not with the batch.
An Emulated fp16/bf16 tensor (precision/emulation.py) counts as the real dtype would (2 bytes an
element), not as the fp32 it is held in: the ledger is the run's on the device it emulates.

The activations are measured once, at a steady step (the last of the first log window after the
warm-up, or the run's last step if it ends sooner; the first step of a resumed process if it starts
past it); every other step costs one comparison. The other parts are counted when training ends
(the optimizer's state exists only after a step that was not skipped), on this rank.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..precision.emulation import Emulated
from .parallel import local

PARTS = ("weights", "masters", "grads", "optimizer", "scaler", "probe", "buffers",
         "weight_copies", "activations")
# the parts that scale with the parameters (bytes_per_param)
MODEL_STATE = ("weights", "masters", "grads", "optimizer")
# autograd nodes of a view or a cast: a saved tensor reached from a parameter through these alone
# is a copy of a weight, not an activation
COPY_NODES = ("ToCopy", "T", "View", "Permute", "Transpose", "Expand", "Unsqueeze", "Squeeze",
              "Alias", "AsStrided", "Slice", "Reshape", "Clone", "Select", "Unbind")


def pieces(t: torch.Tensor) -> list[tuple[tuple, int, str]]:
    """The storages `t` holds, as (key, bytes, dtype name): this rank's shard of a DTensor, an
    Emulated tensor's fp32 data at its reported dtype's size, a wrapper subclass's inner tensors
    (torchao's float8: its data and scale)."""
    t = local(t)
    if isinstance(t, Emulated):
        data = t._data
        storage = data.untyped_storage()
        size = storage.nbytes() // data.element_size() * t.dtype.itemsize
        return [((data.device, storage.data_ptr()), size, dtype_name(t.dtype))]
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [p for n in names for p in pieces(getattr(t, n))]
    storage = t.untyped_storage()
    return [((t.device, storage.data_ptr()), storage.nbytes(), dtype_name(t.dtype))]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def by_dtype(tensors, seen: set) -> dict[str, int]:
    """Bytes per dtype of the storages of `tensors` not in `seen` (which they join)."""
    out = defaultdict(int)
    for t in tensors:
        for key, size, dtype in pieces(t):
            if key not in seen and size:
                seen.add(key)
                out[dtype] += size
    return dict(out)


def held_tensors(obj) -> list[torch.Tensor]:
    """The tensors among an object's attributes, and in its attributes' lists, tuples and dicts."""
    found = []
    for v in vars(obj).values() if obj is not None else ():
        values = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        found += [x for x in values if isinstance(x, torch.Tensor)]
    return found


def grads_by_dtype(stepped: list[torch.Tensor]) -> dict[str, int]:
    """One gradient per stepped tensor, of its shape and dtype (autograd's rule for a leaf's .grad),
    this rank's shard."""
    out = defaultdict(int)
    for p in stepped:
        p = local(p)
        out[dtype_name(p.dtype)] += p.numel() * p.dtype.itemsize
    return dict(out)


def state_parts(model: nn.Module, policy, optimizer, probe=None) -> dict[str, dict[str, int]]:
    """Every part but the activations, by dtype, each storage once across the parts."""
    seen: set = set()
    params = list({id(p): p for p in model.parameters()}.values())
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {
        "weights": by_dtype(params, seen),
        "masters": by_dtype(policy.master_params or [], seen),
        "grads": grads_by_dtype(policy.stepped_params()),
        "optimizer": by_dtype(state, seen),
        "scaler": by_dtype(held_tensors(policy.scaler), seen),
        "probe": by_dtype(held_tensors(probe), seen),
        "buffers": by_dtype(model.buffers(), seen),
    }


def from_weight(t: torch.Tensor, depth: int = 6) -> bool:
    """Whether `t` is a view or a cast of a parameter: its autograd history reaches a leaf through
    view and copy nodes alone (COPY_NODES; torchao's float8 cast)."""
    fn = t.grad_fn
    for _ in range(depth):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return True
        if not (name.rstrip("0123456789").removesuffix("Backward") in COPY_NODES
                or "Float8" in name):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


class SavedCount:
    """What autograd saves for backward while it is entered, each storage once: activations and
    weight copies (see the module docstring); a parameter's own storage is skipped."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params: set = set()
        self.seen: set = set()
        self.parts = {"activations": defaultdict(int), "weight_copies": defaultdict(int)}
        self.hooks = None

    def __enter__(self) -> "SavedCount":
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        # the hooks hold this object's bound methods: dropped, so no cycle keeps the model alive
        # past its job (a finished job frees its model without the cycle collector)
        self.hooks.__exit__(*exc)
        self.hooks = None

    def refresh(self) -> None:
        """The parameters' storages now (FSDP registers a unit's gathered weights in its
        forward)."""
        self.params = {key for p in self.model.parameters() for key, _, _ in pieces(p)}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        found = pieces(t)
        if any(key not in self.params for key, _, _ in found):
            self.refresh()
        part = self.parts["weight_copies" if from_weight(t) else "activations"]
        for key, size, dtype in found:
            if key not in self.params and key not in self.seen:
                self.seen.add(key)
                part[dtype] += size
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


class Ledger:
    """A job's memory ledger: `around` wraps each training step (hooks at the measured step only),
    `took` notes that step's samples and the device's peak, `summary` counts the rest at the end.
    Without a model it measures nothing."""

    def __init__(self, model: nn.Module | None = None, policy=None, optimizer=None, probe=None):
        self.model, self.policy, self.optimizer, self.probe = model, policy, optimizer, probe
        self.target: int | None = None
        self.count: SavedCount | None = None
        self.step = self.samples = self.device_peak = None

    def target_step(self, loop, step: int) -> int:
        """The last step of the first log window after the warm-up (at or after `step`, the first of
        this process), or the run's last."""
        every, first = loop.trainer.log_every, max(step, loop.warm_at + 1)
        return min(math.ceil(first / every) * every, loop.total_steps)

    def around(self, loop, step: int):
        """The context the loop runs training step `step` in: the saved-tensor count at the measured
        step, else nothing."""
        if self.model is None or self.step is not None:
            return contextlib.nullcontext()
        if self.target is None:
            self.target = self.target_step(loop, step)
        if step != self.target:
            return contextlib.nullcontext()
        self.count = SavedCount(self.model)
        return self.count

    def took(self, step: int, samples: int) -> None:
        """After training step `step` (this rank's `samples`): the device's peak of allocated bytes
        so far, at the measured step."""
        if self.count is None or step != self.target or self.step is not None:
            return
        self.step, self.samples = step, samples
        device = self.policy.device
        if device.type != "cpu":
            self.device_peak = torch.accelerator.max_memory_allocated(device)

    def summary(self) -> dict | None:
        """summary.json's "memory": the parts by dtype, their bytes, the total, bytes per parameter
        (weights, masters, grads and optimizer state over this rank's parameters), the activations
        per sample, and on an accelerator its peak beside the total (None before a step)."""
        if self.model is None or self.step is None:
            return None
        for m in self.model.modules():   # a last forward leaves FSDP's root gathered
            if isinstance(m, FSDPModule):
                m.reshard()
        parts = state_parts(self.model, self.policy, self.optimizer, self.probe)
        parts.update({k: dict(v) for k, v in self.count.parts.items()})
        bytes_ = {k: sum(parts[k].values()) for k in PARTS}
        n = sum(local(p).numel() for p in {id(p): p for p in self.model.parameters()}.values())
        total = sum(bytes_.values())
        return {
            "step": self.step, "samples": self.samples, "parameters": n,
            "by_dtype": parts, "bytes": bytes_, "total_bytes": total,
            "bytes_per_param": sum(bytes_[k] for k in MODEL_STATE) / n if n else None,
            "activation_mb_per_sample": bytes_["activations"] / 2**20 / self.samples,
            "device_peak_allocated_bytes": self.device_peak,
            "unaccounted_bytes": None if self.device_peak is None else self.device_peak - total,
        }
