"""Fixtures of every model test: one intra-op thread, NaN-poisoned torch.empty."""
import pytest

from ..conftest import poison_empty


@pytest.fixture(autouse=True, scope="module")
def one_thread(one_thread):
    """tests/conftest.py's one intra-op thread, for every model test module."""
    yield


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    poison_empty(monkeypatch)
