"""CIFAR-10 and CIFAR-100, read from the official "python version" files
(https://www.cs.toronto.edu/~kriz/cifar.html).

On disk, as the official archives unpack (and as torchvision keeps them, so one data folder serves
both):
  cifar-10-batches-py/  data_batch_1..5, test_batch, batches.meta      (cifar-10-python.tar.gz)
  cifar-100-python/     train, test, meta                              (cifar-100-python.tar.gz)
Each file is a Python 2 pickle of a dict: b'data' uint8 [N, 3072] (per image 1024 red, then green,
then blue values, each a row-major 32x32 plane), b'labels' (CIFAR-10) or b'fine_labels' and
b'coarse_labels' (CIFAR-100); the meta file holds the class names. Only numpy arrays, lists and
strings are unpickled (nothing executable).

Where: the extracted folder if complete, else the .tar.gz beside it (read as a stream), else
(dataset.download) the official archive fetched with torchvision's helpers, its published md5
checked, then extracted. A folder or archive already there is checked by its format (dtype, shapes,
label range), not its md5, so a faithful re-encoded copy is accepted; `official_md5` tells whether
the files are the published ones. The decoded arrays (and the training set's channel mean/std) are
cached as .npy in <data_dir>/mixprec-cache/<name>/.
"""
from __future__ import annotations

import pickle
import logging
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.utils import extract_archive

from .images import ImageData, channel_stats
from .files import (ENV_DATA_DIR, ArrayCache, DataError, absent_note, data_root, fetch, md5sum,
                    signature)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CifarSpec:
    name: str
    title: str
    folder: str
    archive: str
    url: str
    md5: str                  # of the archive
    file_md5: dict            # of each extracted file (torchvision's lists)
    train_files: tuple
    test_files: tuple
    meta_file: str
    label_key: str
    names_key: str
    num_classes: int
    coarse_key: str | None = None
    coarse_names_key: str | None = None
    num_coarse: int = 0

    @property
    def files(self) -> tuple:
        return (*self.train_files, *self.test_files, self.meta_file)


def _spec(tv, name, title, label_key, num_classes, **coarse) -> CifarSpec:
    file_md5 = dict(tv.train_list + tv.test_list + [[tv.meta["filename"], tv.meta["md5"]]])
    return CifarSpec(
        name,
        title,
        tv.base_folder,
        tv.filename,
        tv.url,
        tv.tgz_md5,
        file_md5,
        tuple(f for f, _ in tv.train_list),
        tuple(f for f, _ in tv.test_list),
        tv.meta["filename"],
        label_key,
        tv.meta["key"],
        num_classes,
        **coarse,
    )


SPECS = {
    "cifar10": _spec(CIFAR10, "cifar10", "CIFAR-10", "labels", 10),
    "cifar100": _spec(
        CIFAR100,
        "cifar100",
        "CIFAR-100",
        "fine_labels",
        100,
        coarse_key="coarse_labels",
        coarse_names_key="coarse_label_names",
        num_coarse=20,
    ),
}


def load_cifar(name: str, data_dir: str | None = None, download: bool = True, urls=()) -> ImageData:
    """The whole train and test splits as uint8 [N, 3, 32, 32] tensors (see the module doc for where
    from)."""
    spec = SPECS[name]
    root = data_root(data_dir)
    paths = _locate(spec, root, download, tuple(urls) or (spec.url,))
    cache = ArrayCache(root / "mixprec-cache" / name, signature(paths))
    cached = cache.load()
    if cached is not None:
        arrays, meta = cached
        status = "hit"
    else:
        arrays, meta = _decode(spec, paths)
        status = "written" if cache.save(arrays, meta) else "not writable"
    t = {k: torch.from_numpy(v) for k, v in arrays.items()}
    info = {
        "name": name,
        "source": str(paths[0].parent if len(paths) > 1 else paths[0]),
        "cache": status,
        "cache_dir": str(cache.folder),
    }
    return ImageData(
        t["train_x"],
        t["train_y"],
        t["test_x"],
        t["test_y"],
        spec.num_classes,
        tuple(meta["mean"]),
        tuple(meta["std"]),
        classes=tuple(meta["classes"]),
        train_coarse=t.get("train_coarse"),
        test_coarse=t.get("test_coarse"),
        coarse_classes=tuple(meta.get("coarse_classes", ())),
        info=info,
    )


def official_md5(name: str, data_dir: str | None = None) -> dict:
    """{file: True/False} whether each file present matches the md5 torchvision publishes for it."""
    spec = SPECS[name]
    root = data_root(data_dir)
    folder = root / spec.folder
    if all((folder / f).is_file() for f in spec.files):
        return {f: md5sum(folder / f) == spec.file_md5[f] for f in spec.files}
    return (
        {spec.archive: md5sum(root / spec.archive) == spec.md5}
        if (root / spec.archive).is_file()
        else {}
    )


