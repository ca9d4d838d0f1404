"""One job, wired end to end: config -> hardware -> data -> model -> precision policy -> loop ->
records.

This module holds what a job is, how it ends and what it records; its parts (data, model, precision
policy, optimizer, the job kind's steps, the warm-ups before the clock) are built by train/parts.py
from the job's `JobContext`, then trained here (`train_job`: build, then train, as torchtitan's
trainer); each part takes plain values from the validated config. `run_job` (the Hydra job) is also
the one place where every way a job ends becomes its summary.json and its exit status: a `JobError`
carries the console line and the status, `end_job` says it and exits (a sweep goes on with its other
jobs, except after a signal, which was meant for the whole command, and after a failure on a
multi-rank process group, where the ranks that did not fail may be waiting for one that did).
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .config import Config, ConfigError, plain_config, validate_job
from .data.files import DataError
from .data.pipelines import check_shard
from .numerics import verdicts
from .precision import emulation, fsdp, modes
from .precision.modes import hazards
from .precision.policy import PrecisionPolicy
from .precision.state import PolicyState
from . import records
from .records import SUMMARY, Recorder, this_process, write_json_atomic
from .report.console import job_block
from .runtime import busy, dist, hardware, logs
from .runtime.signals import StopSignals, resume_hint
from .train import checkpoint, loop, memory, parallel, replay
from .train.compile import RNN_EAGER, reset_compile_state
from .train.parts import JobContext, Parts, built_parts, probed

log = logging.getLogger(__name__)


class JobError(Exception):
    """A job that ends without completing: the line(s) rank 0 says, and the process's exit
    status."""

    def __init__(self, line: str, code: int, *, stops_sweep: bool = False):
        super().__init__(line)
        self.code, self.stops_sweep = code, stops_sweep


@dataclasses.dataclass(frozen=True)
class JobDir:
    """Where the job's records go, and what Hydra says about the job."""
    out: Path
    sweep: Path | None = None    # the sweep's dir under -m
    ranks: dist.Ranks = dist.SINGLE

    @property
    def group(self) -> str | None:
        return self.sweep.name if self.sweep else None


