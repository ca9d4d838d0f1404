"""One job, wired end to end: config -> hardware -> data -> model -> precision policy -> engine -> records.

This is the only module that puts the parts together; each part takes plain values from the validated config.
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from . import engine, hardware, tricks
from .config import Config, ConfigError, TrickConfig, plain_config, validate
from .data import DeviceBatches, synthetic_images
from .models import build_model, forward_flops
from .optim import build_optimizer, build_schedule
from .precision import PrecisionPolicy
from .records import Recorder
from .tables import job_block


def run_job(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    summary = {
        "status": "failed",
        "choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")},
        "overrides": list(hc.overrides.task),
        "job": {"name": hc.job.name, "num": hc.job.num if multirun else None, "output_dir": str(out_dir),
                "sweep_dir": str(Path(hc.sweep.dir)) if multirun else None, "override_dirname": hc.job.override_dirname},
        "config": None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        summary["config"] = plain_config(cfg)
        config = validate(cfg)
    except ConfigError as e:
        summary["error"] = f"config error: {e}"
        Recorder(out_dir).write_summary(summary)
        print(f"mixprec: config error: {e}", file=sys.stderr)
        if multirun:
            return summary
        sys.exit(2)
    summary = execute(config, summary, out_dir, group=Path(hc.sweep.dir).name if multirun else None,
                      name=hc.job.override_dirname or out_dir.name)
    print(job_block(summary))
    print(f"records     {out_dir}")
    if summary["status"] == "failed" and not multirun:
        print(f"mixprec: the job failed: {summary.get('error')}", file=sys.stderr)
        sys.exit(1)
    return summary


def execute(config: Config, summary: dict, out_dir: Path, group: str | None = None, name: str = "run") -> dict:
    """Run one validated job, write its records, and return its summary (failed jobs included)."""
    try:
        device = hardware.select_device(config.trainer.device)
    except ConfigError as e:
        summary["error"] = f"config error: {e}"
        Recorder(out_dir).write_summary(summary)
        raise
    hardware.configure(device, config.trainer, config.precision, config.seed)
    env = hardware.describe(device)
    profile = hardware.gpu_profile(config.gpu, env["device_name"] if device.type == "cuda" else "cpu")
    summary.update(env=env, gpu_profile=profile, seed=config.seed, name=config.name)
    _warn_if_slow(config, device, profile)

    mirror = None
    if config.logger.name == "wandb" and config.logger.mode != "disabled":
        from .wandb_mirror import WandbMirror
        mirror = WandbMirror(config.logger, out_dir, summary["config"], group=group, name=name,
                             job_type=config.name)
        summary["wandb"] = {"mode": config.logger.mode, "run_id": mirror.run.id, "dir": mirror.run_dir}
    recorder = Recorder(out_dir, mirror)
    try:
        summary.update(train_job(config, device, recorder))
        summary["metrics"]["mfu"] = mfu(summary["metrics"], profile, hardware.peak_kind(config.precision))
    except KeyboardInterrupt:
        summary.update(status="interrupted", error="interrupted by the user (KeyboardInterrupt)")
        raise
    except Exception as e:  # the job failed: record why; a sweep goes on with its other jobs
        summary.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finally:
        summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        summary.setdefault("metrics", {}).update(zip(("peak_memory_mb", "peak_memory_kind"), hardware.peak_memory_mb(device)))
        recorder.write_summary(summary)
        if mirror is not None:
            mirror.finish(ok=summary["status"] in ("completed", "diverged"))
        recorder.close()
    return summary


def train_job(config: Config, device: torch.device, recorder: Recorder) -> dict:
    tr = config.trainer
    data = synthetic_images(config.dataset)
    train_batches = DeviceBatches(data.train_x, data.train_y, tr.batch_size, data.mean, data.std, device=device,
                                  train=True, crop_padding=config.dataset.crop_padding if config.dataset.augment else 0,
                                  flip=config.dataset.augment, seed=config.seed, channels_last=tr.channels_last)
    test_batches = DeviceBatches(data.test_x, data.test_y, tr.eval_batch_size, data.mean, data.std, device=device,
                                 train=False, channels_last=tr.channels_last)

    t, resnet9 = config.trick, config.model.arch == "resnet9"
    whitening, setup_s = fit_whitening(t, data, device) if resnet9 else (None, 0.0)
    model = build_model(config.model, data.num_classes, **(resnet9_options(t, whitening) if resnet9 else {}))
    flops = forward_flops(model, torch.zeros(1, *data.train_x.shape[1:]))
    n_params = sum(p.numel() for p in model.parameters())
    policy = PrecisionPolicy(config.precision, device)
    model = policy.prepare_model(model)
    if tr.channels_last:
        model = model.to(memory_format=torch.channels_last)
    params = policy.optimizer_params(model)
    if t.bn_bias_lr != 1.0:
        params = tricks.bn_bias_groups(model, policy.model_params, params, t.bn_bias_lr, config.optimizer.lr,
                                       config.optimizer.weight_decay)
    optimizer = build_optimizer(config.optimizer, params)
    total_steps = tr.epochs * len(train_batches)
    if tr.max_steps is not None:
        total_steps = min(total_steps, tr.max_steps)
    schedule = build_schedule(config.schedule, optimizer, total_steps)

    ema = tricks.EMA(model, t.ema_momentum, t.ema_every) if t.ema else None
    result = engine.train(model, policy, optimizer, schedule, train_batches, test_batches, tr,
                          label_smoothing=t.label_smoothing, loss_sum=t.loss_sum, ema=ema, tta=t.tta,
                          setup_time_s=setup_s, log=recorder.log, progress=sys.stderr.isatty())
    result["metrics"].update(params=n_params, forward_flops_per_sample=flops,
                             train_flops_per_sample=None if flops is None else 3 * flops)
    return result


def resnet9_options(t: TrickConfig, whitening: torch.Tensor | None = None) -> dict:
    """The trick flags that shape ResNet-9, as its arguments. whitening: the fitted filters when trick.whitening
    (any [27, 3, 3, 3] tensor to rebuild a model whose saved weights hold them)."""
    return dict(activation="celu" if t.celu else "relu", celu_alpha=t.celu_alpha,
                ghost_splits=t.ghost_splits if t.ghost_bn else 1,
                frozen_bn_scale=t.bn_scale if t.frozen_bn_scale else None,
                pool_order="conv_pool_bn_act" if t.maxpool_reorder else "conv_bn_act_pool",
                whitening=whitening if t.whitening else None)


def fit_whitening(t: TrickConfig, data, device: torch.device) -> tuple[torch.Tensor | None, float]:
    """trick.whitening's filters, fitted on the first training images, and the seconds the fit took: they count as
    training time (DAWNBench counts preprocessing; Page fitted them outside his timer, milliseconds on a GPU)."""
    if not t.whitening:
        return None, 0.0
    start = time.perf_counter()
    filters = tricks.fit_patch_whitening(data.train_x[:t.whitening_images], data.mean, data.std, t.whitening_eps,
                                         device)
    hardware.synchronize(device)
    return filters, time.perf_counter() - start


def mfu(metrics: dict, profile: dict, peak_kind: str) -> float | None:
    """Model FLOP utilisation: 3 x forward FLOPs per sample x steady samples/s, over the matched GPU profile's
    dense peak for the precision's math (None without a matched profile or a known peak)."""
    peak = (profile.get("peak_tflops") or {}).get(peak_kind)
    flops = metrics.get("train_flops_per_sample")
    if not peak or not flops or not metrics.get("throughput"):
        return None
    return flops * metrics["throughput"] / (peak * 1e12)


def _warn_if_slow(config: Config, device: torch.device, profile: dict) -> None:
    if profile.get("note") and profile.get("matched") is False:
        print(f"mixprec: note: {profile['note']}", file=sys.stderr)
    low = config.precision.autocast_dtype or config.precision.param_dtype
    if device.type == "cpu" and low in ("float16", "bfloat16"):
        print(f"mixprec: note: {low} on a CPU without native support (AVX512-FP16/AMX) runs PyTorch's slow "
              "reference kernels, often 10-50x slower than fp32: CPU timings say nothing about GPUs",
              file=sys.stderr)
