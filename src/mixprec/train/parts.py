"""A job's parts, built before the clock (torchtitan's shape: build, then train): an image
classifier's or a language model's steps, training batches, precision policy, optimizer and what
the job records about them, as one `Parts`; the wrapper of the trained model (DDP or FSDP, from
train/parallel.py), prewarm and the compile warm-up (train/warmup.py, train/compile.py), and the
job's numerics probe. Each builder takes the job's `JobContext`: config, device, ranks and
per-rank batch, with what the job around it (job.py) knows of its records (dir, W&B group and
name, stop signals, the checkpoint to resume).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..config import Config
from ..data import Resumable, build_image_data, image_loaders
from ..data.wikitext import TokenWindows, batchify, load_text_corpus
from ..models import build_model, forward_flops
from ..models.resnet9 import resnet9_options
from ..numerics.probe import build_probe
from ..precision import modes
from ..precision.modes import emulates
from ..precision.policy import PrecisionPolicy
from ..runtime import dist, hardware
from . import image_steps, loop, parallel, tricks
from .build import build_trained
from .compile import GraphWatch, compile_model, warm_compile
from .lm_steps import LMSteps
from .optim import build_schedule
from .warmup import image_warmup, lm_warmup, prewarm, prewarm_lm, reset_peak


def no_stop() -> None:
    """The stop check of a job no signal stops (a replay, a test): never."""
    return None


@dataclasses.dataclass(frozen=True)
class JobContext:
    """What one job runs with besides its parts, in one object: the validated config, the device,
    the ranks and each rank's batch (per_rank: dist.check's), and for the job's records its dir,
    its W&B group and run name, its stop check (`stop`: the job's stop signals, active since before
    the set-up: the loop stops after a step) and the agreed checkpoint to resume (None: start
    over)."""
    config: Config
    device: torch.device
    ranks: dist.Ranks = dist.SINGLE
    per_rank: int = 0
    out_dir: Path | None = None
    group: str | None = None
    name: str = "run"
    stop: Callable[[], str | None] = no_stop
    resume: dict | None = None

    @property
    def emulated(self) -> bool:
        """Whether the job's fp16/bf16 arithmetic is emulated (under FSDP the weights are cast to
        real fp16/bf16 tensors: precision/fsdp.py)."""
        return emulates(self.config.precision, self.device, self.config.trainer.sharded)


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a job trains, built before the clock: the job kind's steps (ImageSteps, LMSteps) and
    training batches, the precision policy and the optimizer; the trained model (`model`) and the
    weights evaluated and saved (`final`: the EMA's if any); what the checkpoint saves besides
    (`checkpointed`: the EMA, a language model's hidden state); the classes (or vocabulary) the
    saved weights predict; the optimizer's weight-decay groups, compile's GraphWatch, and the
    summary's metrics and data blocks."""
    steps: object
    batches: object
    policy: PrecisionPolicy
    optimizer: torch.optim.Optimizer
    model: nn.Module
    final: nn.Module
    checkpointed: dict
    num_classes: int
    groups: list
    watch: GraphWatch
    metrics: dict
    data: dict


def build_parts(ctx: JobContext) -> Parts:
    """The job's parts: a language model's or an image classifier's."""
    build = language_model_parts if ctx.config.model.is_language_model else image_parts
    return build(ctx)


@contextlib.contextmanager
def built_parts(ctx: JobContext):
    """The job's parts (build_parts) for its training, then ended whatever ended it: a
    DataLoader's workers and FSDP's mesh groups (aborted under NCCL when the job failed:
    parallel.release_meshes)."""
    parts, failed = None, True
    try:
        parts = build_parts(ctx)
        yield parts
        failed = False
    finally:
        steps, batches = (parts.steps, parts.batches) if parts is not None else (None, None)
        for loader in (batches, getattr(steps, "test_batches", None)):
            if isinstance(loader, Resumable):
                loader.close()
        parallel.release_meshes(failed)


def timed_image_loaders(ctx: JobContext, data) -> tuple:
    """The training and test batches of `data` for this rank, and the seconds their preparation
    took: Page's clock starts before his preprocessing (dawn.py at 37a13cc:79-87)."""
    config = ctx.config
    start = time.perf_counter()
    train_batches, test_batches = image_loaders(data, config.dataset, config.trainer, ctx.device,
                                                seed=config.seed,
                                                shard=(ctx.ranks.rank, ctx.ranks.world))
    hardware.synchronize(ctx.device)
    return train_batches, test_batches, time.perf_counter() - start


