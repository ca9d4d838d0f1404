"""Checkpoints and resume: a job's full training state on disk, so an interrupted job continues
exactly.

`checkpoint.pt` (in the job's output dir) is written atomically at every epoch end but the last, and
mid-epoch when the job gets SIGTERM/SIGINT (after the current step). It holds the engine's LoopState
(step counters, epoch records, the kind's accumulators such as best accuracy and time to target,
loss-scale min/max, clock totals, the position in the epoch, the open log window), every registered
part's state_dict (model, optimizer, lr schedule, precision policy: loss scaler and fp32 master
weights; the training loader: its data order at the epoch's start and its place in the epoch; a
trick or a job kind adds its own, e.g. `saver.parts["ema"] = ema`, the language model's hidden
state), every RNG state (python, numpy, torch CPU and the job's GPU), the config and the W&B run id.
"Exactly" on a GPU needs trainer.deterministic=true: with cudnn.benchmark (the default) the resumed
process autotunes again and may pick other cuDNN algorithms, whose sums round differently (a
different, equally valid run). A SIGKILL (no handler can run) loses the work since the last epoch
end. A completed job's checkpoint is deleted; its final weights stay in `model_fp32.pt` (fp32
whatever the training precision; `load_fp32_model` rebuilds the model from the job's summary and
loads them).

A sharded job (trainer.strategy=fsdp) saves its model and optimizer through
torch.distributed.checkpoint (DCP): every rank writes its shards into a new folder
`checkpoint.shards.<step>.<token>/`; once every rank's shards and DCP's metadata are written, rank 0
writes checkpoint.pt (the rest, as above) naming that folder, then removes the older folders. A job
killed while writing leaves the previous checkpoint.pt and its folder whole; a folder that no
checkpoint.pt names is removed when the job dir is opened. A resume needs the world size it was
written with (each rank's RNG states and its slice of the data are its own).

`trainer.resume=auto`: a job whose summary.json says completed or diverged is final and skipped
(nothing is rewritten); otherwise (running = killed, interrupted, failed) it continues from its
checkpoint when there is one, else starts over. metrics.jsonl is cut back to the rows up to the
checkpoint's step, so no row appears twice. The config must be the checkpoint's (config_diff),
except a default batch that has moved since (keep_default_batch: the checkpoint's batch is kept).
"""
from __future__ import annotations

import dataclasses
import importlib.util

import json
import logging
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..config import NO_DEFAULT, schema_default, validate
from ..models import build_model
from ..models.resnet9 import resnet9_options
from ..runtime.defaults import RESOLVER
from ..runtime.dist import SINGLE, Ranks
from ..runtime.hardware import flatten_rnns
from ..precision.fsdp import after_load
from ..precision.state import load_module_state
from ..records import METRICS, SUMMARY, atomic_file
from .optim import saved_state_classes

CHECKPOINT = "checkpoint.pt"
WEIGHTS = "model_fp32.pt"
# a sharded job's model and optimizer shards: one folder per checkpoint, named by checkpoint.pt
SHARDS = "checkpoint.shards."
IN_SHARDS = ("model", "optimizer")     # the parts a sharded job saves through DCP
# 2: the loop state is loop.LoopState.state_dict(); the loader's place is the part "data";
FORMAT = 3
             # 3: "rng" is a list, one entry per rank
FINAL = ("completed", "diverged")        # a job in these states is done: resume=auto skips it
# config that may differ between a run and its resume
VOLATILE = ("trainer.resume", "trainer.device", "logger")


log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint or summary.json that cannot be used; the message names the file and what to
    do. `seen`: what this rank saw, in a few words, and `shards` the folder its checkpoint.pt
    names, for the ranks' agreement (read_agreed)."""

    def __init__(self, message: str, seen: str = "a checkpoint.pt it cannot use",
                 shards: str | None = None):
        super().__init__(message)
        self.seen, self.shards = seen, shards


