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
from ..precision.fsdp import ShardedPolicy, after_steps
from .compile import start_compile_workers
from .optim import build_optimizer, compiles_step, param_groups


@dataclass
class Trained:
    """What a run trains: the prepared model, what the loop calls (`net`: DDP's wrapper, else the
    model), the policy, the optimizer and its weight-decay groups (for the summary)."""
    model: nn.Module
    net: nn.Module
    policy: PrecisionPolicy
    optimizer: torch.optim.Optimizer
    groups: dict


def compiles(config: Config, device: torch.device) -> bool:
    """Whether inductor will compile on this accelerator in this job: the model (trainer.compile)
    or torchao's optimizer step (optim.compiles_step, even with trainer.compile=none). On the CPU
    inductor compiles in the job's process: no workers to start."""
    return device.type != "cpu" and (
        config.trainer.compile != "none" or compiles_step(config.optimizer, device))


def build_trained(model: nn.Module, config: Config, device: torch.device, bn_bias_lr: float = 1.0,
                  channels_last: bool = False, wrap: Callable = lambda model: model) -> Trained:
    """The policy casts the model (weights' dtype, BatchNorm in fp32, float8 Linear layers) on
    `device`; then channels_last, then `wrap` (DDP, which broadcasts rank 0's weights; FSDP's
    fully_shard, which makes the parameters DTensor shards), and only then the stepped tensors
    (fp32 masters cloned from the final weights; FSDP's shards), their groups and the optimizer.
    First, where anything will compile, inductor's workers start out of reach of the job's stop
    signals (compile.start_compile_workers)."""
    check_installed(config.precision)   # a script's build, as a job's start: before the model
    if compiles(config, device):
        start_compile_workers()
    sharded = config.trainer.sharded
    policy = (ShardedPolicy if sharded else PrecisionPolicy)(config.precision, device)
    model = policy.prepare_model(model)
    # FSDP shards contiguous parameters only: its convolutions take the channels_last layout from
    # their inputs (the image pipelines make them channels_last)
    if channels_last and not sharded:
        model = model.to(memory_format=torch.channels_last)
    net = wrap(model)
    stepped = policy.optimizer_params(model)  # first: it sets policy.model_params
    params, groups = param_groups(
        model, policy.model_params, stepped, config.optimizer, config.model.arch, bn_bias_lr
    )
    optimizer = build_optimizer(config.optimizer, params)
    if sharded:
        after_steps(model, optimizer, policy.fp8)
    return Trained(model, net, policy, optimizer, groups)
