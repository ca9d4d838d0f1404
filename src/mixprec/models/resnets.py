"""torchvision ResNets with a CIFAR or ImageNet stem, as fastai 1.0's create_cnn builds them (body,
concat-pool head, optionally pretrained and frozen), and a small CNN."""
from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from torch import nn

from ..config import ConfigError


def resnet(arch: str, stem: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    # ImageNet's 1000-class head is kept only to load the weights; the caller's head replaces it
    if pretrained:
        model = getattr(torchvision.models, arch)(weights=imagenet_weights(arch))
        model.fc = nn.Linear(model.fc.in_features, num_classes)
    else:
        model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if stem == "cifar":
        # 32x32 inputs: a 3x3 stride-1 first conv and no max-pool keep the spatial resolution for
        # layer1.
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def imagenet_weights(arch: str):
    """torchvision's ImageNet weights for `arch` (IMAGENET1K_V1: the weights fastai 1.0 loaded
    through torchvision's `pretrained=True`), from the torch hub cache, downloaded there once
    (torchvision's URL, its sha256 prefix checked) when missing; offline, one ConfigError naming
    what to do."""
    weights = torchvision.models.get_model_weights(arch).IMAGENET1K_V1
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if not path.is_file():
        try:
            torch.hub.load_state_dict_from_url(weights.url, progress=True, check_hash=True)
        except Exception as e:  # offline, or a broken download (removed by torch.hub)
            raise ConfigError(
                f"model.pretrained=true: {path} is missing and could not be downloaded "
                f"({str(e).splitlines()[0][:120]}); fetch it once where there is network (python "
                f"-c \"import torchvision; torchvision.models.{arch}(weights='IMAGENET1K_V1')\"), "
                "copy it there (or set TORCH_HOME), or set model.pretrained=false"
            ) from None
    return weights


class AdaptiveConcatPool2d(nn.Module):
    """fastai 1.0.42 layers.py:171-178: adaptive max-pool and average-pool to 1x1, concatenated (max
    first)."""

    def __init__(self):
        super().__init__()
        self.ap, self.mp = nn.AdaptiveAvgPool2d(1), nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        return torch.cat([self.mp(x), self.ap(x)], 1)


def fastai_head(nf: int, num_classes: int, lin_ftrs: int = 512, p: float = 0.5) -> nn.Sequential:
    """fastai 1.0.42 vision/learner.py create_head (lines 43-53) with its defaults (lin_ftrs None ->
    [nf, 512, nc], ps=0.5 -> [0.25, 0.5], bn_final False): concat pool, flatten, then bn_drop_lin
    (layers.py:48-54) twice: BatchNorm1d, Dropout, Linear (+ ReLU on the first). Weights:
    kaiming_normal_, biases 0 (create_cnn's apply_init(model[1], nn.init.kaiming_normal_),
    learner.py:68; torch_core.py init_default)."""
    head = nn.Sequential(
        AdaptiveConcatPool2d(),
        nn.Flatten(),
        nn.BatchNorm1d(nf),
        nn.Dropout(p / 2),
        nn.Linear(nf, lin_ftrs),
        nn.ReLU(inplace=True),
        nn.BatchNorm1d(lin_ftrs),
        nn.Dropout(p),
        nn.Linear(lin_ftrs, num_classes),
    )
    for m in head.modules():
        if isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight)
            nn.init.zeros_(m.bias)
    return head


def fastai_cnn(
    arch: str, stem: str, num_classes: int, pretrained: bool, freeze_body: bool
) -> nn.Sequential:
    """fastai 1.0.42 create_cnn (vision/learner.py:55-69): the torchvision ResNet cut before its
    pool and fc (cut=-2, learner.py:20, create_body 36-41), nf = 2 x the body's output channels
    (concat pool, line 62), the head above, nn.Sequential(body, head). freeze_body: Learner.freeze()
    (basic_train.py:189-201 with train_bn=True): the body's weights stop training, its BatchNorm
    layers keep training (weights, biases and running statistics)."""
    tv = resnet(arch, stem, num_classes, pretrained)
    body = nn.Sequential(*list(tv.children())[:-2])
    model = nn.Sequential(body, fastai_head(2 * tv.fc.in_features, num_classes))
    if freeze_body:
        for m in body.modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm):
                for p in m.parameters(recurse=False):
                    p.requires_grad_(False)
    return model


def small_cnn(width: int, num_classes: int) -> nn.Module:
    def block(cin, cout):
        return [
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        ]

    return nn.Sequential(
        *block(3, width), nn.MaxPool2d(2),
        *block(width, 2 * width), nn.MaxPool2d(2),
        *block(2 * width, 4 * width), nn.MaxPool2d(2),
        *block(4 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes),
    )
