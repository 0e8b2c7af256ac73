"""SIGTERM under load: in-flight REST and gRPC requests finish, the model is unloaded, exit 0; an unload that
fails is the proxy's exit code, and its reason the termination message."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support.install import install_model, model_ready, wait_model_ready
from tests.support.models import SLOW_CONFIG, SLOW_MODEL, SLOW_MODEL_DELAY_S, write_model
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode
from tritonshare.common.layout import NodeLayout


@dataclass
class Outcomes:
    lock: threading.Lock = field(default_factory=threading.Lock)
    results: list[tuple[float, float, str, str]] = field(default_factory=list)  # start, end, protocol, error

    def add(self, start: float, protocol: str, error: str) -> None:
        with self.lock:
            self.results.append((start, time.monotonic(), protocol, error))


def _rest_worker(url: str, model: str, stop: threading.Event, out: Outcomes) -> None:
    client = httpclient.InferenceServerClient(url, network_timeout=30)
    data = np.arange(8, dtype=np.float32)
    while not stop.is_set():
        inp = httpclient.InferInput("INPUT0", [8], "FP32")
        inp.set_data_from_numpy(data)
        start = time.monotonic()
        try:
            got = client.infer(model, [inp]).as_numpy("OUTPUT0")
            out.add(start, "rest", "" if np.array_equal(got, data) else "wrong output")
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and judged below
            out.add(start, "rest", repr(exc))
            time.sleep(0.05)
    client.close()


def _grpc_worker(url: str, model: str, stop: threading.Event, out: Outcomes) -> None:
    client = grpcclient.InferenceServerClient(url)
    data = np.arange(8, dtype=np.float32)
    while not stop.is_set():
        inp = grpcclient.InferInput("INPUT0", [8], "FP32")
        inp.set_data_from_numpy(data)
        start = time.monotonic()
        try:
            got = client.infer(model, [inp], client_timeout=30).as_numpy("OUTPUT0")
            out.add(start, "grpc", "" if np.array_equal(got, data) else "wrong output")
        except Exception as exc:  # noqa: BLE001
            out.add(start, "grpc", repr(exc))
            time.sleep(0.05)
    client.close()


def test_sigterm_under_load_drains_then_unloads(
    triton: TritonServer, layout: NodeLayout, start_proxy: Callable[..., ProxyProcess], model_name: str
) -> None:
    install_model(layout, triton, model_name, config=SLOW_CONFIG, model_py=SLOW_MODEL)
    proxy = start_proxy(model_name, "--drain-timeout-s", "20", "--unload-timeout-s", "30")
    stop, out = threading.Event(), Outcomes()
    workers = [
        threading.Thread(target=fn, args=(url, model_name, stop, out))
        for fn, url in [(_rest_worker, proxy.url)] * 4 + [(_grpc_worker, proxy.grpc_url)] * 4
    ]
    for w in workers:
        w.start()
    time.sleep(3 * SLOW_MODEL_DELAY_S + 1.0)  # every worker has requests in flight
    signalled = time.monotonic()
    proxy.process.send_signal(15)  # type: ignore[union-attr]
    code = proxy.process.wait(timeout=90)  # type: ignore[union-attr]
    stop.set()
    for w in workers:
        w.join(timeout=60)

    before = [r for r in out.results if r[0] < signalled]
    failed_before = [r for r in before if r[3]]
    assert {r[2] for r in before} == {"rest", "grpc"}
    assert len(before) >= 8
    assert failed_before == [], failed_before[:5]
    # some requests were really in flight at the signal and finished after it
    assert any(r[0] < signalled < r[1] for r in before)
    assert code == 0, proxy.log_text()[-3000:]
    assert not layout.model_dir(model_name).exists()
    assert not model_ready(triton, model_name)


def test_an_unload_triton_still_serves_past_its_timeout_is_exit_13_with_the_reason(tmp_path: Path) -> None:
    """The proxy exited 0 whatever its unload came to: a model Triton went on serving, left LOADING, or a Triton
    that did not answer looked like a clean stop in the pod status. (Here a Triton of its own that polls its
    repository once an hour: it serves the model long after its folder went.)"""
    layout = node(tmp_path)
    write_model(layout.model_dir("kept"))
    server = TritonServer(repository=layout.repository, log_path=tmp_path / "triton.log", poll_secs=3600).start()
    try:
        wait_model_ready(server, "kept")
        proxy = ProxyProcess("kept", server, layout, tmp_path / "proxy.log", ["--unload-timeout-s", "1"]).start()
        try:
            code = proxy.terminate()
        finally:
            proxy.stop()
        assert model_ready(server, "kept")
    finally:
        server.kill()
    assert code == ExitCode.READINESS_TIMEOUT, proxy.log_text()[-3000:]
    assert "Triton still serves kept 1s after its folder was removed" in proxy.termination_log.read_text()
    assert not layout.model_dir("kept").exists()


def test_an_unload_triton_does_not_answer_is_exit_16_with_the_reason(tmp_path: Path) -> None:
    layout = node(tmp_path)
    write_model(layout.model_dir("m"))
    gone = TritonServer(repository=layout.repository, log_path=tmp_path / "none.log")  # never started
    proxy = ProxyProcess("m", gone, layout, tmp_path / "proxy.log", ["--unload-timeout-s", "0.5"]).start()
    try:
        assert proxy.terminate() == ExitCode.TRITON_UNAVAILABLE
    finally:
        proxy.stop()
    assert f"stays in the repository: Triton at {gone.url} does not answer" in proxy.termination_log.read_text()
    assert layout.model_dir("m").is_dir()  # Triton may be starting up, loading it: left for gc


def node(root: Path) -> NodeLayout:
    layout = NodeLayout(repository=root / "models", staging=root / "staging", leases=root / "leases")
    layout.repository.mkdir()
    layout.staging.mkdir()
    return layout
