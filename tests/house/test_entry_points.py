"""Every entry point a user is shown runs, on the CPU, at least to its argument parsing or its "no
GPU" line, the message asserted: each script of scripts/ (--help as __main__, in this process; as
its own process in the slow twin), the inline Python of each shell script (its imports resolve, and
gpu_check.sh runs to its "no GPU is visible" line), and each command README.md and docs/ print
(train.py's overrides composed and validated as a job, every swept value; a script's arguments
through its own parser). A module that moved (`from mixprec import hardware`) fails here, not at
the start of a GPU lease."""
import argparse
import ast
import importlib
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, compose_config
from mixprec.tools import cli
from mixprec.config import validate_job

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
SHELL = sorted((ROOT / "scripts").glob("*.sh"))
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
# commands the docs print that are not ours to run: pip, pytest, ruff, W&B's CLI, a loop's frame
NOT_OURS = ("pip ", "python -m pytest", "ruff ", "wandb ", "python -c ", "for ", "done")


class Parsed(Exception):
    """Raised where an entry point has parsed its arguments: what it parsed."""


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for each command line of the docs' bash blocks (continued lines joined,
    comments dropped) and each inline `python ...`/`torchrun ...` span of their tables."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for block in text.split("```bash")[1:]:
            body = block.split("```", 1)[0].replace("\\\n", " ")
            loop = re.search(r"^for (\w+) in (\S+)", body, re.M)   # `for a in x y; do ... $a`
            for line in body.splitlines():
                command = line.split(" #", 1)[0].strip()
                if loop:
                    command = command.replace(f"${loop[1]}", loop[2])
                if command and not command.startswith("#"):
                    out.append((path.name, command))
        prose = "".join(text.split("```")[0::2])
        spans = re.findall(r"`((?:python|torchrun) [^`]+)`", prose)
        out += [(path.name, span) for span in spans if ("<" not in span or "<time>" in span)
                and re.search(r"train\.py|scripts/|-m mixprec\.", span)]
    return out


def tokens(command: str) -> list[str]:
    """The command's words with the docs' placeholders filled: <time> a folder's time stamp,
    [optional] its content, `...` (more overrides) dropped, $(date +%F) a date."""
    command = command.replace("<time>", "2026-01-01_00-00-00").replace("$(date +%F)", "2026-01-01")
    command = re.sub(r"\[([^\]=]+=[^\]]+)\]", r"\1", command)   # [gpu=h100]: optional
    command = re.sub(r"\[[^\]]*\]", "", command)   # [--compile MODE]: a placeholder
    return [t for t in shlex.split(command) if t != "..."]


def train_overrides(words: list[str]) -> list[str]:
    """train.py's overrides: its own words after train.py, without -m and Hydra's own options."""
    rest = words[next(i for i, w in enumerate(words) if w.endswith("train.py")) + 1:]
    return [w for w in rest if w not in ("-m", "--multirun") and not w.startswith("hydra")]


def swept(overrides: list[str]) -> list[list[str]]:
    """One job's overrides per swept value (each value once, the other keys at their first)."""
    overrides = [re.sub(r"=range\((\d+),.*$", r"=\1", o) for o in overrides]   # range(0,5): 0
    first = [o.split("=", 1)[0] + "=" + o.split("=", 1)[1].split(",")[0] for o in overrides]
    jobs = [first]
    for i, o in enumerate(overrides):
        key, value = o.split("=", 1)
        for v in value.split(",")[1:]:
            jobs.append(first[:i] + [f"{key}={v}"] + first[i + 1:])
    return jobs


def parse_only(monkeypatch):
    """Make argparse (and a script's compose of its overrides) raise Parsed once the arguments are
    parsed: the entry point runs its imports and its parser, not its work."""
    original = argparse.ArgumentParser.parse_known_args
    depth = []

    def parse_known_args(self, args=None, namespace=None):
        depth.append(1)   # a subcommand's parser is parsed inside its parent's call
        try:
            result = original(self, args, namespace)
        finally:
            depth.pop()
        if depth:
            return result
        if result[1] and not getattr(self, "_known_only", False):
            self.error(f"unrecognized arguments: {' '.join(result[1])}")
        raise Parsed(result[0])

    def known(self, args=None, namespace=None):
        self._known_only = True
        return parse_known_args(self, args, namespace)

    def compose(overrides, **kwargs):
        raise Parsed(compose_config(*overrides))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, args=None, namespace=None: parse_known_args(self, args))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args",
                        lambda self, args=None, namespace=None: parse_known_args(self, args))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", known)
    monkeypatch.setattr(cli, "compose", compose)


def run_main(monkeypatch, capsys, path, args: list[str]):
    """Run `path` as `python path args...` in this process; what it raised and printed."""
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except BaseException as e:   # SystemExit, Parsed
        return e, capsys.readouterr()
    return None, capsys.readouterr()


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_each_script_runs_to_its_help(path, monkeypatch, capsys):
    raised, said = run_main(monkeypatch, capsys, path, ["--help"])
    assert isinstance(raised, SystemExit) and raised.code in (0, None), (raised, said.err)
    assert said.out.strip(), f"{path.name} --help printed nothing"
    assert "usage:" in said.out or path.name == "data_stats.py", said.out[:500]


def shell_inline_python(path) -> list[str]:
    """The Python of each `python - <<'PY' ... PY` block of a shell script."""
    return re.findall(r"python3? - [^\n]*<<'PY'[^\n]*\n(.*?)\nPY\n", path.read_text(), re.S)


