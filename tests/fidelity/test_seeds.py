"""What the seeds say: every published value quotes or cites a named document at a named place,
in its own language and script; the quotes are found in copies of their own texts
(scripts/check_quotes.py); the sources' own noise in the report."""
import re

import pytest

from helpers import ROOT, load_script
from helpers.fidelity import composed
from mixprec.report.published import PUBLISHED_DIR, load_source, load_sources


# ------------------------------------------------------------------------------- what the seeds say
def _values(source: str) -> dict:
    return {v.id: v for v in load_source(PUBLISHED_DIR / f"{source}.yaml").values}


def _sources() -> dict:
    return {s.id: s for s in load_sources()}


# characters written one way in simplified script and another in traditional (为/為,
# 网络/網絡, ...): a quote in a document's own script holds none of the other script's
SIMPLIFIED_ONLY = set("为这网络训练数据问题变权较优势现还说发实际设计参会应该种关间长时对")
TRADITIONAL_ONLY = set("為這網絡訓練數據問題變權較優勢現還說發實際設計參會應該種關間長時對")
SEED_FILE = re.compile(r"\d{3}_[0-9a-f]{16}\.txt")


def test_every_published_value_quotes_or_cites_a_named_document_at_a_named_place():
    """Quotes are kept apart from mixprec's words: each names its document and its place there, is
    in the document's language and script, and a non-English one carries an English translation in
    its own field; no shipped value rests on a bare `source` line."""
    for s in _sources().values():
        assert s.documents, s.id
        for d in s.documents.values():
            assert d.name and d.lang and (d.seed is None or SEED_FILE.fullmatch(d.seed)), (
                s.id,
                d.key,
            )
        for v in s.values:
            assert v.quotes or v.cites, (s.id, v.id)
            for q in v.quotes:
                assert q.at and q.text.strip() and q.lang == s.documents[q.doc].lang, (
                    s.id,
                    v.id,
                    q.text,
                )
                assert (q.translation is not None) == (q.lang != "en"), (s.id, v.id, q.text)
                # the report's line quotes it whole
                assert f'"{" ".join(q.text.split())}"' in v.quote
            for c in v.cites:
                assert c.at and c.gist and c.doc in s.documents, (s.id, v.id)
            assert "paraphrase" not in v.quote, (s.id, v.id)
    seeds = {d.seed for s in _sources().values() for d in s.documents.values() if d.seed}
    assert len(seeds) == 4   # the four articles as the project was given them


def test_chinese_quotes_are_in_their_documents_script():
    """The half-precision post and the fastai translation are in traditional script, Page's and the
    torch.amp post's translations in simplified: each quote keeps its document's."""
    langs = {}
    for s in _sources().values():
        for v in s.values:
            for q in v.quotes:
                langs.setdefault(q.lang, []).append(q.text)
                other = {"zh-Hant": SIMPLIFIED_ONLY, "zh-Hans": TRADITIONAL_ONLY}.get(q.lang, set())
                assert not other & set(q.text), (s.id, v.id, sorted(other & set(q.text)))
    assert {"zh-Hant", "zh-Hans", "en"} <= set(langs)
    hant = {s.id for s in _sources().values() for d in s.documents.values() if d.lang == "zh-Hant"}
    assert hant == {"fastai_2080ti", "half_pitfalls"}


def test_fastai_1080ti_reading_is_an_inference_beside_the_seeds_own_sentence():
    v = _values("fastai_2080ti")
    assert v["resnet101_speedup_2080ti"].hardware == "NVIDIA RTX 2080 Ti"
    assert v["resnet101_speedup_1080ti"].hardware == "NVIDIA GTX 1080 Ti"
    # the seed's sentence names the 2080Ti in both halves
    sentence = v["resnet101_speedup_1080ti"].quotes[0]
    assert sentence.text.count("2080Ti") == 2 and "1080Ti" not in sentence.text
    assert "1.18 倍" in sentence.text and "1.13 倍" in sentence.text
    assert sentence == v["resnet101_speedup_2080ti"].quotes[0]
    reasons = [q.text for q in v["resnet101_speedup_1080ti"].quotes[1:]]
    assert any("2 builds" in r for r in reasons) and any("GTX 1080Ti" in r for r in reasons)
    assert v["resnet101_speedup_1080ti"].reading.startswith("an inference")
    for vid in ("batch_gain", "accuracy_parity"):   # the article names no card beside them
        assert v[vid].hardware.startswith("not named"), vid
    assert "1.8 倍" in v["batch_gain"].quotes[0].text


