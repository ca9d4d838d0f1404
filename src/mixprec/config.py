"""Dataclass schemas for the composed Hydra config.

Hydra composes plain YAML values; `validate(cfg)` turns them into these frozen dataclasses and
rejects a bad value before any work starts, with one line naming the field, the value and what is
allowed. Every other module receives these typed objects (or plain values taken from them), never
the raw DictConfig.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config value that cannot work. The message is one line meant for the user."""


# the one line for fused SGD over FSDP's DTensors: the config's check, and train/optim.py's for the
# scripts that build an optimizer without it
FUSED_SGD_SHARDED = ("optimizer.impl=fused: torch's fused SGD has no DTensor rule, and FSDP's "
                     "parameters are DTensors (trainer.strategy=fsdp); use optimizer.impl=auto or "
                     "foreach")


# optimizer names that are torchao's low-bit AdamW (OptimizerConfig.low_bit)
LOW_BIT_OPTIMIZERS = ("adamw8bit", "adamw4bit", "adamw_fp8")

DType = Literal["float32", "float16", "bfloat16"]
# model.arch values that are recurrent language models
RNN_KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
# model.arch values that are word-level language models
LM_ARCHS = RNN_KINDS + ("gpt",)


@dataclass(frozen=True)
class TrainerConfig:
    epochs: int = 2
    max_steps: Optional[int] = None
    batch_size: int = 64
    eval_batch_size: int = 256
    # the first N batches of each evaluated split (a short run on real data); None: every batch
    eval_batches: Optional[int] = None
    device: str = "auto"
    target_acc: Optional[float] = None
    on_nonfinite: Literal["stop", "skip", "continue"] = "stop"
    deterministic: bool = False
    cudnn_benchmark: bool = True
    channels_last: bool = True
    warmup_steps: int = 5
    log_every: int = 50
    grad_clip: Optional[float] = None
    resume: Literal["auto", "never"] = "never"
    # under DDP (torchrun): BatchNorm statistics over the global batch (SyncBatchNorm, GPUs)
    sync_bn: bool = False
    # untimed steps on a throwaway copy before the clock (warmup.py); auto: 3 on a GPU, on a
    # CPU 1 for the process's first job (its one-time costs) and 0 after
    prewarm_steps: Union[int, Literal["auto"]] = "auto"
    # torch.compile mode (train/compile.py)
    compile: Literal["none", "default", "max-autotune", "reduce-overhead"] = "none"
    # how the ranks share the model: auto = DDP under torchrun, one process otherwise; fsdp = FSDP2
    # (fully_shard: parameters, gradients and optimizer state sharded), also on one rank
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    # trainer.strategy=fsdp only: the replicate degree of FSDP's device mesh (HSDP,
    # train/parallel.py). auto = the number of nodes (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE,
    # submitit's nodes; 1 when unknown): shard within each node, replicate across nodes; N: N
    # replicas, each sharding over world / N ranks (1: every rank shards, a 1-D mesh; the world
    # size: pure replication)
    replicate: Union[int, Literal["auto"]] = "auto"
    # write the final fp32 weights (model_fp32.pt) of a finished job; false for speed-only jobs
    save_weights: bool = True

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def prewarm_for(self, device_type: str, first_in_process: bool = False) -> int:
        """prewarm_steps, with auto resolved: 3 on an accelerator (autotuning, lazy init); on a CPU
        1 for the process's first job (a sweep's first: lazy imports and initialisation, the
        allocator's growth, paid before its clock, not in it), else 0; 0 under FSDP (prewarm's
        deep copy of a sharded model is not one it can step)."""
        if self.prewarm_steps != "auto":
            return self.prewarm_steps
        if self.sharded:
            return 0
        return (1 if first_in_process else 0) if device_type == "cpu" else 3

    def check(self) -> None:
        _at_least(self, "epochs", 1)
        _at_least(self, "batch_size", 1)
        _at_least(self, "eval_batch_size", 1)
        _at_least(self, "warmup_steps", 0)
        if self.prewarm_steps != "auto":
            _at_least(self, "prewarm_steps", 0)
        if self.replicate != "auto":
            _at_least(self, "replicate", 1)
        _at_least(self, "log_every", 1)
        if self.max_steps is not None:
            _at_least(self, "max_steps", 1)
        if self.eval_batches is not None:
            _at_least(self, "eval_batches", 1)
        if self.target_acc is not None and not 0.0 < self.target_acc <= 1.0:
            raise ConfigError(
                f"trainer.target_acc={self.target_acc}: must be a fraction in (0, 1], e.g. 0.94, "
                "or null"
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(
                f"trainer.grad_clip={self.grad_clip}: must be a positive number or null"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(
                f"trainer.device={self.device!r}: allowed values are auto, cpu, cuda, cuda:N"
            )


@dataclass(frozen=True)
class ModelConfig:
    arch: Literal[
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "small_cnn",
        "resnet9",
        "lstm",
        "gru",
        "rnn_tanh",
        "rnn_relu",
        "gpt",
    ]
    stem: Literal["cifar", "imagenet"] = "cifar"
    width: int = 32
    # BatchNorm stays in eval mode while training (frozen statistics, as in fine-tuning)
    bn_eval: bool = False
    channels: tuple = (64, 128, 256, 512)   # resnet9: prep, layer1, layer2, layer3
    output_scale: float = 0.125             # resnet9: logits = scale * linear(features)
    # recurrent language models (lstm, gru, rnn_tanh, rnn_relu) only; defaults = PyTorch's
    # word_language_model
    emsize: int = 200
    nhid: int = 200
    nlayers: int = 2
    dropout: float = 0.2
    tied: bool = False        # the decoder shares the embedding's weights (needs emsize == nhid)
    # pad the vocabulary to a multiple of this (apex: 8, for tensor-core GEMMs)
    vocab_multiple: int = 1
    # torchvision ResNets: fastai 1.0's create_cnn (models.fastai_cnn)
    # fastai: concat-pool + BN/dropout/linear head
    head: Literal["torchvision", "fastai"] = "torchvision"
    # torchvision's ImageNet weights for the ResNet body (must be in the torch hub cache)
    pretrained: bool = False
    # body weights frozen, its BatchNorm layers still trained (fastai's freeze, train_bn)
    freeze_body: bool = False
    # gpt only (dropout and vocab_multiple above apply too)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    # longest context (position embeddings); dataset.bptt must not exceed it
    block_size: int = 128

    def check(self) -> None:
        _at_least(self, "width", 1, section="model")
        if len(self.channels) != 4 or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in self.channels
        ):
            raise ConfigError(
                f"model.channels={list(self.channels)}: must be 4 positive integers (prep, layer1, "
                "layer2, layer3)"
            )
        if not self.output_scale > 0:
            raise ConfigError(f"model.output_scale={self.output_scale}: must be > 0")
        for name in (
            "emsize",
            "nhid",
            "nlayers",
            "vocab_multiple",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
        ):
            _at_least(self, name, 1, section="model")
        if self.arch == "gpt" and self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd}: must be a multiple of model.n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout}: must be in [0, 1)")
        if self.tied and not self.is_language_model:
            raise ConfigError(
                "model.tied=true: only the recurrent language models have tied weights "
                f"(model={self.arch})"
            )
        if self.tied and self.emsize != self.nhid:
            raise ConfigError(
                f"model.tied=true: needs model.emsize == model.nhid (got {self.emsize} and "
                f"{self.nhid})"
            )
        if self.bn_eval and self.is_language_model:
            raise ConfigError(f"model.bn_eval=true: model={self.arch} has no BatchNorm")
        torchvision_resnet = self.arch in (
            "resnet18",
            "resnet34",
            "resnet50",
            "resnet101",
            "resnet152",
        )
        for name in ("pretrained", "freeze_body"):
            if getattr(self, name) and not torchvision_resnet:
                raise ConfigError(
                    f"model.{name}=true: only the torchvision ResNets (resnet18..resnet152) have "
                    f"it (model={self.arch})"
                )
        if self.head == "fastai" and not torchvision_resnet:
            raise ConfigError(
                "model.head=fastai: only the torchvision ResNets take fastai's head "
                f"(model={self.arch})"
            )
        if self.freeze_body and self.head != "fastai":
            raise ConfigError(
                "model.freeze_body=true: needs model.head=fastai (the head is what trains)"
            )

    @property
    def is_language_model(self) -> bool:
        return self.arch in LM_ARCHS


