"""One job, wired end to end: config -> hardware -> data -> model -> precision policy -> engine -> records.

This is the only module that puts the parts together; each part takes plain values from the validated config.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from . import checkpoint, dist, engine, hardware, lm_engine, tricks
from .config import Config, ConfigError, TrickConfig, plain_config, validate
from .data import build_image_data, image_loaders
from .datafiles import DataError
from .models import build_model, forward_flops
from .resnet9 import resnet9_options
from .optim import build_optimizer, build_schedule
from .precision import PrecisionPolicy, hazards
from .probe import build_probe
from .records import Recorder
from .tables import job_block
from .wikitext import TokenWindows, batchify, load_text_corpus



def run_job(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    ranks = dist.from_env()   # one rank, or one of the N of a torchrun / submitit multi-task job (see dist.py)
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
        if ranks.main:   # rank 0 speaks for the job; the other ranks exit quietly with the same status
            Recorder(out_dir).write_summary(summary)
            print(f"mixprec: config error: {e}", file=sys.stderr)
        if multirun:
            return summary
        sys.exit(2)
    sweep_dir = Path(hc.sweep.dir) if multirun else None
    if config.trainer.resume == "auto":
        try:
            prior = checkpoint.prior_summary(out_dir)
        except checkpoint.CheckpointError as e:   # left as it is: the sweep table lists it as unreadable
            print(f"mixprec: {e}", file=sys.stderr)
            if multirun:
                return {"status": "unreadable", "error": str(e)}
            sys.exit(2)
        if prior is not None and prior["status"] in checkpoint.FINAL:
            if ranks.main:
                print(f"mixprec: {out_dir}: already {prior['status']}, skipped (trainer.resume=auto; its records are left as they are)")
            return prior
    dist.quiet_unless_main(ranks)
    try:
        summary = execute(config, summary, out_dir, group=sweep_dir.name if multirun else None,
                          name=hc.job.override_dirname or out_dir.name, ranks=ranks)
    except KeyboardInterrupt:
        print(f"\nmixprec: interrupted; to continue: {checkpoint.resume_hint(out_dir, sweep_dir)}", file=sys.stderr)
        sys.exit(130)
    except ConfigError as e:   # one the device or the ranks cannot serve (recorded in summary.json by rank 0)
        if ranks.main:
            print(f"mixprec: config error: {e}", file=sys.stderr)
        if multirun:
            return {**summary, "error": f"config error: {e}"}
        sys.exit(2)
    if not ranks.main:   # rank 0 reports the job
        if summary["status"] in checkpoint.FINAL or multirun:
            return summary
        sys.exit(1)
    print(job_block(summary))
    print(f"records     {out_dir}")
    if summary["status"] == "interrupted":   # a sweep stops too: the signal was meant for the whole command
        print(f"mixprec: {summary['reason']}; checkpoint saved. To continue: "
              f"{checkpoint.resume_hint(out_dir, sweep_dir)}", file=sys.stderr)
        sys.exit(128 + signal.Signals[summary["interrupted_by"]].value)
    if summary["status"] == "failed" and not multirun:
        print(f"mixprec: the job failed: {summary.get('error')}", file=sys.stderr)
        ckpt = out_dir / checkpoint.CHECKPOINT
        if ckpt.exists() and str(ckpt) not in summary.get("error", ""):   # not when the checkpoint is what failed
            print(f"mixprec: to retry from its last checkpoint: {checkpoint.resume_hint(out_dir, None)}", file=sys.stderr)
        sys.exit(1)
    return summary


def execute(config: Config, summary: dict, out_dir: Path, group: str | None = None, name: str = "run",
            ranks: dist.Ranks = dist.SINGLE) -> dict:
    """Run one validated job, write its records (rank 0), and return its summary (failed jobs included)."""
    try:
        device = hardware.select_device(dist.device_name(config.trainer.device, ranks))
        dist.check(config.trainer.batch_size, config.trainer.sync_bn, device, ranks)
    except ConfigError as e:
        summary["error"] = f"config error: {e}"
        if ranks.main:
            Recorder(out_dir).write_summary(summary)
        raise
    made = dist.init(ranks)   # joins the job's process group (torchrun's is joined already, in train.py)
    try:
        return _execute(config, summary, out_dir, group, name, device, ranks)
    finally:
        dist.close(made)


def _execute(config: Config, summary: dict, out_dir: Path, group: str | None, name: str, device: torch.device,
             ranks: dist.Ranks) -> dict:
    hardware.configure(device, config.trainer, config.precision, config.seed)
    env = hardware.describe(device)
    profile = hardware.gpu_profile(config.gpu, env["device_name"] if device.type == "cuda" else "cpu")
    summary.update(env=env, gpu_profile=profile, seed=config.seed, name=config.name,
                   hazards=hazards(config.precision, config.optimizer))
    _warn_if_slow(config, device, profile)

    resume = prior = None
    if config.trainer.resume == "auto":
        try:
            prior = checkpoint.prior_summary(out_dir)
            resume = checkpoint.read(out_dir, summary["config"], device.type)
        except checkpoint.CheckpointError as e:
            summary["error"] = str(e)
            if ranks.main:
                Recorder(out_dir).write_summary(summary)
            return summary
    ranks.barrier()   # every rank has read the dir (rank 0's checkpoint) before rank 0 writes to it
    if not ranks.main:   # the same training, restored from rank 0's checkpoint; rank 0 alone writes records
        try:
            with checkpoint.StopSignals() as stop:   # torchrun forwards a SIGTERM to every rank
                summary.update(train_job(config, device, dist.Silent(out_dir), checkpoint.Checkpointer(out_dir, {}),
                                         resume, ranks.agreed_stop(stop), ranks))
        except Exception as e:   # rank 0 records the job's error; a failure of this rank alone is said here
            summary.update(status="failed", error=f"{type(e).__name__}: {e}")
            print(f"mixprec: rank {ranks.rank}: {summary['error']}".splitlines()[0], file=sys.stderr)
        return summary
    if checkpoint.prepare_dir(out_dir, resume) and resume is None:
        print(f"mixprec: note: {out_dir} held records of an earlier run: starting over "
              f"({'no checkpoint to resume from' if config.trainer.resume == 'auto' else 'trainer.resume=never'})",
              file=sys.stderr)
    if resume is not None:
        summary["resumed"] = checkpoint.resumed_info(resume, prior)
        print(f"mixprec: resuming {out_dir} at step {summary['resumed']['from_step']} "
              f"(epoch {summary['resumed']['from_epoch']:.2f}; it was {summary['resumed']['previous_status']})",
              file=sys.stderr)

    mirror = None
    if config.logger.name == "wandb" and config.logger.mode != "disabled":
        from .wandb_mirror import WandbMirror
        try:
            mirror = WandbMirror(config.logger, out_dir, summary["config"], group=group, name=name,
                                 job_type=config.name, run_id=resume.get("wandb_run_id") if resume else None)
        except RuntimeError as e:   # recorded as a failed job, in one line
            summary["error"] = str(e)
            Recorder(out_dir).write_summary(summary)
            return summary
        summary["wandb"] = {"mode": config.logger.mode, "run_id": mirror.run.id, "dir": mirror.run_dir}
    recorder = Recorder(out_dir, mirror)
    saver = checkpoint.Checkpointer(out_dir, meta={"config": summary["config"], "device_type": device.type,
                                                   "wandb_run_id": mirror and mirror.run.id,
                                                   "resumes": summary.get("resumed", {}).get("history", [])})
    recorder.write_summary({**summary, "status": "running"})   # what a SIGKILLed job leaves behind
    stop = checkpoint.StopSignals()
    try:
        with stop:
            summary.update(train_job(config, device, recorder, saver, resume, ranks.agreed_stop(stop), ranks))
        summary["metrics"]["mfu"] = mfu(summary["metrics"], profile, hardware.peak_kind(config.precision))
        if summary["status"] == "diverged" and summary["hazards"]:
            summary["reason"] += f"; likely cause: {summary['hazards'][0]}"
        summary["metrics"]["checkpoint_time_s"] = saver.seconds
        if summary["status"] == "interrupted":
            summary["interrupted_by"] = stop()
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
        if summary["status"] in checkpoint.FINAL:
            saver.discard()
        if mirror is not None:
            mirror.finish(ok=summary["status"] in ("completed", "diverged"))
        recorder.close()
    return summary


def train_job(config: Config, device: torch.device, recorder: Recorder, saver: checkpoint.Checkpointer | None = None,
              resume: dict | None = None, stop=None, ranks: dist.Ranks = dist.SINGLE) -> dict:
    check_task(config)
    if config.model.is_language_model:
        if ranks.active:
            raise ConfigError("model=" + config.model.arch + ": language models train in one process here; "
                              "torchrun/DDP covers the image models")
        return train_lm_job(config, device, recorder)
    tr = config.trainer
    data = build_image_data(config.dataset)
    train_batches, test_batches = image_loaders(data, config.dataset, tr, device, seed=config.seed,
                                                shard=(ranks.rank, ranks.world))

    t, resnet9 = config.trick, config.model.arch == "resnet9"
    whitening, setup_s = fit_whitening(t, data, device) if resnet9 else (None, 0.0)
    model = build_model(config.model, data.num_classes, **(resnet9_options(t, whitening) if resnet9 else {}))
    flops = forward_flops(model, torch.zeros(1, *train_batches.image_shape))
    n_params = sum(p.numel() for p in model.parameters())
    policy = PrecisionPolicy(config.precision, device)
    model = policy.prepare_model(model)
    if tr.channels_last:
        model = model.to(memory_format=torch.channels_last)
    net = dist.wrap(model, device, tr.sync_bn, ranks)   # what the loop trains: DDP under several ranks, else model
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
    if saver is not None:
        saver.parts.update(model=model, optimizer=optimizer, schedule=schedule, precision=checkpoint.PolicyState(policy))
        if ema is not None:
            saver.parts["ema"] = ema
    loop = saver.restore(resume) if resume is not None else None   # last before training: it sets the RNG states

    with probed(config, model, recorder, ranks) as probe:
        result = engine.train(net, policy, optimizer, schedule, train_batches, test_batches, tr,
                              label_smoothing=t.label_smoothing, loss_sum=t.loss_sum, ema=ema, tta=t.tta,
                              setup_time_s=setup_s, bn_eval=config.model.bn_eval, log=recorder.log,
                              progress=sys.stderr.isatty() and ranks.main, resume=loop,
                              checkpoint=saver.save if saver is not None and ranks.main else None,
                              stop=stop or (lambda: None), ranks=ranks, probe=probe)
        result["numerics"] = probe.summary()
    if ranks.active:
        result["distributed"] = {"world_size": ranks.world, "per_rank_batch": tr.batch_size // ranks.world,
                                 "sync_bn": tr.sync_bn, "backend": str(torch.distributed.get_backend()),
                                 "weight_spread": dist.spread(policy.stepped_params(), ranks)}
    result["metrics"].update(params=n_params, forward_flops_per_sample=flops,
                             train_flops_per_sample=None if flops is None else 3 * flops)
    result["data"] = {**data.info, "train": len(data.train_y), "test": len(data.test_y), "mean": data.mean,
                      "std": data.std}
    if result["status"] in checkpoint.FINAL and ranks.main:   # the weights that were evaluated: the EMA's if any
        final = policy.fp32_state_dict(model if ema is None else ema.model)
        result["weights"] = checkpoint.save_weights(recorder.out_dir, final, data.num_classes)
    return result


def evaluate_saved(run_dir: Path, device: str = "auto") -> dict:
    """Evaluate a finished job's saved weights (model_fp32.pt) in an fp32 model, with fp32 math, on the job's own
    test split: apex's promise that whatever the training precision, the saved model is fp32 and usable."""
    from .config import PrecisionConfig

    model, config = checkpoint.load_fp32_model(run_dir)
    fp32 = PrecisionConfig(name="fp32")
    device = hardware.select_device(device)
    hardware.configure(device, config.trainer, fp32, config.seed)
    data = build_image_data(config.dataset)
    _, test_batches = image_loaders(data, config.dataset, config.trainer, device, seed=config.seed)
    policy = PrecisionPolicy(fp32, device)
    model = policy.prepare_model(model)
    if config.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    loss, acc, _ = engine.evaluate(model, test_batches, policy)
    recorded = checkpoint.prior_summary(Path(run_dir))["metrics"]
    return {"test_acc": acc, "test_loss": loss, "recorded_test_acc": recorded.get("final_test_acc"),
            "recorded_test_loss": recorded.get("final_test_loss"), "precision": config.precision.name}


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

    with probed(config, model, recorder) as probe:
        result = lm_engine.train(model, policy, optimizer, schedule, train_source, valid_source, test_source, tr,
                                 config.dataset.bptt, log=recorder.log, progress=sys.stderr.isatty(), probe=probe)
        result["numerics"] = probe.summary()
    result["metrics"].update(params=n_params, forward_flops_per_sample=flops, train_flops_per_sample=3 * flops,
                             flops_per="token")
    result["data"] = {**corpus.info, "vocab_size": corpus.vocab_size, "train_tokens": len(corpus.train),
                      "valid_tokens": len(corpus.valid), "test_tokens": len(corpus.test), "bptt": config.dataset.bptt}
    if result["status"] in checkpoint.FINAL:
        result["weights"] = checkpoint.save_weights(recorder.out_dir, policy.fp32_state_dict(model), corpus.vocab_size)
    return result


@contextlib.contextmanager
def probed(config: Config, model, recorder: Recorder, ranks: dist.Ranks = dist.SINGLE):
    """The job's numerics probe (probe.py): rank 0 records numerics.jsonl; closed however training ends."""
    probe = build_probe(config.probe, model, recorder.out_dir if ranks.main else None)
    try:
        yield probe
    finally:
        probe.close()


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
