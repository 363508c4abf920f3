"""Fixtures of the serving tests: one intra-op thread (the engine keeps to one OpenMP thread too)."""
import pytest


@pytest.fixture(autouse=True, scope="module")
def one_thread(one_thread):
    """tests/conftest.py's one intra-op thread, for every serving test module."""
    yield
