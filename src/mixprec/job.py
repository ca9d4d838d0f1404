"""One job, wired end to end: config -> hardware -> data -> model -> precision policy -> loop ->
records.

This is the only module that puts the parts together; each part takes plain values from the
validated config. `run_job` (the Hydra job) is also the one place where every way a job ends becomes
its summary.json and its exit status: a `JobError` carries the console line and the status,
`end_job` says it and exits (a sweep goes on with its other jobs, except after a signal, which was
meant for the whole command, and after a failure on a multi-rank process group, where the ranks
that did not fail may be waiting for one that did).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
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

from .config import Config, ConfigError, PrecisionConfig, plain_config, validate_job
from .data import Resumable, build_image_data, image_loaders
from .data.files import DataError
from .data.pipelines import check_shard
from .data.wikitext import TokenWindows, batchify, load_text_corpus
from .models import build_model, forward_flops
from .models.resnet9 import resnet9_options
from .numerics import verdicts
from .numerics.probe import build_probe
from .precision import emulation, fsdp, modes
from .precision.modes import emulates, hazards
from .precision.policy import PrecisionPolicy
from .precision.state import PolicyState
from . import records
from .records import SUMMARY, Recorder, this_process, write_json_atomic
from .report.render import job_block
from .runtime import busy, dist, hardware, logs
from .runtime.signals import StopSignals, resume_hint
from .train import checkpoint, image_steps, loop, memory, parallel, replay, tricks
from .train.build import build_trained
from .train.compile import (
    RNN_EAGER,
    GraphWatch,
    compile_model,
    reset_compile_state,
    start_compile_workers,
    warm_compile,
)
from .train.lm_steps import LMSteps
from .train.optim import build_schedule
from .train.warmup import image_warmup, lm_warmup, prewarm, prewarm_lm, reset_peak

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
    sweep: Path | None    # the sweep's dir under -m
    ranks: dist.Ranks

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
    summary = {
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
    try:
        checkpoint.keep_default_batch(cfg, job.out)   # a resume keeps a default batch that moved
        summary["config"] = plain_config(cfg)
        config = validate_job(cfg)
        modes.check_installed(config.precision)   # fp8's torchao: one line before any work
        prior = final_prior(config, job)
        if prior is not None:
            return prior
        dist.quiet_unless_main(job.ranks)
        summary = train_and_record(config, summary, job.out, group=job.group,
                                   name=run_name(hc.job.override_dirname) or job.out.name,
                                   ranks=job.ranks)
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


def train_and_record(
    config: Config,
    summary: dict,
    out_dir: Path,
    group: str | None = None,
    name: str = "run",
    ranks: dist.Ranks = dist.SINGLE,
) -> dict:
    """Run one validated job, write its records (rank 0), and return its summary (failed jobs
    included)."""
    device = hardware.select_device(dist.device_name(config.trainer.device, ranks))
    tr = config.trainer
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
        resume = (checkpoint.read_agreed(out_dir, summary["config"], device.type, ranks)
                  if tr.resume == "auto" else None)
        # from here a SIGTERM/SIGINT stops the job (torchrun forwards a SIGTERM to every rank)
        with StopSignals() as stop:
            return record_training(config, summary, out_dir, group, name, device, ranks,
                                   per_rank, stop, resume)
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


def record_training(config: Config, summary: dict, out_dir: Path, group: str | None, name: str,
                    device: torch.device, ranks: dist.Ranks, per_rank: int,
                    stop: StopSignals, resume: dict | None = None) -> dict:
    """Set up the device and the job dir (resume, W&B), train, and complete the summary. per_rank:
    each rank's batch (dist.check's). `stop`: the job's stop signals, active since before the
    set-up: the loop stops after a step; note_signal records them. `resume`: the agreed checkpoint
    to resume (None: start over)."""
    modes.configure(device, config.trainer, config.precision, config.seed)
    env = hardware.describe(device)
    profile = hardware.gpu_profile(
        config.gpu, env["device_name"] if device.type != "cpu" else "cpu"
    )
    # under FSDP the weights are cast to real fp16/bf16 tensors (precision/fsdp.py)
    emulated = emulates(config.precision, device, config.trainer.sharded)
    summary.update(env=env, gpu_profile=profile, seed=config.seed, name=config.name,
                   hazards=hazards(config.precision, config.optimizer, device.type),
                   arithmetic=modes.arithmetic(config.precision, device, emulated))
    warn_if_slow(config, device, profile, emulated)
    try:
        open_job_dir(config, summary, out_dir, resume, ranks)
        mirror = agreed_mirror(config, summary, out_dir, group, name, resume, ranks)
    # recorded as a failed job, in one line
    except RuntimeError as e:
        summary["error"] = str(e)
        note_signal(summary, stop())
        if ranks.main:
            write_json_atomic(out_dir / SUMMARY, summary)
        return summary
    recorder = Recorder(out_dir, mirror) if ranks.main else dist.Silent(out_dir)
    saver = checkpoint.Checkpointer(
        out_dir,
        meta={
            "config": summary["config"],
            "device_type": device.type,
            "wandb_run_id": mirror and mirror.run.id,
            "resumes": summary.get("resumed", {}).get("history", []),
        },
        ranks=ranks,
        sharded=config.trainer.sharded,
    )
    recorder.write_summary({**summary, "status": "running"})   # what a SIGKILLed job leaves behind
    agreed, failed_first = ranks.agreed_stop(stop), False
    try:
        train = functools.partial(train_job, per_rank=per_rank)
        with emulation.numerics(emulated):
            summary.update(train(config, device, recorder, saver, resume, agreed, ranks))
            # probe=none
            summary.update(replay.explain(summary, config, device, out_dir, ranks.active, train))
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
        complete_summary(summary, config, device, saver, ranks.world)
        recorder.write_summary(summary)
        if summary["status"] in checkpoint.FINAL and ranks.main:
            saver.discard()
        if mirror is not None:
            mirror.finish(ok=summary["status"] in ("completed", "diverged"))
        recorder.close()
    return summary


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


def open_job_dir(
    config: Config, summary: dict, out_dir: Path, resume: dict | None, ranks: dist.Ranks
) -> None:
    """Make the dir's records match where the job starts: from `resume` (the agreed checkpoint,
    read before any work) or over."""
    prior = checkpoint.prior_summary(out_dir) if config.trainer.resume == "auto" else None
    ranks.barrier()   # every rank has read the dir (rank 0's checkpoint) before rank 0 writes to it
    if not ranks.main:
        return
    if checkpoint.prepare_dir(out_dir, resume) and resume is None:
        why = ("no checkpoint to resume from" if config.trainer.resume == "auto"
               else "trainer.resume=never")
        log.info(f"mixprec: note: {out_dir} held records of an earlier run: starting over ({why})")
    if resume is not None:
        summary["resumed"] = r = checkpoint.resumed_info(resume, prior)
        log.info(
            f"mixprec: resuming {out_dir} at step {r['from_step']} (epoch {r['from_epoch']:.2f}; "
            f"its last status: {r['previous_status']})"
        )


def agreed_mirror(config: Config, summary: dict, out_dir: Path, group: str | None, name: str,
                  resume: dict | None, ranks: dist.Ranks):
    """Rank 0's W&B mirror (None on the other ranks and without W&B), agreed by every rank: when W&B
    fails to start on rank 0, every rank ends the job (RuntimeError, said by rank 0) instead of the
    others going on to wait for rank 0 in the first collective. One small all-reduce, only under
    logger=wandb on several ranks."""
    if config.logger.name != "wandb" or config.logger.mode == "disabled":
        return None
    mirror = failed = None
    if ranks.main:
        try:
            mirror = open_mirror(config, summary, out_dir, group, name, resume)
        except Exception as e:   # noqa: BLE001 - said below, in one line, by every rank's job
            failed = e if isinstance(e, RuntimeError) else RuntimeError(
                f"W&B could not start the run ({type(e).__name__}: "
                f"{(str(e).splitlines() or [''])[0]}); logger=none runs without W&B")
    if ranks.any(failed is not None):
        raise failed or RuntimeError("W&B could not start the run on rank 0 (its train.log says "
                                     "why); logger=none runs without W&B")
    return mirror


def open_mirror(
    config: Config, summary: dict, out_dir: Path, group: str | None, name: str, resume: dict | None
):
    """The W&B run the records are mirrored to (None without W&B); a resumed job continues its
    run."""
    if config.logger.name != "wandb" or config.logger.mode == "disabled":
        return None
    from .records.wandb_mirror import WandbMirror   # lazy: wandb (optional, slow to import)

    mirror = WandbMirror(
        config.logger,
        out_dir,
        summary["config"],
        group=group,
        name=name,
        job_type=config.name,
        run_id=resume.get("wandb_run_id") if resume else None,
    )
    summary["wandb"] = {"mode": config.logger.mode, "run_id": mirror.run.id, "dir": mirror.run_dir,
                        "name": mirror.run.name}
    return mirror


def complete_summary(
    summary: dict,
    config: Config,
    device: torch.device,
    saver: checkpoint.Checkpointer,
    world: int = 1,
) -> None:
    """What the summary adds after training, whatever happened: MFU, the likely cause of a
    divergence, checkpoint time, the case's verdict, the end time and the peak memory."""
    m = summary.setdefault("metrics", {})
    if "throughput" in m:
        m["mfu"] = hardware.mfu(m, summary["gpu_profile"], modes.peak_kind(config.precision), world)
        m["checkpoint_time_s"] = saver.seconds
    if summary["status"] == "diverged" and summary["hazards"]:
        summary["reason"] += f"; likely cause: {summary['hazards'][0]}"
    if config.case is not None:
        summary["case"] = dataclasses.asdict(config.case)
        summary["case"]["as_expected"] = summary["status"] == config.case.expect
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    m.update(hardware.memory_metrics(device))


