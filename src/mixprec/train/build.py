"""The one builder of what a run trains: the model prepared by the precision policy, the parameter
groups and the optimizer over what the policy steps. The job (image and language model) and every
script that trains (benchmark.py, max_batch.py, bench_emulation.py, numerics.py) build through it,
so the order below holds everywhere."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config import Config
from ..precision.modes import check_installed
from ..precision.policy import PrecisionPolicy
from .optim import build_optimizer, param_groups


@dataclass
class Trained:
    """What a run trains: the prepared model, what the loop calls (`net`: DDP's wrapper, else the
    model), the policy, the optimizer and its weight-decay groups (for the summary)."""
    model: nn.Module
    net: nn.Module
    policy: PrecisionPolicy
    optimizer: torch.optim.Optimizer
    groups: dict


def build_trained(model: nn.Module, config: Config, device: torch.device, bn_bias_lr: float = 1.0,
                  channels_last: bool = False, wrap: Callable = lambda model: model) -> Trained:
    """The policy casts the model (weights' dtype, BatchNorm in fp32, float8 Linear layers) on
    `device`; then channels_last, then `wrap` (DDP, which broadcasts rank 0's weights), and only
    then the stepped tensors (fp32 masters cloned from the final weights), their groups and the
    optimizer."""
    check_installed(config.precision)   # a script's build, as a job's start: before the model
    policy = PrecisionPolicy(config.precision, device)
    model = policy.prepare_model(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    net = wrap(model)
    stepped = policy.optimizer_params(model)  # first: it sets policy.model_params
    params, groups = param_groups(
        model, policy.model_params, stepped, config.optimizer, config.model.arch, bn_bias_lr
    )
    return Trained(model, net, policy, build_optimizer(config.optimizer, params), groups)
