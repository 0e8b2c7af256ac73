"""Fixtures for the fault tests: the session's node folder as a :class:`~bench.faults.node.Node` (with its
lease folder) and a local HTTP file server for loader sources."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench.faults.node import Node

from tests.support.storage import HttpFileServer


@pytest.fixture(scope="session")
def node(node_root: Path) -> Node:
    """The node folder the session's Triton polls (``models/``, ``staging/``) plus ``leases/`` for gc."""
    return Node(node_root).create()


@pytest.fixture
def file_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpFileServer]:
    # A loader killed mid-download resets the connection; aiohttp logs that as an error, which is expected here.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    server = HttpFileServer(tmp_path_factory.mktemp("http-root")).start()
    yield server
    server.stop()