def run_job(cfg: DictConfig) -> dict:
    """The Hydra job: returns its summary (a sweep goes on), or exits with the job's status."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    job = JobDir(
        Path(hc.runtime.output_dir), Path(hc.sweep.dir) if multirun else None, dist.from_env()
    )
    logs.setup(job.ranks.main)
    summary = first_summary(hc, job)
    try:
        checkpoint.keep_default_batch(cfg, job.out)   # a resume keeps a default batch that moved
        summary["config"] = plain_config(cfg)
        config = validate_job(cfg)
        modes.check_installed(config.precision)   # fp8's torchao: one line before any work
        prior = final_prior(config, job)
        if prior is not None:
            return prior
        dist.quiet_unless_main(job.ranks)
        summary = train_and_record(config, summary, job,
                                   name=run_name(hc.job.override_dirname) or job.out.name)
        # a job that failed before its first step has no numbers: end_job says its error, once
        if job.ranks.main and records.metrics(summary).get("steps") is not None:
            print(job_block(summary))
        if job.ranks.main:
            print(f"records     {job.out}")
            say_offline_run(summary)
        return end_job(summary, job)
    # bad input, or one the device or the ranks cannot serve: recorded by rank 0, unless the dir
    # holds a job that can still continue (its summary, interrupted or failed, says how)
    except ConfigError as e:
        summary["error"] = f"config error: {e}"
        if job.ranks.main and not checkpoint.continuable(job.out):
            write_json_atomic(job.out / SUMMARY, summary)
        return end_job(summary, job, JobError(f"mixprec: config error: {e}", 2))
    # a summary.json or checkpoint.pt this job cannot use (unreadable; another config, device or
    # world size), refused before any work: the dir is left as it is (the sweep table lists it)
    except checkpoint.CheckpointError as e:
        return end_job({"status": "refused", "error": str(e)}, job, JobError(f"mixprec: {e}", 2))
    # a second Ctrl-C: the summary says interrupted, with no checkpoint of this step
    except KeyboardInterrupt:
        return end_job(
            summary,
            job,
            JobError(
                f"\nmixprec: interrupted; to continue: {resume_hint(job.out, job.sweep)}",
                130,
                stops_sweep=True,
            ),
        )


def first_summary(hc, job: JobDir) -> dict:
    """The summary a job starts with, `failed` until it says otherwise: what Hydra says of the job
    (`hc`: its HydraConfig) and where its records go."""
    multirun = job.sweep is not None
    return {
        "status": "failed",
        "choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")},
        "overrides": list(hc.overrides.task),
        "job": {
            "name": hc.job.name,
            "num": hc.job.num if multirun else None,
            "output_dir": str(job.out),
            "sweep_dir": str(job.sweep) if multirun else None,
            "override_dirname": hc.job.override_dirname,
        },
        "config": None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # rank 0's process: a summary left `running` by a process that is gone reads `killed`
        "process": this_process(),
    }


def run_name(override_dirname: str) -> str:
    """The job's W&B run name: its overrides (Hydra's override_dirname) without the logger's own
    (where the run goes is not what the run is)."""
    return ",".join(o for o in override_dirname.split(",")
                    if not o.lstrip("+~").startswith("logger"))


def say_offline_run(summary: dict) -> None:
    """Where an offline W&B run is, and the command that uploads it (nothing left the machine)."""
    w = summary.get("wandb") or {}
    if w.get("mode") == "offline":
        print(f"wandb       offline run in {w['dir']}; to upload it: wandb sync {w['dir']}")


def final_prior(config: Config, job: JobDir) -> dict | None:
    """Under trainer.resume=auto, the summary of a job already completed or diverged in this dir (it
    is skipped), agreed by every rank before any acts on it (checkpoint.final_agreed)."""
    if config.trainer.resume != "auto":
        return None
    dist.init(job.ranks)   # the ranks agree on what they read (a no-op with one rank)
    prior = checkpoint.final_agreed(job.out, job.ranks)
    if prior is None:
        return None
    if job.ranks.main:
        print(
            f"mixprec: {job.out}: already {prior['status']}, skipped (trainer.resume=auto; its "
            "records are left as they are)"
        )
    return prior


def end_job(summary: dict, job: JobDir, error: JobError | None = None) -> dict:
    """The one place a job ends: its result printed and its failure said (rank 0), then the summary
    returned (a completed job; any job of a sweep) or the process ended with the failure's exit
    status."""
    if error is None and summary["status"] not in checkpoint.FINAL:
        error = outcome(summary, job)
    by = summary.get("stop_signal")
    if error is None and job.sweep and by:   # it completed as the signal came
        error = JobError(f"mixprec: {by} as the job ended ({summary['status']}): the sweep stops "
                         f"here. To continue: {resume_hint(job.out, job.sweep)}",
                         128 + signal.Signals[by].value, stops_sweep=True)
    first = summary.get("failed_rank") == job.ranks.rank   # this rank's job failed first
    if error is not None and not (job.sweep and error.code == 1 and not job.ranks.active):
        if job.ranks.main:
            log.error(str(error))
            dist.error_said(job.ranks)
        # rank 0 did not fail alike: this rank's own error (said already when it failed first)
        elif not first and not dist.error_said(job.ranks):
            print(f"[rank {job.ranks.rank}] {error}", file=sys.__stderr__, flush=True)
    if error is None or (job.sweep and not error.stops_sweep):
        return summary
    # the group ends as after a completed job; a rank that failed first does not wait for ranks
    # that wait for it in a collective
    dist.end_group(job.ranks, wait=not first)
    sys.exit(error.code)


def outcome(summary: dict, job: JobDir) -> JobError:
    """The JobError of a job that trained but did not complete (interrupted or failed)."""
    by = summary.get("interrupted_by")   # None on a rank that another rank's signal stopped
    if summary["status"] == "interrupted":   # with an error (note_signal): no checkpoint was saved
        saved = ("nothing saved since its last checkpoint" if summary.get("error")
                 else "checkpoint saved")
        return JobError(f"mixprec: {summary['reason']}; {saved}. To continue: "
                        f"{resume_hint(job.out, job.sweep)}",
                        128 + signal.Signals[by].value if by else 1, stops_sweep=True)
    line = f"mixprec: the job failed: {summary.get('error')}"
    ckpt = job.out / checkpoint.CHECKPOINT
    # not when the checkpoint is what failed
    if ckpt.exists() and str(ckpt) not in summary.get("error", ""):
        line += f"\nmixprec: to retry from its last checkpoint: {resume_hint(job.out, None)}"
    # on several ranks every rank's sweep ends at once: the others may be waiting in a collective
    return JobError(line, 1, stops_sweep=job.ranks.active)


def train_and_record(config: Config, summary: dict, job: JobDir, name: str = "run") -> dict:
    """Run one validated job, write its records (rank 0) in job.out, and return its summary
    (failed jobs included). name: the W&B run's."""
    ranks, tr = job.ranks, config.trainer
    device = hardware.select_device(dist.device_name(tr.device, ranks))
    per_rank = dist.check(tr.batch_size, tr.sync_bn, device, ranks,
                          config.trick.ghost_splits if config.trick.ghost_bn else 1,
                          sharded=tr.sharded, replicate=tr.replicate)
    refuse_for_ranks(config, ranks)
    # joins the job's process group (torchrun's is joined already, in train.py; FSDP on one rank
    # makes its own)
    made = dist.init(ranks, sharded=tr.sharded)
    try:
        # the checkpoint to resume, read and agreed by every rank before any work: one this job
        # cannot resume (another config, device or world size) is refused, the dir left as it is
        resume = (checkpoint.read_agreed(job.out, summary["config"], device.type, ranks)
                  if tr.resume == "auto" else None)
        # from here a SIGTERM/SIGINT stops the job (torchrun forwards a SIGTERM to every rank)
        with StopSignals() as stop:
            ctx = JobContext(config, device, ranks, per_rank=per_rank, out_dir=job.out,
                             group=job.group, name=name, stop=stop, resume=resume)
            return record_training(ctx, summary)
    finally:
        dist.close(made)


