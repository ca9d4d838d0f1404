"""The two batch pipelines that feed the loop: `image_loaders(...)` gives the train and test
batches of an ImageData (images.py), by `dataset.pipeline`:
- device (the default): the whole split is moved to the device once as uint8 [N, 3, H, W]. Each
  epoch draws a permutation on the device; a batch is a slice of it, augmented (random crop from a
  reflect-padded image, horizontal flip), resized to `dataset.image_size` if that differs,
  normalised with the training set's channel mean/std and optionally cut out, all on the device in
  batches. No DataLoader and no host round trip in the hot loop (Page's first trick).
  Under DDP (`shard=(rank, world)`) every rank draws the same permutation from the shared seed and
  takes its slice of each global batch (trainer.batch_size / world samples); the crop/flip/cutout
  draws are made for the whole global batch and sliced too, so N ranks see exactly the batches one
  process would (tests/distributed/test_ddp.py).
- dataloader: the classic torch.utils.data.DataLoader, the same transforms applied per sample in
  worker processes on the CPU, batches pinned and copied to the device: kept for comparison
  (scripts/bench_pipeline.py).
"""
from __future__ import annotations

import atexit
import math
import signal
import weakref

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..config import ConfigError, DatasetConfig, TrainerConfig
from .images import ImageData


def image_loaders(
    data: ImageData,
    cfg: DatasetConfig,
    trainer: TrainerConfig,
    device: torch.device,
    seed: int,
    shard: tuple[int, int] = (0, 1),
):
    """(train batches, test batches) by `cfg.pipeline`; both have len() and yield (x float
    [B,3,S,S], y) on `device`. `shard=(rank, world)`: the training batches are this rank's slice of
    each global batch (the test batches are whole: every rank evaluates the full test set)."""
    check_shard(cfg, shard[1])
    if shard[1] > 1 and len(data.train_y) < trainer.batch_size:
        raise ConfigError(f"trainer.batch_size={trainer.batch_size}: larger than the training set "
                          f"({len(data.train_y)}); under DDP every step needs a full global batch")
    common = dict(device=device, size=cfg.image_size, channels_last=trainer.channels_last)
    augment = (
        dict(crop_padding=cfg.crop_padding, flip=True, cutout=cfg.cutout) if cfg.augment else {}
    )
    if cfg.pipeline == "dataloader":
        common.update(workers=cfg.workers, pin_memory=cfg.pin_memory)
    cls = DeviceBatches if cfg.pipeline == "device" else LoaderBatches
    train = dict(shard=shard) if shard[1] > 1 else {}
    return (
        cls(
            data.train_x,
            data.train_y,
            trainer.batch_size,
            data.mean,
            data.std,
            train=True,
            seed=seed,
            **augment,
            **common,
            **train,
        ),
        cls(
            data.test_x,
            data.test_y,
            trainer.eval_batch_size,
            data.mean,
            data.std,
            train=False,
            **common,
        ),
    )


def check_shard(cfg: DatasetConfig, world: int) -> None:
    """ConfigError for an image pipeline that does not serve `world` ranks (job.py checks it
    before any work; image_loaders again, for the scripts that build loaders alone)."""
    if world > 1 and cfg.pipeline != "device":
        raise ConfigError(
            f"dataset.pipeline={cfg.pipeline}: not sharded across ranks (DDP or FSDP); use "
            "dataset.pipeline=device"
        )