@dataclass(frozen=True)
class DatasetConfig:
    name: Literal["synthetic", "cifar10", "cifar100", "wikitext2", "synthetic_text"]
    num_classes: int = 10
    # synthetic only (images, or tokens for synthetic_text); real splits are whole
    train_size: Optional[int] = 2048
    test_size: Optional[int] = 512
    # batches are resized to this on the device when it is not 32
    image_size: int = 32
    noise: float = 2.0
    augment: bool = True
    crop_padding: int = 4
    cutout: int = 0                       # side of the square zeroed after normalisation (0 = off)
    # true: a cutout as large as the image (it blanks every image) is meant
    cutout_on_purpose: bool = False
    pipeline: Literal["device", "dataloader"] = "device"
    workers: int = 2                      # dataloader pipeline only
    pin_memory: bool = True               # dataloader pipeline only (used on CUDA)
    data_dir: Optional[str] = None        # null: $MIXPREC_DATA_DIR, else data/ under the project
    download: bool = True
    # CIFAR: archive URLs; wikitext2: folder URLs the file names are appended to
    urls: tuple = ()
    bptt: int = 35                        # text: tokens per (input, target) window
    vocab_size: int = 10000               # synthetic_text only
    seed: int = 1234

    def check(self) -> None:
        fixed = {"cifar10": 10, "cifar100": 100}
        if self.num_classes not in (10, 100):
            raise ConfigError(f"dataset.num_classes={self.num_classes}: allowed values are 10, 100")
        if self.name in fixed and self.num_classes != fixed[self.name]:
            raise ConfigError(
                f"dataset.num_classes={self.num_classes}: {self.name} has {fixed[self.name]} "
                "classes"
            )
        for name in ("train_size", "test_size"):
            value = getattr(self, name)
            if self.name.startswith("synthetic"):
                if value is None:
                    raise ConfigError(f"dataset.{name}: must be set for {self.name} data")
                _at_least(self, name, 1, section="dataset")
            elif value is not None:
                raise ConfigError(
                    f"dataset.{name}={value}: only synthetic data has a size; {self.name} splits "
                    "are used whole (trainer.max_steps makes a short run)"
                )
        _at_least(self, "image_size", 8, section="dataset")
        _at_least(self, "crop_padding", 0, section="dataset")
        _at_least(self, "cutout", 0, section="dataset")
        _at_least(self, "workers", 0, section="dataset")
        _at_least(self, "bptt", 1, section="dataset")
        _at_least(self, "vocab_size", 2, section="dataset")
        self.check_cutout()
        if not self.noise >= 0:
            raise ConfigError(f"dataset.noise={self.noise}: must be >= 0")
        if any(not isinstance(u, str) or "://" not in u for u in self.urls):
            raise ConfigError(
                f"dataset.urls={list(self.urls)}: must be a list of URLs (scheme://...)"
            )

    def check_cutout(self) -> None:
        """A cutout as large as the image blanks every image (the batch is all zeros after
        normalisation): refused unless dataset.cutout_on_purpose says it is meant; larger than the
        image it cannot be placed at all."""
        if self.cutout > self.image_size:
            raise ConfigError(
                f"dataset.cutout={self.cutout}: must be at most "
                f"dataset.image_size={self.image_size}"
            )
        # the crop pads the stored 32 px image
        if self.augment and not self.is_text and self.crop_padding >= 32:
            raise ConfigError(
                f"dataset.crop_padding={self.crop_padding}: the random crop reflect-pads the "
                "stored 32 px images, so the padding must be less than 32 (Page used 4)"
            )
        if self.augment and self.cutout == self.image_size and not self.cutout_on_purpose:
            raise ConfigError(
                f"dataset.cutout={self.cutout} is as large as "
                f"dataset.image_size={self.image_size}: it blanks every image; scale it "
                f"(dataset.cutout={max(self.image_size // 4, 1)}, a quarter of the side as Page's "
                "8 of 32), set dataset.cutout=0, or dataset.cutout_on_purpose=true if blank "
                "inputs are meant"
            )

    @property
    def is_text(self) -> bool:
        return self.name in ("wikitext2", "synthetic_text")


