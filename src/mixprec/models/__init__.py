"""The networks: torchvision ResNets with a CIFAR or ImageNet stem, or as fastai 1.0's create_cnn
builds them, and a small CNN (resnets.py), Page's ResNet-9 (resnet9.py), RNN language models
(rnnlm.py) and a GPT-style Transformer language model (gpt.py). build_model picks one from model=;
set_bn_eval and forward_flops serve every one."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..config import ModelConfig
from .gpt import GPT
from .resnet9 import ResNet9
from .resnets import fastai_cnn, resnet, small_cnn
from .rnnlm import RNNModel

__all__ = ["build_model", "fastai_cnn", "forward_flops", "resnet", "set_bn_eval", "small_cnn"]


def build_model(cfg: ModelConfig, num_classes: int, **resnet9_options) -> nn.Module:
    """num_classes: the vocabulary size for a language model (cfg.is_language_model).
    resnet9_options: ResNet9's trick switches (activation, ghost_splits, ...), which
    resnet9.resnet9_options maps from `trick`."""
    if cfg.arch == "gpt":
        return GPT(
            num_classes,
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.block_size,
            cfg.dropout,
            cfg.vocab_multiple,
        )
    if cfg.is_language_model:
        return RNNModel(
            cfg.arch,
            num_classes,
            cfg.emsize,
            cfg.nhid,
            cfg.nlayers,
            cfg.dropout,
            cfg.tied,
            cfg.vocab_multiple,
        )
    if cfg.arch == "resnet9":
        return ResNet9(num_classes, cfg.channels, cfg.output_scale, **resnet9_options)
    if cfg.arch.startswith("resnet"):
        if cfg.head == "fastai":
            return fastai_cnn(cfg.arch, cfg.stem, num_classes, cfg.pretrained, cfg.freeze_body)
        return resnet(cfg.arch, cfg.stem, num_classes, cfg.pretrained)
    if cfg.arch == "small_cnn":
        return small_cnn(cfg.width, num_classes)
    # unreachable: the schema allows only the above
    raise ValueError(f"unknown model.arch {cfg.arch!r}")


def set_bn_eval(model: nn.Module) -> None:
    """Put every BatchNorm layer in eval mode (running statistics, no updates) inside a training
    model."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def forward_flops(model: nn.Module, sample: torch.Tensor) -> float | None:
    """FLOPs of one forward pass per sample (matmuls and convolutions, 2 per multiply-add), counted
    by torch.utils.flop_counter on a real forward in eval mode; None where the counter cannot
    run."""

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(sample)
        return counter.get_total_flops() / sample.shape[0]
    except Exception:  # an op the counter does not know; MFU is then left out, not guessed
        return None
    finally:
        model.train(was_training)