class Resumable:
    """A loader that knows its place in an epoch, so a training loop never skips batches itself.
    state_dict(): the states of the loader's random generators at the epoch's start (at an epoch's
    end, the next one's: the order's, and the augmentation's where it has its own) and the batches
    served since; load_state_dict() (a resume) restores them and replays the served batches' random
    draws at once, outside any timing: the next iteration continues with the next batch, as the
    uninterrupted run. A subclass gives `generators` (what its order and augmentation draw from),
    `_order()` (the epoch's order, drawn at its start) and `_batch(order, i)`."""

    generators: tuple = ()  # the loader's own random generators
    position = 0            # batches served in the epoch in progress
    _start = None           # the generators' states at its start
    _pending = None         # (order, first batch) set by resume_at

    def close(self) -> None:
        """Release what the loader holds beyond memory (LoaderBatches: its worker processes)."""

    def __iter__(self):
        order, first = self._pending or (self._begin(), 0)
        self._pending = None
        for i in range(first, len(self)):
            self.position = i + 1
            yield self._batch(order, i)
        self.position = 0

    def _states(self) -> list:
        return [g.get_state() for g in self.generators]

    def _begin(self):
        self._start, self.position = self._states(), 0
        return self._order()

    def resume_at(self, batch: int) -> None:
        """The next iteration serves the current epoch from batch `batch` on (the generators at the
        epoch's start)."""
        order = self._begin()
        for i in range(batch):
            self._batch(order, i)
        self._pending, self.position = (order, batch), batch

    def state_dict(self) -> dict:
        return {
            "generators": self._start if self.position else self._states(),
            "batch": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        for g, saved in zip(self.generators, state["generators"], strict=True):
            g.set_state(saved)
        self.resume_at(state["batch"])


class DeviceBatches(Resumable):
    """Batches of a device-resident uint8 split, augmented and normalised on the device.

    train=True: a fresh permutation each epoch (from this loader's own generator, so the same seed
    gives the same batches), the last incomplete batch dropped, crop/flip/cutout applied.
    train=False: in order, every sample. `size`: the side of the batches served (resized on the
    device when it differs from the images'). `shard=(rank, world)`: serve this rank's slice
    (batch_size / world samples) of each global batch.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        mean,
        std,
        *,
        device: torch.device,
        train: bool,
        crop_padding: int = 0,
        flip: bool = False,
        cutout: int = 0,
        size: int | None = None,
        seed: int = 0,
        channels_last: bool = False,
        shard: tuple[int, int] = (0, 1),
    ):
        self.images = images.to(device, non_blocking=True)
        self.labels = labels.to(device, non_blocking=True)
        self.batch_size = batch_size
        self.device = device
        self.train = train
        self.augment = dict(
            pad=crop_padding if train else 0, flip=flip and train, cutout=cutout if train else 0
        )
        self.size = size
        self.image_shape = (images.shape[1], size or images.shape[2], size or images.shape[3])
        self.channels_last = channels_last
        self.mean, self.std = norm_tensors(mean, std, device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.generators = (self.generator,)
        n = len(self.images)
        self.drop_last = train and n >= batch_size
        self.shard = shard
        same_size = size is None or (size, size) == tuple(images.shape[-2:])
        self.gather = (
            gather_tables(images.shape[-2:], crop_padding, cutout, device)
            if train and crop_padding and same_size
            else None
        )   # the one-gather path (gathered); else transform (prepare)

    def __len__(self) -> int:
        n = len(self.images)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _order(self):
        return (
            torch.randperm(len(self.images), device=self.device, generator=self.generator)
            if self.train
            else None
        )

    def _batch(self, order, i: int):
        sl = slice(i * self.batch_size, min((i + 1) * self.batch_size, len(self.images)))
        idx = order[sl] if order is not None else sl
        if self.shard[1] > 1:
            idx = shard_of(idx, self.shard)
        if self.gather is not None:
            return self.gathered(idx), self.labels[idx]
        return self.transform(self.images[idx]), self.labels[idx]

    def gathered(self, idx: torch.Tensor) -> torch.Tensor:
        """What transform(images[idx]) serves, in fewer ops: the crop, the flip and the batch's
        selection in one gather from the uint8 split (reflect padding as an index table), converted
        to float in the batch's layout, then normalised and cut out as `prepare` does. The same
        random draws in the same order, the same values (a gather copies; the normalisation is the
        same elementwise arithmetic), so the same batches bit for bit
        (tests/unit/data/test_pipeline.py); 22 ops a batch (33 with cutout), where `prepare` took
        33 (55), with half the passes over the batch."""
        a = self.augment
        rows, cols = crop_flip_index(
            len(idx), self.gather, a["pad"], a["flip"], self.generator, self.shard
        )
        x = self.images[idx.view(-1, 1, 1), :, rows.unsqueeze(2), cols.unsqueeze(1)].permute(
            0, 3, 1, 2
        )
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        x = (x.to(torch.float32, memory_format=layout) - self.mean) / self.std
        if a["cutout"]:  # in place: x keeps its layout
            x.masked_fill_(
                cutout_mask(len(idx), self.gather, a["cutout"], self.generator, self.shard), 0.0
            )
        return x

    def transform(self, batch: torch.Tensor) -> torch.Tensor:
        x = prepare(
            batch,
            self.mean,
            self.std,
            size=self.size,
            generator=self.generator,
            shard=self.shard,
            **self.augment,
        )
        return in_layout(x, self.channels_last)


class LoaderBatches(Resumable):
    """The classic path: a torch DataLoader over the uint8 split on the CPU, the same transforms as
    DeviceBatches applied per sample in `workers` processes, batches pinned (on CUDA) and copied to
    the device. The order comes from a generator seeded with `seed`; each worker's augmentation RNG
    from the DataLoader's per-worker seeds (with workers=0, from a generator seeded with seed + 1,
    saved with the order)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        mean,
        std,
        *,
        device: torch.device,
        train: bool,
        crop_padding: int = 0,
        flip: bool = False,
        cutout: int = 0,
        size: int | None = None,
        seed: int = 0,
        channels_last: bool = False,
        workers: int = 2,
        pin_memory: bool = True,
    ):
        augment = dict(
            pad=crop_padding if train else 0, flip=flip and train, cutout=cutout if train else 0
        )
        self.augment_generator = (
            torch.Generator().manual_seed(seed + 1) if train and workers == 0 else None
        )
        norm = norm_tensors(mean, std, torch.device("cpu"))
        if augment["pad"] and (size is None or (size, size) == tuple(images.shape[-2:])):
            samples = _PaddedSamples(
                images.cpu(), labels.cpu(), *norm, generator=self.augment_generator, **augment
            )
        else:
            samples = _PreparedSamples(
                images.cpu(),
                labels.cpu(),
                *norm,
                size=size,
                generator=self.augment_generator,
                **augment,
            )
        self.loader = DataLoader(
            samples,
            batch_size,
            shuffle=train,
            drop_last=train and len(images) >= batch_size,
            num_workers=workers,
            pin_memory=pin_memory and device.type != "cpu",
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(seed),
            worker_init_fn=leave_stopping_to_the_job if workers > 0 else None,
        )
        self.device = device
        self.channels_last = channels_last
        self.image_shape = (images.shape[1], size or images.shape[2], size or images.shape[3])
        self.generators = tuple(
            g for g in (self.loader.generator, self.augment_generator) if g is not None
        )
        if workers > 0:
            _WITH_WORKERS.add(self)

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        """Stop the worker processes now, as the job ends (they ignore the stop signals that reach
        the whole process group: leave_stopping_to_the_job); without it, interpreter exit would
        terminate-and-join them."""
        iterator, self.loader._iterator = getattr(self.loader, "_iterator", None), None
        if iterator is not None:
            iterator._shutdown_workers()

    def _order(self):
        """The epoch's DataLoader iterator (the augmentation draws of a resume are exact only with
        workers=0: persistent workers keep the seeds they were started with)."""
        return iter(self.loader)

    def _batch(self, order, i: int):
        x, y = next(order)
        return in_layout(x.to(self.device, non_blocking=True), self.channels_last), y.to(
            self.device, non_blocking=True
        )