@dataclass(frozen=True)
class PrecisionConfig:
    name: str
    autocast_dtype: Optional[Literal["float16", "bfloat16"]] = None
    param_dtype: DType = "float32"
    master_weights: bool = False
    keep_bn_fp32: bool = True
    loss_scale: Union[float, str] = "none"   # "dynamic" | "none" | a positive number (static scale)
    init_scale: float = 65536.0
    growth_interval: int = 2000
    tf32: bool = False
    # precision=fp8: torchao float8 Linear layers (tensorwise, rowwise); precision=mxfp8: its MXFP8
    # Linear layers (mxfp8: 32-element blocks, one E8M0 scale each)
    fp8_recipe: Optional[Literal["tensorwise", "rowwise", "mxfp8"]] = None
    # fp16/bf16 rounding emulated on fp32 kernels (precision/emulation.py): auto = wherever the
    # device is not CUDA
    emulate: Union[bool, Literal["auto"]] = "auto"
    # clip the model's gradients as backward left them (scaled, in the model's dtype) before they
    # are copied to the masters and unscaled, the threshold applying to the scaled norm: apex
    # word_language_model main.py@28bdc04e:180
    clip_scaled_model_grads: bool = False
    # trainer.strategy=fsdp only: the dtype gradients are reduced in across ranks (FSDP's
    # MixedPrecisionPolicy.reduce_dtype); null = float32, the rule for sharded jobs
    reduce_dtype: Optional[Literal["float32", "bfloat16"]] = None

    def check(self) -> None:
        if self.fp8_recipe is not None:
            if self.autocast_dtype != "bfloat16" or self.param_dtype != "float32":
                raise ConfigError(
                    "precision.fp8_recipe: float8 Linear layers run beside bf16 autocast on fp32 "
                    "weights (autocast_dtype=bfloat16, param_dtype=float32)"
                )
        ls = self.loss_scale
        if isinstance(ls, str) and ls not in ("dynamic", "none"):
            raise ConfigError(f"precision.loss_scale={ls!r}: allowed values are dynamic, none, "
                              "or a positive number (static scale)")
        if not isinstance(ls, str) and not (math.isfinite(ls) and ls > 0):
            raise ConfigError(
                f"precision.loss_scale={ls}: a static loss scale must be a positive finite number"
            )
        if not self.init_scale > 0:
            raise ConfigError(f"precision.init_scale={self.init_scale}: must be > 0")
        _at_least(self, "growth_interval", 1, section="precision")
        if self.master_weights and self.param_dtype == "float32":
            raise ConfigError(
                "precision.master_weights=true: only meaningful with param_dtype float16 or "
                "bfloat16"
            )
        if self.clip_scaled_model_grads and self.loss_scale == "dynamic":
            raise ConfigError(
                "precision.clip_scaled_model_grads=true with loss_scale=dynamic: the clip "
                "threshold would apply to a scale that changes; use a static loss scale (a "
                "number) or none"
            )
        if (
            self.loss_scale == "dynamic"
            and self.param_dtype != "float32"
            and not self.master_weights
        ):
            raise ConfigError(
                f"precision.loss_scale=dynamic with param_dtype={self.param_dtype}: GradScaler "
                "needs fp32 gradients; set precision.master_weights=true (apex O2) or a static "
                "loss scale (a number) or none"
            )

    @property
    def scaled(self) -> bool:
        return self.loss_scale != "none"


