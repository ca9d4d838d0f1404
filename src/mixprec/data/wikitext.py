"""Text corpora for language models: Wikitext-2 (word level) and a synthetic token stream,
batchified and served as bptt windows.

The API a language-model job builds on:

    corpus = load_text_corpus(config.dataset)       # Corpus: train/valid/test int64 token ids [T]
    on the CPU,
                                                    # vocab (id -> word), vocab_size, info (source,
                                                    cache)
    source = batchify(corpus.train, batch_size, device)    # int64 [nbatch, batch_size] on the
    device; column j
                                                    # is one contiguous stretch of the stream (the
                                                    tail is dropped)
    for x, y in TokenWindows(source, config.dataset.bptt):  # x, y [seq_len, batch_size], seq_len =
    bptt except
        ...                                         # the last; y is x one token later: y[t] =
        source[i + t + 1]
    x, y = get_batch(source, i, bptt)               # the window starting at row i

This is PyTorch's word_language_model example (batchify, get_batch), except that its flat target is
y.reshape(-1) here. Wikitext-2 is the example's tokenized files, wikitext-2/{train,valid,test}.txt
in the data folder: each line's whitespace-separated words, then `<eos>`; the vocabulary grows over
train, valid, test in that order (Wikitext-2: 2,088,628 / 217,646 / 245,569 tokens, 33,278 words).
Missing files are fetched from the `dataset.urls` folders in order and kept only if their sha256 is
the published one; files already there are read as they are (`official` in the corpus info says
whether each matches). Token ids and vocabulary are cached as .npy in
<data_dir>/mixprec-cache/wikitext2/.
"""
from __future__ import annotations

import math
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import DatasetConfig
from .pipelines import Resumable
from .files import (ENV_DATA_DIR, ArrayCache, DataError, absent_note, data_root, fetch, sha256sum,
                    signature)

log = logging.getLogger(__name__)

EOS = "<eos>"
FOLDER = "wikitext-2"
SPLITS = ("train", "valid", "test")
SHA256 = {
    "train": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
    "valid": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
    "test": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
}
OFFICIAL_URL = (
    "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/"
)


@dataclass
class Corpus:
    train: torch.Tensor     # int64 [T] token ids
    valid: torch.Tensor
    test: torch.Tensor
    vocab: list             # id -> word
    info: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


def load_text_corpus(cfg: DatasetConfig) -> Corpus:
    if cfg.name == "synthetic_text":
        return synthetic_corpus(cfg.vocab_size, cfg.train_size, cfg.test_size, cfg.seed)
    return load_wikitext2(cfg.data_dir, cfg.download, cfg.urls)


def load_wikitext2(data_dir: str | None = None, download: bool = True, urls=()) -> Corpus:
    root = data_root(data_dir)
    folder = root / FOLDER
    paths = [folder / f"{split}.txt" for split in SPLITS]
    why = "dataset.download=false"
    if download and not all(p.is_file() for p in paths):
        why = f"the download failed ({_download(folder, tuple(urls) or (OFFICIAL_URL,))})"
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DataError(
            f"Wikitext-2 not found: {folder} lacks {', '.join(missing)}{absent_note(root)} "
            "(expected train.txt, valid.txt, test.txt: the tokenized files of PyTorch's "
            "word_language_model example); "
            f"{why}. Get them from {OFFICIAL_URL} into {folder}, or point dataset.data_dir or "
            f"${ENV_DATA_DIR} at a folder that has {FOLDER}/, or run without data with "
            "dataset=synthetic_text"
        )
    cache = ArrayCache(root / "mixprec-cache" / "wikitext2", signature(paths))
    cached = cache.load()
    if cached is not None:
        arrays, meta = cached
        status = "hit"
    else:
        arrays, meta = _decode(paths)
        status = "written" if cache.save(arrays, meta) else "not writable"
    ids = {s: torch.from_numpy(arrays[s]) for s in SPLITS}
    info = {
        "name": "wikitext2",
        "source": str(folder),
        "cache": status,
        "cache_dir": str(cache.folder),
        "lines": meta["lines"],
        "official": meta["official"],
    }
    return Corpus(ids["train"], ids["valid"], ids["test"], meta["vocab"], info)


