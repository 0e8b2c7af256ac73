"""Fixtures for proxy tests: real models in the session's Triton and ``tritonshare proxy`` subprocesses."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.install import install_model
from tests.support.models import DECOUPLED_CONFIG, DECOUPLED_MODEL, SLOW_CONFIG
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


# An identity model (4 instances, so Triton itself would run 4 requests at once) that takes DELAY_S per
# request and records, per execution, its wall-clock start and end and the first value of each request's
# INPUT0: what Triton really ran, when, and in which order — the ground truth for admission-control tests.
RECORDING_MODEL = """\
import time

import triton_python_backend_utils as pb_utils

LOG = {log!r}
DELAY_S = {delay_s!r}


class TritonPythonModel:
    def execute(self, requests):
        start = time.time()
        time.sleep(DELAY_S)
        out, values = [], []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            values.append(repr(float(x[0])) if x.size else "nan")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        with open(LOG, "a") as fh:  # one short append per execution: whole lines, even from 4 processes
            fh.write(f"{{start!r}} {{time.time()!r}} {{' '.join(values)}}\\n")
        return out
"""


@dataclass(frozen=True)
class Execution:
    start: float
    end: float
    values: tuple[float, ...]  # INPUT0[0] of each request in the execution


@dataclass(frozen=True)
class RecordingModel:
    name: str
    log: Path
    delay_s: float

    def executions(self) -> list[Execution]:
        """What Triton ran, in the order the executions started."""
        if not self.log.exists():
            return []
        runs = []
        for line in self.log.read_text().splitlines():
            start, end, *values = line.split()
            runs.append(Execution(float(start), float(end), tuple(float(v) for v in values)))
        return sorted(runs, key=lambda run: run.start)

    def max_concurrency(self) -> int:
        """The most requests Triton was executing at any one moment."""
        events = sorted(
            [(run.start, 1, len(run.values)) for run in self.executions()]
            + [(run.end, 0, len(run.values)) for run in self.executions()]  # at a tie, an end comes first
        )
        now = peak = 0
        for _, starts, count in events:
            now += count if starts else -count
            peak = max(peak, now)
        return peak


@pytest.fixture
def recording_model(triton: TritonServer, layout: NodeLayout, tmp_path: Path) -> Callable[[float], RecordingModel]:
    """Install a fresh :data:`RECORDING_MODEL` taking ``delay_s`` per request."""

    def install(delay_s: float) -> RecordingModel:
        name = f"rec-{uuid.uuid4().hex[:10]}"
        model = RecordingModel(name, tmp_path / f"{name}.log", delay_s)
        install_model(
            layout,
            triton,
            name,
            config=SLOW_CONFIG,
            model_py=RECORDING_MODEL.format(log=str(model.log), delay_s=delay_s),
        )
        return model

    return install
