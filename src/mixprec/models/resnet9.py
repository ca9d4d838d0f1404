"""ResNet-9: David Page's DAWNBench network ("How to train your ResNet", parts 4 and 8), with the
switches his bag-of-tricks ladder flips (train/parts.py maps the `trick` flags onto these).

prep: conv(3 -> 64) -> layer1: conv(64 -> 128), pool, residual of two conv-BN-act -> layer2:
conv(128 -> 256), pool -> layer3: conv(256 -> 512), pool, residual -> global max-pool -> linear(512
-> classes, no bias) -> x output_scale. Every conv is 3x3, stride 1, no bias, followed by BatchNorm
and the activation. 6.57M parameters at the default widths.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TrickConfig

POOL_ORDERS = {
    "conv_bn_act_pool": ("conv", "bn", "act", "pool"),  # Page's baseline
    # the same function: max-pool commutes with a monotone act
    "conv_bn_pool_act": ("conv", "bn", "pool", "act"),
    # step 3: BN sees the pooled map (a different network)
    "conv_pool_bn_act": ("conv", "pool", "bn", "act"),
}


class GhostBatchNorm(nn.BatchNorm2d):
    """BatchNorm whose training statistics are taken over `splits` interleaved parts of the batch
    (split k holds samples k, k+S, k+2S, ...; the batches are shuffled, so which samples share a
    split is immaterial). As in Page's code an NCHW batch is viewed as [N/S, S*C, H, W] (free in
    NCHW memory) and normalised by one BN call. A channels_last batch has no such view (the S and C
    of a sample are not adjacent in NHWC memory): it is copied to NCHW, normalised by the same call
    and copied back to channels_last, so both layouts compute the same numbers. Running statistics
    as Page's layer keeps them: S*C of them (split_mean, split_var), which training updates, and
    running_mean/running_var their mean over the splits, taken when the layer turns to evaluation
    (Page's `train` override) and when its state is saved, not every step (6 ops a layer fewer a
    step); evaluation is plain BatchNorm with them."""

    def __init__(self, num_features: int, splits: int):
        super().__init__(num_features)
        self.splits = splits
        self.register_buffer("split_mean", torch.zeros(splits * num_features))
        self.register_buffer("split_var", torch.ones(splits * num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        n, c, h, w = x.shape
        s = self.splits
        if n % s:
            raise ValueError(
                f"ghost batch norm: a batch of {n} does not split into {s} equal parts"
            )
        if x.is_contiguous():
            return self._ghost_forward(x)
        y = self._ghost_forward(x.contiguous())
        return y.contiguous(memory_format=torch.channels_last) if x.is_contiguous(
            memory_format=torch.channels_last) else y

    def _ghost_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: an NCHW-contiguous [N, C, H, W] batch; one batch_norm over its [N/S, S*C, H, W]
        view."""
        n, c, h, w = x.shape
        s = self.splits
        return F.batch_norm(
            x.view(n // s, s * c, h, w),
            self.split_mean,
            self.split_var,
            self.weight.repeat(s),
            self.bias.repeat(s),
            True,
            self.momentum,
            self.eps,
        ).view(n, c, h, w)

    @torch.no_grad()
    def collate(self) -> None:
        """running_mean/running_var <- the mean over the splits of split_mean/split_var."""
        s, c = self.splits, self.num_features
        torch.mean(self.split_mean.view(s, c), 0, out=self.running_mean)
        torch.mean(self.split_var.view(s, c), 0, out=self.running_var)

    def train(self, mode: bool = True):
        if self.training and not mode:
            self.collate()
        return super().train(mode)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.training:   # in evaluation they were collated when it began
            self.collate()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Weights saved before the per-split statistics existed (running_mean/var only) load with
        each split starting from them, as the running statistics they were."""
        for split, running in (("split_mean", "running_mean"), ("split_var", "running_var")):
            if prefix + split not in state_dict and prefix + running in state_dict:
                state_dict[prefix + split] = state_dict[prefix + running].repeat(self.splits)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def conv_bn(c_in: int, c_out: int, norm, act, pool_order: str | None = None) -> nn.Sequential:
    """conv 3x3 -> BN -> activation, with a 2x2 max-pool placed by `pool_order` (None: no pool)."""
    parts = {
        "conv": nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        "bn": norm(c_out),
        "act": act(),
        "pool": nn.MaxPool2d(2),
    }
    order = POOL_ORDERS[pool_order] if pool_order else ("conv", "bn", "act")
    return nn.Sequential(OrderedDict((name, parts[name]) for name in order))


class Residual(nn.Module):
    def __init__(self, channels: int, norm, act):
        super().__init__()
        self.res1 = conv_bn(channels, channels, norm, act)
        self.res2 = conv_bn(channels, channels, norm, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.res2(self.res1(x))


class Scale(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def whitening_stem(filters: torch.Tensor, c_out: int, norm, act) -> nn.Sequential:
    """Page's step 8: a fixed 3x3 conv with the patch-whitening filters (27 = 3*3*3 of them), then a
    learnt 1x1 conv to c_out channels, BN and activation."""
    whiten = nn.Conv2d(3, filters.shape[0], 3, padding=1, bias=False)
    whiten.weight = nn.Parameter(filters.detach().float().cpu().clone(), requires_grad=False)
    return nn.Sequential(
        OrderedDict(
            whiten=whiten,
            conv=nn.Conv2d(filters.shape[0], c_out, 1, bias=False),
            bn=norm(c_out),
            act=act(),
        )
    )


class ResNet9(nn.Sequential):
    def __init__(
        self,
        num_classes: int = 10,
        channels=(64, 128, 256, 512),
        output_scale: float = 0.125,
        *,
        activation: str = "relu",
        celu_alpha: float = 0.075,
        ghost_splits: int = 1,
        frozen_bn_scale: float | None = None,
        pool_order: str = "conv_bn_act_pool",
        whitening: torch.Tensor | None = None,
    ):
        if activation not in ("relu", "celu"):
            raise ValueError(f"activation={activation!r}: relu or celu")
        if pool_order not in POOL_ORDERS:
            raise ValueError(f"pool_order={pool_order!r}: one of {', '.join(POOL_ORDERS)}")
        act = nn.ReLU if activation == "relu" else (lambda: nn.CELU(celu_alpha))
        norm = nn.BatchNorm2d if ghost_splits == 1 else (lambda c: GhostBatchNorm(c, ghost_splits))
        c0, c1, c2, c3 = channels
        super().__init__(
            OrderedDict(
                prep=conv_bn(3, c0, norm, act)
                if whitening is None
                else whitening_stem(whitening, c0, norm, act),
                layer1=nn.Sequential(
                    conv_bn(c0, c1, norm, act, pool_order), Residual(c1, norm, act)
                ),
                layer2=conv_bn(c1, c2, norm, act, pool_order),
                layer3=nn.Sequential(
                    conv_bn(c2, c3, norm, act, pool_order), Residual(c3, norm, act)
                ),
                pool=nn.AdaptiveMaxPool2d(1),
                flatten=nn.Flatten(),
                linear=nn.Linear(c3, num_classes, bias=False),
                scale=Scale(output_scale),
            )
        )
        # Page's step 7: the scales stop learning, the biases keep learning
        if frozen_bn_scale is not None:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.data.fill_(frozen_bn_scale)
                    m.weight.requires_grad_(False)


def resnet9_options(t: TrickConfig, whitening: torch.Tensor | None = None) -> dict:
    """The trick flags that shape ResNet-9, as its arguments. whitening: the fitted filters when
    trick.whitening (any [27, 3, 3, 3] tensor to rebuild a model whose saved weights hold them)."""
    return dict(activation="celu" if t.celu else "relu", celu_alpha=t.celu_alpha,
                ghost_splits=t.ghost_splits if t.ghost_bn else 1,
                frozen_bn_scale=t.bn_scale if t.frozen_bn_scale else None,
                pool_order="conv_pool_bn_act" if t.maxpool_reorder else "conv_bn_act_pool",
                whitening=whitening if t.whitening else None)