@dataclass(frozen=True)
class GpuConfig:
    name: str = "auto"
    # the full device names (as the driver reports them) this profile's peaks are for
    match: tuple = ()
    peak_tflops: dict = field(default_factory=dict)
    memory_gb: Optional[float] = None
    bandwidth_gbs: Optional[float] = None
    source: Optional[str] = None


@dataclass(frozen=True)
class OptimizerConfig:
    # adamw8bit, adamw4bit, adamw_fp8: torchao's AdamW with its two moments in 8-bit, 4-bit or
    # FP8 (e4m3) blocks of one scale each (train/optim.py, docs/pitfalls.md)
    name: Literal["sgd", "adam", "adamw", "adamw8bit", "adamw4bit", "adamw_fp8"]
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    # the step's kernels (optim.impl_kwargs)
    impl: Literal["auto", "fused", "foreach", "loop"] = "auto"
    # which tensors weight_decay applies to: all; matrices (>= 2-D: matmul and embedding weights,
    # not biases and norms); auto: the model family's recipe (matrices for the gpt, all otherwise;
    # optim.DECAY_AUTO)
    decay: Literal["auto", "all", "matrices"] = "auto"
    # optimizer=adamw on bfloat16 weights without fp32 masters (precision=bf16): torchao's AdamW
    # computes the step in fp32 and rounds the new weight to bf16 stochastically (unbiased), so an
    # update below half a unit in the last place moves the weight in expectation
    stochastic_round: bool = False

    @property
    def low_bit(self) -> bool:
        """torchao's AdamW with quantized moments (optimizer=adamw8bit, adamw4bit, adamw_fp8)."""
        return self.name in LOW_BIT_OPTIMIZERS

    def check(self) -> None:
        if self.stochastic_round and self.name != "adamw":
            raise ConfigError(
                f"optimizer.stochastic_round=true: torchao's bf16 stochastic rounding is its "
                f"AdamW's; use optimizer=adamw, not {self.name}"
            )
        if (self.low_bit or self.stochastic_round) and self.impl != "auto":
            raise ConfigError(
                f"optimizer.impl={self.impl}: torchao's AdamW (optimizer={self.name}"
                f"{' stochastic_round' if self.stochastic_round else ''}) has one implementation "
                "of its own; use optimizer.impl=auto"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"optimizer.lr={self.lr}: must be a positive number")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.momentum={self.momentum}: must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay={self.weight_decay}: must be >= 0")
        if self.eps <= 0:
            raise ConfigError(f"optimizer.eps={self.eps}: must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas={list(self.betas)}: must be two numbers in [0, 1)")
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ConfigError("optimizer.nesterov=true: needs optimizer=sgd with momentum > 0")


