"""The docs against the repository: the pinned versions (constraints.txt) where the README, CI and docs/gpus.md
speak of them, and no reference a user cannot follow (issue numbers, the developers' own files)."""
import re

import pytest

from helpers import ROOT
from mixprec.versions import read_constraints

DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def readme_setup_command() -> str:
    block = (ROOT / "README.md").read_text().split("## Set-up", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()[0].split("#", 1)[0].strip()


def test_the_readme_installs_the_pinned_versions_and_ci_runs_the_readme_command():
    command = readme_setup_command()
    assert command == 'pip install -e ".[dev]" -c constraints.txt'
    ci = [line.split("#", 1)[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci, ".ci/run must install with the README's set-up command"
    assert "-c constraints.txt" in (ROOT / "environment.yml").read_text()


def test_constraints_pin_the_key_packages_exactly():
    pins = read_constraints()
    for name in ("torch", "torchvision", "torchao", "hydra-core", "omegaconf", "wandb", "numpy", "matplotlib", "tqdm",
                 "pyyaml", "pytest", "ruff", "submitit", "hydra-submitit-launcher", "wandb-workspaces"):
        assert re.fullmatch(r"\d+(\.\d+)*\w*(\.post\d+)?", pins.get(name, "")), f"constraints.txt: no == pin of {name}"


def test_docs_gpus_speaks_of_the_pinned_torch_and_cuda():
    pins = read_constraints()
    cuda = ".".join(pins["nvidia-cuda-runtime"].split(".")[:2])   # the wheel's CUDA: its runtime library's version
    text = " ".join((ROOT / "docs" / "gpus.md").read_text().split())
    assert f"torch {pins['torch']}" in text and f"{pins['torch']}+cu{cuda.replace('.', '')}" in text
    assert f"CUDA {cuda}" in text
    assert f"torchvision {pins['torchvision']}" in text and f"torchao {pins['torchao']}" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"torch {pins['torch']}" in readme and f"CUDA {cuda}" in readme


def test_pyproject_names_no_other_tested_version():
    text = (ROOT / "pyproject.toml").read_text()
    assert "tested with" not in text   # the tested versions are constraints.txt's, said once


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_internal_process(path):
    text = path.read_text()
    for pattern in (r"\b[Ii]ssues? #?\d+", r"\bshared/", r"reproduction issue", r"DESIGN\.md", r"\bthis session\b"):
        assert not re.search(pattern, text), f"{path.name}: {re.search(pattern, text)[0]!r}: say what is meant"