def test_half_pitfalls_quotes_the_post_and_names_its_card():
    v = _values("half_pitfalls")
    assert all("1080 Ti" in x.hardware for x in v.values())
    assert any("在1080Ti上" in q.text for q in v["small_net_no_gain"].quotes)
    # the post's observation; the eps mechanism is mixprec's, not quoted as its
    adam = v["adam_fp16_nan"]
    assert "梯度為零的權重變成了NAN" in adam.quotes[0].text and "eps" not in adam.quote
    small, large = v["small_net_no_gain"], v["larger_net_gain"]
    assert small.value == 1.0 and any("還沒有全精度快" in q.text for q in small.quotes)
    assert any("沒有很明顯的優勢" in q.text for q in small.quotes)
    assert large.value == pytest.approx(1 / (1 - 1 / 6)) and any(
        "要快1/6" in q.text for q in large.quotes
    )
    assert "1.17x" in large.reading


def test_bn_eval_pitfall_and_its_fix_are_quoted_word_for_word():
    """The post's BatchNorm-in-eval failure and its fix, m.eval().half() on every BatchNorm, are
    quoted, not paraphrased; the post names apex's keep_batchnorm_fp32, no opt level."""
    v = _values("half_pitfalls")
    fails, fix = v["bn_eval_fp32bn_fails"], v["bn_eval_half_fix"]
    assert any(
        "keep_batchnorm_fp32的設置并不起作用" in q.text and "不正確的bug" in q.text
        for q in fails.quotes
    )
    code = next(q.text for q in fix.quotes if "def fix_bn" in q.text)
    assert "m.eval().half()" in code and "model.apply(fix_bn)" in code and "BatchNorm" in code
    assert any("所有BN層設置為半精度" in q.text for q in fix.quotes)
    assert "O2" not in fails.label and "O2" not in fails.quote


def test_pages_numbers_the_seed_lacks_cite_his_notebook():
    """75 s, 33.5 s and step 3's 25 epochs are not in the seed: each cites the notebook at
    37a13cc."""
    s = _sources()["page_ladder"]
    notebook = next(d for d in s.documents.values() if d.commit and d.commit.startswith("37a13cc"))
    assert "bag_of_tricks.ipynb" in notebook.name and s.documents["seed"].lang == "zh-Hans"
    v = {x.id: x for x in s.values}
    for vid, number in (
        ("step01_time", "75 s"),
        ("step09_time", "33.5 s"),
        ("step03_epochs", "25 epochs"),
    ):
        cites = [c for c in v[vid].cites if c.doc == notebook.key]
        assert cites and number in cites[0].gist, vid
        assert not any(number.split()[0] in q.text for q in v[vid].quotes if q.doc == "seed"), vid
    # the seed's own number beside it
    assert any("(34s)" in q.text for q in v["step09_time"].quotes)


def test_apex_readme_numbers_are_2019s_and_the_1504_tie_says_it_is_an_inference():
    s = _sources()["apex_word_lm"]
    assert s.date == "2019-02-01" and s.documents["readme"].commit.startswith("859f528b")
    for vid in ("fp16_ppl_scale1", "fp16_ppl_scale128"):
        v = next(x for x in s.values if x.id == vid)
        texts = [q.text for q in v.quotes]
        assert any(
            "around 93 with loss scale 1.0 to around 90 with loss scale 128.0" in t for t in texts
        )
        # the commands beside it: 6 epochs, no model size
        assert any("--epochs 6" in t for t in texts)
        assert v.reading.startswith("an inference") and "1504" in v.reading
        assert "inference" in v.label


