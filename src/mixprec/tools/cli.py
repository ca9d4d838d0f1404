"""What the scripts of scripts/ share with train.py: the config composed from conf/ as a job sees
it, and one way to end on a user's mistake.

A bad argument, a bad override, an unknown option, a missing file or folder ends a script with exit
status 2 (1 for data that cannot be read, as train.py) and one line on stderr that names the mistake
and what to do instead, never a traceback: `run(prog, main)` wraps a script's main(); `compose()`
turns Hydra's multi-line composition errors into a ConfigError of one line; `ArgumentParser` says an
argparse error in one line too. An exception that is not the user's (a bug) still ends in its
traceback.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ..config import ConfigError

CONF = Path(__file__).resolve().parents[3] / "conf"


def compose(overrides, *, return_hydra_config: bool = False):
    """conf/config.yaml composed with `overrides` (Hydra's compose API, as train.py composes a job);
    a bad override, an unknown group option or key: ConfigError, one line."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(
                "config", overrides=list(overrides), return_hydra_config=return_hydra_config
            )
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(hydra_message(e)) from None


def hydra_message(e: BaseException) -> str:
    """Hydra's error (several lines: the option missing and the options there are; the override that
    cannot be applied and its cause) as one line that names the mistake and the fix."""
    text = str(e)
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
    if missing:
        group, option = missing.groups()
        head, _, tail = text.partition("Available options in")
        options = []
        # the indented lines after it; "Config search path:" ends them
        for line in tail.splitlines()[1:]:
            if line.strip() and not line[:1].isspace():
                break
            options += [line.strip()] if line.strip() else []
        return f"{group}={option}: no such option of `{group}` (conf/{group}/); " + (
            f"choose one of: {', '.join(options)}" if options else "see conf/ for the options"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    bad_key = re.match(r"Could not override '([^']+)'", lines[0]) if lines else None
    if bad_key:
        key = bad_key[1]
        return (
            f"{key}: no such key in the config; check its spelling (python train.py --cfg job "
            f"prints every key), or add a new key with +{key}=..."
        )
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        lines.append(str(cause).strip().splitlines()[0])
    line = "; ".join(lines) or type(e).__name__
    if "override_grammar" in line or "no viable alternative" in line or "mismatched input" in line:
        line = (f"an override does not parse ({line}); write each as key=value, quoting values "
                "with spaces or brackets")
    return line


def user_error(e: BaseException, known: tuple = ()) -> tuple[str, int] | None:
    """(the line, the exit status) of an exception that is the user's mistake; None for anything
    else (a bug)."""
    # lazy: both import torch, which the launcher (scripts/reproduce.py) imports cli without
    from ..data.files import DataError
    from ..train.checkpoint import CheckpointError

    if isinstance(e, ConfigError):
        return f"config error: {one_line(e)}", 2
    if isinstance(e, HydraException):
        return f"config error: {hydra_message(e)}", 2
    if isinstance(e, DataError):
        return f"data error: {one_line(e)}", 1
    if isinstance(e, (CheckpointError, *known)):
        return one_line(e), 2
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        what = e.strerror or type(e).__name__
        return (f"{e.filename}: {what[0].lower() + what[1:]}" if e.filename else one_line(e)), 2
    return None


def one_line(e: BaseException) -> str:
    return (
        "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    )


def run(prog: str, main, argv=None, known: tuple = ()) -> int:
    """main(argv)'s exit status; a user's mistake (ConfigError, Hydra's errors, DataError,
    CheckpointError, a missing file, or one of `known`) ends it with `prog: <one line>` on stderr
    instead of a traceback."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        said = user_error(e, known)
        if said is None:
            raise
        print(f"{prog}: {said[0]}", file=sys.stderr)
        return said[1]


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (the mistake, then where the options are
    listed)."""

    def error(self, message: str):
        name = self.prog.removesuffix(".py")
        self.exit(
            2, f"{name}: error: {message}; python scripts/{name}.py --help lists the arguments\n"
        )
