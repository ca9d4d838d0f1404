"""Tiny datasets written in the exact official on-disk formats, for the loader tests (never real
data).

CIFAR "python version": Python 2 pickles (protocol 2, str written as BINSTRING so they load as bytes
with encoding='bytes' and as str with 'latin1'; numpy arrays through
numpy.core.multiarray._reconstruct, as the published files were written with numpy 1.x), dict keys
as bytes, 'data' uint8 [N, 3072] channel-major rows. The .tar.gz holds the folder, as
cifar-10-python.tar.gz / cifar-100-python.tar.gz do (readme.html included). Wikitext-2: UTF-8 text
files, one line per paragraph.
"""
from __future__ import annotations

import functools
import http.server
import io
import pickle
import tarfile
import threading
from pathlib import Path

import numpy as np

CIFAR10_NAMES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]


class _Py2Pickler(pickle._Pickler):
    dispatch = dict(pickle._Pickler.dispatch)

    def save_bytes(self, obj):
        n = len(obj)
        self.write(
            (
                pickle.SHORT_BINSTRING + bytes([n])
                if n < 256
                else pickle.BINSTRING + n.to_bytes(4, "little")
            )
            + obj
        )
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(len(x), 3072))


def cifar_files(name: str, seed: int = 0, sizes=None) -> tuple[dict, dict]:
    """({file name: bytes}, expected arrays) for a tiny CIFAR-10 or CIFAR-100 in the official
    format."""
    rng = np.random.default_rng(seed)
    files, expect = {}, {}
    if name == "cifar10":
        sizes = sizes or {
            "data_batch_1": 3,
            "data_batch_2": 2,
            "data_batch_3": 4,
            "data_batch_4": 1,
            "data_batch_5": 2,
            "test_batch": 5,
        }
        for split, names in (
            ("train", [f"data_batch_{i}" for i in range(1, 6)]),
            ("test", ["test_batch"]),
        ):
            xs, ys = [], []
            for f in names:
                x = rng.integers(0, 256, (sizes[f], 3, 32, 32), dtype=np.uint8)
                y = rng.integers(0, 10, sizes[f])
                files[f] = py2_pickle(
                    {
                        b"batch_label": f.encode(),
                        b"labels": [int(v) for v in y],
                        b"data": _rows(x),
                        b"filenames": [f"img_{i}.png".encode() for i in range(len(y))],
                    }
                )
                xs.append(x)
                ys.append(y)
            expect[f"{split}_x"], expect[f"{split}_y"] = np.concatenate(xs), np.concatenate(ys)
        files["batches.meta"] = py2_pickle({b"label_names": [n.encode() for n in CIFAR10_NAMES],
                                            b"num_cases_per_batch": 10000, b"num_vis": 3072})
        expect["classes"] = CIFAR10_NAMES
    else:
        sizes = sizes or {"train": 7, "test": 4}
        for split in ("train", "test"):
            x = rng.integers(0, 256, (sizes[split], 3, 32, 32), dtype=np.uint8)
            coarse = rng.integers(0, 20, sizes[split])
            fine = coarse * 5 + rng.integers(0, 5, sizes[split])
            files[split] = py2_pickle(
                {
                    b"filenames": [f"img_{i}.png".encode() for i in range(len(x))],
                    b"batch_label": f"{split}ing batch 1 of 1".encode(),
                    b"fine_labels": [int(v) for v in fine],
                    b"coarse_labels": [int(v) for v in coarse],
                    b"data": _rows(x),
                }
            )
            expect[f"{split}_x"], expect[f"{split}_y"], expect[f"{split}_coarse"] = x, fine, coarse
        expect["classes"] = [f"fine_{i}" for i in range(100)]
        expect["coarse_classes"] = [f"coarse_{i}" for i in range(20)]
        files["meta"] = py2_pickle(
            {
                b"fine_label_names": [n.encode() for n in expect["classes"]],
                b"coarse_label_names": [n.encode() for n in expect["coarse_classes"]],
            }
        )
    return files, expect


FOLDERS = {"cifar10": ("cifar-10-batches-py", "cifar-10-python.tar.gz"),
           "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz")}


def write_cifar(
    root: Path, name: str, form: str = "folder", seed: int = 0, files: dict | None = None
) -> dict:
    """Write a tiny CIFAR under root as the extracted folder or the .tar.gz; returns the expected
    arrays."""
    made, expect = cifar_files(name, seed)
    files = {**made, **(files or {})}
    folder, archive = FOLDERS[name]
    root.mkdir(parents=True, exist_ok=True)
    if form == "folder":
        (root / folder).mkdir(exist_ok=True)
        for f, data in files.items():
            (root / folder / f).write_bytes(data)
    else:
        with tarfile.open(root / archive, "w:gz") as tar:
            for f, data in {**files, "readme.html": b"<html>tiny test copy</html>"}.items():
                info = tarfile.TarInfo(f"{folder}/{f}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return expect


WIKI = {
    "train": " = Valkyria = \n\n Senjō no Valkyria 3 : <unk> \n the game 's team \n",
    "valid": " = Homarus = \n the game \n",
    "test": "\n Robert <unk> is an actor \n",
}


def wiki_expected(texts: dict = WIKI) -> tuple[dict, list]:
    """Token ids per split and the vocabulary, worked out the PyTorch example's way (independently
    here)."""
    vocab, ids = [], {}
    for split in ("train", "valid", "test"):
        out = []
        for line in texts[split].split("\n")[:-1]:
            for w in line.split() + ["<eos>"]:
                if w not in vocab:
                    vocab.append(w)
                out.append(vocab.index(w))
        ids[split] = out
    return ids, vocab


def write_wikitext(root: Path, texts: dict = WIKI) -> Path:
    folder = root / "wikitext-2"
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in texts.items():
        (folder / f"{split}.txt").write_bytes(
            text.encode("utf-8") if isinstance(text, str) else text
        )
    return folder


class Serve:
    """A local HTTP server for a folder (download tests without the internet): `with Serve(dir) as
    url: ...`."""

    def __init__(self, folder: Path):
        handler = functools.partial(_QuietHandler, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# the discard port: refused at once, so no test ever reaches the internet
UNREACHABLE = "http://127.0.0.1:9/"