def _download(folder: Path, urls: tuple) -> str:
    """Fetch each missing split file (sha256 checked); the reasons for any that could not be had, or
    ''."""
    failures = []
    for split in SPLITS:
        path = folder / f"{split}.txt"
        if not path.is_file():
            try:
                fetch([u.rstrip("/") + f"/{split}.txt" for u in urls], path, sha256=SHA256[split])
            except DataError as e:
                failures.append(str(e))
    return "; ".join(failures)


def _decode(paths: list[Path]) -> tuple[dict, dict]:
    vocab: dict = {}
    arrays, lines, official = {}, {}, {}
    for split, path in zip(SPLITS, paths):
        arrays[split], lines[split] = _tokenize(path, vocab)
        official[split] = sha256sum(path) == SHA256[split]
    if not all(official.values()):
        log.warning(
            f"mixprec: note: {', '.join(f'{s}.txt' for s, ok in official.items() if not ok)} in "
            f"{paths[0].parent} differ from the published Wikitext-2 files (sha256); using them as "
            "they are"
        )
    return arrays, {"vocab": list(vocab), "lines": lines, "official": official}


def _tokenize(path: Path, vocab: dict) -> tuple[np.ndarray, int]:
    """Token ids of every line's words and an <eos>, growing `vocab` (word -> id) with words not
    seen yet."""
    ids, n_lines = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                ids.extend([vocab.setdefault(w, len(vocab)) for w in line.split()])
                ids.append(vocab.setdefault(EOS, len(vocab)))
                n_lines += 1
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason}); the file is corrupt: delete it and "
                        "fetch it again") from None
    if n_lines == 0:
        raise DataError(
            f"{path}: empty; expected tokenized text, one sentence or paragraph per line"
        )
    return np.array(ids, dtype=np.int64), n_lines


def synthetic_corpus(vocab_size: int, train_tokens: int, eval_tokens: int, seed: int = 0) -> Corpus:
    """A learnable token stream: a fixed random Markov chain where each word is followed by one of 4
    successors (probabilities 0.6, 0.2, 0.1, 0.1), so a model can get well below the uniform
    perplexity of vocab_size. Word 0 is <eos>. Deterministic from `seed`; valid and test have
    `eval_tokens` each."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 4)).tolist()

    def stream(n: int) -> torch.Tensor:
        out, token = [], int(rng.integers(vocab_size))
        for c in rng.choice(4, size=n, p=[0.6, 0.2, 0.1, 0.1]).tolist():
            token = successors[token][c]
            out.append(token)
        return torch.tensor(out, dtype=torch.int64)

    vocab = [EOS] + [f"w{i}" for i in range(1, vocab_size)]
    return Corpus(stream(train_tokens), stream(eval_tokens), stream(eval_tokens), vocab,
                  {"name": "synthetic_text", "seed": seed})


def batchify(
    ids: torch.Tensor, batch_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[T] -> [T // batch_size, batch_size] on `device`: column j holds tokens j*nbatch ..
    (j+1)*nbatch - 1."""
    nbatch = len(ids) // batch_size
    if nbatch < 2:
        raise DataError(
            f"{len(ids)} tokens cannot make batches of {batch_size} columns with 2 or more rows"
        )
    return ids[:nbatch * batch_size].view(batch_size, nbatch).t().contiguous().to(device)


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, target) window starting at row i: up to bptt rows, the target one row later."""
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len]


class TokenWindows(Resumable):
    """Every (input, target) window of a batchified stream, in order: len() = ceil((nbatch - 1) /
    bptt). It knows its place in the stream (data.Resumable), for a language-model run resumed in
    the middle of an epoch."""

    def __init__(self, source: torch.Tensor, bptt: int):
        self.source, self.bptt = source, bptt

    def __len__(self) -> int:
        return math.ceil((len(self.source) - 1) / self.bptt)

    def _order(self):
        return None

    def _batch(self, order, i: int):
        return get_batch(self.source, i * self.bptt, self.bptt)
