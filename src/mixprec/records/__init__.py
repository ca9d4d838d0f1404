"""Records: a job's metrics.jsonl and summary.json (the source of truth), mirrored to W&B when
enabled.

summary.json is written atomically (a temp file in the same directory, then os.replace), so a reader
never sees half a file; metrics.jsonl gets one complete line per row, flushed as it is written.
atomic_file is the package's one atomic writer: checkpoints, caches, the report and its figures, the
scripts' outputs all use it.

The second half is the summary-format contract: the accessors through which every reader (the
report, the sweep table, the reference folders, scripts/reproduce.py) reads a summary's fields.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import tempfile
from pathlib import Path

from ..config import LM_ARCHS

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"


def write_json_atomic(path: Path, data: dict) -> None:
    with atomic_file(path, "w") as f:
        json.dump(jsonable(data), f, indent=2, allow_nan=False)
        f.write("\n")


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb"):
    """Write `path` all or nothing: into a temp file in the same directory, fsynced, then
    os.replace'd over it. A reader (or a process killed mid-write) never sees half a file; on an
    error the temp file is removed."""
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
    """Plain JSON: non-finite floats become the strings 'nan'/'inf'/'-inf' (strict JSON has no
    NaN)."""
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
        raise ValueError(
            f"{path}: not a valid summary.json ({e.msg} at line {e.lineno}); re-run that job"
        ) from None


def job_order(path: Path) -> tuple:
    """Sweep jobs in job-number order (their folders start with it), others by name."""
    head = path.parent.name.split("_", 1)[0]
    return (str(path.parent.parent), int(head) if head.isdigit() else 10**9, path.parent.name)


def read_summaries(paths) -> tuple[list[tuple[Path, dict]], list[str]]:
    """(file, summary) for each readable summary.json of `paths`, in their order, and the reason
    each other one could not be read."""
    read, problems = [], []
    for path in paths:
        try:
            read.append((path, read_summary(path)))
        except (ValueError, OSError) as e:
            problems.append(str(e))
    return read, problems


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


def read_jsonl(path: Path) -> list[dict]:
    """A .jsonl file's rows (an incomplete last line, as a killed job may leave, is skipped); []
    when it is absent."""
    rows = []
    path = Path(path)
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# ----------------------------------------------------------------------------------- summary fields
# The summary-format contract: everything that reads a summary.json (the report, the sweep table,
# the reference folders, scripts/reproduce.py) reaches its fields through these accessors.


def config(summary: dict) -> dict:
    """The job's resolved config (plain values)."""
    return summary.get("config") or {}


def metrics(summary: dict) -> dict:
    return summary.get("metrics") or {}


def choices(summary: dict) -> dict:
    """The config-group choices (model, precision, dataset, trick...)."""
    return summary.get("choices") or {}


def env(summary: dict) -> dict:
    """The hardware and software it ran on; {} for a job that failed before recording it."""
    return summary.get("env") or {}


def overrides(summary: dict) -> list[str]:
    """The job's command-line overrides (`precision=amp`, `seed=1`...)."""
    return summary.get("overrides") or []


def this_process() -> dict:
    """This process, as a job's summary records it at the start: what a reader looks for to tell a
    job still running from one whose process died without recording its end."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def process_gone(summary: dict) -> bool:
    """Whether the process the summary names is known to be gone: on this host, no process has its
    pid. A job of another host (or one that recorded no process) is not known to be gone."""
    p = summary.get("process") or {}
    if not p.get("pid") or p.get("host") != socket.gethostname():
        return False
    try:
        os.kill(p["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:   # alive, another user's
        return False
    return False


def status(summary: dict) -> str | None:
    """The job's status; `killed` for one that says `running` whose process is gone (SIGKILL, out
    of memory, torchrun's grace running out: nothing could record its end)."""
    s = summary.get("status")
    return "killed" if s == "running" and process_gone(summary) else s


def completed(summary: dict) -> bool:
    return summary.get("status") == "completed"


def experiment(summary: dict) -> str:
    """The experiment the job belongs to (set by an experiment preset), "default" without one."""
    return str(summary.get("name") or config(summary).get("name") or "default")


def seed(summary: dict):
    return summary.get("seed", config(summary).get("seed"))


def job_num(summary: dict):
    """Its job number in a sweep (None for a single run)."""
    return (summary.get("job") or {}).get("num")


