"""Stopping a job cleanly: SIGTERM/SIGINT ask the training loop to stop after the current step (it
writes a checkpoint first, checkpoint.py), and the command that continues an interrupted job or
sweep."""
from __future__ import annotations

import logging
import shlex
import signal
import sys
from pathlib import Path

log = logging.getLogger(__name__)


class StopSignals:
    """While active, SIGTERM/SIGINT ask the job to stop after the current step (the loop writes a
    checkpoint first); a second signal acts at once (SIGINT: KeyboardInterrupt; SIGTERM: the
    default, terminate). Calling the object returns the first signal's name, or None."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __call__(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:   # the second one: stop now
            self._restore()
            signal.raise_signal(signum)
            return
        self.signum = signum
        log.warning(
            f"mixprec: {signal.Signals(signum).name}: stopping after this step and writing a "
            "checkpoint (send it again to stop at once)"
        )

    def __enter__(self) -> "StopSignals":
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        except ValueError:   # not the main thread: signals keep their defaults
            self._previous = {}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous = {}


def resume_hint(out_dir: Path, sweep_dir: Path | None) -> str:
    """The command that continues this job (or its sweep): the same arguments, trainer.resume=auto
    and the dir."""
    drop = ("trainer.resume=", "hydra.run.dir=", "hydra.sweep.dir=", "+trainer.resume=")
    args = [a for a in sys.argv[1:] if not a.startswith(drop)]
    where = f"hydra.sweep.dir={sweep_dir}" if sweep_dir else f"hydra.run.dir={out_dir}"
    return " ".join(
        shlex.quote(a) for a in ["python", "train.py", *args, "trainer.resume=auto", where]
    )
