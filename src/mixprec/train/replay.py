"""Attribution's replay under probe=none: a diverged run whose first non-finite event could only be
named as "weights an earlier update made non-finite" is trained again from its seed, up to the step
whose loss was non-finite, under probe=ranges with every step probed, in `<job dir>/replay/`; that
replay's first event (step, pass, module, tensor, what) and verdict replace the inexact ones.
Nothing is done for a run that did not diverge, so probe=none still costs nothing on a normal run;
the replay is skipped beyond MAX_STEPS steps (the reason then says to rerun with probe=ranges),
under several ranks or FSDP, and when the replay does not diverge alike (a non-deterministic run:
the summary says so). The replay runs in the job's process after its training: the job's peak memory
includes it.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import torch

from ..numerics import events
from ..records import Recorder
from ..runtime import dist
from . import checkpoint
from .parts import no_stop

log = logging.getLogger(__name__)

MAX_STEPS = 200
DIR = "replay"


def replay_step(summary: dict, probe: str, several_ranks: bool) -> int | None:
    """The step to replay up to, or None when the summary's attribution is exact or no replay is
    due."""
    e = (summary.get("numerics") or {}).get("first_nonfinite")
    if summary.get("status") != "diverged" or probe != "none" or several_ranks or not e:
        return None
    # exact, or measured from Adam's state
    if e.get("tensor") != "weights" or e.get("what") == "0/0":
        return None
    step = (summary.get("nonfinite") or {}).get("step")
    return step if step and step <= MAX_STEPS else None


def replay_config(config, step: int):
    """The job's config, probed at every step, stopped at `step`, in a fresh dir, without W&B."""
    r = dataclasses.replace
    return r(config, probe=r(config.probe, name="ranges", every=1),
             trainer=r(config.trainer, max_steps=step, resume="never", on_nonfinite="stop"),
             logger=r(config.logger, name="none"))


def explain(summary: dict, ctx, train) -> dict:
    """What the replay changes in the summary ({} when none is due): numerics.first_nonfinite,
    numerics.replay, the verdict, and the reason's first-event clause. ctx: the job's JobContext
    (train/parts.py); `train(ctx, recorder, saver)` is job.train_job, run on one rank with no stop
    signal and nothing to resume."""
    config = ctx.config
    step = replay_step(summary, config.probe.name, ctx.ranks.active)
    # a sharded job's probe sees no model (parts.probed), so probe=ranges could name no module there
    if step is None or config.trainer.sharded:
        return {}
    cfg, where = replay_config(config, step), Path(ctx.out_dir) / DIR
    log.info(
        f"mixprec: replaying steps 1-{step} under probe=ranges to time the first non-finite value "
        f"({where})"
    )
    random.seed(cfg.seed)   # as hardware.configure seeded the job (its flags are still set)
    torch.manual_seed(cfg.seed)
    recorder = Recorder(where)
    saver = checkpoint.Checkpointer(where, meta={"config": summary.get("config")})
    quiet, level = logging.getLogger(events.__name__), logging.getLogger(events.__name__).level
    quiet.setLevel(logging.ERROR)   # step 1's input warnings were said by the run itself
    try:
        result = train(dataclasses.replace(ctx, config=cfg, ranks=dist.SINGLE, stop=no_stop,
                                           resume=None, out_dir=where), recorder, saver)
    # the job diverged whatever the replay does: it stays diverged, the replay's error noted
    except Exception as e:
        log.warning(
            f"mixprec: the replay failed ({type(e).__name__}: {e}); the attribution stays as it was"
        )
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    finally:
        quiet.setLevel(level)
        saver.discard()
        recorder.close()
    return merged(summary, result, where, step)


def merged(summary: dict, result: dict, where: Path, step: int) -> dict:
    numerics = dict(summary.get("numerics") or {})
    old, new = (
        numerics.get("first_nonfinite"),
        (result.get("numerics") or {}).get("first_nonfinite"),
    )
    if result.get("status") != "diverged" or not new or not new.get("row"):
        numerics["replay"] = {"dir": str(where), "steps": step, "matched": False,
                              **({"error": result["error"]} if result.get("error") else {})}
        return {"numerics": numerics}
    numerics.update(
        first_nonfinite={**new, "replayed": True},
        replay={"dir": str(where), "steps": step, "matched": True},
    )
    out = {"numerics": numerics, "reason": (summary.get("reason") or "").replace(
        events.line(old), events.line(new) + " (replayed under probe=ranges)")}
    v = result.get("verdict")
    if v is not None:
        out["verdict"] = {
            **v,
            "cites": [c.replace("numerics.jsonl", f"{DIR}/numerics.jsonl") for c in v["cites"]],
        }
    return out
