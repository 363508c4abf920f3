"""Fixtures of every model test: one intra-op thread, NaN-poisoned torch.empty."""
import pytest
import torch

from ..conftest import poison_empty


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny ops on shared cores: intra-op threads cost far more than the work (100x measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    poison_empty(monkeypatch)