def verdict(summary: dict) -> str:
    """The numerics verdict's line (numerics/verdicts.py): the mechanism, where, and the fix; ""
    when none."""
    return (summary.get("verdict") or {}).get("line") or ""


def verdict_short(summary: dict) -> str:
    """The verdict's mechanism and where (step, pass, module), for a table's note; "" when none."""
    v = summary.get("verdict") or {}
    return f"verdict: {v['short']}" if v.get("short") else ""


def reason(summary: dict) -> str:
    """Why it did not complete (a divergence's reason, a failure's error, a killed job's process);
    "" when it says nothing."""
    if status(summary) == "killed":
        p = summary["process"]
        return (f"killed: its process (pid {p['pid']} on {p['host']}) ended without recording "
                "an end (SIGKILL, out of memory, or a stop signal it could not act on in time)")
    return summary.get("reason") or summary.get("error") or ""


def eval_cap(summary: dict) -> str:
    """"eval: N batches" for a job whose evaluation scored only N batches of each split
    (trainer.eval_batches: an image job's evenly spaced, a language model's first; its test numbers
    are not the whole split's); "" otherwise."""
    n = metrics(summary).get("eval_batches")
    if not n:
        return ""
    return f"eval: {n} batch{'es' if n > 1 else ''} " + ("(the first)" if is_language_model(summary)
                                     else "(evenly spaced)")


def fp8_emulated(summary: dict) -> bool:
    return bool((summary.get("fp8") or {}).get("fp8_emulated"))


def emulated(summary: dict) -> bool:
    """Its low-precision arithmetic was emulated (fp16/bf16 rounding on fp32 kernels, or torchao's
    fp8 emulation): its losses and accuracies stand, its times are no fp16/bf16/FP8 times."""
    return summary.get("arithmetic") == "emulated" or fp8_emulated(summary)


def fp32_arithmetic(summary: dict) -> bool:
    """A mode whose only difference from fp32 is TF32 ran where TF32 does nothing (a CPU, a GPU
    without TF32): its arithmetic was fp32's, so a speed-up over fp32 would be noise."""
    return summary.get("arithmetic") == "plain_fp32"


def no_speedup(summary: dict) -> bool:
    """Its time is no time of its precision's arithmetic (emulated, or plain fp32): no speed-up."""
    return emulated(summary) or fp32_arithmetic(summary)


def arch(summary: dict) -> str | None:
    return (config(summary).get("model") or {}).get("arch")


def is_language_model(summary: dict) -> bool:
    return arch(summary) in LM_ARCHS


def lookup(summary: dict, key: str, missing=None):
    """A choice (`precision`) or else a dotted config path (`trainer.epochs`); `missing` where it
    has none."""
    if key in choices(summary):
        return choices(summary)[key]
    have = config(summary)
    for part in key.split("."):
        if not isinstance(have, dict) or part not in have:
            return missing
        have = have[part]
    return have


def baseline_key(summary: dict) -> str:
    """Jobs whose resolved configs differ only in precision (and in the case label) share this key:
    a job's fp32 partner is the fp32 job with its key."""
    cfg = {k: v for k, v in config(summary).items() if k not in ("precision", "case")}
    return json.dumps(cfg, sort_keys=True)


def wandb_run_id(summary: dict) -> str | None:
    """The W&B run it was mirrored to (None: logger=none)."""
    return (summary.get("wandb") or {}).get("run_id")


def sharded(summary: dict) -> dict | None:
    """A sharded job's (trainer.strategy=fsdp) world size, param and reduce dtypes and per-rank
    held bytes (summary["distributed"]); None for any other job."""
    d = summary.get("distributed") or {}
    return d if d.get("strategy") == "fsdp" else None


def held_mb(summary: dict) -> list[dict] | None:
    """A sharded job's per-rank MB of parameters, gradients and optimizer state, in rank order."""
    d = sharded(summary) or {}
    return [{k: v / 2**20 for k, v in rank.items()} for rank in d.get("held_bytes") or []] or None


def memory(summary: dict) -> dict:
    """The job's memory ledger (train/memory.py; {} before a step or in an older record)."""
    return summary.get("memory") or {}


def fsdp_float8_all_gather(summary: dict) -> bool:
    """Whether a sharded fp8 job all-gathered its float8 weights in float8."""
    return bool((summary.get("fp8") or {}).get("fsdp_float8_all_gather"))
