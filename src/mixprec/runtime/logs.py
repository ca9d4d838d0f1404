"""The job's notes: one line each through `logging` (the "mixprec" logger), said on the console
(stderr) as they are and, under Hydra, written with a time stamp into <job dir>/train.log
(conf/hydra/job_logging/mixprec.yaml sets both up). Ranks other than 0 say only their errors: rank 0
speaks for the job."""
from __future__ import annotations

import logging
import sys

LOG = logging.getLogger("mixprec")


class Console(logging.Handler):
    """Each note as it is, on sys.stderr as it is when the note is written (outside Hydra: tests,
    scripts)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def setup(main: bool) -> None:
    """Notes at INFO on rank 0, errors only elsewhere; a console for them where Hydra gave the
    logger none."""
    LOG.setLevel(logging.INFO if main else logging.ERROR)
    if not LOG.handlers:
        LOG.addHandler(Console())
