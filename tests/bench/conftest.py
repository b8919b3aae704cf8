"""Fixtures shared by the benchmark tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Timings are not asserted: one thread keeps a loaded machine's OpenMP barriers from stalling the run."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
