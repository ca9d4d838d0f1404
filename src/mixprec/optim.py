"""Optimizers, the piecewise-linear learning-rate schedule, and the plateau rule of the language models."""
from __future__ import annotations

import numpy as np
import torch

from .config import OptimizerConfig, ScheduleConfig


def build_optimizer(cfg: OptimizerConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    # The optimizer's state takes the dtype of the tensors it steps: fp16 under precision=half (the fp16-Adam
    # pitfall), fp32 under master weights.
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_schedule(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """LambdaLR multiplying optimizer.lr by the piecewise-linear curve through (knots, values), knots being
    fractions of total_steps. Stepped once per optimizer step.
    schedule=plateau: PyTorch's word_language_model rule instead, stepped once per epoch with the validation
    loss (`schedule.step(valid_loss)`): the lr is divided by cfg.factor after every epoch whose validation loss
    is not below the best so far (ReduceLROnPlateau, patience 0, threshold 0)."""
    if cfg.name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=1 / cfg.factor, patience=0,
                                                          threshold=0.0)
    knots = np.asarray(cfg.knots, dtype=np.float64) * max(total_steps, 1)
    values = np.asarray(cfg.values, dtype=np.float64)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(np.interp(step, knots, values)))
