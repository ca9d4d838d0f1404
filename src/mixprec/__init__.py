"""mixprec: reproduce what mixed precision buys in speed, memory and accuracy."""
__version__ = "0.1.0"

from .runtime.defaults import register as _register_defaults  # noqa: E402
from .runtime.jobdirs import register as _register_job_dirname  # noqa: E402

# ${mixprec.job_dirname:...}: the sweep job folders' names (conf/config.yaml)
_register_job_dirname()
# ${mixprec.batch_default:...}: trainer.batch_size, 256 on a GPU (defaults.py)
_register_defaults()
