"""Settings for the benchmarks' tests."""

import pytest
import torch

import gradsparse as gs


@pytest.fixture(autouse=True)
def _thread_counts_restored():
    """The benchmarks' main functions run in the test process, and some set torch's and
    gradsparse's thread counts (benchmarks/density.py: 2 and 1): every later test of the session
    ran with them. Each test's are put back after it (gradsparse's to its default)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    gs.set_num_threads(0)
