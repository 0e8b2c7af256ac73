"""Fixtures for proxy tests: real models in the session's Triton and ``tritonshare proxy`` subprocesses."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.install import install_model
from tests.support.models import DECOUPLED_CONFIG, DECOUPLED_MODEL
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout


@dataclass(frozen=True)
class ServedModels:
    own: str  # the proxy's model (identity: INPUT0 FP32 [-1] -> OUTPUT0)
    other: str  # another tenant's model in the same Triton (identity)
    stream: str  # a decoupled model: one response per element of INPUT0


@pytest.fixture(scope="session")
def served_models(triton: TritonServer, layout: NodeLayout) -> ServedModels:
    tag = uuid.uuid4().hex[:6]
    models = ServedModels(own=f"own-{tag}", other=f"other-{tag}", stream=f"stream-{tag}")
    install_model(layout, triton, models.own)
    install_model(layout, triton, models.other)
    install_model(layout, triton, models.stream, config=DECOUPLED_CONFIG, model_py=DECOUPLED_MODEL)
    return models


@pytest.fixture(scope="session")
def proxy(
    triton: TritonServer, layout: NodeLayout, served_models: ServedModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    """One proxy for the own model, shared by the session; it never unloads (``--no-unload``)."""
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    process = ProxyProcess(served_models.own, triton, layout, log, ["--no-unload"]).start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def stream_proxy(
    triton: TritonServer, layout: NodeLayout, served_models: ServedModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    """A proxy whose own model is the decoupled one (for ModelStreamInfer)."""
    log = tmp_path_factory.mktemp("proxy") / "stream-proxy.log"
    process = ProxyProcess(served_models.stream, triton, layout, log, ["--no-unload"]).start()
    yield process
    process.stop()


@pytest.fixture
def start_proxy(triton: TritonServer, layout: NodeLayout, tmp_path: Path) -> Iterator[Callable[..., ProxyProcess]]:
    """Start extra proxies (e.g. for drain/unload tests, which end them); all are killed at teardown."""
    started: list[ProxyProcess] = []

    def start(name: str, *extra: str, server: TritonServer | None = None) -> ProxyProcess:
        process = ProxyProcess(name, server or triton, layout, tmp_path / f"proxy-{len(started)}.log", list(extra))
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def own_model(triton: TritonServer, layout: NodeLayout) -> str:
    """A fresh identity model of the test's own (for tests that unload it)."""
    name = f"own-{uuid.uuid4().hex[:10]}"
    install_model(layout, triton, name)
    return name
