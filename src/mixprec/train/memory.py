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
past it); every other step costs one comparison. Its hooks cost a few microseconds a saved tensor
and are never compiled by dynamo (SavedCount), yet slow that step: the loop leaves it out of the
steady throughput (loop.train_one). The other parts are counted when training ends (the optimizer's
state exists only after a step that was not skipped), on this rank. The total adds the saved tensors
and the gradients, which never all coexist; `at_once_bytes` is what the parts held at one moment of
the measured step, and on an accelerator the device's peak less it is `outside_ledger_bytes`
(Ledger.at_once).
"""
from __future__ import annotations

import contextlib
import functools
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
    (torchao's float8: its data and scale). A key is (device, address)."""
    return [((s.device, s.data_ptr()), size, dtype) for s, size, dtype in storages(t)]


def storages(t: torch.Tensor) -> list[tuple[torch.UntypedStorage, int, str]]:
    """pieces(t) with each storage itself in place of its key (SavedCount checks that a parameter's
    storage is still where it was counted)."""
    if type(t) in (torch.Tensor, nn.Parameter):   # the common case, first: a few attribute reads
        storage = t.untyped_storage()
        return [(storage, storage.nbytes(), dtype_name(t.dtype))]
    t = local(t)
    if isinstance(t, Emulated):
        data = t._data
        storage = data.untyped_storage()
        size = storage.nbytes() // data.element_size() * t.dtype.itemsize
        return [(storage, size, dtype_name(t.dtype))]
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [p for n in names for p in storages(getattr(t, n))]
    storage = t.untyped_storage()
    return [(storage, storage.nbytes(), dtype_name(t.dtype))]


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32 (kept: str() of a dtype costs microseconds, and the saved-tensor
    hook asks for each tensor)."""
    return str(dtype).removeprefix("torch.")


def by_dtype(tensors, seen: set, device: str | None = None) -> dict[str, int]:
    """Bytes per dtype of the storages of `tensors` not in `seen` (which they join); with `device`
    (a device type), of those on it only."""
    out = defaultdict(int)
    for t in tensors:
        for key, size, dtype in pieces(t):
            if key not in seen and size and device in (None, key[0].type):
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


def grads_by_dtype(stepped: list[torch.Tensor], device: str | None = None) -> dict[str, int]:
    """One gradient per stepped tensor, of its shape and dtype (autograd's rule for a leaf's .grad),
    this rank's shard; with `device` (a device type), of the tensors on it only."""
    out = defaultdict(int)
    for p in stepped:
        p = local(p)
        if device in (None, p.device.type):
            out[dtype_name(p.dtype)] += p.numel() * p.dtype.itemsize
    return dict(out)


def state_parts(model: nn.Module, policy, optimizer, probe=None,
                device: str | None = None) -> dict[str, dict[str, int]]:
    """Every part but the activations, by dtype, each storage once across the parts; with `device`
    (a device type), what is on it only (Adam's step counters stay on the host, for one)."""
    seen: set = set()
    params = list({id(p): p for p in model.parameters()}.values())
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {
        "weights": by_dtype(params, seen, device),
        "masters": by_dtype(policy.master_params or [], seen, device),
        "grads": grads_by_dtype(policy.stepped_params(), device),
        "optimizer": by_dtype(state, seen, device),
        "scaler": by_dtype(held_tensors(policy.scaler), seen, device),
        "probe": by_dtype(held_tensors(probe), seen, device),
        "buffers": by_dtype(model.buffers(), seen, device),
    }


@functools.cache
def node_kind(node: type) -> str:
    """"leaf" for AccumulateGrad (a parameter's), "copy" for a view or a cast (COPY_NODES, torchao's
    float8 cast), else "other"; one answer a node type (the saved-tensor hook asks for each)."""
    name = node.__name__
    if name == "AccumulateGrad":
        return "leaf"
    copy = name.rstrip("0123456789").removesuffix("Backward") in COPY_NODES or "Float8" in name
    return "copy" if copy else "other"


def from_weight(t: torch.Tensor, depth: int = 6) -> bool:
    """Whether `t` is a view or a cast of a parameter: its autograd history reaches a leaf through
    view and copy nodes alone (COPY_NODES; torchao's float8 cast)."""
    fn = t.grad_fn
    for _ in range(depth):
        if fn is None:
            return False
        kind = node_kind(type(fn))
        if kind != "copy":
            return kind == "leaf"
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


def leaf_or_its_view(t: torch.Tensor) -> bool:
    """Whether `t`, or the tensor it is a view of, is a leaf that autograd accumulates a gradient
    into: what a parameter is (FSDP's gathered weights too), and seldom anything else."""
    base = t if t._base is None else t._base
    return base.grad_fn is None and base.requires_grad