def refuse_for_ranks(config: Config, ranks: dist.Ranks) -> None:
    """What the job's ranks cannot run, refused in one line before any work (every rank alike): a
    language model on several ranks but sharded, a recurrent one compiled, an image pipeline that
    does not shard across ranks."""
    tr, arch = config.trainer, config.model.arch
    if not config.model.is_language_model:
        check_shard(config.dataset, ranks.world)
    elif ranks.active and not tr.sharded:
        raise ConfigError(
            "model=" + arch + ": language models train in one process here, or the "
            "gpt sharded (trainer.strategy=fsdp); torchrun/DDP covers the image models"
        )
    elif tr.compile != "none" and arch != "gpt":
        raise ConfigError(
            f"trainer.compile={tr.compile} with model={arch}: {RNN_EAGER}; use "
            "trainer.compile=none (the GPT and the image models compile)"
        )


def record_training(ctx: JobContext, summary: dict) -> dict:
    """Set up the device and the job dir (resume, W&B), train, and complete the summary.
    ctx.per_rank: each rank's batch (dist.check's). ctx.stop: the job's stop signals, active since
    before the set-up: the loop stops after a step; note_signal records them. ctx.resume: the
    agreed checkpoint to resume (None: start over)."""
    describe_job(ctx, summary)
    try:
        open_job_dir(ctx, summary)
        mirror = agreed_mirror(ctx, summary)
    # recorded as a failed job, in one line
    except RuntimeError as e:
        summary["error"] = str(e)
        note_signal(summary, ctx.stop())
        if ctx.ranks.main:
            write_json_atomic(ctx.out_dir / SUMMARY, summary)
        return summary
    recorder, saver = open_records(ctx, summary, mirror)
    ranks, stop = ctx.ranks, ctx.stop
    agreed, failed_first = ranks.agreed_stop(stop), False
    try:
        with emulation.numerics(ctx.emulated):
            summary.update(train_job(dataclasses.replace(ctx, stop=agreed), recorder, saver))
            # a diverged probe=none job trained again under probe=ranges to time its first
            # non-finite value (train/replay.py); nothing for any other job
            summary.update(replay.explain(summary, ctx, train_job))
    except KeyboardInterrupt:
        summary.update(status="interrupted", error="interrupted by the user (KeyboardInterrupt)")
        raise
    # data missing/unreadable, or a config the data cannot serve: one line
    except (DataError, ConfigError) as e:
        summary.update(
            status="failed", error=f"{'data' if isinstance(e, DataError) else 'config'} error: {e}"
        )
    except Exception as e:  # the job failed: record why; a sweep goes on with its other jobs
        summary.update(
            status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()
        )
        note_failed_rank(summary, ranks)
        # torchrun stops every rank once one has failed: a SIGTERM after this rank's failure, or
        # after another rank's, is no stop the user asked for
        failed_first = ranks.active and (stop() is None
                                         or summary["failed_rank"] != ranks.rank)
    finally:
        note_signal(summary, None if failed_first else stop() or agreed.last)
        complete_summary(summary, ctx, saver)
        recorder.write_summary(summary)
        if summary["status"] in checkpoint.FINAL and ranks.main:
            saver.discard()
        if mirror is not None:
            mirror.finish(ok=summary["status"] in ("completed", "diverged"))
        recorder.close()
    return summary


