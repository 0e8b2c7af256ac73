"""SIGTERM under load: in-flight REST and gRPC requests finish, the model is unloaded, exit 0."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support.install import install_model, model_ready
from tests.support.models import SLOW_CONFIG, SLOW_MODEL, SLOW_MODEL_DELAY_S
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
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
