"""The W&B mirror, read back from the offline run's own .wandb file: its final summary equals
summary.json."""
import json
from pathlib import Path

import pytest
import torch

from helpers import run_tiny
from helpers.wandb_files import final_summary

pytest.importorskip("wandb")


@pytest.mark.slow
def test_the_mirrored_summary_is_summary_json_after_a_3_epoch_job(tmp_path):
    s = run_tiny(tmp_path, "logger=wandb", "trainer.max_steps=null", "trainer.epochs=3")
    assert s["status"] == "completed" and len(s["epochs"]) == 3
    epochs_eval = [e["eval_time_s"] for e in s["epochs"]]
    # the job's total, not the last epoch's
    assert s["metrics"]["eval_time_s"] == pytest.approx(sum(epochs_eval))
    mirrored = final_summary(Path(s["wandb"]["dir"]))
    expected = {"status": "completed"}
    for k, v in s["metrics"].items():
        if isinstance(v, dict):
            expected.update({f"{k}/{kk}": vv for kk, vv in v.items()})
        elif v is not None:
            expected[k] = v
    assert {k: mirrored.get(k) for k in expected} == expected


def test_wandb_failing_on_rank_0_alone_ends_every_rank_before_training(tmp_path, monkeypatch):
    """logger=wandb on 2 ranks (threads whose collectives meet, tests/helpers/fakes.py): wandb.init
    fails on rank 0, the only rank that starts W&B. Every rank ends the job failed, before any
    training (rank 1 does not go on to wait for rank 0 in the first collective), and rank 0 records
    the reason in one line."""
    import wandb

    import mixprec.job
    from helpers.fakes import on_threads
    from helpers import TINY, compose_config
    from mixprec.config import plain_config, validate
    from mixprec.train.parts import JobContext

    def refused(**_):
        raise ConnectionError("api.wandb.ai unreachable\nretrying...")
    monkeypatch.setattr(wandb, "init", refused)
    cfg = compose_config(*TINY, "logger=wandb", "logger.mode=offline")
    config = validate(cfg)

    def job_on(ranks):
        out = tmp_path / f"rank{ranks.rank}"
        out.mkdir()
        summary = {"status": "failed", "config": plain_config(cfg)}   # as run_job starts it
        ctx = JobContext(config, torch.device("cpu"), ranks, 8, out, stop=lambda: None)
        return mixprec.job.record_training(ctx, summary)
    rank0, rank1 = on_threads(job_on)
    assert rank0["status"] == rank1["status"] == "failed"
    assert "metrics" not in rank0 and "metrics" not in rank1   # nothing trained
    assert rank0["error"] == ("W&B could not start the run (api.wandb.ai unreachable); if a "
                              "killed job's W&B service (wandb-core) still holds it, end that "
                              "process; logger=none runs without W&B")
    assert rank1["error"] == ("W&B could not start the run on rank 0 (its train.log says why); "
                              "logger=none runs without W&B")
    assert json.loads((tmp_path / "rank0" / "summary.json").read_text())["error"] == rank0["error"]
    assert not (tmp_path / "rank1" / "summary.json").exists()   # rank 0 records the job
