"""Fixtures shared by every test tier: a node folder, a real Triton watching it, unique model names, a slow
HTTP store."""

from __future__ import annotations

import os

# Child processes start with a preexec_fn (children.die_with_parent), so subprocess forks and runs Python in the
# child before exec: grpcio's fork handlers then run there too, and once aborted a proxy before its exec (CI, 28 Nov:
# "epoll_wait error: Bad file descriptor", exit -6). No test forks to use gRPC in the child: off, before grpc loads.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.build import running_compiled
from tests.support.storage import CrawlingHttpServer
from tests.support.triton import TritonServer, triton_available, triton_venv
from tritonshare.common.layout import NodeLayout


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``interpreted`` spy on a method of the proxy (which path a request took): a compiled class
    calls its methods directly, so a patch cannot see them. Against the compiled build they are skipped, and
    scripts/test.sh runs them again against the source tree."""
    if running_compiled():
        skip = pytest.mark.skip(reason="spies on a method, which compiled code calls directly (scripts/test.sh "
                                "runs it against the source tree)")  # fmt: skip
        for item in items:
            if item.get_closest_marker("interpreted"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def node_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("node")
    (root / "models").mkdir()
    (root / "staging").mkdir()
    return root


@pytest.fixture(scope="session")
def layout(node_root: Path) -> NodeLayout:
    return NodeLayout(repository=node_root / "models", staging=node_root / "staging", leases=node_root / "leases")


@pytest.fixture(scope="session")
def triton(layout: NodeLayout, node_root: Path) -> Iterator[TritonServer]:
    """One real Triton (POLL, 1 s) for the session, watching ``layout.repository``. Tests share it,
    so each uses its own model name (:func:`model_name`)."""
    if not triton_available():
        pytest.fail(f"no Triton venv at {triton_venv()} — run scripts/setup.sh first")
    server = TritonServer(repository=layout.repository, log_path=node_root / "triton.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def explicit_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, NodeLayout]]:
    """A second real Triton, in explicit mode (``--model-control-mode=explicit``: it loads only what it is told
    to), watching a node folder of its own. Shared like :func:`triton`: tests use their own model names."""
    root = tmp_path_factory.mktemp("explicit-node")
    layout = NodeLayout(repository=root / "models", staging=root / "staging", leases=root / "leases")
    layout.repository.mkdir()
    layout.staging.mkdir()
    server = TritonServer(repository=layout.repository, log_path=root / "triton.log", mode="explicit").start()
    yield server, layout
    server.stop()


@pytest.fixture
def model_name() -> str:
    return f"m-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def crawling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrawlingHttpServer]:
    """An HTTP file server sending each body at 1 MiB/s: a download to stop midway."""
    server = CrawlingHttpServer(tmp_path_factory.mktemp("http-root"))
    server.start()
    yield server
    server.stop()