# -- what a job dir holds --------------------------------------------------------------------------
def prior_summary(out_dir: Path) -> dict | None:
    """The summary.json already in out_dir (None when there is none); CheckpointError when it is
    unreadable."""
    path = Path(out_dir) / SUMMARY
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            f"{path}: not a readable summary.json ({e}); move it away to re-run that job"
        ) from None
    if not isinstance(summary, dict) or not isinstance(summary.get("status"), str):
        raise CheckpointError(
            f"{path}: not a mixprec summary (no status); move it away to re-run that job"
        )
    return summary


def optimizer_name(config: dict) -> str | None:
    """The optimizer a job's config (a plain dict) names; None when it names none."""
    optimizer = config.get("optimizer") if isinstance(config, dict) else None
    return optimizer.get("name") if isinstance(optimizer, dict) else None


def load(path: Path, optimizer: str | None, **kwargs) -> dict:
    """checkpoint.pt through torch.load's weights-only unpickler, told of the classes the job's
    `optimizer` keeps its state in (torchao's low-bit moments: optim.saved_state_classes)."""
    with torch.serialization.safe_globals(saved_state_classes(optimizer)):
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)


def reason(error: Exception) -> str:
    """A load's error in one line: the weights-only unpickler's refusal names the class it lacks
    on a later line of its message (its first line is a banner, with terminal escapes)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line] or [type(error).__name__]
    named = [line for line in lines if line.startswith("WeightsUnpickler error")]
    return (named or lines)[0].split(" was not an allowed global")[0][:200]


def unexpected_class(why: str, optimizer: str | None) -> str:
    """What to do about an intact checkpoint holding a class the unpickler was not told of: a
    low-bit optimizer's state while the job's config names another optimizer (a changed config),
    or a class whose package this Python lacks."""
    if "torchao.optim" in why and importlib.util.find_spec("torchao") is not None:
        return (f"it is intact, and holds a torchao low-bit optimizer's state while this job's "
                f"config names optimizer={optimizer}: resume with the job's own overrides")
    return ("it is intact: install the package that class comes from (torchao: pip install -e "
            "\".[dev]\"), then resume")


def read(out_dir: Path, config: dict, device_type: str, world: int = 1) -> dict | None:
    """The job's checkpoint (None when there is none), checked to belong to this config, kind of
    device and world size (`world` ranks), and, for a sharded job, to name a folder of shards that
    is there."""
    path = Path(out_dir) / CHECKPOINT
    if not path.exists():
        return None
    fix = f"delete {path} to start the job over, or run with trainer.resume=never"
    try:
        ckpt = load(path, optimizer_name(config))
    except Exception as e:   # truncated, garbage, or not a torch file: the reason is one line
        why = reason(e)
        if "Unsupported global" in why:   # intact, but of a class this job does not expect
            fix = f"{unexpected_class(why, optimizer_name(config))}; or {fix}"
        raise CheckpointError(f"{path}: not a readable checkpoint ({why}); {fix}") from None
    if (
        not isinstance(ckpt, dict)
        or ckpt.get("format") != FORMAT
        or not {"loop", "parts", "rng", "config"} <= set(ckpt)
    ):
        raise CheckpointError(f"{path}: not a mixprec checkpoint (format {FORMAT}); {fix}")
    # the RNG and data-order states are per kind of device
    if ckpt.get("device_type") != device_type:
        raise CheckpointError(
            f"{path}: written on {ckpt.get('device_type')}, this job runs on {device_type}; resume "
            f"on the same kind of device, or {fix}"
        )
    if len(ckpt["rng"]) != world:
        raise CheckpointError(world_error(path, len(ckpt["rng"]), world))
    shards = ckpt.get("shards")
    gap = shards and shards_gap(Path(out_dir) / shards)
    if gap:
        raise CheckpointError(f"{path}: its shards are not whole ({gap}); {fix}",
                              seen=f"checkpoint.pt of step {ckpt['loop']['step']} ({gap})",
                              shards=shards)
    diff = config_diff(ckpt["config"], config)
    if diff:
        raise CheckpointError(
            f"{path}: written by a different config ({diff}); resume with the job's own overrides, "
            f"or {fix}"
        )
    return ckpt


def shards_gap(folder: Path) -> str | None:
    """What a folder of DCP shards lacks (None: it is whole): its .metadata, or a file the metadata
    names (a rank may read any of them: DCP writes an item held alike by every rank once)."""
    if not (folder / ".metadata").exists():
        return f"{folder.name}/.metadata missing"
    try:
        meta = dcp.FileSystemReader(folder).read_metadata()
    except Exception:   # truncated or garbage: the reason is the file   # noqa: BLE001
        return f"{folder.name}/.metadata unreadable"
    files = sorted({info.relative_path for info in meta.storage_data.values()})
    lost = [name for name in files if not (folder / name).exists()]
    return f"{folder.name}/{', '.join(lost)} missing" if lost else None


def read_agreed(out_dir: Path, config: dict, device_type: str, ranks: Ranks) -> dict | None:
    """read() on every rank, then agreed (a gather: every rank has read the dir before rank 0
    writes to it): every rank gets the same checkpoint, or None, or the same CheckpointError. Ranks
    that see different things (a job dir on each node's own disk, a checkpoint deleted on one
    node) all fail in one line naming what each rank saw, before a collective load would wait
    for a rank that has nothing to load."""
    try:
        ckpt, error = read(out_dir, config, device_type, ranks.world), None
        seen = ("no checkpoint.pt", None) if ckpt is None else (
            f"checkpoint.pt of step {ckpt['loop']['step']}"
            + (f" and {ckpt['shards']}/" if ckpt.get("shards") else ""), ckpt.get("shards"))
    except CheckpointError as e:
        ckpt, error, seen = None, e, (e.seen, e.shards)
    views = ranks.gather(seen)
    if len({text for text, _ in views}) > 1:
        raise CheckpointError(unshared_error(Path(out_dir) / CHECKPOINT, views))
    if error is not None:
        raise error
    return ckpt


def unshared_error(path: Path, views: list) -> str:
    """The one line for ranks that do not see the same checkpoint: what each saw, what to do."""
    saw = seen_by([text for text, _ in views])
    shards = next((s for _, s in views if s), None)
    copy = f"{CHECKPOINT} and {shards}/" if shards else CHECKPOINT
    return (f"{path}: the ranks do not see the same checkpoint ({saw}); every rank reads it: put "
            f"the job dir on a file system that every node shares, or copy {copy} into each "
            "node's job dir (or delete them on every node to start over)")


def seen_by(views: list[str]) -> str:
    """'rank 0: x; ranks 1-3: y': what each rank saw (views in rank order), ranks grouped."""
    by_view: dict = {}
    for rank, text in enumerate(views):
        by_view.setdefault(text, []).append(rank)
    return "; ".join(f"{rank_list(r)}: {text}" for text, r in by_view.items())


def final_agreed(out_dir: Path, ranks: Ranks) -> dict | None:
    """The summary of a job already final in out_dir (completed or diverged: trainer.resume=auto
    skips it), else None, agreed by every rank (a gather) before any acts on it: ranks that see
    different things (a job dir on each node's own disk) all fail in one line naming what each
    saw, where one rank skipping the job and another training it would wait for each other in a
    collective. An unreadable summary.json: CheckpointError on every rank alike."""
    try:
        prior, error = prior_summary(out_dir), None
    except CheckpointError as e:
        prior, error = None, e
    final = prior is not None and prior["status"] in FINAL
    seen = (f"a {prior['status']} job" if final else
            "an unreadable summary.json" if error else "no finished job")
    views = ranks.gather(seen)
    if len(set(views)) > 1:
        raise CheckpointError(
            f"{Path(out_dir) / SUMMARY}: the ranks do not see the same job ({seen_by(views)}); "
            "under trainer.resume=auto every rank reads the job dir: put it on a file system "
            "every node shares, or delete the job dir on every node to run the job again")
    if error is not None:
        raise error
    return prior if final else None


def continuable(out_dir: Path) -> bool:
    """Whether out_dir holds a job that trainer.resume=auto can continue (a checkpoint.pt): a job
    refused before any work leaves that job's summary.json, interrupted or failed, as it is."""
    return (Path(out_dir) / CHECKPOINT).exists()


def rank_list(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0, 2', 'ranks 1-7': ascending rank numbers in a few words."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run))
                     for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def world_error(path: Path, written: int, world: int) -> str:
    """The one line for a resume with another world size than the checkpoint's."""
    return (f"{path}: written by {written} rank(s), this job has {world}; resume with as many "
            f"ranks (torchrun --nproc_per_node={written}), or delete it to start over")


def keep_default_batch(cfg, out_dir: Path) -> int | None:
    """Under trainer.resume=auto, a job whose trainer.batch_size is the device default (defaults.py:
    no preset or override set it) resumes with its checkpoint's batch when the default has changed
    since (64 on CUDA before 256): a default is not the user's change. Sets it in `cfg` (a Hydra
    DictConfig, before validation) and says so; returns the batch taken, else None. A checkpoint
    that cannot be read is left to read(), which says what is wrong."""
    trainer = cfg.get("trainer")
    if trainer is None or trainer.get("resume") != "auto" or "batch_size" not in trainer:
        return None
    default = OmegaConf.to_container(trainer, resolve=False)["batch_size"]
    path = Path(out_dir) / CHECKPOINT
    if not (isinstance(default, str) and RESOLVER in default and path.exists()):
        return None
    if set_batch(Path(out_dir) / SUMMARY):   # the user's batch then, dropped now: a change, refused
        return None
    try:   # mmap: only the pickled structure is read, not the tensors
        ckpt = load(path, cfg.get("optimizer", {}).get("name"), mmap=True)
        saved = ckpt["config"]["trainer"]["batch_size"]
        now = trainer.batch_size
    except Exception:
        return None
    if not isinstance(saved, int) or isinstance(saved, bool) or saved == now:
        return None
    trainer.batch_size = saved
    log.info(f"mixprec: note: resuming {out_dir} with its checkpoint's batch, "
             f"trainer.batch_size={saved} (the default is {now} now; a default is not a change to "
             f"the job: to train at {now}, start over with trainer.resume=never)")
    return saved


def set_batch(summary_file: Path) -> bool:
    """Whether the job that wrote this summary.json set trainer.batch_size by an override (True
    when the file cannot be read: then nothing is taken for a default)."""
    try:
        overrides = json.loads(summary_file.read_text()).get("overrides") or []
    except (OSError, ValueError):
        return True
    return any(o.lstrip("+~").split("=", 1)[0] == "trainer.batch_size" for o in overrides)


def config_diff(old: dict, new: dict, prefix: str = "") -> str | None:
    """The first setting that differs between two plain configs (ignoring VOLATILE ones), as 'key:
    old -> new'. A key the old config lacks (a checkpoint written before the field existed, e.g.
    trainer.replicate) whose new value is the schema's default is no change: the old job ran as
    that default."""
    for key in sorted(set(old) | set(new)):
        name = prefix + key
        if name in VOLATILE:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = config_diff(a, b, name + ".")
            if found:
                return found
        elif key not in old and key in new and plain(schema_default(name)) == plain(b):
            continue
        elif a != b:
            return (f"{name}: {json.dumps(a) if key in old else '(not set)'} -> "
                    f"{json.dumps(b) if key in new else '(not set)'}")
    return None


def plain(value):
    """A config value as JSON has it (tuples as lists), for comparing a schema default with a
    composed value; NO_DEFAULT stays itself (equal to no value)."""
    return value if value is NO_DEFAULT else json.loads(json.dumps(value))


def prepare_dir(out_dir: Path, ckpt: dict | None) -> bool:
    """Make out_dir's records match where the job starts: cut metrics.jsonl back to the checkpoint's
    step (all rows when starting over), remove a stale checkpoint and leftover temp files. True when
    it held records."""
    out_dir = Path(out_dir)
    held = (out_dir / SUMMARY).exists() or (out_dir / METRICS).exists()
    for tmp in out_dir.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
    remove_shards(out_dir, keep=ckpt and ckpt.get("shards"))
    if ckpt is None:
        (out_dir / CHECKPOINT).unlink(missing_ok=True)
    truncate_metrics(out_dir / METRICS, ckpt["loop"]["step"] if ckpt else 0)
    return held


def remove_shards(out_dir: Path, keep: str | None = None) -> None:
    """Remove the folders of shards in out_dir but `keep` (the one checkpoint.pt names): older
    checkpoints' and any a killed job left half-written."""
    for folder in Path(out_dir).glob(SHARDS + "*"):
        if folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the complete rows of metrics.jsonl up to `step` (a killed writer may leave half a last
    line)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] <= step:
            keep.append(line + "\n")
    with atomic_file(path, "w") as f:
        f.writelines(keep)


def resumed_info(ckpt: dict, prior: dict | None) -> dict:
    """What the summary says about a resume: from which step/epoch, and all earlier resumes of the
    job."""
    loop = ckpt["loop"]
    this = {
        "from_step": loop["step"],
        "from_epoch": loop["epoch"] + loop["batch"] / max(loop["steps_per_epoch"], 1),
        "mid_epoch": loop["batch"] > 0,
        "previous_status": (prior or {}).get("status"),
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return {**this, "history": [*ckpt.get("resumes", []), this]}


# -- saving and restoring --------------------------------------------------------------------------
def _job_accelerator(device_type: str | None = None) -> torch.device | None:
    """The device this job's accelerator RNG lives on: the current one (hardware.configure makes the
    job's device current), None when no accelerator is visible or the job runs on another device
    type (`device_type`, e.g. a CPU job on a GPU machine: asking for CUDA's RNG state would
    initialise CUDA for nothing)."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is None or (device_type is not None and acc.type != device_type):
        return None
    return torch.device(acc.type, torch.accelerator.current_device_index())


def rng_state(device_type: str | None = None) -> dict:
    """Every RNG state of this process: python, numpy, torch CPU, and the job's own accelerator
    device (not every visible GPU by index: a resume on another device restores it onto its own
    device) when the job runs on it (`device_type`; None: whatever accelerator is visible). Under
    DDP the checkpoint holds one such state per rank, and each rank restores its own
    (tests/distributed/test_ddp.py)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    acc = _job_accelerator(device_type)
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "accelerator": None if acc is None else torch.get_device_module(acc).get_rng_state(acc),
    }


def set_rng_state(state: dict, device_type: str | None = None) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    acc = _job_accelerator(device_type)
    if state.get("accelerator") is not None and acc is not None:
        torch.get_device_module(acc).set_rng_state(state["accelerator"], acc)


class Checkpointer:
    """Writes out_dir/checkpoint.pt from the registered parts (name -> object with
    state_dict/load_state_dict) and the engine's loop state; `meta` (config, W&B run id, earlier
    resumes) is stored alongside. `sharded`: the model and optimizer are FSDP's shards, saved and
    loaded through DCP by every rank (see above)."""

    def __init__(self, out_dir: Path, meta: dict, ranks: Ranks = SINGLE, sharded: bool = False):
        self.path = Path(out_dir) / CHECKPOINT
        self.meta = meta
        self.ranks = ranks
        self.sharded = sharded
        self.parts: dict = {}
        self.seconds = 0.0        # time spent writing checkpoints (never inside the training clock)

    def save(self, loop) -> None:
        """Write the checkpoint: the loop state (loop.LoopState), every part's state and every
        rank's RNG states. Every rank calls it (the RNG states are gathered, a collective; a sharded
        job's ranks write their shards); rank 0 writes checkpoint.pt."""
        t0 = time.perf_counter()
        gathered = self.ranks.gather((rng_state(self.meta.get("device_type")), time.time_ns()))
        state = loop.state_dict()
        shards = None
        if self.sharded:   # the folder's name: rank 0's clock, the same on every rank
            shards = f"{SHARDS}{state['step']}.{gathered[0][1]}"
            dcp.save(self.shard_state(), checkpoint_id=self.path.parent / shards)
        if not self.ranks.main:
            return
        data = {
            "format": FORMAT,
            **self.meta,
            "loop": state,
            "parts": {name: part.state_dict() for name, part in self.parts.items()
                      if not (self.sharded and name in IN_SHARDS)},
            "rng": [rng for rng, _ in gathered],
            "shards": shards,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with atomic_file(self.path) as f:
            torch.save(data, f)
        if shards is not None:
            remove_shards(self.path.parent, keep=shards)
        self.seconds += time.perf_counter() - t0

    def shard_state(self) -> dict:
        """The model's and optimizer's state as DCP saves and loads them: this rank's shards."""
        model, optim = get_state_dict(self.parts["model"], self.parts["optimizer"])
        return {"model": model, "optimizer": optim}

    def restore(self, ckpt: dict, loop) -> None:
        """Load the loop state (an loop.LoopState), every part (the loader its place in the epoch;
        a sharded job's model and optimizer from their shards) and the RNG states: call it last,
        just before training."""
        held = set(ckpt["parts"]) | (set(IN_SHARDS) if ckpt.get("shards") else set())
        missing = sorted(set(self.parts) - held)
        if missing:
            raise CheckpointError(
                f"{self.path}: holds no state for {', '.join(missing)}; delete it to start over"
            )
        # each rank's RNG states and its slice of the data are its own
        if len(ckpt["rng"]) != self.ranks.world:
            raise CheckpointError(world_error(self.path, len(ckpt["rng"]), self.ranks.world))
        if ckpt.get("shards"):
            self.load_shards(self.path.parent / ckpt["shards"])
        for name, part in self.parts.items():
            if name not in ckpt["parts"]:
                continue
            # the model: emulated numerics swap its parameters' contents on load
            if isinstance(part, torch.nn.Module):
                load_module_state(part, ckpt["parts"][name])
                flatten_rnns(part)
            else:
                part.load_state_dict(ckpt["parts"][name])
        loop.load_state_dict(ckpt["loop"])
        set_rng_state(ckpt["rng"][self.ranks.rank], self.meta.get("device_type"))

    def load_shards(self, folder: Path) -> None:
        """Every rank reads its shards of the model and optimizer (a collective)."""
        state = self.shard_state()
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(self.parts["model"], self.parts["optimizer"],
                       model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        after_load(self.parts["model"])   # FP8 all-gather: the loaded weights' scales

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        remove_shards(self.path.parent)


def save_weights(out_dir: Path, state_dict: dict, num_classes: int) -> dict:
    """The final fp32 weights, written atomically; returns what the summary records about them."""
    with atomic_file(Path(out_dir) / WEIGHTS) as f:
        torch.save(state_dict, f)
    return {"file": WEIGHTS, "dtype": "float32", "num_classes": num_classes}


def load_fp32_model(run_dir: Path):
    """An fp32 model with a finished job's final weights, rebuilt from its summary.json config (for
    evaluation). Returns (model, config). CheckpointError, naming the file, when the run has no
    usable weights."""
    run_dir = Path(run_dir)
    summary = prior_summary(run_dir)
    if summary is None or not summary.get("weights"):
        unsaved = (summary or {}).get("config", {}).get("trainer", {}).get("save_weights") is False
        raise CheckpointError(
            f"{run_dir}: no final weights recorded (summary.json status "
            f"{(summary or {}).get('status')}); "
            + (f"the job ran with trainer.save_weights=false: run it again without it to get "
               f"{WEIGHTS}" if unsaved else f"only a finished job has {WEIGHTS}")
        )
    config = validate(summary["config"])
    options = {}
    # the whitening filters are in the saved weights: any tensor of their shape
    if config.model.arch == "resnet9":
        options = resnet9_options(
            config.trick, torch.zeros(27, 3, 3, 3) if config.trick.whitening else None
        )
    # the saved weights are the whole model: no ImageNet weights need be read to rebuild a
    # pretrained one
    model = build_model(
        dataclasses.replace(config.model, pretrained=False),
        summary["weights"]["num_classes"],
        **options,
    )
    path = run_dir / summary["weights"]["file"]
    try:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as e:
        raise CheckpointError(
            f"{path}: not loadable into {config.model.arch} ({str(e).splitlines()[0][:200]})"
        ) from None
    return model.float().eval(), config