class SavedCount:
    """What autograd saves for backward while it is entered, each storage once: activations and
    weight copies (see the module docstring); a parameter's own storage is skipped.

    A saved tensor costs a few attribute reads: the parameters' storages are collected once, when it
    is entered, and again only when a parameter it does not know is saved (FSDP registers a unit's
    gathered weights in the unit's forward, at a new address each all-gather; a known storage counts
    as a parameter's only while it is still at the address it was collected at, as FSDP frees it
    after the forward). The hooks are kept out of dynamo (torch.compiler.disable): where a compiled
    model breaks its graph, autograd calls them inside frames dynamo evaluates, and dynamo would
    compile them, again for each kind of tensor, up to its recompile limit."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params: dict = {}   # key (device, address) -> the storage collected there
        self.seen: set = set()
        self.parts = {"activations": defaultdict(int), "weight_copies": defaultdict(int)}
        # the same bytes by device type (the ledger's at-once figure counts those on the device)
        self.devices = {part: defaultdict(int) for part in self.parts}
        self.hooks = None

    def __enter__(self) -> "SavedCount":
        self.refresh()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        # the hooks hold this object's bound methods: dropped, so no cycle keeps the model alive
        # past its job (a finished job frees its model without the cycle collector); the storages
        # too (FSDP's gathered ones are its own to free)
        self.hooks.__exit__(*exc)
        self.hooks = None
        self.params = {}

    def refresh(self) -> None:
        """The parameters' storages now (FSDP registers a unit's gathered weights in its
        forward)."""
        self.params = {(s.device, s.data_ptr()): s
                       for p in self.model.parameters() for s, _, _ in storages(p)}

    def is_param(self, key: tuple) -> bool:
        """Whether the storage at `key` is a parameter's: one collected there, still there."""
        storage = self.params.get(key)
        return storage is not None and storage.data_ptr() == key[1]

    @torch.compiler.disable
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook: counts `t`'s storages not counted yet, unless they are parameters'."""
        found = pieces(t)
        if not all(self.is_param(key) for key, _, _ in found) and leaf_or_its_view(t):
            self.refresh()
        name = "weight_copies" if from_weight(t) else "activations"
        part, device = self.parts[name], self.devices[name]
        for key, size, dtype in found:
            if key not in self.seen and not self.is_param(key):
                self.seen.add(key)
                part[dtype] += size
                device[key[0].type] += size
        return t

    @staticmethod
    @torch.compiler.disable
    def unpack(t: torch.Tensor) -> torch.Tensor:
        """The unpack hook: the tensor as saved."""
        return t


class Ledger:
    """A job's memory ledger: `around` wraps each training step (hooks at the measured step only),
    `took` notes that step's samples and the device's peak, `summary` counts the rest at the end.
    Without a model it measures nothing."""

    def __init__(self, model: nn.Module | None = None, policy=None, optimizer=None, probe=None):
        self.model, self.policy, self.optimizer, self.probe = model, policy, optimizer, probe
        self.target: int | None = None
        self.count: SavedCount | None = None
        self.before: dict | None = None   # the state's bytes on the device as the step starts
        self.step = self.samples = self.device_peak = None

    def target_step(self, loop, step: int) -> int:
        """The last step of the first log window after the warm-up (at or after `step`, the first of
        this process), or the run's last."""
        every, first = loop.trainer.log_every, max(step, loop.warm_at + 1)
        return min(math.ceil(first / every) * every, loop.total_steps)

    def measures(self, loop, step: int) -> bool:
        """Whether training step `step` is the measured one (the loop keeps its time and samples out
        of the steady throughput: its hooks slow it)."""
        if self.model is None or self.step is not None:
            return False
        if self.target is None:
            self.target = self.target_step(loop, step)
        return step == self.target

    def around(self, loop, step: int):
        """The context the loop runs training step `step` in: the saved-tensor count at the measured
        step, else nothing."""
        if not self.measures(loop, step):
            return contextlib.nullcontext()
        self.count = SavedCount(self.model)
        # the state the step starts with, on the device: all of it lives through the step
        device = self.policy.device.type
        self.before = {k: sum(v.values()) for k, v in state_parts(
            self.model, self.policy, self.optimizer, self.probe, device).items()}
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
        per sample, the most the parts hold at once on the device, and on an accelerator its peak
        beside that (None before a step)."""
        if self.model is None or self.step is None:
            return None
        for m in self.model.modules():   # a last forward leaves FSDP's root gathered
            if isinstance(m, FSDPModule):
                m.reshard()
        parts = state_parts(self.model, self.policy, self.optimizer, self.probe)
        parts.update({k: dict(v) for k, v in self.count.parts.items()})
        bytes_ = {k: sum(parts[k].values()) for k in PARTS}
        n = sum(local(p).numel() for p in {id(p): p for p in self.model.parameters()}.values())
        held = self.at_once()
        return {
            "step": self.step, "samples": self.samples, "parameters": n,
            "by_dtype": parts, "bytes": bytes_, "total_bytes": sum(bytes_.values()),
            "bytes_per_param": sum(bytes_[k] for k in MODEL_STATE) / n if n else None,
            "activation_mb_per_sample": bytes_["activations"] / 2**20 / self.samples,
            "at_once_bytes": held,
            "device_peak_allocated_bytes": self.device_peak,
            "outside_ledger_bytes": None if self.device_peak is None else self.device_peak - held,
        }

    def at_once(self) -> int:
        """The most the parts held at one moment of the measured step, on the policy's device: the
        state it started with (every part but the gradients and the saved tensors: a step frees none
        of it) with either every tensor autograd saved (activations and weight copies: all held when
        backward starts) or every gradient (all held when the optimizer steps), not both, as the
        total adds them: backward frees the saved tensors as it makes the gradients. All of it was
        on the device at once, so the device's peak is never below it."""
        device = self.policy.device.type
        saved = sum(self.count.devices[k][device] for k in self.count.devices)
        state = sum(v for k, v in self.before.items() if k != "grads")
        return state + max(saved, self.before["grads"])
