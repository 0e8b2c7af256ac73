"""A flood of probes through a tenant's proxy, counted where it matters: at "Triton". The probes need no token
and take no admission slot (the kubelet sends none), so each one the proxy forwarded was free load on the node's
SHARED Triton: 60k liveness calls a second through one tenant's proxy took another tenant's p99 from 2 ms to
140-220 ms. The proxy answers them from what it keeps of Triton's answer, asked at most once a second.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.proxy.test_rest import Raw
from tests.reliability.conftest import Hostile
from tritonshare.proxy.policy import GRPC_SERVICE, HEALTH_SERVICE

FLOOD = 2000  # requests per probe
ASKED = {"/v2/health/live", "/v2/models/tenant-own/ready"}  # what the proxy asks Triton for the probes


def questions(hostile: Hostile, since: int) -> dict[str, int]:
    """The probe questions that reached Triton's REST port since ``since``, by path."""
    reached: dict[str, int] = {}
    for seen in hostile.rest.seen[since:]:
        reached[seen.path] = reached.get(seen.path, 0) + 1
    return reached


def at_most(seconds: float) -> int:
    """Questions a probe kept for 1 s may cost in ``seconds``: one per second begun, and one more."""
    return int(seconds) + 2


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready"])
def test_a_rest_probe_flood_reaches_triton_about_once_a_second(hostile: Hostile, path: str) -> None:
    since, started = len(hostile.rest.seen), time.monotonic()
    with Raw(hostile.proxy.http_port) as raw:
        raw.send(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * FLOOD)  # pipelined: as fast as it goes
        statuses = [raw.response()[0] for _ in range(FLOOD)]
    elapsed = time.monotonic() - started
    assert statuses == [200] * FLOOD  # the stand-in says yes to everything
    reached = questions(hostile, since)
    assert set(reached) <= ASKED, reached
    assert sum(reached.values()) <= at_most(elapsed), f"{FLOOD} probes in {elapsed:.1f}s reached Triton: {reached}"


@pytest.mark.parametrize(
    ("method", "answer"),
    [
        (f"/{GRPC_SERVICE}/ServerLive", pb.ServerLiveResponse(live=True).SerializeToString()),
        (f"/{GRPC_SERVICE}/ServerReady", pb.ServerReadyResponse(ready=True).SerializeToString()),
        (f"/{HEALTH_SERVICE}/Check", b"\x08\x01"),  # HealthCheckResponse{status: SERVING}
    ],
)
def test_a_grpc_probe_flood_never_reaches_triton_s_grpc_port(hostile: Hostile, method: str, answer: bytes) -> None:
    grpc_since, rest_since, started = len(hostile.grpc.seen), len(hostile.rest.seen), time.monotonic()
    with grpc.insecure_channel(hostile.proxy.grpc_url) as channel:
        probe = channel.unary_unary(method)  # each request is an empty message
        with ThreadPoolExecutor(8) as pool:  # many streams at once on one connection
            answers = list(pool.map(lambda _: probe(b"", timeout=10), range(FLOOD // 4)))
    elapsed = time.monotonic() - started
    assert set(answers) == {answer}
    assert hostile.grpc.seen[grpc_since:] == []  # never forwarded
    reached = questions(hostile, rest_since)
    assert set(reached) <= ASKED, reached
    assert sum(reached.values()) <= at_most(elapsed), f"{FLOOD // 4} calls in {elapsed:.1f}s reached Triton: {reached}"