def test_numerics_and_pitfall_cases_say_what_they_compose():
    """lstm_half is a pure-fp16 LSTM on synthetic text: no published number is tied to it;
    bn_eval_fp32bn composes precision=half (no master weights, no loss scale), and its words say so,
    not "apex O2"."""
    text = (ROOT / "conf" / "numerics_case" / "lstm_half.yaml").read_text()
    assert "93" not in text and "90" not in text and "apex" not in text
    c, s = composed("experiment=half_pitfalls", "pitfall=bn_eval_fp32bn")
    assert s["choices"]["precision"] == "half" and c.precision.keep_bn_fp32 and c.model.bn_eval
    assert not c.precision.master_weights and c.precision.loss_scale in (None, "none")
    words = (ROOT / "conf" / "pitfall" / "bn_eval_fp32bn.yaml").read_text()
    assert "O2" not in words and "precision=half" in words and "no master weights" in words


def test_titles_authors_and_addresses_are_the_sources_own():
    s = _sources()
    amp = s["torch_amp"]
    assert amp.title == (
        "Introducing native PyTorch automatic mixed precision for faster training on NVIDIA GPUs"
    )
    assert amp.author == "Mengdi Huang, Chetan Tekur, Michael Carilli"
    half = s["half_pitfalls"]   # the seed's title; it gives no address, author or date of its own
    assert half.title == "Pytorch半精度網絡訓練需要注意什么問題"
    assert half.url is None and half.title_translation
    assert s["page_ladder"].url == "https://myrtle.ai/how-to-train-your-resnet-8-bag-of-tricks/"