@pytest.mark.parametrize("path", SHELL, ids=lambda p: p.name)
def test_each_shell_scripts_inline_python_compiles_and_its_imports_resolve(path):
    blocks = shell_inline_python(path)
    assert blocks or "python -" not in path.read_text(), f"{path.name}: a block not found"
    for block in blocks:
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(
                        f"{node.module}.{alias.name}"), (
                        f"{path.name}: from {node.module} import {alias.name}: no such name")


def run_shell(*args):
    # the script runs `python`: this interpreter's, as in an activated venv
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PATH=path)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def test_gpu_check_on_a_cpu_ends_with_its_no_gpu_line():
    r = run_shell()
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-2000:]
    assert "torch " in r.stdout and "device cpu" in r.stdout, out[-2000:]
    assert out.strip().splitlines()[-1] == (
        "gpu_check: no GPU is visible (torch.accelerator); nothing to check"), out[-2000:]
    assert r.returncode == 2
    r = run_shell("--speed")
    assert r.stderr.strip().splitlines()[-1] == (
        "gpu_speed: no GPU is visible; use --dry-run for the CPU rehearsal"), r.stderr[-2000:]
    assert r.returncode == 2


def test_the_docs_commands_are_all_recognised():
    """Each command the docs print is one this file runs, or one named as not ours."""
    kinds = [kind(c) for _, c in doc_commands()]
    assert kinds.count("train") > 30 and kinds.count("script") > 15, kinds
    unknown = [c for (_, c), k in zip(doc_commands(), kinds) if k is None]
    assert not unknown, unknown


def kind(command: str) -> str | None:
    words = tokens(command)
    if command.startswith(NOT_OURS):
        return "other"
    if words[:2] == ["python", "train.py"] or (
            words[0] == "torchrun" and any(w.endswith("train.py") for w in words)):
        return "train"
    if words[0] == "python" and words[1].startswith("scripts/"):
        return "script"
    if words[0] == "python" and words[1] == "-m" and words[2].startswith("mixprec."):
        return "module"
    if words[0].endswith("gpu_check.sh") or words[:2] == ["bash", "scripts/gpu_check.sh"]:
        return "shell"
    return None


TRAIN = [(f, c) for f, c in doc_commands() if kind(c) == "train"]
RUNNABLE = [(f, c) for f, c in doc_commands() if kind(c) in ("script", "module")]


@pytest.mark.parametrize("doc,command", TRAIN, ids=[f"{f}: {c[:60]}" for f, c in TRAIN])
def test_each_train_command_the_docs_print_makes_a_job(doc, command):
    """The command's first job (each swept key at its first value) composes and validates."""
    overrides = swept(train_overrides(tokens(command)))[0]
    assert validate_job(compose_config(*overrides)).model.arch, overrides


@pytest.mark.slow   # about a second a job: the 10 tricks of the ladder, the 5 ResNets
def test_each_train_command_the_docs_print_makes_a_job_for_every_swept_value():
    for doc, command in TRAIN:
        for overrides in swept(train_overrides(tokens(command)))[1:]:
            assert validate_job(compose_config(*overrides)).model.arch, (doc, overrides)


@pytest.mark.parametrize("doc,command", RUNNABLE, ids=[f"{f}: {c[:60]}" for f, c in RUNNABLE])
def test_each_script_command_the_docs_print_parses(doc, command, monkeypatch, capsys):
    words = tokens(command)
    parse_only(monkeypatch)
    if words[1] == "-m":   # python -m mixprec.<module>
        monkeypatch.setattr(sys, "argv", [words[2], *words[3:]])
        with pytest.raises(Parsed):
            runpy.run_module(words[2], run_name="__main__", alter_sys=True)
        return
    raised, said = run_main(monkeypatch, capsys, ROOT / words[1], words[2:])
    if "--help" in words:   # the command shows its help: it parsed as far as --help
        assert isinstance(raised, SystemExit) and raised.code == 0 and "usage:" in said.out
        return
    assert isinstance(raised, Parsed), (command, raised, said.err[-1000:])


@pytest.mark.slow   # a process each (torch's import): the entry points exactly as a user runs them
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_each_script_as_its_own_process_prints_its_help(path):
    r = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.strip(), f"{path.name} --help printed nothing"


def test_a_job_without_saved_weights_says_so_and_the_speed_checks_save_none(tmp_path, tiny):
    """trainer.save_weights=false: a finished job writes no model_fp32.pt and its summary says none;
    evaluating it says why in one line. The speed check's jobs and benchmark.py's cells save none
    (the 2 x 4096 GPT's weights alone are 4.3 GB inside a 128 s budget)."""
    from mixprec.train.checkpoint import CheckpointError, load_fp32_model

    summary = tiny("trainer.save_weights=false")
    assert summary["status"] == "completed" and summary.get("weights") is None
    assert not (tmp_path / "model_fp32.pt").exists()
    with pytest.raises(CheckpointError, match="trainer.save_weights=false: run it again without"):
        load_fp32_model(tmp_path)
    gs = importlib.util.spec_from_file_location("gpu_speed", ROOT / "scripts" / "gpu_speed.py")
    module = importlib.util.module_from_spec(gs)
    gs.loader.exec_module(module)
    steps = module.plan(tmp_path, False, [], {"cifar10": True, "wikitext2": True})
    for s in steps:
        assert "trainer.save_weights=false" in s["cmd"] or s["cmd"][1].endswith("benchmark.py"), s
    bench = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(bench)
    bench.loader.exec_module(module)
    assert module.compose(["model=small_cnn"])[0].trainer.save_weights is False
