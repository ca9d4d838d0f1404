"""Data on disk: where it lives, how it is fetched and checked, and the decoded-array cache.

- `data_root(data_dir)`: `dataset.data_dir` if set, else $MIXPREC_DATA_DIR, else `data/` under the
  project.
- `fetch(urls, dest, md5=..., sha256=...)`: download with torchvision's helpers from the first URL
  that works, check the checksum, then move the file into place; a failed or mismatching download
  leaves nothing behind, not even the folders it made (a mistyped dataset.data_dir stays absent;
  `absent_note` says so in the error).
- `ArrayCache`: decoded arrays as .npy files plus a manifest naming the source files (size, mtime)
  they came from. Each file is written to a temporary name and renamed; the manifest goes last, so a
  cache is either complete and current or ignored. A folder that cannot be written (read-only data)
  just means no cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import logging
from pathlib import Path

import numpy as np
from torchvision.datasets.utils import download_url

from ..records import atomic_file, write_json_atomic

log = logging.getLogger(__name__)

ENV_DATA_DIR = "MIXPREC_DATA_DIR"
CACHE_VERSION = 1
PROJECT_ROOT = Path(__file__).resolve().parents[3]   # src/mixprec/data/files.py -> the project


class DataError(RuntimeError):
    """Data that is missing, corrupt or not in the expected format. The message is one line for the
    user."""


def data_root(data_dir: str | None) -> Path:
    if data_dir:
        return Path(data_dir).expanduser().resolve()
    if os.environ.get(ENV_DATA_DIR):
        return Path(os.environ[ENV_DATA_DIR]).expanduser().resolve()
    base = PROJECT_ROOT if (PROJECT_ROOT / "pyproject.toml").exists() else Path.cwd()
    return base / "data"


def absent_note(root: Path) -> str:
    """" (<root> does not exist: ...)" when the data folder is not there (a mistyped
    dataset.data_dir), else ""."""
    return "" if root.exists() else (
        f" ({root} does not exist: check dataset.data_dir or ${ENV_DATA_DIR} for a typo)"
    )


def made_folders(folder: Path) -> list[Path]:
    """The folders from `folder` up that do not exist yet, deepest first (what a download makes)."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove each of `folders` (deepest first) that is an empty folder."""
    for f in folders:
        try:
            f.rmdir()
        except OSError:   # not empty (another download's file), or gone
            return


def sha256sum(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def md5sum(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def fetch(urls, dest: Path, *, md5: str | None = None, sha256: str | None = None) -> None:
    """Download `dest` from the first of `urls` that gives a file with the expected checksum.
    Raises DataError listing every URL tried and why it failed (and removes the folders it made)."""
    made, failures = made_folders(dest.parent), []
    for url in urls:
        tmp = dest.parent / f".{dest.name}.{os.getpid()}.part"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            log.warning(f"mixprec: downloading {url} -> {dest}")
            tmp.unlink(missing_ok=True)   # download_url keeps a file that is already there
            download_url(url, str(dest.parent), filename=tmp.name)
            got = md5sum(tmp) if md5 else sha256sum(tmp) if sha256 else None
            if got != (md5 or sha256):
                raise ValueError(
                    f"{'md5' if md5 else 'sha256'} {got} is not the published {md5 or sha256}"
                )
            os.replace(tmp, dest)
            return
        # unreachable, refused, redirected to an error page, wrong checksum...
        except Exception as e:
            failures.append(
                f"{url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(
                    ": "
                )
            )
        finally:
            tmp.unlink(missing_ok=True)
    remove_empty(made)
    raise DataError("; ".join(failures) or "no download URL configured (dataset.urls is empty)")


def signature(paths) -> list:
    """What the cache depends on: each source file's name, size and modification time."""
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


class ArrayCache:
    """A folder of .npy arrays and a manifest.json that ties them to their sources (see the module
    doc)."""

    def __init__(self, folder: Path, source: list):
        self.folder = folder
        self.manifest = folder / "manifest.json"
        self.source = source

    def load(self) -> tuple[dict, dict] | None:
        """(arrays, meta) if a complete cache of exactly these sources is there, else None."""
        try:
            manifest = json.loads(self.manifest.read_text())
            if manifest.get("version") != CACHE_VERSION or manifest.get("source") != self.source:
                return None
            arrays = {}
            for key, entry in manifest["arrays"].items():
                path = self.folder / entry["file"]
                if path.stat().st_size != entry["bytes"]:
                    return None
                arrays[key] = np.load(path, mmap_mode="c", allow_pickle=False)   # paged in on use
            return arrays, manifest["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, arrays: dict, meta: dict) -> bool:
        """Write the arrays, then the manifest. False (with a note) where the folder cannot be
        written."""
        entries = {}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.manifest.unlink(missing_ok=True)
            for key, value in arrays.items():
                path = self.folder / f"{key}.npy"
                with atomic_file(path, "wb") as f:
                    np.save(f, np.ascontiguousarray(value), allow_pickle=False)
                entries[key] = {
                    "file": path.name,
                    "bytes": path.stat().st_size,
                    "shape": list(value.shape),
                    "dtype": str(value.dtype),
                }
            write_json_atomic(
                self.manifest,
                {"version": CACHE_VERSION, "source": self.source, "arrays": entries, "meta": meta},
            )
            return True
        except OSError as e:
            # a disk that filled up: leave no arrays without their manifest
            for entry in entries.values():
                (self.folder / entry["file"]).unlink(missing_ok=True)
            log.warning(
                f"mixprec: note: no cache written in {self.folder} ({type(e).__name__}: "
                f"{e.strerror or e}); the data is decoded again next time"
            )
            return False
