"""The W&B mirror, read back from the offline run's own .wandb file: its final summary equals
summary.json."""
import json
import struct
import time
from pathlib import Path

import pytest
import torch

from helpers import run_tiny

pytest.importorskip("wandb")

# the .wandb file is a LevelDB-style log: 32 KiB blocks of chunks (crc32, length, type) + data
BLOCK = 32 * 1024


def wandb_records(path: Path):
    """The protobuf Records of an offline run's .wandb file, in order (W&B's own schema,
    wandb.proto)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, chunks = 7, []   # header: ":W&B", magic (2 bytes), version (1 byte)
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:   # block trailer padding
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):   # FULL or LAST: a complete record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def final_summary(run_dir: Path) -> dict:
    """The run's summary as W&B holds it at the end: every summary record applied in order
    (wandb-core writes one for each committed history row, with the row's values, and one for each
    summary update)."""
    path = next(run_dir.glob("*.wandb"))
    # wandb-core writes the file behind the process: wait for its exit record
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path)):
        assert time.monotonic() < deadline, f"{path}: no exit record after 60 s"
        time.sleep(0.5)
    summary = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            for item in record.summary.remove:
                summary.pop(item.key or "/".join(item.nested_key), None)
    return summary


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
    """logger=wandb on 2 ranks (threads whose collectives meet, tests/fakes.py): wandb.init fails on
    rank 0, the only rank that starts W&B. Every rank ends the job failed, before any training
    (rank 1 does not go on to wait for rank 0 in the first collective), and rank 0 records the
    reason in one line."""
    import wandb

    import mixprec.job
    from fakes import on_threads
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
