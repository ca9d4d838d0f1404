"""Records: a job's metrics.jsonl and summary.json (the source of truth), mirrored to W&B when enabled.

summary.json is written atomically (a temp file in the same directory, then os.replace), so a reader never
sees half a file; metrics.jsonl gets one complete line per row, flushed as it is written.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"


def write_json_atomic(path: Path, data: dict) -> None:
    with atomic_file(path, "w") as f:
        json.dump(jsonable(data), f, indent=2, allow_nan=False)
        f.write("\n")


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb"):
    """Write `path` all or nothing: into a temp file in the same directory, fsynced, then os.replace'd over it.
    A reader (or a process killed mid-write) never sees half a file; on an error the temp file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def jsonable(x):
    """Plain JSON: non-finite floats become the strings 'nan'/'inf'/'-inf' (strict JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


class Recorder:
    """Writes the job's records into out_dir and mirrors them to an optional W&B run."""

    def __init__(self, out_dir: Path, mirror=None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.mirror = mirror
        self._metrics = open(self.out_dir / METRICS, "a")

    def log(self, row: dict) -> None:
        self._metrics.write(json.dumps(jsonable(row), allow_nan=False) + "\n")
        self._metrics.flush()
        if self.mirror is not None:
            self.mirror.log(row)

    def write_summary(self, summary: dict) -> Path:
        path = self.out_dir / SUMMARY
        write_json_atomic(path, summary)
        if self.mirror is not None:
            self.mirror.summary(summary)
        return path

    def close(self) -> None:
        self._metrics.close()


def read_summary(path: Path) -> dict:
    """Read one summary.json; a file that is not valid JSON raises ValueError naming the file."""
    path = Path(path)
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a valid summary.json ({e.msg} at line {e.lineno}); re-run that job") from None