def train_job(
    config: Config,
    device: torch.device,
    recorder: Recorder,
    saver: checkpoint.Checkpointer,
    resume: dict | None = None,
    stop=lambda: None,
    ranks: dist.Ranks = dist.SINGLE,
    *,
    per_rank: int,
) -> dict:
    """Build the job's parts (image or language model), restore a checkpoint into them, and run the
    shared loop. per_rank: each rank's batch (dist.check's)."""
    build = language_model_parts if config.model.is_language_model else image_parts
    reset_compile_state(device)   # an earlier job of this process (a sweep's) leaves nothing
    steps = batches = None
    failed = True
    try:
        steps, batches, policy, optimizer, info = build(config, device, ranks, per_rank)
        result = run_parts(config, device, steps, batches, policy, optimizer, info, saver, resume,
                           stop, ranks, per_rank, recorder)
        failed = False
        return result
    finally:   # a DataLoader's workers and FSDP's mesh groups end with the job, whatever ended it
        for loader in (batches, getattr(steps, "test_batches", None)):
            if isinstance(loader, Resumable):
                loader.close()
        parallel.release_meshes(failed)


def run_parts(
    config: Config,
    device: torch.device,
    steps,
    batches,
    policy,
    optimizer,
    info: dict,
    saver: checkpoint.Checkpointer,
    resume: dict | None,
    stop,
    ranks: dist.Ranks,
    per_rank: int,
    recorder: Recorder,
) -> dict:
    """Restore a checkpoint into the built parts and run the shared loop (per_rank: each rank's
    batch, for the record)."""
    tr = config.trainer
    model = info.pop("model")
    saver.parts.update(model=model, optimizer=optimizer, schedule=steps.schedule,
                       precision=PolicyState(policy), data=batches, **info.pop("parts"))
    state = loop.LoopState()   # setup (the whitening fit) is timed apart, as Page timed it
    held = parallel.HeldPeak(model, optimizer) if tr.sharded else None
    if resume is not None:
        saver.restore(resume, state)   # last before training: it sets the RNG states
    with probed(config, model, recorder, ranks) as probe:
        run = loop.Loop(policy, optimizer, tr, loop.total_steps(tr, len(batches)), log=recorder.log,
                           checkpoint=saver.save, stop=stop, ranks=ranks,
                           progress=sys.stderr.isatty() and ranks.main, probe=probe,
                           busy=busy.meter_for(device, ranks.world),
                           memory=memory.Ledger(model, policy, optimizer, probe))
        result = loop.fit(steps, batches, run, state)
        result["memory"] = run.memory.summary()
        result["numerics"] = probe.summary()
        result["verdict"] = verdicts.judge(
            result["numerics"],
            probe.rows(),
            verdicts.context(config, result["status"], result["metrics"].get("steps")),
        )
    if ranks.active or tr.sharded:
        result["distributed"] = distributed_record(config, device, ranks, per_rank, policy, held)
    result["metrics"].update(info.pop("metrics"), **info.pop("compiled").finish())
    m = result["metrics"]
    # an image job: its time on Page's clock, the one-off data preparation included
    if "preprocess_time_s" in m:
        m["page_clock_s"] = m["train_time_s"] + m["preprocess_time_s"]
    # precision=fp8: the float8 and bf16 Linear layers, emulated or not (else None)
    result["fp8"] = policy.fp8
    final = info.pop("final")   # the weights that were evaluated: the EMA's if any
    # under FSDP gathering the weights is a collective: every rank takes part, rank 0 saves them
    if result["status"] in checkpoint.FINAL and tr.save_weights and (ranks.main or tr.sharded):
        weights = policy.fp32_state_dict(final)
        if ranks.main:
            result["weights"] = checkpoint.save_weights(recorder.out_dir, weights,
                                                        info.pop("num_classes"))
    # its weight-decay groups
    return {**result, "data": info["data"], "optimizer": info["optimizer"]}