def test_every_line_citation_of_dawn_py_is_of_one_commit():
    """dawn.py's line numbers differ between its commits: every line citation names the commit it
    counts in, and it is the same one everywhere."""
    texts = [
        *(ROOT / "src" / "mixprec" / "published").glob("*.yaml"),
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "conf").rglob("*.yaml"),
        *(ROOT / "tests").rglob("*.py"),
        ROOT / "README.md",
    ]
    commits = set()
    for path in texts:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w])dawn\.py(:\d| at [0-9a-f]| \([0-9a-f]{7})", text), path
        commits |= set(re.findall(r"(?<![\w])dawn\.py@([0-9a-f]+)", text))
    assert commits == {"55be9b98"}


TINY_PUBLISHED = """
id: tiny
title: t
experiments: [x]
hardware: h
documents:
  seed: {name: the tiny seed, lang: zh-Hant, seed: 000_0123456789abcdef.txt}
  readme: {name: a README at a commit, lang: en, commit: abc1234}
values:
  - id: a
    metric: speedup
    value: 1.2
    unit: x
    match: {precision: half}
    quotes:
      - {in: seed, at: line 2, text: "半精度 要快1/6", translation: half precision, 1/6 faster}
      - {in: readme, at: line 1, text: around 93 with loss scale 1.0}
"""


def test_check_quotes_finds_each_quote_in_the_text_it_cites_and_lists_the_rest(tmp_path, capsys):
    check = load_script("check_quotes")
    published, seeds = tmp_path / "published", tmp_path / "seeds"
    published.mkdir(), seeds.mkdir()
    (published / "tiny.yaml").write_text(TINY_PUBLISHED, encoding="utf-8")
    (seeds / "000_0123456789abcdef.txt").write_text("標題\n半精度\n要快1/6。\n", encoding="utf-8")
    # not a *.txt
    (seeds / "README.md").write_text("around 93 with loss scale 1.0", encoding="utf-8")
    args = [str(seeds), "--published", str(published)]
    # a line break reads as a space; the README is left out
    assert check.entry([*args, "--seeds-only"]) == 0
    assert (
        "1 distinct quotes against 1 texts (000_0123456789abcdef.txt): 1 found, 0 not"
        in capsys.readouterr().out
    )
    assert check.entry(args) == 1   # the README's quote is in none of the given texts
    out = capsys.readouterr().out
    assert (
        'IN NONE: tiny (a): a README at a commit (line 1): "around 93 with loss scale 1.0"' in out
    )
    # no space: not verbatim
    (seeds / "000_0123456789abcdef.txt").write_text("半精度要快1/6", encoding="utf-8")
    (seeds / "001_0123456789abcdef.txt").write_text("半精度 要快1/6", encoding="utf-8")
    assert check.entry([*args, "--seeds-only"]) == 1
    out = capsys.readouterr().out
    assert (
        "NOT IN 000_0123456789abcdef.txt: tiny (a)" in out
        and "found in 001_0123456789abcdef.txt" in out
    )
    readme = tmp_path / "readme.txt"
    readme.write_text("... from around 93 with loss scale 1.0 to ...", encoding="utf-8")
    (seeds / "001_0123456789abcdef.txt").unlink()
    (seeds / "000_0123456789abcdef.txt").write_text("半精度 要快1/6", encoding="utf-8")
    assert check.entry([*args, str(readme)]) == 0
    for bad, why in (
        (tmp_path / "nowhere", "no such file or folder"),
        (published, "no *.txt file in it"),
    ):
        assert check.entry([str(bad), "--published", str(published)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"check_quotes: {bad}: {why}")


def test_the_published_quotes_are_found_where_they_say_in_a_copy_of_their_own_texts(
    tmp_path, capsys
):
    """Without the source texts (tests never read them): the shipped quotes written into one file
    per seed each pass; a seed file missing one of its quotes fails and names it."""
    check = load_script("check_quotes")
    files = {}
    for s in _sources().values():
        for v in s.values:
            for q in v.quotes:
                seed = s.documents[q.doc].seed
                if seed:
                    files.setdefault(seed, []).append(q.text)
    for seed, texts in files.items():
        (tmp_path / seed).write_text("\n".join(texts), encoding="utf-8")
    assert check.entry([str(tmp_path), "--seeds-only"]) == 0
    dropped = files["001_1d63221301538ce3.txt"][0]
    (tmp_path / "001_1d63221301538ce3.txt").write_text(
        "\n".join(files["001_1d63221301538ce3.txt"][1:])
    )
    assert check.entry([str(tmp_path), "--seeds-only"]) == 1
    assert (
        "NOT IN 001_1d63221301538ce3.txt: half_pitfalls (adam_fp16_nan)" in capsys.readouterr().out
    )
    assert "梯度為零的權重變成了NAN" in dropped


def test_torch_amp_values_are_eight_gpus_with_their_epochs_and_the_blogs_noise():
    v = _values("torch_amp")
    assert all(x.hardware.startswith("8x NVIDIA") for x in v.values())
    assert "8xV100" in v["amp_speedup_range"].quote and v["amp_speedup_range"].noise is None
    accuracy = [x for x in v.values() if x.metric in ("test_acc_pct", "acc_change_vs_fp32")]
    assert len(accuracy) == 11 and all(
        x.noise == 0.4 and "trainer.epochs" in x.match for x in accuracy
    )
    assert (
        v["a100_amp_acc"].match["trainer.epochs"]
        == v["a100_tf32_acc"].match["trainer.epochs"]
        == 90
    )
    # the blog's parity lies within its own noise
    for gap in ("v100_gap_50", "v100_gap_90", "v100_gap_250"):
        assert abs(v[gap].value) <= v[gap].noise


def test_the_report_says_when_a_number_is_within_the_sources_own_noise(tmp_path):
    import json

    from mixprec.report.make import make_report

    for name, precision, acc in (("amp", "amp", 0.77), ("tf32", "tf32", 0.75)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        d.joinpath("summary.json").write_text(
            json.dumps(
                {
                    "status": "completed",
                    "name": "torch_amp",
                    "seed": 0,
                    "overrides": ["seed=0"],
                    "choices": {"model": "resnet50", "precision": precision},
                    "job": {"name": "train", "num": None},
                    "config": {"seed": 0, "name": "torch_amp", "trainer": {"epochs": 90}},
                    "metrics": {"train_time_s": 1.0, "final_test_acc": acc},
                }
            )
        )
    data = make_report([str(tmp_path / "runs")], tmp_path / "report")
    rows = {c["id"]: c["rows"] for c in data["experiments"][0]["comparisons"]}
    # 77.0 vs 76.93
    assert rows["a100_amp_acc"][0]["noise"].startswith("within the source's own noise (±0.4")
    # 75.0 vs 76.85
    assert rows["a100_tf32_acc"][0]["noise"].startswith("outside the source's own noise")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "within the source's own noise (±0.4 % top-1 (ImageNet))" in md
