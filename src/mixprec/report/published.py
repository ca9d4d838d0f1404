"""The published numbers: one YAML per source article under src/mixprec/published/, loaded and
checked here.

A source lists the experiment names it applies to (summary["name"], set by experiment presets) and
its values. Each value says what it measures (`metric`), the number as published (a number, a
[low, high] range, or an outcome such as `diverged`), its unit, the hardware it was measured on,
where it comes from, and `match`: which runs it is compared with, by config-group choice
(`precision: amp`) or dotted config path (`trainer.epochs: 50`); a list means any of those values.
`noise` (optional): the run-to-run variation the source states for the value, in its unit; a
reproduced value that lies that close to the published one is reported as "within the source's own
noise".

Where a value comes from is kept in parts, so that a quotation is only ever a document's own words:
- `documents` (top level): each document the file quotes or cites, by a key: `name` (how it is
  cited), `lang` (its language and script: en, zh-Hans, zh-Hant), optional `url` and `commit`, and
  `seed` (the file name of the source text the project was given; scripts/check_quotes.py reads it);
- `quotes`: `{in: <document key>, at: <where in it>, text: <verbatim>}`, in the document's language
  and script (`lang`, the document's by default); a non-English quote carries `translation`, an
  English rendering that is mixprec's, never the source's;
- `cites`: `{in, at, gist}` where no text is quoted (what it says there, in mixprec's words);
- `reading` (optional): how mixprec reads the quotes into the value, an inference stated as one.
A made-up file may give `source` instead, a citation in words. `Published.quote` is all of it in one
line.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..records import lookup

PUBLISHED_DIR = Path(__file__).parent.parent / "published"

# metrics a value can name besides any key of summary["metrics"] (the report computes these per run)
DERIVED = {
    "speedup": "fp32 training time / this run's, same other overrides",
    "status": "the run's outcome: completed, diverged, failed",
    "test_ppl": "test perplexity of the best-validation model (metrics.test_ppl_at_best_valid, as "
                "apex's main.py "
    "reports it), else metrics.final_test_ppl, else exp(final_test_loss)",
    "test_acc_pct": "final test accuracy in percent",
    "acc_change_vs_fp32": "final test accuracy minus the fp32 run's, in percentage points",
    "batch_gain": "metrics.max_batch_size / the fp32 run's",
}
COMPARE = ("ratio", "difference")
OUTCOMES = ("completed", "diverged", "failed", "interrupted")


LANG = re.compile(r"[a-z]{2,3}(-[A-Z][a-z]{3})?")   # a language, and its script: en, zh-Hant


class SourceError(ValueError):
    """A published-numbers file that is not as described above; the message names the file and the
    field."""


@dataclass(frozen=True)
class Document:
    key: str
    name: str                   # how the document is cited, e.g. "apex README@859f528b"
    lang: str
    url: str | None = None
    commit: str | None = None
    seed: str | None = None     # file name of the source text the project was given, if it is one


@dataclass(frozen=True)
class Quote:
    doc: str                    # a Document's key
    at: str                     # where in the document
    text: str                   # verbatim, in the document's language and script
    lang: str
    translation: str | None     # mixprec's English rendering of a non-English quote


@dataclass(frozen=True)
class Cite:
    doc: str
    at: str
    gist: str                   # what the document says there, in mixprec's words (not a quote)


@dataclass(frozen=True)
class Published:
    source: str                 # the source's id (its file name)
    id: str
    label: str
    metric: str
    value: object               # float, (low, high), or an outcome string
    unit: str
    hardware: str
    quote: str                  # where the value comes from, in one line: quotes, cites, reading
    match: dict
    # ratio (reproduced / published) or difference (reproduced - published)
    compare: str = "ratio"
    noise: float | None = None  # the source's own run-to-run variation of the value, in its unit
    quotes: tuple = ()          # Quote, each verbatim
    cites: tuple = ()           # Cite
    reading: str | None = None  # mixprec's inference from them to the value

    def format_value(self) -> str:
        if isinstance(self.value, tuple):
            return f"{self.value[0]:g}-{self.value[1]:g} {self.unit}"
        if isinstance(self.value, str):
            return self.value
        return f"{self.value:g} {self.unit}"


@dataclass(frozen=True)
class Source:
    id: str
    title: str
    author: str | None
    date: str | None
    url: str | None
    experiments: tuple
    values: tuple
    path: Path
    documents: dict = field(default_factory=dict)   # key -> Document
    title_translation: str | None = None   # mixprec's English rendering of a non-English title


def load_sources(directory: Path | None = None) -> list[Source]:
    """Every *.yaml under `directory` (default: the package's published/), sorted by file name."""
    directory = Path(directory or PUBLISHED_DIR)
    if not directory.is_dir():
        raise SourceError(f"{directory}: no such folder of published numbers")
    return [load_source(p) for p in sorted(directory.glob("*.yaml"))]


def load_source(path: Path) -> Source:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SourceError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a mapping with id, title, experiments, values")
    need = functools.partial(_need, path)
    sid = need(data, "id", "")
    if sid != path.stem:
        raise SourceError(f"{path}: id: {sid!r} must equal the file name {path.stem!r}")
    experiments = need(data, "experiments", "", (list,))
    documents = _documents(path, data.get("documents") or {})
    values, seen = [], set()
    for i, v in enumerate(need(data, "values", "", (list,))):
        values.append(_load_value(path, data, documents, i, v))
        if values[-1].id in seen:
            raise SourceError(f"{path}: values[{i}] ({values[-1].id}).id: duplicate id")
        seen.add(values[-1].id)
    return Source(id=sid, title=need(data, "title", ""), author=_opt_str(data.get("author")),
                  date=_opt_str(data.get("date")), url=_opt_str(data.get("url")),
                  experiments=tuple(str(e) for e in experiments), values=tuple(values), path=path,
                  documents=documents, title_translation=_opt_str(data.get("title_translation")))


def _need(path: Path, d: dict, key: str, where: str, types=(str,)):
    """d[key], present and of one of `types`; else one line naming the file and the field."""
    if d.get(key) is None or not isinstance(d[key], types):
        kinds = "/".join(t.__name__ for t in types)
        raise SourceError(f"{path}: {where}{key}: missing or not a {kinds}")
    return d[key]


def _load_value(path: Path, data: dict, documents: dict, i: int, v) -> Published:
    """The file's i-th value, checked field by field."""
    need = functools.partial(_need, path)
    where = f"values[{i}]."
    if not isinstance(v, dict):
        raise SourceError(f"{path}: {where[:-1]}: expected a mapping")
    vid = need(v, "id", where)
    where = f"values[{i}] ({vid})."
    hardware = v.get("hardware", data.get("hardware"))
    if not isinstance(hardware, str):
        raise SourceError(f"{path}: {where}hardware: missing (set it on the value or the source)")
    metric = need(v, "metric", where)
    compare = v.get("compare", "ratio")
    if compare not in COMPARE:
        raise SourceError(f"{path}: {where}compare: {compare!r}; "
                          f"allowed values are {', '.join(COMPARE)}")
    match = v.get("match")
    if not isinstance(match, dict) or not match:
        raise SourceError(f"{path}: {where}match: missing; name the runs it compares with, "
                          "e.g. {precision: amp}")
    noise = v.get("noise")
    if noise is not None and not (_is_number(noise) and noise > 0):
        raise SourceError(f"{path}: {where}noise: {noise!r}; a positive number in the value's "
                          "unit, or leave it out")
    quotes, cites, reading, line = _origin(path, where, v, documents)
    return Published(source=path.stem, id=vid, label=str(v.get("label", vid)), metric=metric,
                     value=_value(v.get("value"), metric, f"{path}: {where}value"),
                     unit=need(v, "unit", where), hardware=hardware, quote=line, match=dict(match),
                     compare=compare, noise=None if noise is None else float(noise), quotes=quotes,
                     cites=cites, reading=reading)


def _documents(path: Path, raw) -> dict:
    """The file's `documents`: key -> Document."""
    if not isinstance(raw, dict):
        raise SourceError(f"{path}: documents: expected a mapping of key -> {{name, lang, ...}}")
    docs = {}
    for key, d in raw.items():
        where = f"documents.{key}."
        if not isinstance(d, dict):
            raise SourceError(f"{path}: {where[:-1]}: expected a mapping with name and lang")
        lang = _need(path, d, "lang", where)
        if not LANG.fullmatch(lang):
            raise SourceError(f"{path}: {where}lang: {lang!r}; a language code such as en, "
                              "zh-Hans, zh-Hant")
        docs[str(key)] = Document(key=str(key), name=_need(path, d, "name", where), lang=lang,
                                  url=_opt_str(d.get("url")), commit=_opt_str(d.get("commit")),
                                  seed=_opt_str(d.get("seed")))
    return docs


def _origin(path: Path, where: str, v: dict, documents: dict) -> tuple:
    """(quotes, cites, reading, the one-line account) of a value: at least one quote or citation,
    each naming a declared document and a place in it, a non-English quote with its English
    translation; or else a `source` line."""
    need = functools.partial(_need, path)
    quotes, cites, parts = [], [], []
    for kind in [k for k in v if k in ("quotes", "cites")]:   # in the file's order
        for j, q in enumerate(v[kind] or []):
            at = f"{where}{kind}[{j}]."
            if not isinstance(q, dict) or need(q, "in", at) not in documents:
                named = q.get("in") if isinstance(q, dict) else q
                raise SourceError(f"{path}: {at}in: {named!r}; name one of the file's documents "
                                  f"({', '.join(documents) or 'none declared'})")
            doc = documents[q["in"]]
            if kind == "cites":
                cites.append(Cite(doc=doc.key, at=need(q, "at", at), gist=need(q, "gist", at)))
                parts.append(f"{doc.name} ({cites[-1].at}): {cites[-1].gist}")
                continue
            lang = q.get("lang", doc.lang)
            if not isinstance(lang, str) or not LANG.fullmatch(lang):
                raise SourceError(f"{path}: {at}lang: {lang!r}; a code such as en, zh-Hant")
            translation = _opt_str(q.get("translation"))
            if lang != "en" and not translation:
                raise SourceError(f"{path}: {at}translation: missing; a {lang} quote needs its "
                                  "English rendering")
            quotes.append(Quote(doc=doc.key, at=need(q, "at", at), text=need(q, "text", at),
                                lang=lang, translation=translation))
            parts.append(f'{doc.name} ({quotes[-1].at}): "{" ".join(quotes[-1].text.split())}"'
                         + (f' [translation: "{translation}"]' if translation else ""))
    reading = _opt_str(v.get("reading"))
    if reading:
        parts.append(f"reading: {reading}")
    if not (quotes or cites):
        parts = [need(v, "source", where)]   # a made-up file's citation in words
    return tuple(quotes), tuple(cites), reading, "; ".join(parts)


def _value(x, metric: str, where: str):
    if metric == "status":
        if x not in OUTCOMES:
            raise SourceError(f"{where}: {x!r}; a status value is one of {', '.join(OUTCOMES)}")
        return x
    if isinstance(x, list) and len(x) == 2 and all(_is_number(e) for e in x) and x[0] <= x[1]:
        return (float(x[0]), float(x[1]))
    if _is_number(x):
        return float(x)
    raise SourceError(f"{where}: {x!r}; expected a number or a [low, high] range")


def noise_verdict(value: Published, reproduced: float) -> str | None:
    """Whether a reproduced number lies within the source's own stated run-to-run variation of the
    published one (None where the source states none, or the value is a range)."""
    if value.noise is None or not _is_number(value.value):
        return None
    near = abs(reproduced - value.value) <= value.noise
    return (
        f"{'within' if near else 'outside'} the source's own noise (±{value.noise:g} {value.unit})"
    )


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _opt_str(x) -> str | None:
    return None if x is None else str(x)


_MISSING = object()


def matches(match: dict, summary: dict) -> bool:
    """Whether a run's summary has every value `match` asks for (choices first, then dotted config
    paths)."""
    for key, want in match.items():
        have = lookup(summary, key, _MISSING)
        if have is _MISSING or not any(
            _same(have, w) for w in (want if isinstance(want, list) else [want])
        ):
            return False
    return True


def _same(have, want) -> bool:
    if _is_number(have) and _is_number(want):
        return math.isclose(float(have), float(want), rel_tol=1e-9, abs_tol=0.0)
    return str(have) == str(want)


@functools.cache
def shipped(source_id: str) -> Source:
    """One of the package's published sources (published/<id>.yaml), read when first asked for, then
    kept."""
    return load_source(PUBLISHED_DIR / f"{source_id}.yaml")


# the published values that draw a ladder staircase: Page's fixed-schedule training times
# (train_time_s; step 1's on his clock, the data preparation included: page_clock_s), or times to a
# target accuracy
LADDER_METRICS = ("train_time_s", "page_clock_s", "time_to_target_s")


def ladder_steps(values) -> list[Published]:
    """The values among `values` that are ladder steps, in the source's order."""
    return [v for v in values if v.metric in LADDER_METRICS]


@functools.cache
def page_ladder() -> dict:
    """trick -> (label, seconds, epochs) on one V100, from published/page_ladder.yaml, in ladder
    order: each step's fixed-schedule training time; a range of seconds (step 9: 33.5-34 s) is shown
    as its upper end."""
    values = shipped("page_ladder").values
    epochs = {v.match["trick"]: int(v.value) for v in values if v.metric == "epochs"}
    return {
        v.match["trick"]: (
            v.label.split(" ", 1)[1],
            float(max(v.value) if isinstance(v.value, tuple) else v.value),
            epochs[v.match["trick"]],
        )
        for v in sorted(ladder_steps(values), key=lambda v: v.match["trick"])
    }


def apex_ppl_values() -> tuple:
    """apex's published test perplexities (published/apex_word_lm.yaml)."""
    return tuple(v for v in shipped("apex_word_lm").values if v.metric == "test_ppl")
