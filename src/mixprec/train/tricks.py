"""Training tricks of Page's bag-of-tricks ladder that are not layers (those are in
models/resnet9.py), each a few plain lines.

parts.py maps the `trick` flags onto these; the step (step.py's image_forward) calls
`cross_entropy`, image_steps.ImageSteps `EMA.update` and `tta_logits`.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.hardware import synchronize
from ..precision.policy import by_dtype


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, label_smoothing: float = 0.0,
                  summed: bool = False) -> torch.Tensor:
    """The training loss. Label smoothing a: (1 - a) * CE + a * mean over classes of -log p
    (PyTorch's definition, and Page's). summed: the sum over the batch rather than the mean (Page's
    convention: with lr / batch and weight decay * batch it is the same SGD, and in fp16 the sum
    acts as a loss scale of the batch size)."""
    return F.cross_entropy(
        logits.float(), y, label_smoothing=label_smoothing, reduction="sum" if summed else "mean"
    )


def tta_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of x, mean of the logits of x and of its left-right mirror): flip test-time
    augmentation."""
    out = model(x).float()
    return out, (out + model(x.flip(3)).float()) / 2


def fit_whitening(t, data, device: torch.device) -> tuple[torch.Tensor | None, float]:
    """trick.whitening's filters (`t`: the TrickConfig), fitted on the first training images of
    `data`, and the seconds the fit took, recorded as setup_time_s and not counted in train_time_s,
    as Page counted it for the article's ladder: bag_of_tricks.ipynb fits them once (cell 70: `Λ, V
    = eigens(patches(train_set['data'] [:10000,:,4:-4,4:-4]))`) before any run's `Timer` is made
    (cells 73-85); his DAWNBench script new_dawn.py:73 fits them inside the timer instead. (None,
    0.0) without trick.whitening."""
    if not t.whitening:
        return None, 0.0
    start = time.perf_counter()
    filters = fit_patch_whitening(
        data.train_x[: t.whitening_images], data.mean, data.std, t.whitening_eps, device
    )
    synchronize(device)
    return filters, time.perf_counter() - start


@torch.no_grad()
def fit_patch_whitening(
    images: torch.Tensor, mean, std, eps: float, device: torch.device
) -> torch.Tensor:
    """Page's 3x3 patch whitening: the 27 eigenvectors of the (uncentred) covariance of every 3x3x3
    patch of the normalised uint8 `images` [N, 3, H, W], each divided by sqrt(eigenvalue + eps), as
    conv filters [27, 3, 3, 3] (largest eigenvalue first). Filtered patches then have covariance V^T
    S V / (L + eps) = diag(L / (L + eps)): the identity, up to eps. Computed on `device` in chunks,
    accumulated in float64."""
    m = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
    s = torch.tensor(std, device=device).view(1, -1, 1, 1) * 255
    cov, count = torch.zeros(27, 27, dtype=torch.float64, device=device), 0
    for chunk in images.split(500):
        x = (chunk.to(device).float() - m) / s
        patches = (
            x.unfold(2, 3, 1).unfold(3, 3, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 27).double()
        )  # (c,kh,kw)
        cov += patches.T @ patches
        count += len(patches)
    # 27x27: on the CPU, no solver start-up
    eigenvalues, vectors = torch.linalg.eigh(cov.cpu() / (count - 1))
    eigenvalues, vectors = eigenvalues.flip(0), vectors.flip(1)     # largest first, as Page
    return (vectors.T / torch.sqrt(eigenvalues + eps)[:, None]).float().reshape(27, 3, 3, 3)


class EMA:
    """An exponential moving average of a model's weights and float buffers (BN statistics), updated
    every `every` optimizer steps with rho = momentum ** every: v_ema <- rho * v_ema + (1 - rho) * v
    (Page: momentum 0.99 every 5 steps, starting from the initial weights, updates at steps 1, 6,
    11, ...). `model` is the averaged copy the loop evaluates; state_dict() holds everything a
    checkpoint needs."""

    def __init__(self, model: nn.Module, momentum: float, every: int):
        self.model = copy.deepcopy(model).requires_grad_(False)
        self.rho = momentum ** every
        self.every = every
        self.steps = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Call after every optimizer step. One foreach lerp per dtype (fp16 weights, fp32
        BatchNorm) instead of a lerp_ per tensor: the same rule, element by element the same lerp
        (on the CPU the foreach op runs lerp_ per tensor; CUDA's multi-tensor kernel applies ATen's
        same lerp formula in the same opmath type), in 2 dispatches rather than ~40, and no
        state_dict() (a detach per tensor) per update."""
        self.steps += 1
        if (self.steps - 1) % self.every:
            return
        for ema_group, group in by_dtype(float_tensors(self.model), float_tensors(model)):
            torch._foreach_lerp_(ema_group, group, 1 - self.rho)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.steps = state["steps"]


def float_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The floating-point parameters and buffers of `model`, in one fixed order (a DDP or compiled
    wrapper yields its module's, in the module's order): what the EMA averages (integer buffers,
    BatchNorm's num_batches_tracked, are not)."""
    return [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
