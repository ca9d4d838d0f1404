"""mixprec: reproduce what mixed precision buys in speed, memory and accuracy."""
__version__ = "0.1.0"

from .jobdirs import register as _register_job_dirname  # noqa: E402

_register_job_dirname()   # ${mixprec.job_dirname:...}: the sweep job folders' names (conf/config.yaml)
