"""The docs against the repository: the pinned versions (constraints.txt) where the README, CI and
docs/gpus.md speak of them, and no reference a user cannot follow (issue numbers, the developers'
own files)."""
import json
import re
from pathlib import Path

import pytest

from helpers import ROOT
from mixprec.runtime.versions import read_constraints

DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def readme_setup_command() -> str:
    block = (
        (ROOT / "README.md")
        .read_text()
        .split("## Set-up", 1)[1]
        .split("```bash", 1)[1]
        .split("```", 1)[0]
    )
    return block.strip().splitlines()[0].split("#", 1)[0].strip()


def test_the_readme_installs_the_pinned_versions_and_ci_runs_the_readme_command():
    command = readme_setup_command()
    assert command == 'pip install -e ".[dev]" -c constraints.txt'
    ci = [line.split("#", 1)[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci, ".ci/run must install with the README's set-up command"
    assert "-c constraints.txt" in (ROOT / "environment.yml").read_text()


def test_constraints_pin_the_key_packages_exactly():
    pins = read_constraints()
    for name in (
        "torch",
        "torchvision",
        "torchao",
        "hydra-core",
        "omegaconf",
        "wandb",
        "numpy",
        "matplotlib",
        "tqdm",
        "pyyaml",
        "pytest",
        "pytest-xdist",
        "ruff",
        "submitit",
        "hydra-submitit-launcher",
        "wandb-workspaces",
    ):
        assert re.fullmatch(r"\d+(\.\d+)*\w*(\.post\d+)?", pins.get(name, "")), (
            f"constraints.txt: no == pin of {name}"
        )


def test_docs_gpus_speaks_of_the_pinned_torch_and_cuda():
    pins = read_constraints()
    # the wheel's CUDA: its runtime library's version
    cuda = ".".join(pins["nvidia-cuda-runtime"].split(".")[:2])
    text = " ".join((ROOT / "docs" / "gpus.md").read_text().split())
    assert f"torch {pins['torch']}" in text and f"{pins['torch']}+cu{cuda.replace('.', '')}" in text
    assert f"CUDA {cuda}" in text
    assert f"torchvision {pins['torchvision']}" in text and f"torchao {pins['torchao']}" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"torch {pins['torch']}" in readme and f"CUDA {cuda}" in readme


def recorded_device(folder: Path) -> str:
    """The device a committed results folder's records say it ran on ("cpu", "cuda:0", ...)."""
    env = folder / "environment.json"
    if env.is_file():   # a scripts/reproduce.py folder
        return json.loads(env.read_text())["device"]
    (numbers,) = folder.glob("*.json")   # scripts/fixed_numbers.py's record
    return json.loads(numbers.read_text())["device"]


def test_the_readme_is_a_front_door():
    """At most 150 lines; within the first 100 the set-up, the main command and a sweep, the
    precision modes and the layout; the layout names every top-level folder and every subpackage of
    src/mixprec; the results summary (15 lines at most) links the results page and every folder
    under outputs/reference/ with its device."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    at = {line: i for i, line in enumerate(lines) if line.startswith("## ")}
    assert list(at)[:4] == ["## Set-up", "## Run", "## Precision modes", "## Layout"]
    run = [line.split("#")[0].strip() for line in lines[at["## Run"]:at["## Precision modes"]]]
    assert "python train.py" in run and any(line.startswith("python train.py -m ") for line in run)
    tree = lines[at["## Layout"]:]
    tree = tree[tree.index("```") + 1:]
    tree = tree[:tree.index("```")]
    assert at["## Layout"] + len(tree) < 100
    first_words = {line.split()[0] for line in tree}
    for folder in ("train.py", "conf/", "src/mixprec/", "scripts/", "tests/", "outputs/", "docs/"):
        assert folder in first_words, f"README's layout: no line for {folder}"
    for pkg in sorted((ROOT / "src" / "mixprec").glob("*/__init__.py")):
        name = f"{pkg.parent.name}/"
        assert name in first_words, f"README's layout: no line for src/mixprec/{name}"
    following = [i for i in at.values() if i > at["## Results"]]
    end = min(following, default=len(lines))
    results = [line for line in lines[at["## Results"] + 1:end] if line.strip()]
    assert len(results) <= 15 and any("](docs/results.md)" in line for line in results)
    reference = ROOT / "outputs" / "reference"
    folders = [p.parent for p in sorted(reference.rglob("plan.json"))]
    folders += [p for p in sorted(reference.iterdir())
                if p.is_dir() and not any(p.rglob("plan.json"))]
    assert len(folders) >= 6
    for f in folders:
        link = f"]({f.relative_to(ROOT).as_posix()}/"
        row = next((line for line in results if link in line), None)
        assert row is not None, f"README's results: no line links {f.relative_to(reference)}"
        on_cpu = recorded_device(f).startswith("cpu")
        assert ("| CPU, fp16/bf16 emulated |" in row) == on_cpu, row


def test_pyproject_names_no_other_tested_version():
    text = (ROOT / "pyproject.toml").read_text()
    assert "tested with" not in text   # the tested versions are constraints.txt's, said once


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_internal_process(path):
    text = path.read_text()
    for pattern in (
        r"\b[Ii]ssues? #?\d+",
        r"\bshared/",
        r"reproduction issue",
        r"DESIGN\.md",
        r"\bthis session\b",
    ):
        assert not re.search(pattern, text), (
            f"{path.name}: {re.search(pattern, text)[0]!r}: say what is meant"
        )


def test_the_readmes_gpu_steps_install_against_the_machines_own_torch_first():
    """A GPU machine with its own torch (a cloud image; the lent H200s: 2.11.0, no network): the
    README's set-up says, before scripts/gpu_check.sh, how to install without replacing it (the
    tested pins would ask pip for torch 2.14.1 and its CUDA wheels), with the oldest pins' torch;
    docs/install.md covers another torch and no network."""
    lines = (ROOT / "README.md").read_text().split("## Run")[0].splitlines()
    oldest = read_constraints(ROOT / "constraints-oldest.txt")["torch"]
    keep = next(i for i, line in enumerate(lines) if "-c constraints-oldest.txt" in line)
    check = next(i for i, line in enumerate(lines) if line.startswith("scripts/gpu_check.sh"))
    said = lines[keep - 1]
    assert keep < check and "own torch" in said and "instead of the first" in said
    assert f"own torch is {oldest} " in said   # pip keeps exactly the pinned version
    install = (ROOT / "docs" / "install.md").read_text()
    section = install.split("## A GPU machine with its own torch")[1].split("\n## ")[0]
    assert "pip install --no-index --find-links wheels" in section and "another >= " in section
