"""A mode's state in a checkpoint: the loss scaler's (GradScaler or static), the host's copy of the
scale, and the fp32 master weights (o2); and how a model's state loads under the mode's numerics
(emulated fp16/bf16 swaps each parameter's contents: load_module_state)."""
from __future__ import annotations

import torch


class PolicyState:
    """The precision policy's state: the loss scaler (GradScaler or static) and the fp32 master
    weights (o2)."""

    def __init__(self, policy):
        self.policy = policy

    def state_dict(self) -> dict:
        p = self.policy
        return {
            "scaler": p.scaler.state_dict(),
            "scale_value": p.scale_value,
            "master_params": None
            if p.master_params is None
            else [m.detach() for m in p.master_params],
        }

    def load_state_dict(self, state: dict) -> None:
        p = self.policy
        p.scaler.load_state_dict(state["scaler"])
        p.scale_value = state["scale_value"]
        if p.master_params is not None:
            with torch.no_grad():
                for master, saved in zip(p.master_params, state["master_params"], strict=True):
                    master.copy_(saved)


def load_module_state(module: torch.nn.Module, state: dict) -> None:
    """module.load_state_dict(state), also under `numerics` (where loading swaps each parameter's
    contents too): an RNN keeps weak references to its weights, which torch.utils.swap_tensors
    refuses to swap, so they are dropped before the load and rebuilt after it, as RNNBase._apply
    does around .to() and .half()."""
    rnns = [m for m in module.modules() if isinstance(m, torch.nn.RNNBase)]
    for m in rnns:
        m._flat_weight_refs = []
    try:
        module.load_state_dict(state)
    finally:
        for m in rnns:
            m._init_flat_weights()