def describe_job(ctx: JobContext, summary: dict) -> None:
    """The device set up for the job (modes.configure), and what the summary says of it before
    training: the environment, the GPU profile, the seed, the hazards and the arithmetic."""
    config, device = ctx.config, ctx.device
    modes.configure(device, config.trainer, config.precision, config.seed)
    env = hardware.describe(device)
    profile = hardware.gpu_profile(
        config.gpu, env["device_name"] if device.type != "cpu" else "cpu"
    )
    # under FSDP the weights are cast to real fp16/bf16 tensors (precision/fsdp.py)
    emulated = ctx.emulated
    summary.update(env=env, gpu_profile=profile, seed=config.seed, name=config.name,
                   hazards=hazards(config.precision, config.optimizer, device.type),
                   arithmetic=modes.arithmetic(config.precision, device, emulated))
    warn_if_slow(config, device, profile, emulated)


def open_records(ctx: JobContext, summary: dict, mirror) -> tuple:
    """The job's recorder (rank 0's; the other ranks' write nothing) and checkpointer, and the
    summary a SIGKILLed job leaves behind (`running`)."""
    recorder = Recorder(ctx.out_dir, mirror) if ctx.ranks.main else dist.Silent(ctx.out_dir)
    saver = checkpoint.Checkpointer(
        ctx.out_dir,
        meta={
            "config": summary["config"],
            "device_type": ctx.device.type,
            "wandb_run_id": mirror and mirror.run.id,
            "resumes": summary.get("resumed", {}).get("history", []),
        },
        ranks=ctx.ranks,
        sharded=ctx.config.trainer.sharded,
    )
    recorder.write_summary({**summary, "status": "running"})   # what a SIGKILLed job leaves behind
    return recorder, saver


def note_failed_rank(summary: dict, ranks: dist.Ranks) -> None:
    """A job that failed on a multi-rank process group: the first rank that failed (`failed_rank`,
    agreed through the group's store: dist.first_failure) and its error; a rank that failed first
    says its error here (rank 0 records the job's)."""
    if not ranks.active:
        return
    line = (str(summary["error"]).splitlines() or ["?"])[0]
    rank, said = dist.first_failure(ranks, line)
    summary["failed_rank"] = rank
    if rank != ranks.rank:   # this rank's collective ended when that rank left
        summary.update(error=f"rank {rank}: {said}", error_here=summary["error"])
    elif not ranks.main:
        log.error(f"mixprec: rank {ranks.rank}: {line}")


def note_signal(summary: dict, by: str | None) -> None:
    """The stop signal that reached the job (`by`; None: none) in its summary: `stop_signal`
    whatever the job's status (a job that completed as it came stops a sweep all the same),
    `interrupted_by` for a job it stopped. A job that failed after the signal ends `interrupted`:
    the signal reached its helper processes too (inductor's compile workers, a C++ compiler, W&B's
    service), and what failed next is its doing; the error stays recorded."""
    if by is None:
        return
    summary["stop_signal"] = by
    if summary["status"] == "failed":
        first = (str(summary.get("error") or "").splitlines() or ["?"])[0]
        summary.update(status="interrupted",
                       reason=f"{by} received; the job then stopped on {first}")
    if summary["status"] == "interrupted":
        summary["interrupted_by"] = by


