"""Fixtures that test modules of several rooms take in (autouse where a module imports them)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine their hand-offs made
    these tests ~20x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