def distributed_record(config: Config, device: torch.device, ranks: dist.Ranks, per_rank: int,
                       policy: PrecisionPolicy, held: parallel.HeldPeak | None) -> dict:
    """The summary's "distributed" block of a job on several ranks or sharded; every rank calls it
    (the weight spread and the held bytes are gathered: collectives)."""
    tr = config.trainer
    record = {
        "world_size": ranks.world,
        "per_rank_batch": per_rank,
        "sync_bn": tr.sync_bn,
        "backend": dist.backend_for(device),
        "strategy": "fsdp" if tr.sharded else "ddp",
        # FSDP's ranks hold different shards: no copies to compare
        "weight_spread": None if tr.sharded else dist.spread(policy.stepped_params(), ranks),
    }
    if held is not None:   # the mesh, each rank's bytes, gathered, and the dtypes FSDP uses
        record.update(fsdp.dtypes(config.precision),
                      mesh=parallel.mesh_record(dist.mesh_shape(tr.replicate, ranks)),
                      held_bytes=ranks.gather(held.measure()))
    return record


@contextlib.contextmanager
def probed(config: Config, model, recorder: Recorder, ranks: dist.Ranks):
    """The job's numerics probe (numerics/probe.py): rank 0 records numerics.jsonl; closed however
    training ends. Under FSDP it sees no model (its layers hold shards outside their unit's
    forward): skips are counted, not attributed to parameters."""
    probe = build_probe(config.probe, None if config.trainer.sharded else model,
                        recorder.out_dir if ranks.main else None)
    try:
        yield probe
    finally:
        probe.close()