def open_job_dir(ctx: JobContext, summary: dict) -> None:
    """Make the dir's records match where the job starts: from ctx.resume (the agreed checkpoint,
    read before any work) or over."""
    out_dir, resume, ranks = ctx.out_dir, ctx.resume, ctx.ranks
    prior = checkpoint.prior_summary(out_dir) if ctx.config.trainer.resume == "auto" else None
    ranks.barrier()   # every rank has read the dir (rank 0's checkpoint) before rank 0 writes to it
    if not ranks.main:
        return
    if checkpoint.prepare_dir(out_dir, resume) and resume is None:
        why = ("no checkpoint to resume from" if ctx.config.trainer.resume == "auto"
               else "trainer.resume=never")
        log.info(f"mixprec: note: {out_dir} held records of an earlier run: starting over ({why})")
    if resume is not None:
        summary["resumed"] = r = checkpoint.resumed_info(resume, prior)
        log.info(
            f"mixprec: resuming {out_dir} at step {r['from_step']} (epoch {r['from_epoch']:.2f}; "
            f"its last status: {r['previous_status']})"
        )


def agreed_mirror(ctx: JobContext, summary: dict):
    """Rank 0's W&B mirror (None on the other ranks and without W&B), agreed by every rank: when W&B
    fails to start on rank 0, every rank ends the job (RuntimeError, said by rank 0) instead of the
    others going on to wait for rank 0 in the first collective. One small all-reduce, only under
    logger=wandb on several ranks."""
    logger = ctx.config.logger
    if logger.name != "wandb" or logger.mode == "disabled":
        return None
    mirror = failed = None
    if ctx.ranks.main:
        try:
            mirror = open_mirror(ctx, summary)
        except Exception as e:   # noqa: BLE001 - said below, in one line, by every rank's job
            failed = e if isinstance(e, RuntimeError) else RuntimeError(
                f"W&B could not start the run ({type(e).__name__}: "
                f"{(str(e).splitlines() or [''])[0]}); logger=none runs without W&B")
    if ctx.ranks.any(failed is not None):
        raise failed or RuntimeError("W&B could not start the run on rank 0 (its train.log says "
                                     "why); logger=none runs without W&B")
    return mirror


def open_mirror(ctx: JobContext, summary: dict):
    """The W&B run the records are mirrored to (None without W&B), in ctx.group under ctx.name; a
    resumed job continues its run."""
    config, resume = ctx.config, ctx.resume
    if config.logger.name != "wandb" or config.logger.mode == "disabled":
        return None
    from .records.wandb_mirror import WandbMirror   # lazy: wandb (optional, slow to import)

    mirror = WandbMirror(
        config.logger,
        ctx.out_dir,
        summary["config"],
        group=ctx.group,
        name=ctx.name,
        job_type=config.name,
        run_id=resume.get("wandb_run_id") if resume else None,
    )
    summary["wandb"] = {"mode": config.logger.mode, "run_id": mirror.run.id, "dir": mirror.run_dir,
                        "name": mirror.run.name}
    return mirror


def complete_summary(summary: dict, ctx: JobContext, saver: checkpoint.Checkpointer) -> None:
    """What the summary adds after training, whatever happened: MFU, the likely cause of a
    divergence, checkpoint time, the case's verdict, the end time and the peak memory."""
    config = ctx.config
    m = summary.setdefault("metrics", {})
    if "throughput" in m:
        m["mfu"] = hardware.mfu(m, summary["gpu_profile"], modes.peak_kind(config.precision),
                                ctx.ranks.world)
        m["checkpoint_time_s"] = saver.seconds
    if summary["status"] == "diverged" and summary["hazards"]:
        summary["reason"] += f"; likely cause: {summary['hazards'][0]}"
    if config.case is not None:
        summary["case"] = dataclasses.asdict(config.case)
        summary["case"]["as_expected"] = summary["status"] == config.case.expect
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    m.update(hardware.memory_metrics(ctx.device))


