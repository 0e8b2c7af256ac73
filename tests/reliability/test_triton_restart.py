"""Triton restarts under a serving proxy: while Triton is away, every request through the proxy — REST on a
kept-alive connection, gRPC on one long-lived channel — is answered at once with 503 / UNAVAILABLE (none hangs),
the proxy's readiness (REST ``/v2/health/ready``, gRPC ``ServerReady``) is false; once Triton is back and has
loaded the model again from the repository, the same proxy process and the same client connections serve again.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.support.install import wait_model_ready
from tests.support.models import write_model
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.proxy.policy import GRPC_SERVICE

pytestmark = [pytest.mark.triton, pytest.mark.slow]

OUTAGE_S = 3.0  # how long Triton stays down
ANSWER_S = 1.0  # every request during the outage is answered within this
RECOVERY_S = 3.0  # after Triton has the model READY again, the proxy serves within this
REST_BODY = b'{"inputs":[{"name":"INPUT0","shape":[2],"datatype":"FP32","data":[1.0,2.0]}]}'


@dataclass
class Calls:
    """(start, end, protocol, outcome) of every call; outcome "ok" or a status."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    seen: list[tuple[float, float, str, str]] = field(default_factory=list)

    def add(self, start: float, protocol: str, outcome: str) -> None:
        with self.lock:
            self.seen.append((start, time.monotonic(), protocol, outcome))

    def between(self, start: float, end: float) -> list[tuple[float, float, str, str]]:
        with self.lock:
            return [c for c in self.seen if start <= c[0] < end]


def rest_worker(port: int, model: str, stop: threading.Event, calls: Calls) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        started = time.monotonic()
        try:
            conn.request("POST", f"/v2/models/{model}/infer", REST_BODY)
            response = conn.getresponse()
            response.read()
            calls.add(started, "rest", "ok" if response.status == 200 else str(response.status))
            if response.will_close:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            calls.add(started, "rest", type(exc).__name__)
            conn.close()
        time.sleep(0.02)
    conn.close()


def grpc_worker(url: str, model: str, stop: threading.Event, calls: Calls) -> None:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
    request.raw_input_contents.append(np.array([1.0, 2.0], dtype=np.float32).tobytes())
    with grpc.insecure_channel(url) as channel:  # one channel for the whole test, as a client keeps it
        infer = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")
        while not stop.is_set():
            started = time.monotonic()
            try:
                infer(request.SerializeToString(), timeout=30)
                calls.add(started, "grpc", "ok")
            except grpc.RpcError as exc:
                calls.add(started, "grpc", str(exc.code().name))
            time.sleep(0.02)


def rest_ready(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status
    finally:
        conn.close()


def grpc_ready(url: str) -> str:
    with grpc.insecure_channel(url) as channel:
        call = channel.unary_unary(
            f"/{GRPC_SERVICE}/ServerReady", response_deserializer=pb.ServerReadyResponse.FromString
        )
        try:
            return "ready" if call(pb.ServerReadyRequest().SerializeToString(), timeout=5).ready else "not ready"
        except grpc.RpcError as exc:
            return str(exc.code().name)


@pytest.fixture
def own_triton(tmp_path: Path) -> Iterator[TritonServer]:
    """A Triton of this test's own (it gets killed), polling a repository that holds one identity model."""
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    write_model(tmp_path / "models" / "restarted")
    server = start(TritonServer(repository=tmp_path / "models", log_path=tmp_path / "triton.log"))
    wait_model_ready(server, "restarted")
    yield server
    server.kill()


def start(server: TritonServer, attempts: int = 3) -> TritonServer:
    """Start (or restart, on the same ports) Triton, again if it dies while starting: its Python backend on this
    kind of machine now and then aborts at model start-up (boost::interprocess::lock_exception), which is not the
    fault under test."""
    for attempt in range(attempts):
        try:
            return server.start()
        except RuntimeError:
            if attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def proxy(own_triton: TritonServer, tmp_path: Path) -> Iterator[ProxyProcess]:
    layout = NodeLayout(repository=own_triton.repository, staging=tmp_path / "staging")
    process = ProxyProcess("restarted", own_triton, layout, tmp_path / "proxy.log", ["--no-unload"]).start()
    yield process
    process.stop()


def test_a_killed_triton_leaves_no_python_backend_regions_behind(own_triton: TritonServer) -> None:
    """SIGKILLed, Triton's Python backend stubs leave their /dev/shm regions for good (hundreds in a run of the
    suite); the servers of the tests are started with a prefix of their own for those regions, removed with them."""
    regions = own_triton.regions()
    assert regions, f"no region {own_triton.shm_prefix}* in /dev/shm: the prefix did not reach the Python backend"
    own_triton.kill()
    assert [r.name for r in regions if r.exists()] == []


def test_the_proxy_answers_at_once_while_triton_is_away_and_serves_again_when_it_is_back(
    own_triton: TritonServer, proxy: ProxyProcess
) -> None:
    stop, calls = threading.Event(), Calls()
    workers = [
        threading.Thread(target=rest_worker, args=(proxy.http_port, "restarted", stop, calls)),
        threading.Thread(target=grpc_worker, args=(proxy.grpc_url, "restarted", stop, calls)),
    ]
    for worker in workers:
        worker.start()
    try:
        time.sleep(1.0)
        killed = time.monotonic()
        own_triton.kill()
        time.sleep(ANSWER_S + 0.5)  # the readiness cache (1 s) has expired
        away = (rest_ready(proxy.http_port), grpc_ready(proxy.grpc_url))
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed)))
        restarted = time.monotonic()
        start(own_triton)  # same ports, same repository: Triton loads the model again
        wait_model_ready(own_triton, "restarted")
        back = time.monotonic()
        time.sleep(RECOVERY_S)
        after = (rest_ready(proxy.http_port), grpc_ready(proxy.grpc_url))
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)

    before = calls.between(0, killed - 0.1)
    assert before and all(c[3] == "ok" for c in before), before[-5:]
    outage = calls.between(killed + 0.1, restarted)
    assert {c[2] for c in outage} == {"rest", "grpc"}
    assert {c[3] for c in outage} <= {"503", "UNAVAILABLE"}, {c[3] for c in outage}
    slowest = max(c[1] - c[0] for c in outage)
    assert slowest < ANSWER_S, f"a request took {slowest:.2f}s to be refused while Triton was away"
    assert away[0] != 200 and away[1] != "ready", away
    settled = calls.between(back + RECOVERY_S - 1.0, time.monotonic())
    assert {c[2] for c in settled} == {"rest", "grpc"}
    assert all(c[3] == "ok" for c in settled), settled[:5]
    assert after == (200, "ready")
    recovered = {p: min(c[1] for c in calls.between(back, time.monotonic()) if c[2] == p and c[3] == "ok") - back
                 for p in ("rest", "grpc")}  # fmt: skip
    print(
        f"\nTriton away {restarted - killed:.1f}s: {len(outage)} requests refused "
        f"({sorted({c[3] for c in outage})}), slowest refusal {slowest * 1000:.0f} ms; readiness while away "
        f"REST {away[0]}, gRPC {away[1]}; first success after the model was READY again: "
        f"REST {recovered['rest']:.2f}s, gRPC {recovered['grpc']:.2f}s"
    )
    assert proxy.process is not None and proxy.process.poll() is None  # the same proxy, never restarted
