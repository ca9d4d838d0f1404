"""One job, wired end to end: config -> hardware -> data -> model -> precision policy -> engine -> records.

This is the only module that puts the parts together; each part takes plain values from the validated config.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from . import engine, hardware, lm_engine
from .config import Config, ConfigError, plain_config, validate
from .data import build_image_data, image_loaders
from .datafiles import DataError
from .models import build_model, forward_flops
from .optim import build_optimizer, build_schedule
from .precision import PrecisionPolicy, hazards
from .records import Recorder
from .tables import job_block
from .wikitext import TokenWindows, batchify, load_text_corpus

WEIGHTS = "model_fp32.pt"   # the final weights in fp32, whatever the training precision (scripts/generate.py)


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
    summary.update(env=env, gpu_profile=profile, seed=config.seed, name=config.name,
                   hazards=hazards(config.precision, config.optimizer))
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
        if summary["status"] == "diverged" and summary["hazards"]:
            summary["reason"] += f"; likely cause: {summary['hazards'][0]}"
    except KeyboardInterrupt:
        summary.update(status="interrupted", error="interrupted by the user (KeyboardInterrupt)")
        raise
    except (DataError, ConfigError) as e:  # data missing/unreadable, or a config the data cannot serve: one line
        summary.update(status="failed", error=f"{'data' if isinstance(e, DataError) else 'config'} error: {e}")
    except Exception as e:  # the job failed: record why; a sweep goes on with its other jobs
        summary.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finally:
        if config.case is not None:
            summary["case"] = dataclasses.asdict(config.case)
            summary["case"]["as_expected"] = summary["status"] == config.case.expect
        summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        summary.setdefault("metrics", {}).update(zip(("peak_memory_mb", "peak_memory_kind"), hardware.peak_memory_mb(device)))
        recorder.write_summary(summary)
        if mirror is not None:
            mirror.finish(ok=summary["status"] in ("completed", "diverged"))
        recorder.close()
    return summary


def train_job(config: Config, device: torch.device, recorder: Recorder) -> dict:
    check_task(config)
    if config.model.is_language_model:
        return train_lm_job(config, device, recorder)
    tr = config.trainer
    data = build_image_data(config.dataset)
    train_batches, test_batches = image_loaders(data, config.dataset, tr, device, seed=config.seed)

    model = build_model(config.model, data.num_classes)
    flops = forward_flops(model, torch.zeros(1, *train_batches.image_shape))
    n_params = sum(p.numel() for p in model.parameters())
    policy = PrecisionPolicy(config.precision, device)
    model = policy.prepare_model(model)
    if tr.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(config.optimizer, policy.optimizer_params(model))
    total_steps = tr.epochs * len(train_batches)
    if tr.max_steps is not None:
        total_steps = min(total_steps, tr.max_steps)
    schedule = build_schedule(config.schedule, optimizer, total_steps)

    result = engine.train(model, policy, optimizer, schedule, train_batches, test_batches, tr,
                          label_smoothing=config.trick.label_smoothing, bn_eval=config.model.bn_eval,
                          log=recorder.log,
                          progress=sys.stderr.isatty())
    result["metrics"].update(params=n_params, forward_flops_per_sample=flops,
                             train_flops_per_sample=None if flops is None else 3 * flops)
    result["data"] = {**data.info, "train": len(data.train_y), "test": len(data.test_y), "mean": data.mean,
                      "std": data.std}
    return result


def check_task(config: Config) -> None:
    """What validates field by field but cannot make one job: a model and a dataset of different tasks."""
    lm, text = config.model.is_language_model, config.dataset.is_text
    if lm and not text:
        raise ConfigError(f"model={config.model.arch} is a language model: it needs a text dataset (dataset=wikitext2 "
                          f"or synthetic_text), not dataset={config.dataset.name}")
    if text and not lm:
        raise ConfigError(f"dataset={config.dataset.name} is a text corpus: it trains a language model (model=lstm, "
                          f"gru, rnn_tanh or rnn_relu), not model={config.model.arch}")
    if config.schedule.name == "plateau" and not lm:
        raise ConfigError("schedule=plateau anneals on a validation loss, which only language-model jobs have; "
                          "choose onecycle, piecewise or constant")
    if lm and config.trainer.target_acc is not None:
        raise ConfigError("trainer.target_acc: a language model is scored in perplexity, not accuracy; leave it null")


def train_lm_job(config: Config, device: torch.device, recorder: Recorder) -> dict:
    """A word-level language model on a text corpus (see lm_engine.py); throughput and FLOPs are per token."""
    tr = config.trainer
    corpus = load_text_corpus(config.dataset)
    train_source = batchify(corpus.train, tr.batch_size, device)
    valid_source, test_source = (batchify(ids, tr.eval_batch_size, device) for ids in (corpus.valid, corpus.test))

    model = build_model(config.model, corpus.vocab_size)
    flops = model.flops_per_token()
    n_params = sum(p.numel() for p in model.parameters())
    policy = PrecisionPolicy(config.precision, device)
    model = policy.prepare_model(model)
    optimizer = build_optimizer(config.optimizer, policy.optimizer_params(model))
    total_steps = tr.epochs * len(TokenWindows(train_source, config.dataset.bptt))
    schedule = build_schedule(config.schedule, optimizer, min(total_steps, tr.max_steps or total_steps))

    result = lm_engine.train(model, policy, optimizer, schedule, train_source, valid_source, test_source, tr,
                             config.dataset.bptt, log=recorder.log, progress=sys.stderr.isatty())
    result["metrics"].update(params=n_params, forward_flops_per_sample=flops, train_flops_per_sample=3 * flops,
                             flops_per="token")
    result["data"] = {**corpus.info, "vocab_size": corpus.vocab_size, "train_tokens": len(corpus.train),
                      "valid_tokens": len(corpus.valid), "test_tokens": len(corpus.test), "bptt": config.dataset.bptt}
    if result["status"] in ("completed", "diverged"):
        path = recorder.out_dir / WEIGHTS
        torch.save(policy.fp32_state_dict(model), path.with_name(f".{WEIGHTS}.tmp"))
        os.replace(path.with_name(f".{WEIGHTS}.tmp"), path)   # all or nothing
        result["weights"] = {"file": WEIGHTS, "dtype": "float32", "num_classes": corpus.vocab_size}
    return result


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
