"""The W&B mirror read back from the offline run's own .wandb file."""
import json
import struct
import time
from pathlib import Path


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
