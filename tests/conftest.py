"""pytest's fixtures and the gpu marker's skip; the shared helpers are in tests/helpers/."""
import fcntl
import os
import shutil

import pytest

from helpers import run_tiny


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need a CUDA GPU (tests/gpu/test_gpu.py): skipped, with the reason, where
    there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (pytest -m gpu on a GPU machine; see docs/gpus.md)"
    )
    for item in items:
        if item.get_closest_marker("gpu"):   # the marker (tests/gpu/ makes "gpu" a keyword of all)
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (pytest-xdist): each test goes to the worker that is free (work stealing) in place of
    xdist's default split into fixed chunks, which left one core idle behind the torchrun tests at
    the end of the quick loop. An explicit --dist other than load is kept."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling   # only under pytest-xdist

    return WorkStealingScheduling(config, log)


@pytest.fixture
def tiny(tmp_path):
    return lambda *overrides: run_tiny(tmp_path, *overrides)


@pytest.fixture(scope="session")
def ranks_ran(tmp_path_factory):
    """The folder where 2 spawned gloo ranks wrote what the FSDP checks without a job read
    (tests/helpers/fsdp_ranks.py's checks_on_rank): one spawn for the session, shared by
    pytest-xdist's workers (-n 2) under a file lock (the first worker to ask spawns; the other waits
    and reads): one spawn's CPU, not one per worker."""
    from helpers.distributed import on_ranks   # torch.distributed: only where asked for
    from helpers.fsdp_ranks import checks_on_rank

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent   # the session's folder, above each worker's own
    folder, done = root / "ranks", root / "ranks.done"
    with open(root / "ranks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)   # a spawn that failed: afresh
            folder.mkdir()
            on_ranks(checks_on_rank, folder)
            done.touch()
    return folder
