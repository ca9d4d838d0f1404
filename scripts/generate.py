#!/usr/bin/env python
"""Sample text from a trained language model, as PyTorch's word_language_model generate.py does.

    python scripts/generate.py outputs/runs/<time> [--words 1000] [--temperature 1.0] [--seed 1111]
    [--out FILE]

The run's summary.json gives the model and the dataset; the vocabulary comes from reloading that
corpus (Wikitext-2 from its cache; --data-dir when the data sits elsewhere now), the weights from
the run's model_fp32.pt (fp32 whatever the training precision). The first word is drawn at random,
each next one from softmax(logits / temperature) over the vocabulary, the hidden state carried
along; 20 words a line. Exit status: 0, 2 for a run that cannot be sampled (not a language model, no
weights, bad arguments), 1 when its corpus cannot be read.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from mixprec.tools import cli
from mixprec.config import ConfigError, validate
from mixprec.data.files import DataError
from mixprec.models import build_model
from mixprec.records import SUMMARY, read_summary
from mixprec.train.checkpoint import WEIGHTS
from mixprec import records
from mixprec.data.wikitext import load_text_corpus

ROOT = Path(__file__).resolve().parents[1]


class RunError(Exception):
    """A run directory that holds no language model to sample from. The message is one line."""


def load(run_dir: Path, data_dir: str | None = None, device: str = "cpu"):
    """(model in eval mode on `device`, vocabulary) of a finished language-model run."""
    path = run_dir / SUMMARY
    if not path.is_file():
        raise RunError(f"{path}: not found; give the output directory of a train.py run")
    try:
        summary = read_summary(path)
    except ValueError as e:
        raise RunError(str(e)) from None
    if not records.is_language_model(summary):
        raise RunError(
            f"{run_dir}: model={records.arch(summary)} is not a language model (lstm, gru, "
            "rnn_tanh, rnn_relu, gpt)"
        )
    weights = summary.get("weights") or {}
    if not weights or not (run_dir / weights["file"]).is_file():
        raise RunError(
            f"{run_dir}: no {WEIGHTS} (status {records.status(summary)}); only a completed job "
            "leaves its final weights"
        )
    config = validate(summary["config"])
    dataset = (
        config.dataset
        if data_dir is None
        else dataclasses.replace(config.dataset, data_dir=data_dir, download=False)
    )
    corpus = load_text_corpus(dataset)
    if corpus.vocab_size != weights["num_classes"]:
        raise RunError(f"{dataset.name} now has {corpus.vocab_size} words, the run was trained on "
                       f"{weights['num_classes']}: not the same corpus")
    model = build_model(config.model, corpus.vocab_size)
    model.load_state_dict(
        torch.load(run_dir / weights["file"], map_location="cpu", weights_only=True)
    )
    return model.to(device).eval(), corpus.vocab


def generate(model, vocab: list, words: int, temperature: float = 1.0, seed: int = 1111) -> str:
    """An RNN reads one word at a time and carries its hidden state; a Transformer (no hidden state)
    rereads the last block_size words each time."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    context = torch.randint(len(vocab), (1, 1), generator=gen, device=device)
    hidden = model.init_hidden(1)
    out = []
    with torch.no_grad():
        for _ in range(words):
            logits, hidden = model(context, hidden)
            # padded rows left out
            probs = torch.softmax(logits[-1, 0, :len(vocab)].float() / temperature, dim=0)
            token = torch.multinomial(probs, 1, generator=gen).view(1, 1)
            context = (
                token if hidden is not None else torch.cat([context, token])[-model.block_size :]
            )
            out.append(vocab[int(token)])
    return "\n".join(" ".join(out[i:i + 20]) for i in range(0, len(out), 20)) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(prog="generate.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a language-model job's output directory")
    ap.add_argument(
        "--words", type=int, default=1000, help="number of words to generate (default 1000)"
    )
    ap.add_argument(
        "--temperature", type=float, default=1.0, help="higher: more diverse (default 1.0; >= 1e-3)"
    )
    ap.add_argument("--seed", type=int, default=1111, help="random seed (default 1111)")
    ap.add_argument(
        "--out", type=Path, help="write the text to this file (default: standard output)"
    )
    ap.add_argument("--data-dir", help="where the corpus is now, if not where the run found it")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    args = ap.parse_args(argv)
    try:
        if args.words < 1:
            raise RunError(f"--words {args.words}: must be at least 1")
        if not args.temperature >= 1e-3:
            raise RunError(f"--temperature {args.temperature}: must be at least 1e-3")
        from mixprec.runtime.hardware import select_device

        # one that is not here: a ConfigError, one line
        device = select_device(args.device, option="--device")
        model, vocab = load(args.run_dir, args.data_dir, device)
    except (RunError, ConfigError) as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"generate: data error: {e}", file=sys.stderr)
        return 1
    text = generate(model, vocab, args.words, args.temperature, args.seed)
    if args.out is None:
        sys.stdout.write(text)
    else:
        records.write_text_atomic(args.out, text)
        print(f"generate: {args.words} words -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run("generate", main, known=(RunError,)))
