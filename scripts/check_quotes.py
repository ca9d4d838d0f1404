#!/usr/bin/env python
"""Whether every quote in src/mixprec/published/*.yaml stands word for word in the text it cites.

    python scripts/check_quotes.py DIR [DIR_OR_FILE ...]   # every quote, against DIR's *.txt
    python scripts/check_quotes.py DIR --seeds-only        # only quotes from the given source texts

A quote is found when its text is a substring of one of the texts, every run of whitespace (line
breaks included) read as one space on both sides; nothing else is loosened (script, punctuation and
case count). A quote whose document names a source-text file (`seed:` in the published file) that is
among the texts must be in that very file. Prints one line per quote that is not, naming the
published file, the values quoting it and the document it cites, and exits 1; exits 0 when every
quote checked was found. --seeds-only leaves out the quotes whose document is not one of the given
source texts (an original at a commit, such as a README). --published DIR reads another folder of
published files. A path that does not exist, or a folder without *.txt: one line on stderr, exit 2.

The source texts are not in the repository (they are the articles' own words, under their authors'
copyright): they are plain UTF-8 text copies of the documents the published files quote, one *.txt
per document, named as its `seed:` says. `--help` lists them, each with where its text is read
(docs/sources/README.md too): save each document's text under that name in one folder, give the
folder.
"""
from __future__ import annotations

import argparse
import sys
import unicodedata
from pathlib import Path

from mixprec.tools import cli
from mixprec.report.published import PUBLISHED_DIR, SourceError, load_sources

ROOT = Path(__file__).resolve().parents[1]


def flat(text: str) -> str:
    """The text as the check compares it: NFC, every whitespace run one space."""
    return " ".join(unicodedata.normalize("NFC", text).split())


class TextsError(ValueError):
    """A path that is neither a folder of source texts nor a text file; the message is one line."""


def read_texts(paths: list[str]) -> dict[str, str]:
    """file name -> flattened text, for every *.txt under each folder and every file given."""
    texts = {}
    for p in map(Path, paths):
        if not p.exists():
            raise TextsError(f"{p}: no such file or folder; give the folder of source texts")
        files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
        if not files:
            raise TextsError(f"{p}: no *.txt file in it; give the folder of source texts")
        for f in files:
            try:
                texts[f.name] = flat(f.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                raise TextsError(f"{f}: not readable as UTF-8 text ({e})") from None
    return texts


def unique_quotes(sources, seeds: set[str] | None) -> dict:
    """(source id, Document, quote text, place) -> the ids of the values quoting it; with `seeds`,
    only the quotes whose document is one of those source-text files."""
    found = {}
    for s in sources:
        for v in s.values:
            for q in v.quotes:
                doc = s.documents[q.doc]
                if seeds is None or doc.seed in seeds:
                    found.setdefault((s.id, doc, q.text, q.at), []).append(v.id)
    return found


def problems(quotes: dict, texts: dict[str, str]) -> list[str]:
    """One line per quote that is not where it says it is: in the source-text file its document
    names (when that file is among the texts), else in any of the texts."""
    lines = []
    for (sid, doc, text, at), value_ids in quotes.items():
        needle = flat(text)
        where = [name for name, t in texts.items() if needle in t]
        said = f'{sid} ({", ".join(value_ids)}): {doc.name} ({at}): "{" ".join(text.split())}"'
        if doc.seed in texts and doc.seed not in where:
            elsewhere = f"; found in {', '.join(where)}" if where else ""
            lines.append(f"NOT IN {doc.seed}: {said}{elsewhere}")
        elif not where:
            lines.append(f"IN NONE: {said}")
    return lines


def source_texts(sources) -> list[str]:
    """One line per source text the published files name: its file name, the source and document,
    and where its text is read (the document's address, else its title and the original's)."""
    lines = []
    for s in sources:
        for d in s.documents.values():
            if d.seed:
                where = (f"from {d.url}" if d.url else
                         f"no address recorded: find it by the title \"{s.title}\""
                         + (f" (the original: {s.url})" if s.url else ""))
                lines.append(f"  {d.seed}  {s.id}: {d.name}; {where}")
    return lines


def epilog() -> str:
    """--help's list of the source texts (docs/sources/README.md holds the same)."""
    return (
        "source texts: plain UTF-8 copies of the quoted documents, not in the repository (their "
        "authors' words), one *.txt each in one folder, named as below (docs/sources/README.md):\n"
        + "\n".join(source_texts(load_sources(PUBLISHED_DIR)))
    )


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(prog="check_quotes.py", description=__doc__.splitlines()[0],
                            epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="folders of source texts (*.txt) or text files")
    ap.add_argument("--seeds-only", action="store_true",
                    help="check only the quotes whose document is one of the given source texts")
    ap.add_argument("--published", default=str(PUBLISHED_DIR), help="folder of published *.yaml")
    args = ap.parse_intermixed_args(argv)
    sources = load_sources(Path(args.published))
    texts = read_texts(args.paths)
    quotes = unique_quotes(sources, set(texts) if args.seeds_only else None)
    lines = problems(quotes, texts)
    print(f"checked {len(quotes)} distinct quotes against {len(texts)} texts ({', '.join(texts)}): "
          f"{len(quotes) - len(lines)} found, {len(lines)} not")
    for line in lines:
        print(line)
    return 1 if lines else 0


def entry(argv: list[str] | None = None) -> int:
    """main's exit status; a bad folder or published file: one line on stderr, status 2."""
    return cli.run("check_quotes", main, argv, known=(SourceError, TextsError))


if __name__ == "__main__":
    sys.exit(entry())
