"""A mode's state in a checkpoint: the loss scaler's (GradScaler or static), the host's copy of the
scale, and the fp32 master weights (o2)."""
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
