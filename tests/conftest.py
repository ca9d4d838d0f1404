"""pytest's fixtures and the gpu marker's skip; the shared helpers are in helpers.py."""
import pytest

from helpers import run_tiny


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need a CUDA GPU (tests/test_gpu.py): skipped, with the reason, where there
    is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (pytest -m gpu on a GPU machine; see docs/gpus.md)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny(tmp_path):
    return lambda *overrides: run_tiny(tmp_path, *overrides)


@pytest.fixture(scope="session")
def ranks_ran(tmp_path_factory):
    """The folder where 2 spawned gloo ranks wrote what the FSDP checks without a job read
    (tests/test_fsdp.py's checks_on_rank): one spawn for the session."""
    from test_fsdp import checks_on_rank, on_ranks   # torch.distributed: only where asked for

    folder = tmp_path_factory.mktemp("ranks")
    on_ranks(checks_on_rank, folder)
    return folder
