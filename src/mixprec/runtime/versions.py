"""The versions a job runs with, against the ones the test suite last passed with (constraints.txt
at the root).

`installed()` is what summary.json records (env.versions); `read_constraints()` reads the pins the
README's set-up command installs; `differences()` says which recorded versions are not the pinned
ones (the report flags the job). A local version label (torch's `+cu130`) is the wheel's build, not
another release: it is left out of the comparison.
"""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parents[3] / "constraints.txt"
# the packages whose versions a job's numbers depend on (the rest of constraints.txt is what they
# pull in)
KEY_PACKAGES = ("torch", "torchvision", "torchao", "numpy", "hydra-core", "omegaconf", "wandb")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_constraints(path: Path | None = None) -> dict[str, str]:
    """{package (canonical name): pinned version} of the `name==version` lines; {} without the file
    (an install from a wheel rather than the repository)."""
    path = CONSTRAINTS if path is None else Path(path)
    if not path.is_file():
        return {}
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if m:
            pins[canonical(m[1])] = m[2]
    return pins


def installed(names=KEY_PACKAGES) -> dict[str, str | None]:
    """The installed version of each package (None: not installed)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def release(version: str | None) -> str | None:
    return None if version is None else str(version).split("+", 1)[0]


def differences(versions: dict | None, pins: dict[str, str] | None = None) -> list[str]:
    """'torch 2.15.0 (pinned 2.14.1)' for each recorded version that is not its pin; packages not
    recorded, not installed or not pinned are left out."""
    pins = read_constraints() if pins is None else pins
    out = []
    for name, version in (versions or {}).items():
        pin = pins.get(canonical(name))
        if version is not None and pin is not None and release(version) != release(pin):
            out.append(f"{name} {version} (pinned {pin})")
    return out