def train_job(ctx: JobContext, recorder: Recorder, saver: checkpoint.Checkpointer) -> dict:
    """Build, then train: the job's parts (image or language model: train/parts.py), a checkpoint
    (ctx.resume) restored into them, the shared loop run over them, and its result completed
    (finish_result). ctx.per_rank: each rank's batch (dist.check's)."""
    reset_compile_state(ctx.device)   # an earlier job of this process (a sweep's) leaves nothing
    with built_parts(ctx) as parts:
        tr, ranks, model, policy = ctx.config.trainer, ctx.ranks, parts.model, parts.policy
        saver.parts.update(model=model, optimizer=parts.optimizer, schedule=parts.steps.schedule,
                           precision=PolicyState(policy), data=parts.batches, **parts.checkpointed)
        state = loop.LoopState()   # setup (the whitening fit) is timed apart, as Page timed it
        held = parallel.HeldPeak(model, parts.optimizer) if tr.sharded else None
        if ctx.resume is not None:
            saver.restore(ctx.resume, state)   # last before training: it sets the RNG states
        with probed(ctx, model) as probe:
            run = loop.Loop(policy, parts.optimizer, tr, loop.total_steps(tr, len(parts.batches)),
                            log=recorder.log, checkpoint=saver.save, stop=ctx.stop, ranks=ranks,
                            progress=sys.stderr.isatty() and ranks.main, probe=probe,
                            busy=busy.meter_for(ctx.device, ranks.world),
                            memory=memory.Ledger(model, policy, parts.optimizer, probe))
            result = loop.fit(parts.steps, parts.batches, run, state)
            result["memory"] = run.memory.summary()
            result["numerics"] = probe.summary()
            result["verdict"] = verdicts.judge(
                result["numerics"],
                probe.rows(),
                verdicts.context(ctx.config, result["status"], result["metrics"].get("steps")),
            )
        if ranks.active or tr.sharded:
            result["distributed"] = distributed_record(ctx, policy, held)
        return finish_result(ctx, parts, result, recorder)


def finish_result(ctx: JobContext, parts: Parts, result: dict, recorder: Recorder) -> dict:
    """The loop's result with what the parts add: their metrics and compile's record, Page's clock,
    the fp8 layers, the saved weights (a final job under trainer.save_weights), the data and the
    optimizer's groups."""
    tr, ranks, policy = ctx.config.trainer, ctx.ranks, parts.policy
    result["metrics"].update(parts.metrics, **parts.watch.finish())
    m = result["metrics"]
    # an image job: its time on Page's clock, the one-off data preparation included
    if "preprocess_time_s" in m:
        m["page_clock_s"] = m["train_time_s"] + m["preprocess_time_s"]
    # precision=fp8: the float8 and bf16 Linear layers, emulated or not (else None)
    result["fp8"] = policy.fp8
    final = parts.final   # the weights that were evaluated: the EMA's if any
    # under FSDP gathering the weights is a collective: every rank takes part, rank 0 saves them
    if result["status"] in checkpoint.FINAL and tr.save_weights and (ranks.main or tr.sharded):
        weights = policy.fp32_state_dict(final)
        if ranks.main:
            result["weights"] = checkpoint.save_weights(recorder.out_dir, weights,
                                                        parts.num_classes)
    # its weight-decay groups
    return {**result, "data": parts.data, "optimizer": parts.groups}


def distributed_record(ctx: JobContext, policy: PrecisionPolicy,
                       held: parallel.HeldPeak | None) -> dict:
    """The summary's "distributed" block of a job on several ranks or sharded; every rank calls it
    (the weight spread and the held bytes are gathered: collectives)."""
    config, ranks = ctx.config, ctx.ranks
    tr = config.trainer
    record = {
        "world_size": ranks.world,
        "per_rank_batch": ctx.per_rank,
        "sync_bn": tr.sync_bn,
        "backend": dist.backend_for(ctx.device),
        "strategy": "fsdp" if tr.sharded else "ddp",
        # FSDP's ranks hold different shards: no copies to compare
        "weight_spread": None if tr.sharded else dist.spread(policy.stepped_params(), ranks),
    }
    if held is not None:   # the mesh, each rank's bytes, gathered, and the dtypes FSDP uses
        record.update(fsdp.dtypes(config.precision),
                      mesh=parallel.mesh_record(dist.mesh_shape(tr.replicate, ranks)),
                      held_bytes=ranks.gather(held.measure()))
        if any(isinstance(m, fsdp.FP32Affine) for m in held.model.modules()):
            record["batchnorm"] = fsdp.batchnorm_note(config.precision)
    return record


def warn_if_slow(
    config: Config, device: torch.device, profile: dict, emulated: bool = False
) -> None:
    if profile.get("note") and profile.get("matched") is False:
        log.info(f"mixprec: note: {profile['note']}")
    modes.say_notes(config.precision, device, emulated)