@dataclass(frozen=True)
class ScheduleConfig:
    name: str = "constant"
    knots: tuple = (0.0, 1.0)
    values: tuple = (1.0, 1.0)
    # plateau only: lr divided by this after an epoch whose validation loss is no better
    factor: float = 4.0
    # fastai_onecycle only (fastai 1.0 fit_one_cycle): cosine lr from lr/div_factor up to lr over
    # pct_start of the steps, then cosine down to lr/(div_factor*final_div); momentum (Adam's beta1)
    # cosine moms[0]
    # -> moms[1] -> moms[0]
    div_factor: float = 25.0
    pct_start: float = 0.3
    final_div: float = 1.0e4
    moms: tuple = (0.95, 0.85)

    def check(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 1):
            raise ConfigError(
                f"schedule.factor={self.factor}: must be a number > 1 (the lr is divided by it)"
            )
        k = list(self.knots)
        if len(k) < 2 or len(k) != len(self.values):
            raise ConfigError(
                "schedule.knots/values: need two or more knots and one value per knot (got "
                f"{len(k)} and {len(self.values)})"
            )
        if k[0] != 0.0 or k[-1] != 1.0 or any(b < a for a, b in zip(k, k[1:])):
            raise ConfigError(
                f"schedule.knots={k}: must rise from 0.0 to 1.0 (fractions of the run's steps)"
            )
        if any(v < 0 for v in self.values):
            raise ConfigError(f"schedule.values={list(self.values)}: lr multipliers must be >= 0")
        if not (self.div_factor > 0 and self.final_div > 0 and 0 < self.pct_start < 1):
            raise ConfigError(
                f"schedule: div_factor={self.div_factor} and final_div={self.final_div} must be > "
                f"0, pct_start={self.pct_start} in (0, 1)"
            )
        if len(self.moms) != 2 or not all(0 <= m < 1 for m in self.moms):
            raise ConfigError(f"schedule.moms={list(self.moms)}: must be two momenta in [0, 1)")


