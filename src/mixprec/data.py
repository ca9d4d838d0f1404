"""Data: image datasets as uint8 tensors, and the device-resident batch pipeline.

The whole split is moved to the device once as uint8 [N, 3, H, W]. Each epoch draws a permutation on the
device; a batch is a slice of it, augmented (random crop from a reflect-padded image, horizontal flip) and
normalised on the device. No DataLoader and no host round trip in the hot loop (Page's first trick).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import DatasetConfig


@dataclass
class ImageData:
    train_x: torch.Tensor   # uint8 [N, 3, H, W]
    train_y: torch.Tensor   # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple             # per-channel mean of the training images, in [0, 1]
    std: tuple


def synthetic_images(cfg: DatasetConfig) -> ImageData:
    """CIFAR-shaped, learnable images, a pure function of cfg (its own seed, not the run's)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    c, s = cfg.num_classes, cfg.image_size
    # A smooth random pattern per class: 4x4 colour noise upsampled to the image size, unit contrast.
    protos = F.interpolate(torch.randn(c, 3, 4, 4, generator=gen), size=(s, s), mode="bicubic", align_corners=False)
    protos = (protos - protos.mean(dim=(1, 2, 3), keepdim=True)) / protos.std(dim=(1, 2, 3), keepdim=True)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n) % c
        y = y[torch.randperm(n, generator=gen)]
        x = protos[y]
        shifts = torch.randint(-2, 3, (n, 2), generator=gen)
        x = torch.stack([torch.roll(img, (int(dy), int(dx)), dims=(1, 2)) for img, (dy, dx) in zip(x, shifts)])
        x = x + cfg.noise * torch.randn(x.shape, generator=gen)
        return (128 + 48 * x).round().clamp(0, 255).to(torch.uint8), y

    train_x, train_y = draw(cfg.train_size)
    test_x, test_y = draw(cfg.test_size)
    mean, std = channel_stats(train_x)
    return ImageData(train_x, train_y, test_x, test_y, c, mean, std)


def channel_stats(images: torch.Tensor) -> tuple[tuple, tuple]:
    x = images.to(torch.float64).div_(255)
    return tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(x.std(dim=(0, 2, 3)).tolist())


class DeviceBatches:
    """Batches of a device-resident uint8 split, augmented and normalised on the device.

    train=True: a fresh permutation each epoch (from this loader's own generator, so the same seed gives the
    same batches), the last incomplete batch dropped, crop/flip applied. train=False: in order, every sample.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, mean, std, *,
                 device: torch.device, train: bool, crop_padding: int = 0, flip: bool = False, seed: int = 0,
                 channels_last: bool = False):
        self.images = images.to(device, non_blocking=True)
        self.labels = labels.to(device, non_blocking=True)
        self.batch_size = batch_size
        self.device = device
        self.train = train
        self.crop_padding = crop_padding if train else 0
        self.flip = flip and train
        self.channels_last = channels_last
        self.mean = torch.tensor(mean, device=device, dtype=torch.float32).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(std, device=device, dtype=torch.float32).view(1, -1, 1, 1) * 255
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        n = len(self.images)
        self.drop_last = train and n >= batch_size

    def __len__(self) -> int:
        n = len(self.images)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        n = len(self.images)
        order = torch.randperm(n, device=self.device, generator=self.generator) if self.train else None
        for i in range(len(self)):
            sl = slice(i * self.batch_size, min((i + 1) * self.batch_size, n))
            idx = order[sl] if order is not None else sl
            yield self.transform(self.images[idx]), self.labels[idx]

    def state_dict(self) -> dict:
        """The data order's state (this loader's generator): restored, the loader replays the same batches."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def transform(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.float()
        if self.crop_padding:
            x = random_crop(x, self.crop_padding, self.generator)
        if self.flip:
            x = random_flip(x, self.generator)
        x = (x - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x


def random_crop(x: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Per-sample random crop of the original size from the reflect-padded batch (offsets 0..2*pad)."""
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    oy = torch.randint(0, 2 * pad + 1, (b,), device=x.device, generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (b,), device=x.device, generator=generator)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, :, None]      # [B, H, 1]
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, :]      # [B, 1, W]
    batch_idx = torch.arange(b, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch_idx, rows, cols].permute(0, 3, 1, 2)


def random_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    mask = torch.rand(x.shape[0], device=x.device, generator=generator) < 0.5
    return torch.where(mask[:, None, None, None], x.flip(3), x)
