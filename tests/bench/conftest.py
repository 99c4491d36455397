"""Fixtures of the benchmark tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """A tiny model needs no second thread; with one, a busy machine cannot slow the steps a hundredfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