def image_parts(config: Config, device: torch.device, ranks: dist.Ranks, per_rank: int):
    """An image classifier's steps, training batches, policy, optimizer, and what the job records
    about it; per_rank: each rank's batch (its slice of the global batch)."""
    tr, t, resnet9 = config.trainer, config.trick, config.model.arch == "resnet9"
    data = build_image_data(config.dataset)
    # Page's clock starts before his preprocessing (dawn.py at 37a13cc:79-87)
    start = time.perf_counter()
    train_batches, test_batches = image_loaders(data, config.dataset, tr, device, seed=config.seed,
                                                shard=(ranks.rank, ranks.world))
    hardware.synchronize(device)
    preprocess_s = time.perf_counter() - start
    whitening, setup_s = tricks.fit_whitening(t, data, device) if resnet9 else (None, 0.0)
    options = resnet9_options(t, whitening) if resnet9 else {}
    model = build_model(config.model, data.num_classes, **options)
    flops = forward_flops(model, torch.zeros(1, *train_batches.image_shape))
    n_params = sum(p.numel() for p in model.parameters())
    built = build_trained(model, config, device, t.bn_bias_lr, tr.channels_last,
                          wrap=wrapper(config, device, ranks))
    model, net, policy, optimizer = built.model, built.net, built.policy, built.optimizer
    schedule = build_schedule(config.schedule, optimizer, loop.total_steps(tr, len(train_batches)))
    ema = tricks.EMA(model, t.ema_momentum, t.ema_every) if t.ema else None
    steps = image_steps.ImageSteps(net, schedule, test_batches, label_smoothing=t.label_smoothing,
                              loss_sum=t.loss_sum, ema=ema, tta=t.tta, bn_eval=config.model.bn_eval,
                              setup_time_s=setup_s)
    # Page's clock: untimed warm-up steps on throwaway copies before the clock starts (warmup.py),
    # then the compilation of the model the loop trains, also before the clock (train/compile.py)
    prewarm_s = prewarm(model, policy, optimizer, first_prewarm(tr, device), per_rank,
                        train_batches.image_shape, data.num_classes, tr.channels_last, tr.grad_clip)
    modes.refuse_emulated_compile(config.precision, tr.compile, policy.emulated)
    shapes = image_warmup(min(per_rank, len(data.train_y) // ranks.world), tr.eval_batch_size,
                          len(data.test_y), train_batches.image_shape, data.num_classes,
                          tr.channels_last, config.model.bn_eval,
                          evaluates=ema is None)   # an EMA job evaluates ema.model, eagerly
    compile_s, watch = compile_and_warm(steps, net, policy, tr.compile, shapes)
    info = {"model": model, "parts": {} if ema is None else {"ema": ema},
            "final": model if ema is None else ema.model, "num_classes": data.num_classes,
            "optimizer": built.groups, "compiled": watch,
            "metrics": {"params": n_params, "forward_flops_per_sample": flops,
                        "prewarm_time_s": prewarm_s, "preprocess_time_s": preprocess_s,
                        "compile_time_s": compile_s,
                        "train_flops_per_sample": None if flops is None else 3 * flops},
            "data": {**data.info, "train": len(data.train_y), "test": len(data.test_y),
                     "mean": data.mean, "std": data.std}}
    return steps, train_batches, policy, optimizer, info


def first_prewarm(tr, device: torch.device) -> int:
    """The job's prewarm steps (TrainerConfig.prewarm_for), knowing whether it is the process's
    first job (hardware.configure counted it)."""
    return tr.prewarm_for(device.type, first_in_process=hardware.JOBS_IN_PROCESS == 1)


def wrapper(config: Config, device: torch.device, ranks: dist.Ranks):
    """What wraps the trained model: FSDP's sharding (trainer.strategy=fsdp) over the mesh of
    trainer.replicate, else DDP under several ranks, else nothing."""
    if config.trainer.sharded:
        shape = dist.mesh_shape(config.trainer.replicate, ranks)
        return lambda m: parallel.shard(m, config.precision, device, shape, config.trainer.compile)
    return lambda m: parallel.wrap(m, device, config.trainer.sync_bn, ranks)


def compile_and_warm(steps, net: torch.nn.Module, policy: PrecisionPolicy, mode: str,
                     warmup) -> tuple:
    """The loop's model (steps.model) compiled in `mode` and warmed for `warmup`'s shapes before the
    clock, then the device's peak reset (prewarm's copies are gone: the peak is the run's own,
    warmup.py). Returns the warm-up's seconds and the GraphWatch that records the job's graphs and
    eager calls. On an accelerator the compile workers start first, out of reach of the job's stop
    signals (start_compile_workers)."""
    steps.model = compile_model(net, mode)
    watch = GraphWatch(net, mode)
    if mode != "none" and policy.device.type != "cpu":
        start_compile_workers()
    seconds = warm_compile(steps.model, policy, mode, warmup)
    watch.warmed()
    reset_peak(policy.device)
    return seconds, watch


def language_model_parts(config: Config, device: torch.device, ranks: dist.Ranks, per_rank: int):
    """A word-level language model on a text corpus (see train/lm_steps.py); throughput and FLOPs
    are per token. per_rank: each rank's columns (the whole batch in one process; FSDP's ranks split
    it)."""
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
    built = build_trained(model, config, device, wrap=wrapper(config, device, ranks))
    model, policy, optimizer, groups = built.model, built.policy, built.optimizer, built.groups
    schedule = build_schedule(config.schedule, optimizer, loop.total_steps(tr, len(windows)))
    steps = LMSteps(model, schedule, valid_source, test_source, bptt, columns=per_rank)
    prewarm_s = prewarm_lm(model, policy, optimizer, first_prewarm(tr, device), bptt, per_rank,
                           corpus.vocab_size, tr.grad_clip)
    modes.refuse_emulated_compile(config.precision, tr.compile, policy.emulated)
    shapes = lm_warmup(len(train_source), per_rank, [len(valid_source), len(test_source)],
                       tr.eval_batch_size, bptt, corpus.vocab_size)
    compile_s, watch = compile_and_warm(steps, model, policy, tr.compile, shapes)
    info = {"model": model, "parts": {"hidden": steps}, "final": model,
            "num_classes": corpus.vocab_size, "optimizer": groups, "compiled": watch,
            "metrics": {"params": n_params, "forward_flops_per_sample": flops,
                        "train_flops_per_sample": 3 * flops, "flops_per": "token",
                        "prewarm_time_s": prewarm_s, "compile_time_s": compile_s},
            "data": {**corpus.info, "vocab_size": corpus.vocab_size,
                     "train_tokens": len(corpus.train), "valid_tokens": len(corpus.valid),
                     "test_tokens": len(corpus.test), "bptt": bptt}}
    return steps, windows, policy, optimizer, info


def evaluate_saved(run_dir: Path, device: str = "auto") -> dict:
    """Evaluate a finished job's saved weights (model_fp32.pt) in an fp32 model, with fp32 math, on
    the job's own test split: apex's promise that whatever the training precision, the saved model
    is fp32 and usable. The model is built as the job built it (train/build.py), under fp32; nothing
    is stepped, so the optimizer takes the device's own kernels (impl=auto)."""
    model, config = checkpoint.load_fp32_model(run_dir)
    auto = dataclasses.replace(config.optimizer, impl="auto")
    config = dataclasses.replace(config, precision=PrecisionConfig(name="fp32"), optimizer=auto)
    device = hardware.select_device(device)
    modes.configure(device, config.trainer, config.precision, config.seed)
    data = build_image_data(config.dataset)
    _, test_batches = image_loaders(data, config.dataset, config.trainer, device, seed=config.seed)
    built = build_trained(model, config, device, channels_last=config.trainer.channels_last)
    loss, acc, _ = image_steps.evaluate(built.model, test_batches, built.policy)
    recorded = checkpoint.prior_summary(Path(run_dir))["metrics"]
    return {
        "test_acc": acc,
        "test_loss": loss,
        "recorded_test_acc": recorded.get("final_test_acc"),
        "recorded_test_loss": recorded.get("final_test_loss"),
        "precision": config.precision.name,
    }


def warn_if_slow(
    config: Config, device: torch.device, profile: dict, emulated: bool = False
) -> None:
    if profile.get("note") and profile.get("matched") is False:
        log.info(f"mixprec: note: {profile['note']}")
    modes.say_notes(config.precision, device, emulated)