def image_model(ctx: JobContext, data) -> tuple:
    """The image classifier, built as the config says (resnet9: Page's switches and the whitening
    fit), and the seconds the whitening fit took (its setup time)."""
    config, t = ctx.config, ctx.config.trick
    resnet9 = config.model.arch == "resnet9"
    whitening, setup_s = tricks.fit_whitening(t, data, ctx.device) if resnet9 else (None, 0.0)
    options = resnet9_options(t, whitening) if resnet9 else {}
    return build_model(config.model, data.num_classes, **options), setup_s


def image_parts(ctx: JobContext) -> Parts:
    """An image classifier's steps, training batches, policy, optimizer, and what the job records
    about it; ctx.per_rank: each rank's batch (its slice of the global batch)."""
    config, device = ctx.config, ctx.device
    tr, t = config.trainer, config.trick
    data = build_image_data(config.dataset)
    train_batches, test_batches, preprocess_s = timed_image_loaders(ctx, data)
    model, setup_s = image_model(ctx, data)
    flops = forward_flops(model, torch.zeros(1, *train_batches.image_shape))
    n_params = sum(p.numel() for p in model.parameters())
    built = build_trained(model, config, device, t.bn_bias_lr, tr.channels_last,
                          wrap=wrapper(ctx))
    model, net, policy, optimizer = built.model, built.net, built.policy, built.optimizer
    schedule = build_schedule(config.schedule, optimizer, loop.total_steps(tr, len(train_batches)))
    ema = tricks.EMA(model, t.ema_momentum, t.ema_every) if t.ema else None
    steps = image_steps.ImageSteps(net, schedule, test_batches, label_smoothing=t.label_smoothing,
                                   loss_sum=t.loss_sum, ema=ema, tta=t.tta,
                                   bn_eval=config.model.bn_eval, setup_time_s=setup_s)
    # Page's clock: untimed warm-up steps on throwaway copies before the clock starts (warmup.py),
    # then the compilation of the model the loop trains, also before the clock (train/compile.py)
    prewarm_s = prewarm(model, policy, optimizer, first_prewarm(tr, device), ctx.per_rank,
                        train_batches.image_shape, data.num_classes, tr.channels_last, tr.grad_clip)
    modes.refuse_emulated_compile(config.precision, tr.compile, policy.emulated)
    shapes = image_warmup(min(ctx.per_rank, len(data.train_y) // ctx.ranks.world),
                          tr.eval_batch_size, len(data.test_y), train_batches.image_shape,
                          data.num_classes, tr.channels_last, config.model.bn_eval,
                          evaluates=ema is None)   # an EMA job evaluates ema.model, eagerly
    compile_s, watch = compile_and_warm(steps, net, policy, tr.compile, shapes, optimizer)
    return Parts(
        steps, train_batches, policy, optimizer, model,
        final=model if ema is None else ema.model,
        checkpointed={} if ema is None else {"ema": ema},
        num_classes=data.num_classes, groups=built.groups, watch=watch,
        metrics={"params": n_params, "forward_flops_per_sample": flops,
                 "prewarm_time_s": prewarm_s, "preprocess_time_s": preprocess_s,
                 "compile_time_s": compile_s,
                 "train_flops_per_sample": None if flops is None else 3 * flops},
        data={**data.info, "train": len(data.train_y), "test": len(data.test_y),
              "mean": data.mean, "std": data.std},
    )


def first_prewarm(tr, device: torch.device) -> int:
    """The job's prewarm steps (TrainerConfig.prewarm_for), knowing whether it is the process's
    first job (hardware.configure counted it)."""
    return tr.prewarm_for(device.type, first_in_process=hardware.JOBS_IN_PROCESS == 1)


def wrapper(ctx: JobContext):
    """What wraps the trained model: FSDP's sharding (trainer.strategy=fsdp) over the mesh of
    trainer.replicate, else DDP under several ranks, else nothing."""
    config, device, ranks = ctx.config, ctx.device, ctx.ranks
    if config.trainer.sharded:
        shape = dist.mesh_shape(config.trainer.replicate, ranks)
        return lambda m: parallel.shard(m, config.precision, device, shape, config.trainer.compile)
    return lambda m: parallel.wrap(m, device, config.trainer.sync_bn, ranks)


def compile_and_warm(steps, net: torch.nn.Module, policy: PrecisionPolicy, mode: str,
                     warmup, optimizer: torch.optim.Optimizer) -> tuple:
    """The loop's model (steps.model) compiled in `mode` and warmed for `warmup`'s shapes before the
    clock, then the device's peak reset (prewarm's copies are gone: the peak is the run's own,
    warmup.py). Returns the warm-up's seconds and the GraphWatch that records the job's graphs (the
    model's; `optimizer`'s apart) and eager calls. The compile workers started with the model's
    build (build.build_trained)."""
    steps.model = compile_model(net, mode, options=policy.compile_options())
    watch = GraphWatch(net, mode, optimizer)
    seconds = warm_compile(steps.model, policy, mode, warmup)
    watch.warmed()
    reset_peak(policy.device)
    return seconds, watch


def language_model_parts(ctx: JobContext) -> Parts:
    """A word-level language model on a text corpus (see train/lm_steps.py); throughput and FLOPs
    are per token. ctx.per_rank: each rank's columns (the whole batch in one process; FSDP's ranks
    split it)."""
    config, device, ranks, per_rank = ctx.config, ctx.device, ctx.ranks, ctx.per_rank
    tr, bptt = config.trainer, config.dataset.bptt
    corpus = load_text_corpus(config.dataset)
    # under FSDP each rank trains on its columns of the global batch; every rank scores the whole
    # validation and test splits (the same forwards: FSDP's all-gathers are collectives)
    train_source = batchify(corpus.train, tr.batch_size, device)[
        :, ranks.rank * per_rank:(ranks.rank + 1) * per_rank].contiguous()
    valid_source, test_source = (batchify(ids, tr.eval_batch_size, device)
                                 for ids in (corpus.valid, corpus.test))
    windows = TokenWindows(train_source, bptt)
    model = build_model(config.model, corpus.vocab_size)
    flops = model.flops_per_token(bptt)
    n_params = sum(p.numel() for p in model.parameters())
    built = build_trained(model, config, device, wrap=wrapper(ctx))
    model, policy, optimizer, groups = built.model, built.policy, built.optimizer, built.groups
    schedule = build_schedule(config.schedule, optimizer, loop.total_steps(tr, len(windows)))
    steps = LMSteps(model, schedule, valid_source, test_source, bptt, columns=per_rank)
    prewarm_s = prewarm_lm(model, policy, optimizer, first_prewarm(tr, device), bptt, per_rank,
                           corpus.vocab_size, tr.grad_clip)
    modes.refuse_emulated_compile(config.precision, tr.compile, policy.emulated)
    shapes = lm_warmup(len(train_source), per_rank, [len(valid_source), len(test_source)],
                       tr.eval_batch_size, bptt, corpus.vocab_size)
    compile_s, watch = compile_and_warm(steps, model, policy, tr.compile, shapes, optimizer)
    return Parts(
        steps, windows, policy, optimizer, model, final=model, checkpointed={"hidden": steps},
        num_classes=corpus.vocab_size, groups=groups, watch=watch,
        metrics={"params": n_params, "forward_flops_per_sample": flops,
                 "train_flops_per_sample": 3 * flops, "flops_per": "token",
                 "prewarm_time_s": prewarm_s, "compile_time_s": compile_s},
        data={**corpus.info, "vocab_size": corpus.vocab_size,
              "train_tokens": len(corpus.train), "valid_tokens": len(corpus.valid),
              "test_tokens": len(corpus.test), "bptt": bptt},
    )


@contextlib.contextmanager
def probed(ctx: JobContext, model):
    """The job's numerics probe (numerics/probe.py): rank 0 records numerics.jsonl in ctx.out_dir;
    closed however training ends. Under FSDP it sees no model (its layers hold shards outside their
    unit's forward): skips are counted, not attributed to parameters."""
    probe = build_probe(ctx.config.probe, None if ctx.config.trainer.sharded else model,
                        ctx.out_dir if ctx.ranks.main else None)
    try:
        yield probe
    finally:
        probe.close()