_WITH_WORKERS = weakref.WeakSet()   # the LoaderBatches whose workers may still run


@atexit.register   # registered after multiprocessing's own exit hook, so it runs first
def _close_all() -> None:
    """At interpreter exit, stop every loader's workers the code did not close: multiprocessing's
    exit hook would terminate them (SIGTERM, which they ignore) and wait for them."""
    for loader in list(_WITH_WORKERS):
        loader.close()


def leave_stopping_to_the_job(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT: `timeout`, Slurm's scancel and a terminal's
    Ctrl-C signal the whole process group, and a worker that died of it failed the job (the
    DataLoader's SIGCHLD handler raises "worker killed by signal" wherever the main process is)
    where the job should stop after its step, write its checkpoint and end `interrupted`
    (signals.py). The main process shuts its workers down as it ends; a worker whose main process
    died exits by itself (the DataLoader's watchdog)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _PreparedSamples(Dataset):
    def __init__(self, images, labels, mean, std, **transform):
        self.images, self.labels, self.mean, self.std, self.transform = (
            images,
            labels,
            mean,
            std,
            transform,
        )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return prepare(self.images[i : i + 1], self.mean, self.std, **self.transform)[
            0
        ], self.labels[i]


class _PaddedSamples(Dataset):
    """Page's step-1 data: the whole split padded (reflect) and normalised once, up front
    (dawn.py@55be9b98 lines 33-40, inside his timer: here in the loader's construction, timed as
    preprocess_time_s), then per sample a crop (a view), a flip and a cutout. The same draws in the
    same order as `prepare` on one image and the same values (padding and cropping copy, normalising
    is elementwise), so the same samples bit for bit (tests/unit/data/test_pipeline.py), at a few
    ops a sample where `prepare` took ~30: what lets num_workers=0 keep up."""

    def __init__(self, images, labels, mean, std, *, pad: int, flip: bool, cutout: int,
                 generator: torch.Generator | None):
        self.padded = (F.pad(images.float(), (pad, pad, pad, pad), mode="reflect") - mean) / std
        self.labels, self.size, self.pad = labels, tuple(images.shape[-2:]), pad
        self.flip, self.cutout, self.generator = flip, cutout, generator

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        (h, w), g = self.size, self.generator
        oy, ox = (int(torch.randint(0, 2 * self.pad + 1, (1,), generator=g)) for _ in range(2))
        x = self.padded[i, :, oy:oy + h, ox:ox + w]
        if self.flip and float(torch.rand(1, generator=g)) < 0.5:
            x = x.flip(2)
        if self.cutout:
            y0, x0 = (
                int(torch.randint(0, n - self.cutout + 1, (1, 1, 1), generator=g)) for n in (h, w)
            )
            x = x.clone()
            x[:, y0:y0 + self.cutout, x0:x0 + self.cutout] = 0.0
        return x, self.labels[i]


def in_layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """The batch in the memory layout trainer.channels_last asks for: NHWC (channels_last) or NCHW.
    Both are explicit: the crop's gather leaves NHWC strides (random_crop), which would otherwise
    train NHWC either way."""
    return x.contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )


def norm_tensors(mean, std, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel mean/std in [0, 1] as [1, C, 1, 1] tensors on the 0..255 pixel scale."""
    as_tensor = lambda v: (
        (torch.tensor(v, dtype=torch.float64) * 255).to(device, torch.float32).view(1, -1, 1, 1)
    )  # noqa: E731
    return as_tensor(mean), as_tensor(std)


def prepare(
    batch: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    pad: int = 0,
    flip: bool = False,
    cutout: int = 0,
    size: int | None = None,
    generator: torch.Generator | None = None,
    shard: tuple[int, int] = (0, 1),
) -> torch.Tensor:
    """uint8 [B, C, H, W] -> float32 batch: random crop (reflect pad), flip, resize to `size`,
    normalise, cutout. `shard=(rank, world)`: `batch` is this rank's slice of a global batch of B *
    world; the random draws are made for the global batch and sliced alike, so they equal one
    process's draws for the whole batch."""
    x = batch.float()
    if pad:
        x = random_crop(x, pad, generator, shard)
    if flip:
        x = random_flip(x, generator, shard)
    if size and tuple(x.shape[-2:]) != (size, size):
        x = F.interpolate(
            x, size=(size, size), mode="bilinear", align_corners=False, antialias=size < x.shape[-1]
        )
    x = (x - mean) / std
    if cutout:
        x = random_cutout(x, cutout, generator, shard)
    return x


def shard_of(t: torch.Tensor, shard: tuple[int, int]) -> torch.Tensor:
    """Rank `shard[0]`'s equal slice (along dim 0) of `t`, split into `shard[1]` parts."""
    rank, world = shard
    if world == 1:
        return t   # no slice op: one process serves the whole batch
    b = len(t) // world
    return t[rank * b:(rank + 1) * b]


def random_crop(x: torch.Tensor, pad: int, generator: torch.Generator | None,
                shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Per-sample random crop of the original size from the reflect-padded batch (offsets 0..2*pad).
    The gather runs in NHWC, so the result has NHWC strides; the loaders set the layout last
    (in_layout)."""
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    oy = shard_of(
        torch.randint(0, 2 * pad + 1, (b * shard[1],), device=x.device, generator=generator), shard
    )
    ox = shard_of(
        torch.randint(0, 2 * pad + 1, (b * shard[1],), device=x.device, generator=generator), shard
    )
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, :, None]      # [B, H, 1]
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, :]      # [B, 1, W]
    batch_idx = torch.arange(b, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch_idx, rows, cols].permute(0, 3, 1, 2)


def gather_tables(hw, pad: int, cutout: int, device: torch.device) -> dict:
    """Index tables of the one-gather batches (DeviceBatches.gathered). rows, cols: the source index
    of each position of an image reflect-padded by `pad` (F.pad's reflect: -1 -> 1, H -> H - 2);
    rows_at, cols_at and cols_mirrored: the output positions forward and mirrored; with `cutout`,
    rows_cut[y0] and cols_cut[x0]: whether each row (column) lies in a square of that side starting
    at y0 (x0)."""
    tables = {}
    for name, n in zip(("rows", "cols"), hw):
        k = torch.arange(-pad, n + pad, device=device)
        tables[name] = torch.where(k < 0, -k, torch.where(k > n - 1, 2 * (n - 1) - k, k))
        tables[name + "_at"] = at = torch.arange(n, device=device)
        if cutout:
            start = torch.arange(n - cutout + 1, device=device)[:, None]
            tables[name + "_cut"] = (at >= start) & (at < start + cutout)
    tables["cols_mirrored"] = tables["cols_at"].flip(0)
    return tables


def crop_flip_index(b: int, tables: dict, pad: int, flip: bool, generator: torch.Generator | None,
                    shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, H], cols [B, W]): the source row and column in the unpadded image of each pixel of
    each sample's random crop (offsets 0..2*pad of the reflect-padded image) and, with `flip`, its
    random mirror: the draws of random_crop then random_flip, in their order and shapes."""
    device = tables["rows"].device
    oy = shard_of(
        torch.randint(0, 2 * pad + 1, (b * shard[1],), device=device, generator=generator), shard
    )
    ox = shard_of(
        torch.randint(0, 2 * pad + 1, (b * shard[1],), device=device, generator=generator), shard
    )
    at = tables["cols_at"]
    if flip:
        mirror = shard_of(torch.rand(b * shard[1], device=device, generator=generator), shard) < 0.5
        at = torch.where(mirror.unsqueeze(1), tables["cols_mirrored"], at)
    return tables["rows"][oy.unsqueeze(1) + tables["rows_at"]], tables["cols"][ox.unsqueeze(1) + at]


def cutout_mask(b: int, tables: dict, side: int, generator: torch.Generator | None,
                shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """random_cutout's mask [B, 1, H, W] (the same draws, in its order and shapes) from the tables'
    bands."""
    h, w = len(tables["rows_at"]), len(tables["cols_at"])
    device = tables["rows"].device
    y0 = shard_of(
        torch.randint(0, h - side + 1, (b * shard[1], 1, 1), device=device, generator=generator),
        shard,
    )
    x0 = shard_of(
        torch.randint(0, w - side + 1, (b * shard[1], 1, 1), device=device, generator=generator),
        shard,
    )
    return (
        tables["rows_cut"][y0.view(-1)].unsqueeze(2) & tables["cols_cut"][x0.view(-1)].unsqueeze(1)
    ).unsqueeze(1)


def random_flip(
    x: torch.Tensor, generator: torch.Generator | None, shard: tuple[int, int] = (0, 1)
) -> torch.Tensor:
    mask = (
        shard_of(torch.rand(x.shape[0] * shard[1], device=x.device, generator=generator), shard)
        < 0.5
    )
    return torch.where(mask[:, None, None, None], x.flip(3), x)


def random_cutout(x: torch.Tensor, side: int, generator: torch.Generator | None,
                  shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Zero one side x side square per sample, placed uniformly where it fits inside the image
    (DeVries & Taylor 2017, as in Page's ResNet-9 runs); applied after normalisation, so the square
    reads as the mean colour."""
    b, _, h, w = x.shape
    y0 = shard_of(
        torch.randint(0, h - side + 1, (b * shard[1], 1, 1), device=x.device, generator=generator),
        shard,
    )
    x0 = shard_of(
        torch.randint(0, w - side + 1, (b * shard[1], 1, 1), device=x.device, generator=generator),
        shard,
    )
    rows = torch.arange(h, device=x.device)[None, :, None]
    cols = torch.arange(w, device=x.device)[None, None, :]
    inside = (rows >= y0) & (rows < y0 + side) & (cols >= x0) & (cols < x0 + side)   # [B, H, W]
    return x.masked_fill(inside[:, None], 0.0)