def _locate(spec: CifarSpec, root: Path, download: bool, urls: tuple) -> list[Path]:
    """The complete folder's files, or [the archive]; downloads the archive when allowed and
    needed."""
    folder, archive = root / spec.folder, root / spec.archive
    files = [folder / f for f in spec.files]
    if all(f.is_file() for f in files):
        return files
    if archive.is_file():
        return [archive]
    if download:
        try:
            fetch(urls, archive, md5=spec.md5)
        except DataError as e:
            why = f"the download failed ({e})"
        else:
            try:
                extract_archive(str(archive), str(root))
            # a full disk, say: the archive itself is complete and still readable
            except Exception as e:
                log.warning(
                    f"mixprec: note: could not extract {archive} ({e}); reading it directly"
                )
            return files if all(f.is_file() for f in files) else [archive]
    else:
        why = "dataset.download=false"
    missing = [f.name for f in files if not f.is_file()]
    lacking = (
        f" ({spec.folder}/ is there but lacks {', '.join(missing)})" if folder.is_dir() else ""
    )
    raise DataError(
        f"{spec.title} not found in {root}{absent_note(root)}: "
        f"expected {spec.folder}/ with {', '.join(spec.files)} "
        f"(the official python version) or {spec.archive}{lacking}; {why}. Get {spec.url} (md5 "
        f"{spec.md5}) and unpack it in {root}, or point dataset.data_dir or ${ENV_DATA_DIR} at a "
        "folder that has it, or run without data with dataset=synthetic"
        + (f" dataset.num_classes={spec.num_classes}" if spec.num_classes != 10 else "")
    )


def _decode(spec: CifarSpec, paths: list[Path]) -> tuple[dict, dict]:
    raw = _read_folder(paths) if len(paths) > 1 else _read_archive(spec, paths[0])
    meta_where, meta = raw[spec.meta_file]
    out = {"classes": _names(meta, spec.names_key, spec.num_classes, meta_where)}
    if spec.coarse_key:
        out["coarse_classes"] = _names(meta, spec.coarse_names_key, spec.num_coarse, meta_where)
    arrays = {}
    for split, names in (("train", spec.train_files), ("test", spec.test_files)):
        parts = [_batch(spec, *raw[f]) for f in names]
        arrays[f"{split}_x"] = np.concatenate([p[0] for p in parts])
        arrays[f"{split}_y"] = np.concatenate([p[1] for p in parts])
        if spec.coarse_key:
            arrays[f"{split}_coarse"] = np.concatenate([p[2] for p in parts])
    mean, std = channel_stats(torch.from_numpy(arrays["train_x"]))
    return arrays, {**out, "mean": list(mean), "std": list(std)}


def _read_folder(paths: list[Path]) -> dict:
    out = {}
    for path in paths:
        with open(path, "rb") as f:
            out[path.name] = (str(path), _unpickle(f, str(path)))
    return out


def _read_archive(spec: CifarSpec, archive: Path) -> dict:
    wanted = {f"{spec.folder}/{f}": f for f in spec.files}
    out = {}
    try:
        with tarfile.open(archive, "r|gz") as tar:
            for member in tar:
                if member.name in wanted and member.isfile():
                    out[wanted[member.name]] = (
                        f"{archive}:{member.name}",
                        _unpickle(tar.extractfile(member), f"{archive}:{member.name}"),
                    )
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(
            f"{archive}: not a readable .tar.gz ({type(e).__name__}: {e}); the file is truncated "
            f"or corrupt: delete it and fetch {spec.url} again"
        ) from None
    missing = [name for name, f in wanted.items() if f not in out]
    if missing:
        raise DataError(
            f"{archive}: lacks {', '.join(missing)}; not the official {spec.title} python-version "
            "archive"
        )
    return out


_NUMPY = getattr(np, "_core", None) or np.core


class _Unpickler(pickle.Unpickler):
    """Unpickles only what the CIFAR files hold: numpy arrays (and their dtypes), lists, dicts,
    strings, ints."""
    allowed = {("numpy.core.multiarray", "_reconstruct"): _NUMPY.multiarray._reconstruct,
               ("numpy._core.multiarray", "_reconstruct"): _NUMPY.multiarray._reconstruct,
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}

    def find_class(self, module, name):
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a CIFAR file holds only numpy arrays, lists and "
            "strings"
        )


def _unpickle(f, where: str) -> dict:
    try:
        d = _Unpickler(f, encoding="bytes").load()
    except (tarfile.TarError, zlib.error, EOFError) as e:
        raise DataError(f"{where}: truncated or corrupt ({type(e).__name__}: {e})") from None
    except Exception as e:  # an unpickling error of any kind: the bytes are not a CIFAR pickle
        raise DataError(
            f"{where}: not a readable CIFAR pickle, truncated or corrupt ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(d, dict):
        raise DataError(f"{where}: expected a pickled dict, found {type(d).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in d.items()}


def _names(meta: dict, key: str, n: int, where: str) -> list[str]:
    names = meta.get(key)
    if not isinstance(names, list) or len(names) != n:
        raise DataError(f"{where}: '{key}' must list {n} class names, found "
                        f"{len(names) if isinstance(names, list) else type(names).__name__}")
    return [v.decode("latin1") if isinstance(v, bytes) else str(v) for v in names]


def _batch(spec: CifarSpec, where: str, d: dict):
    data = d.get("data")
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3072
    ):
        got = (
            f"{data.dtype} {list(data.shape)}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise DataError(
            f"{where}: 'data' must be uint8 [N, 3072] (3x32x32 channel-major rows), found {got}"
        )
    out = [data.reshape(-1, 3, 32, 32)]
    for key, n in ((spec.label_key, spec.num_classes), (spec.coarse_key, spec.num_coarse)):
        if key is None:
            continue
        if key not in d:
            raise DataError(f"{where}: no '{key}' entry")
        y = np.asarray(d[key])
        if (
            y.ndim != 1
            or len(y) != len(data)
            or (len(y) and not np.issubdtype(y.dtype, np.integer))
        ):
            raise DataError(
                f"{where}: '{key}' must be {len(data)} integer labels (one per image), found "
                f"{y.dtype} {list(y.shape)}"
            )
        if len(y) and (y.min() < 0 or y.max() >= n):
            raise DataError(f"{where}: '{key}' must be in 0..{n - 1}, found {y.min()}..{y.max()}")
        out.append(y.astype(np.int64))
    return out