@dataclass(frozen=True)
class TrickConfig:
    """Training tricks, each a plain flag (conf/trick/none.yaml documents them); Page's ladder steps
    set them."""
    name: str = "none"
    label_smoothing: float = 0.0
    loss_sum: bool = False          # sum the loss over the batch instead of averaging it
    maxpool_reorder: bool = False   # resnet9: conv-pool-BN-act instead of conv-BN-act-pool
    celu: bool = False              # resnet9: CELU(celu_alpha) instead of ReLU
    celu_alpha: float = 0.075
    # resnet9: BN statistics per split of ghost_splits in a training batch
    ghost_bn: bool = False
    ghost_splits: int = 16
    frozen_bn_scale: bool = False   # resnet9: BN weights fixed at bn_scale, biases learnt
    bn_scale: float = 1.0
    # lr multiplier of BN biases (their weight decay is divided by it)
    bn_bias_lr: float = 1.0
    # resnet9: fixed 3x3 patch-whitening stem fitted on the training images
    whitening: bool = False
    whitening_eps: float = 0.01
    whitening_images: int = 10000
    ema: bool = False               # evaluate an exponential moving average of the weights
    ema_momentum: float = 0.99
    ema_every: int = 5
    # score the average of the logits of each test image and its mirror
    tta: bool = False

    def check(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"trick.label_smoothing={self.label_smoothing}: must be in [0, 1)")
        for name in ("celu_alpha", "bn_scale", "bn_bias_lr", "whitening_eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"trick.{name}={getattr(self, name)}: must be > 0")
        for name in ("ghost_splits", "whitening_images", "ema_every"):
            _at_least(self, name, 1, section="trick")
        if not 0.0 <= self.ema_momentum < 1.0:
            raise ConfigError(f"trick.ema_momentum={self.ema_momentum}: must be in [0, 1)")

    def check_for(self, arch: str, batch_size: int) -> None:
        """The tricks that reshape the network exist in ResNet-9 only; ghost splits must divide the
        batch."""
        for name in ("maxpool_reorder", "celu", "ghost_bn", "frozen_bn_scale", "whitening"):
            if getattr(self, name) and arch != "resnet9":
                raise ConfigError(
                    f"trick.{name}=true: only model=resnet9 has this switch (model={arch})"
                )
        if self.ghost_bn and batch_size % self.ghost_splits:
            raise ConfigError(
                f"trick.ghost_splits={self.ghost_splits}: must divide "
                f"trainer.batch_size={batch_size}"
            )


@dataclass(frozen=True)
class LoggerConfig:
    name: Literal["wandb", "none"] = "none"
    mode: Literal["offline", "online", "disabled"] = "disabled"
    project: str = "mixprec"
    entity: Optional[str] = None
    tags: tuple = ()


@dataclass(frozen=True)
class ProbeConfig:
    """The numerics probe (src/mixprec/numerics/probe.py): none = no hooks (attribution of skipped
    and non-finite steps only, at the event); ranges = per-layer ranges at step 1, every `every`
    steps and every skipped step."""
    name: Literal["none", "ranges"] = "none"
    every: int = 50
    max_skips: int = 20     # skipped steps listed in the summary (all are counted)

    def check(self) -> None:
        _at_least(self, "every", 1, section="probe")
        _at_least(self, "max_skips", 0, section="probe")


@dataclass(frozen=True)
class CaseConfig:
    """A named case of an experiment whose outcome is the finding (e.g. a half-precision
    pitfall)."""
    name: str
    expect: Literal["completed", "diverged"]
    finding: str = ""


@dataclass(frozen=True)
class Config:
    name: str
    seed: int
    trainer: TrainerConfig
    model: ModelConfig
    dataset: DatasetConfig
    precision: PrecisionConfig
    gpu: GpuConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    trick: TrickConfig
    logger: LoggerConfig
    probe: ProbeConfig = ProbeConfig()
    case: Optional[CaseConfig] = None

    def check(self) -> None:
        self.trick.check_for(self.model.arch, self.trainer.batch_size)
        self.check_strategy()
        self.check_mxfp8()
        p = self.precision
        if self.optimizer.stochastic_round and (p.param_dtype != "bfloat16" or p.master_weights):
            raise ConfigError(
                f"optimizer.stochastic_round=true: it rounds bfloat16 weights stepped without fp32 "
                f"masters (precision=bf16), and precision={p.name} steps "
                f"{'fp32 masters' if p.master_weights else p.param_dtype + ' weights'}; use "
                "precision=bf16"
            )
        if self.model.arch == "gpt" and self.dataset.bptt > self.model.block_size:
            raise ConfigError(
                f"dataset.bptt={self.dataset.bptt}: a gpt window must fit its context, "
                f"model.block_size={self.model.block_size}; lower bptt or raise block_size"
            )

    def check_strategy(self) -> None:
        """What FSDP (trainer.strategy=fsdp) cannot express, refused in one line before any work:
        its parameters are fp32 shards (the masters) that it casts to the mode's low dtype for
        compute, so a mode without fp32 masters, one whose arithmetic is emulated, or one that
        clips the low-precision copies has no meaning there; see docs/fsdp.md."""
        p, tr, name = self.precision, self.trainer, f"precision={self.precision.name}"
        if not tr.sharded:
            if p.reduce_dtype is not None:
                raise ConfigError(
                    f"precision.reduce_dtype={p.reduce_dtype}: only sharded jobs choose it "
                    "(trainer.strategy=fsdp); DDP reduces gradients in their own dtype"
                )
            if tr.replicate != "auto":
                raise ConfigError(
                    f"trainer.replicate={tr.replicate}: the replicate degree of FSDP's device "
                    "mesh, only for trainer.strategy=fsdp; DDP replicates over every rank "
                    "(leave trainer.replicate=auto)"
                )
            return
        refusals = (
            (self.model.arch in RNN_KINDS, f"model={self.model.arch}: FSDP shards the GPT and "
             "the image models; a recurrent model trains in one process (trainer.strategy=auto)"),
            (p.param_dtype != "float32" and not p.master_weights,
             f"{name}: its weights live in {p.param_dtype} without fp32 masters, but FSDP's "
             "sharded parameters are the fp32 masters; use precision=amp_bf16 (bfloat16) or amp "
             "(float16)"),
            (not p.keep_bn_fp32 and (p.autocast_dtype or p.param_dtype != "float32")
             and not self.model.is_language_model, f"{name} with precision.keep_bn_fp32=false: "
             "FSDP would hand each BatchNorm low-precision weights against its fp32 running "
             "statistics; under trainer.strategy=fsdp use precision.keep_bn_fp32=true"),
            (p.clip_scaled_model_grads, f"{name}: it clips the fp16 model's scaled gradients, "
             "which FSDP does not keep apart from the fp32 masters; use precision=apex_fp16"),
            (p.emulate is True, f"{name} with precision.emulate=true: FSDP casts the weights to "
             "real fp16/bf16 tensors, which the emulation cannot wrap; use precision.emulate=auto "
             "(native fp16/bf16 kernels under FSDP)"),
            (self.trick.ema, "trick.ema=true: the averaged copy of a sharded model is not "
             "supported under trainer.strategy=fsdp; use trick.ema=false"),
            (tr.sync_bn, "trainer.sync_bn=true: SyncBatchNorm is DDP's; under "
             "trainer.strategy=fsdp use sync_bn=false"),
            (self.probe.name == "ranges", "probe=ranges: the probe's hooks read whole layers, "
             "which FSDP holds as shards; under trainer.strategy=fsdp use probe=none"),
            (tr.prewarm_steps not in ("auto", 0), f"trainer.prewarm_steps={tr.prewarm_steps}: "
             "prewarm steps a deep copy, which a sharded model cannot be; use prewarm_steps=0"),
            (tr.compile in ("reduce-overhead", "max-autotune"), f"trainer.compile={tr.compile}: "
             "CUDA graphs need fixed addresses, and FSDP frees and re-gathers the weights every "
             "step (untested under FSDP here); use trainer.compile=default or none"),
            (self.optimizer.name == "sgd" and self.optimizer.impl == "fused", FUSED_SGD_SHARDED),
        )
        for refused, line in refusals:
            if refused:
                raise ConfigError(line)

    def check_mxfp8(self) -> None:
        """What torchao's MXFP8 Linear layers cannot do (precision/mxfp8.py), refused in one line
        before any work: FSDP (torchao 0.18's MXFP8 training of sharded weights is its tensor-
        subclass recipe, which needs a PyTorch nightly)."""
        if self.precision.fp8_recipe == "mxfp8" and self.trainer.sharded:
            raise ConfigError(
                f"precision={self.precision.name} under trainer.strategy=fsdp: torchao 0.18's "
                "MXFP8 Linear layers take no sharded weights; use trainer.strategy=auto or ddp, or "
                "precision=fp8 under FSDP"
            )

    def check_task(self) -> None:
        """What validates field by field but cannot make one job: a model and a dataset of different
        tasks (validate_job checks it; scripts that read one part of a config, e.g. its dataset,
        validate alone)."""
        lm, text = self.model.is_language_model, self.dataset.is_text
        if lm and not text:
            raise ConfigError(
                f"model={self.model.arch} is a language model: it needs a text dataset "
                f"(dataset=wikitext2 or synthetic_text), not dataset={self.dataset.name}"
            )
        if text and not lm:
            raise ConfigError(
                f"dataset={self.dataset.name} is a text corpus: it trains a language model "
                f"(model=lstm, gru, rnn_tanh, rnn_relu or gpt), not model={self.model.arch}"
            )
        if self.schedule.name == "plateau" and not lm:
            raise ConfigError(
                "schedule=plateau anneals on a validation loss, which only language-model jobs "
                "have; choose onecycle, piecewise or constant"
            )
        if lm and self.trainer.target_acc is not None:
            raise ConfigError(
                "trainer.target_acc: a language model is scored in perplexity, not accuracy; "
                "leave it null"
            )


def validate(cfg: DictConfig | dict) -> Config:
    """Resolve and check a composed config; raise ConfigError naming the first bad field."""
    data = (
        plain_config(cfg)
        if isinstance(cfg, DictConfig)
        else {k: v for k, v in cfg.items() if k != "hydra"}
    )
    return _build(Config, data, "")


def validate_job(cfg: DictConfig | dict) -> Config:
    """validate(), and that the config makes one job: its model and dataset are of the same task."""
    config = validate(cfg)
    config.check_task()
    return config


def plain_config(cfg: DictConfig) -> dict:
    """The job's config as plain resolved values, without Hydra's own node."""
    try:
        return OmegaConf.to_container(
            OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True
        )
    except Exception as e:  # an interpolation that does not resolve
        raise ConfigError(f"config does not resolve: {e}".splitlines()[0]) from None


NO_DEFAULT = object()   # schema_default's answer for a key the schema gives no default


def schema_default(key: str):
    """The schema's default of a dotted config key ("trainer.replicate" -> "auto"; a section whose
    field has a default, as a plain dict), or NO_DEFAULT (a required field, or no such key): what a
    config written before the field existed stands for (a checkpoint's, train/checkpoint.py)."""
    cls, parts = Config, key.split(".")
    for i, name in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(
            cls) else {}
        if name not in fields:
            return NO_DEFAULT
        f = fields[name]
        if i == len(parts) - 1:
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                return NO_DEFAULT
            return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        cls = typing.get_type_hints(cls)[name]
        if typing.get_origin(cls) is Union:   # Optional[Section]: the section's own fields
            cls = next(a for a in typing.get_args(cls) if a is not type(None))
    return NO_DEFAULT


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'}: expected a mapping of fields, got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown field; allowed fields are {', '.join(sorted(names))}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(
                    f"{key}: missing (no default); set it in the config or on the command line"
                )
            continue
        kwargs[f.name] = _coerce(hints[f.name], data[f.name], key)
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        obj.check()
    return obj


def _coerce(tp, value, key):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin is Union:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must be set (null is not allowed)")
        choices = [a for a in args if a is not type(None)]
        if (
            all(a is bool or typing.get_origin(a) is Literal for a in choices)
            and not isinstance(value, bool)
            and not any(value in typing.get_args(a) for a in choices if a is not bool)
        ):
            allowed = [
                v for a in choices for v in (("true", "false") if a is bool else typing.get_args(a))
            ]
            raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(map(str, allowed))}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            errors[-1]
            if len(errors) == 1
            else f"{key}={value!r}: not a valid value ({'; '.join(errors)})"
        )
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(map(str, allowed))}")
        return value
    if value is None:
        raise ConfigError(f"{key}: must be set (null is not allowed)")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: must be a string")
        return value
    if tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: must be a list")
        return tuple(value)
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: must be a mapping")
        return dict(value)
    return value


def _at_least(obj, name: str, low: int, section: str = "trainer") -> None:
    value = getattr(obj, name)
    if value < low:
        raise ConfigError(f"{section}.{name}={value}: must be an integer >= {low}")
