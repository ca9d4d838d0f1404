"""Models: torchvision ResNets with a CIFAR or ImageNet stem, a small CNN, Page's ResNet-9 (resnet9.py), RNN
language models (rnnlm.py) and a GPT-style Transformer language model (gpt.py)."""
from __future__ import annotations

import torch
import torchvision
from torch import nn

from .config import ModelConfig
from .gpt import GPT
from .resnet9 import ResNet9
from .rnnlm import RNNModel


def build_model(cfg: ModelConfig, num_classes: int, **resnet9_options) -> nn.Module:
    """num_classes: the vocabulary size for a language model (cfg.is_language_model). resnet9_options: ResNet9's
    trick switches (activation, ghost_splits, ...), which resnet9.resnet9_options maps from `trick`."""
    if cfg.arch == "gpt":
        return GPT(num_classes, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.dropout, cfg.vocab_multiple)
    if cfg.is_language_model:
        return RNNModel(cfg.arch, num_classes, cfg.emsize, cfg.nhid, cfg.nlayers, cfg.dropout, cfg.tied,
                        cfg.vocab_multiple)
    if cfg.arch == "resnet9":
        return ResNet9(num_classes, cfg.channels, cfg.output_scale, **resnet9_options)
    if cfg.arch.startswith("resnet"):
        return resnet(cfg.arch, cfg.stem, num_classes)
    if cfg.arch == "small_cnn":
        return small_cnn(cfg.width, num_classes)
    raise ValueError(f"unknown model.arch {cfg.arch!r}")  # unreachable: the schema allows only the above


def resnet(arch: str, stem: str, num_classes: int) -> nn.Module:
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if stem == "cifar":
        # 32x32 inputs: a 3x3 stride-1 first conv and no max-pool keep the spatial resolution for layer1.
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def small_cnn(width: int, num_classes: int) -> nn.Module:
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, width), nn.MaxPool2d(2),
        *block(width, 2 * width), nn.MaxPool2d(2),
        *block(2 * width, 4 * width), nn.MaxPool2d(2),
        *block(4 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes),
    )


def set_bn_eval(model: nn.Module) -> None:
    """Put every BatchNorm layer in eval mode (running statistics, no updates) inside a training model."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def forward_flops(model: nn.Module, sample: torch.Tensor) -> float | None:
    """FLOPs of one forward pass per sample (matmuls and convolutions, 2 per multiply-add), counted by
    torch.utils.flop_counter on a real forward in eval mode; None where the counter cannot run."""
    from torch.utils.flop_counter import FlopCounterMode

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
