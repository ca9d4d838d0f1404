#!/usr/bin/env python
"""What data you have: counts per split and per class, channel mean/std, or token and vocabulary
counts.

    python scripts/data_stats.py dataset=cifar10                       # any dataset option, any
    overrides python scripts/data_stats.py dataset=cifar100 dataset.data_dir=/data
    python scripts/data_stats.py dataset=wikitext2

The dataset is composed from conf/ exactly as train.py composes it (and downloaded if missing and
allowed). A missing or unreadable dataset: one line on stderr and exit status 1; a bad value: exit
status 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from mixprec.tools import cli
from mixprec.config import ConfigError, validate
from mixprec.data.files import DataError

ROOT = Path(__file__).resolve().parents[1]


def image_report(cfg) -> list[str]:
    from mixprec.data import build_image_data

    data = build_image_data(cfg)
    lines = [f"dataset     {cfg.name}  ({data.info.get('source', 'generated from dataset.seed')})"]
    if cfg.name.startswith("cifar"):
        from mixprec.data.cifar import official_md5
        ok = official_md5(cfg.name, cfg.data_dir)
        bad = [f for f, good in ok.items() if not good]
        lines.append(
            "files       "
            + (
                "the published files (md5 matches)"
                if not bad
                else f"md5 differs from the published one for {', '.join(bad)} (not the official "
                "files: e.g. a re-encoded copy; accuracies may not compare)"
            )
        )
        lines.append(f"cache       {data.info['cache']}  ({data.info['cache_dir']})")
    shape = "x".join(map(str, data.train_x.shape[1:]))
    lines.append(
        f"images      train {len(data.train_y):,}, test {len(data.test_y):,}  (uint8 {shape}, "
        f"{data.num_classes} classes)"
    )
    lines.append("channel     mean " + " ".join(f"{v:.4f}" for v in data.mean) + "   std "
                 + " ".join(f"{v:.4f}" for v in data.std) + "   (train, in [0, 1])")
    lines += class_table(
        "class",
        data.classes or [str(i) for i in range(data.num_classes)],
        data.train_y,
        data.test_y,
    )
    if data.train_coarse is not None:
        lines += class_table("superclass", data.coarse_classes, data.train_coarse, data.test_coarse)
    return lines


def class_table(title: str, names, train_y: torch.Tensor, test_y: torch.Tensor) -> list[str]:
    train = torch.bincount(train_y, minlength=len(names)).tolist()
    test = torch.bincount(test_y, minlength=len(names)).tolist()
    width = max(len(title), *(len(n) for n in names))
    rows = [f"{'':2}{title:<{width}}  {'train':>8}  {'test':>8}"]
    rows += [f"{'':2}{name:<{width}}  {a:>8,}  {b:>8,}" for name, a, b in zip(names, train, test)]
    return rows + [f"{'':2}{'total':<{width}}  {sum(train):>8,}  {sum(test):>8,}"]


def text_report(cfg) -> list[str]:
    from mixprec.data.wikitext import EOS, load_text_corpus

    corpus = load_text_corpus(cfg)
    info = corpus.info
    lines = [f"dataset     {cfg.name}  ({info.get('source', 'generated from dataset.seed')})"]
    if "official" in info:
        bad = [s for s, good in info["official"].items() if not good]
        lines.append(
            "files       "
            + (
                "the published files (sha256 matches)"
                if not bad
                else f"sha256 differs from the published one for {', '.join(bad)}"
            )
        )
        lines.append(f"cache       {info['cache']}  ({info['cache_dir']})")
    lines.append(f"vocabulary  {corpus.vocab_size:,} words (train, valid, test in that order)")
    vocab = corpus.vocab
    unk = vocab.index("<unk>") if "<unk>" in vocab else None
    eos = vocab.index(EOS) if EOS in vocab else None
    lines.append(f"  {'split':<6} {'tokens':>10} {'<eos>':>8} {'<unk>':>8} {'distinct':>9}")
    for split in ("train", "valid", "test"):
        ids = getattr(corpus, split)
        hist = torch.bincount(ids, minlength=corpus.vocab_size)
        lines.append(f"  {split:<6} {len(ids):>10,} {int(hist[eos]) if eos is not None else 0:>8,} "
                     f"{int(hist[unk]) if unk is not None else 0:>8,} {int((hist > 0).sum()):>9,}")
    return lines


def main(overrides: list[str]) -> int:
    try:
        cfg = validate(cli.compose(overrides)).dataset
    except ConfigError as e:   # a bad value, an unknown group option or key
        print(f"data_stats: config error: {e}", file=sys.stderr)
        return 2
    try:
        lines = text_report(cfg) if cfg.is_text else image_report(cfg)
    except DataError as e:
        print(f"data_stats: data error: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    sys.exit(cli.run("data_stats", main, sys.argv[1:]))
