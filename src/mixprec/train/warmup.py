"""Random batches and the shapes to warm, built once for both warm-ups before the clock: prewarm's
throwaway steps (prewarm.py: one batch of the training shape) and compile's warm-up (compile.py:
every training and evaluation shape the compiled model will see), and their losses: the step's
forwards (step.py) on a random batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .compile import Warmup
from .step import forward, image_forward, lm_forward


def image_loss(net, policy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A random batch's plain cross-entropy (no label smoothing, the mean)."""
    return image_forward(net, x, y, policy)[0]


def image_infer(net, policy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The evaluation forward (compile's warm-up of the evaluation shapes)."""
    return forward(net, x, policy)


def lm_loss(net, policy, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A window's loss from a fresh hidden state."""
    return lm_forward(net, x, y, net.init_hidden(x.size(1)), policy)[0]


@dataclass
class ImageBatch:
    """Random images of the training layout and labels, `size` of them."""
    image_shape: tuple
    num_classes: int
    channels_last: bool = False

    def __call__(self, size: int, gen: torch.Generator, device: torch.device) -> tuple:
        x = torch.rand(size, *self.image_shape, device=device, generator=gen)
        x = x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
        return x, torch.randint(0, self.num_classes, (size,), device=device, generator=gen)


@dataclass
class TokenBatch:
    """A window of random tokens, shape (rows, columns), and its targets."""
    vocab_size: int

    def __call__(self, shape: tuple, gen: torch.Generator, device: torch.device) -> tuple:
        rows, columns = shape
        x = torch.randint(0, self.vocab_size, (rows + 1, columns), device=device, generator=gen)
        return x[:-1], x[1:]


def image_warmup(batch: int, eval_batch: int, test_size: int, image_shape: tuple, num_classes: int,
                 channels_last: bool = False, bn_eval: bool = False,
                 evaluates: bool = True) -> Warmup:
    """An image job's shapes: the training batch (the training loaders drop a last partial batch),
    the evaluation batch and the test set's last, partial, one. evaluates=False (an EMA job, which
    evaluates the EMA's own, uncompiled copy): no evaluation shape, so no graph is compiled that no
    call would use."""
    eval_shapes = split_shapes(test_size, eval_batch) if evaluates else []
    return Warmup([batch], eval_shapes, ImageBatch(image_shape, num_classes, channels_last),
                  image_loss, image_infer, bn_eval)


def split_shapes(n: int, size: int) -> list[int]:
    """The lengths of the slices of n things cut into `size`s: `size` (or n if fewer), then any
    remainder."""
    return [min(n, size)] + ([n % size] if n > size and n % size else [])


def lm_warmup(train_rows: int, columns: int, eval_rows: list[int], eval_columns: int, bptt: int,
              vocab_size: int) -> Warmup:
    """A language model's windows: bptt rows and the last window's (a batchified stream of `rows`
    rows has rows - 1 targets per column), in training (train_rows x columns) and in evaluation
    (each split's rows)."""
    train = [(r, columns) for r in split_shapes(train_rows - 1, bptt)]
    evals = sorted(
        {(r, eval_columns) for rows in eval_rows for r in split_shapes(rows - 1, bptt)},
        reverse=True,
    )
    return Warmup(train, evals, TokenBatch(vocab_size), lm_loss, lm_loss)
