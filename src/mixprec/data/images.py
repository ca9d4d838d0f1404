"""Image datasets as uint8 tensors on the CPU: the ImageData container, the synthetic CIFAR-shaped
set, and the exact per-channel statistics that normalise them (CIFAR itself: cifar.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..config import DatasetConfig


@dataclass
class ImageData:
    train_x: torch.Tensor   # uint8 [N, 3, H, W]
    train_y: torch.Tensor   # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple             # per-channel mean of the training images, in [0, 1]
    std: tuple
    classes: tuple = ()     # class names, index = label
    train_coarse: Optional[torch.Tensor] = None   # CIFAR-100's 20 superclass labels (int64 [N])
    test_coarse: Optional[torch.Tensor] = None
    coarse_classes: tuple = ()
    # where it came from (source, cache), for the job's records
    info: dict = field(default_factory=dict)


def synthetic_images(cfg: DatasetConfig) -> ImageData:
    """CIFAR-shaped (3x32x32), learnable images, a pure function of cfg (its own seed, not the
    run's). Like CIFAR, they are resized to `dataset.image_size` on the device when that is not
    32."""
    gen = torch.Generator().manual_seed(cfg.seed)
    c, s = cfg.num_classes, 32
    # A smooth random pattern per class: 4x4 colour noise upsampled to the image size, unit
    # contrast.
    protos = F.interpolate(
        torch.randn(c, 3, 4, 4, generator=gen), size=(s, s), mode="bicubic", align_corners=False
    )
    protos = (protos - protos.mean(dim=(1, 2, 3), keepdim=True)) / protos.std(
        dim=(1, 2, 3), keepdim=True
    )

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n) % c
        y = y[torch.randperm(n, generator=gen)]
        x = protos[y]
        shifts = torch.randint(-2, 3, (n, 2), generator=gen)
        x = torch.stack(
            [torch.roll(img, (int(dy), int(dx)), dims=(1, 2)) for img, (dy, dx) in zip(x, shifts)]
        )
        x = x + cfg.noise * torch.randn(x.shape, generator=gen)
        return (128 + 48 * x).round().clamp(0, 255).to(torch.uint8), y

    train_x, train_y = draw(cfg.train_size)
    test_x, test_y = draw(cfg.test_size)
    mean, std = channel_stats(train_x)
    return ImageData(train_x, train_y, test_x, test_y, c, mean, std, info={"name": "synthetic"})


def channel_stats(images: torch.Tensor) -> tuple[tuple, tuple]:
    """Per-channel mean and (unbiased) std of uint8 [N, C, H, W] images, in [0, 1]. Exact, from each
    channel's 256-bin histogram, so a whole CIFAR training set needs no float copy of itself."""
    values = torch.arange(256, dtype=torch.float64)
    mean, std = [], []
    for c in range(images.shape[1]):
        hist = torch.bincount(images[:, c].reshape(-1), minlength=256).to(torch.float64)
        n = hist.sum()
        m = (hist * values).sum() / n
        mean.append(m.item() / 255)
        std.append(((hist * (values - m).square()).sum() / (n - 1)).sqrt().item() / 255)
    return tuple(mean), tuple(std)
