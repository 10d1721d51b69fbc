"""Fixtures of the package's tests: a real `kvferry node` (see ``nodeproc.py``) shared by a
test session, one of a test's own, and a client of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nodeproc import Node as NodeProc, kvferry_bin  # noqa: E402,F401  (the tests import them from here)


@pytest.fixture(scope="session")
def node(tmp_path_factory):
    n = NodeProc(tmp_path_factory.mktemp("node"))
    yield n
    n.stop()


@pytest.fixture
def client(node):
    import kvferry

    return kvferry.EngineClient(node.addr, deadline_s=10.0)


@pytest.fixture
def fresh_node(tmp_path):
    """A node of the test's own, for tests that stop it."""
    n = NodeProc(tmp_path)
    yield n
    n.stop()
