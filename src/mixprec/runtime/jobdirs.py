"""The name of a sweep job's folder: `<job num>_<overrides>` (conf/config.yaml, hydra.sweep.subdir),
shortened when the overrides make it longer than a file name may be.

Hydra names each job's folder after its overrides (hydra.job.override_dirname); a long override list
(say 300 characters) would exceed the 255-byte limit of a file name and end the sweep with `OSError:
File name too long`. `job_dirname` keeps a name of up to MAX_BYTES as it is, and writes a longer one
as a readable prefix and a hash of the whole name: short, the same on every run of the same
overrides (trainer.resume=auto finds it again) and unique to them. The full overrides stay in the
job's summary.json (`overrides`, `job.override_dirname`).

The resolver is registered when mixprec is imported: by train.py before Hydra starts, and in a
submitit job's process when it loads the sweep's callbacks (mixprec.report.callbacks), before Hydra
names the job's folder there.
"""
from __future__ import annotations

import hashlib

from omegaconf import OmegaConf

RESOLVER = "mixprec.job_dirname"
MAX_BYTES = 200     # a file name may have 255; room left for a file system that counts otherwise
PREFIX_BYTES = 120
HASH_CHARS = 12


def job_dirname(num, overrides) -> str:
    """`<num>_<overrides>`, or, when that is longer than MAX_BYTES, its first PREFIX_BYTES and a
    hash of it all."""
    return shorten(f"{num}_{overrides or ''}")


def shorten(name: str, max_bytes: int = MAX_BYTES, prefix_bytes: int = PREFIX_BYTES) -> str:
    """`name` if it has at most max_bytes (UTF-8), else its first prefix_bytes, '_' and a hash of
    the whole name."""
    data = name.encode()
    if len(data) <= max_bytes:
        return name
    prefix = data[:prefix_bytes].decode(errors="ignore").rstrip(",=_ ")
    return f"{prefix}_{hashlib.sha256(data).hexdigest()[:HASH_CHARS]}"


def register() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, job_dirname)
