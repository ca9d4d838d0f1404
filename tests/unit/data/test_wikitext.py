"""Wikitext-2 from tiny files in the official format, download with sha256, offline errors, batchify
and windows, the synthetic token stream, and scripts/data_stats.py (run in-process)."""

import pytest
import torch

from helpers import compose_config, load_script
from helpers.official_formats import Serve, UNREACHABLE, WIKI, wiki_expected, write_wikitext
from mixprec.data import wikitext
from mixprec.config import validate
from mixprec.data.files import DataError, sha256sum


def corpus_of(root, *more):
    return wikitext.load_text_corpus(
        validate(compose_config("dataset=wikitext2", f"dataset.data_dir={root}", *more)).dataset
    )


def test_token_ids_and_vocabulary_are_the_examples(tmp_path):
    write_wikitext(tmp_path)
    ids, vocab = wiki_expected()
    corpus = corpus_of(tmp_path, "dataset.download=false")
    assert corpus.vocab == vocab and corpus.vocab_size == len(vocab) == 17
    # the blank line is a lone <eos>
    assert vocab[:4] == ["=", "Valkyria", "<eos>", "Senjō"]
    for split in ("train", "valid", "test"):
        got = getattr(corpus, split)
        assert got.dtype == torch.int64 and got.tolist() == ids[split], split
    assert len(corpus.train) == 4 + 1 + 7 + 5 and corpus.info["lines"] == {
        "train": 4,
        "valid": 2,
        "test": 2,
    }
    assert corpus.info["official"] == {"train": False, "valid": False, "test": False}
    assert corpus.info["cache"] == "written"
    again = corpus_of(tmp_path, "dataset.download=false")
    assert (
        again.info["cache"] == "hit"
        and again.vocab == vocab
        and torch.equal(again.test, corpus.test)
    )


def test_a_file_that_is_not_utf8_is_named_and_nothing_is_cached(tmp_path):
    write_wikitext(tmp_path, {**WIKI, "valid": b" ok \n \xff\xfe broken \n"})
    with pytest.raises(
        DataError,
        match=r"wikitext-2/valid.txt: not UTF-8 text \(invalid start byte\); the file is corrupt",
    ):
        corpus_of(tmp_path, "dataset.download=false")
    assert not (tmp_path / "mixprec-cache").exists()


def test_offline_and_missing_says_where_what_and_how(tmp_path):
    write_wikitext(tmp_path, {"valid": WIKI["valid"]})
    with pytest.raises(DataError) as e:
        corpus_of(tmp_path, f"dataset.urls=[{UNREACHABLE}]")
    msg = str(e.value)
    assert (
        msg.startswith(
            f"Wikitext-2 not found: {tmp_path / 'wikitext-2'} lacks train.txt, test.txt (expected "
            "train.txt, valid.txt, test.txt"
        )
        and "\n" not in msg
    )
    assert (
        f"{UNREACHABLE}train.txt" in msg
        and "Connection refused" in msg
        and wikitext.OFFICIAL_URL in msg
    )
    assert "dataset=synthetic_text" in msg and "MIXPREC_DATA_DIR" in msg
    # no partial file
    assert sorted(p.name for p in (tmp_path / "wikitext-2").iterdir()) == ["valid.txt"]


def test_download_keeps_only_files_with_the_published_sha256(tmp_path, monkeypatch):
    served = write_wikitext(tmp_path / "served")
    root = tmp_path / "data"
    with Serve(served) as url:
        with pytest.raises(
            DataError,
            match=f"{url}train.txt: ValueError: sha256 [0-9a-f]+ is not the published "
            f"{wikitext.SHA256['train']}",
        ):
            corpus_of(root, f"dataset.urls=[{url}]")
        # nothing left behind, not even the folders the download made
        assert not root.exists()
        monkeypatch.setattr(
            wikitext, "SHA256", {s: sha256sum(served / f"{s}.txt") for s in wikitext.SPLITS}
        )
        corpus = corpus_of(root, f"dataset.urls=[{UNREACHABLE},{url}]")
    for split in wikitext.SPLITS:
        assert (root / "wikitext-2" / f"{split}.txt").read_bytes() == (
            served / f"{split}.txt"
        ).read_bytes()
    # the (patched) published ones
    assert corpus.info["official"] == {"train": True, "valid": True, "test": True}
    assert corpus.vocab == wiki_expected()[1]


def test_batchify_and_bptt_windows():
    ids = torch.arange(103)
    source = wikitext.batchify(ids, 4)
    assert source.shape == (25, 4)
    # a column is one contiguous stretch
    assert source[:, 1].tolist() == list(range(25, 50))
    windows = list(wikitext.TokenWindows(source, bptt=7))
    assert len(windows) == len(wikitext.TokenWindows(source, 7)) == 4
    assert [len(x) for x, _ in windows] == [7, 7, 7, 3]
    for x, y in windows:
        assert torch.equal(y, x + 1)                               # the target is the next token
    assert torch.equal(torch.cat([x for x, _ in windows]), source[:-1])
    x, y = wikitext.get_batch(source, 21, 7)
    assert torch.equal(x, source[21:24]) and torch.equal(y, source[22:25])
    with pytest.raises(DataError, match="5 tokens cannot make batches of 4 columns"):
        wikitext.batchify(torch.arange(5), 4)


def test_synthetic_token_stream_is_deterministic_and_learnable():
    cfg = validate(
        compose_config(
            "dataset=synthetic_text",
            "dataset.vocab_size=50",
            "dataset.train_size=5000",
            "dataset.test_size=500",
        )
    ).dataset
    a, b = wikitext.load_text_corpus(cfg), wikitext.load_text_corpus(cfg)
    assert torch.equal(a.train, b.train) and torch.equal(a.test, b.test) and a.vocab == b.vocab
    assert (
        a.vocab_size == 50
        and a.vocab[0] == "<eos>"
        and len(a.train) == 5000
        and len(a.valid) == len(a.test) == 500
    )
    assert int(a.train.min()) >= 0 and int(a.train.max()) < 50
    # each token's most frequent successor follows it ~60% of the time (uniform would be ~2%)
    pairs = torch.bincount(a.train[:-1] * 50 + a.train[1:], minlength=2500).view(50, 50)
    assert pairs.max(1).values.sum() / pairs.sum() > 0.5


def data_stats():
    return load_script("data_stats")


def test_data_stats_reports_tokens_and_vocabulary(tmp_path, capsys):
    write_wikitext(tmp_path)
    assert data_stats().main(["dataset=wikitext2", f"dataset.data_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert (
        "vocabulary  17 words" in out
        and "sha256 differs from the published one for train, valid, test" in out
    )
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["train"] == ["17", "4", "1", "12"] and rows["valid"] == ["7", "2", "0", "5"]
    assert rows["test"] == ["7", "2", "1", "6"]


def test_data_stats_offline_is_one_line_and_exit_1(tmp_path, capsys):
    code = data_stats().main(
        ["dataset=wikitext2", f"dataset.data_dir={tmp_path}", f"dataset.urls=[{UNREACHABLE}]"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("data_stats: data error: Wikitext-2 not found: ")
    assert [line for line in err if not line.startswith("mixprec: downloading")] == [err[-1]]
