"""``--max-connections`` against the real Triton: one connection past the cap is told why in its protocol's words
(REST 503 with Retry-After, gRPC UNAVAILABLE) and closed, is counted, takes no place; once a
connection closes, a new one is served."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.proxy.conftest import ServedModels
from tests.proxy.test_metrics import _samples
from tests.proxy.test_rest import Raw
from tests.support.proxy import ProxyProcess

pytestmark = pytest.mark.triton

LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"


def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _metric(proxy: ProxyProcess, name: str, **labels: str) -> float:
    found = [v for n, lab, v in _samples(proxy) if n == name and labels.items() <= lab.items()]
    return sum(found)


def _served(port: int) -> bool:
    with Raw(port) as raw:
        return raw.send(LIVE).response()[0] == 200


def test_a_rest_connection_past_the_cap_gets_503_and_takes_no_place(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    proxy = start_proxy(served_models.own, "--max-connections", "2")
    port = proxy.http_port
    with Raw(port) as first, Raw(port) as second:
        for raw in (first, second):
            assert raw.send(LIVE).response()[0] == 200
        for _ in range(3):  # turned away ones do not count: the next is turned away too
            with Raw(port) as extra:
                status, headers, body = extra.send(LIVE).response()
                assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
                message = json.loads(body)["error"]
                assert f"model '{served_models.own}'" in message and "maximum of 2 client connections" in message
                assert "--max-connections" in message
                assert extra.closed_by_peer()
        assert first.send(LIVE).response()[0] == 200  # the two held ones are served on
        assert _metric(proxy, "tritonshare_proxy_client_connections", protocol="rest") == 2
        assert _metric(proxy, "tritonshare_proxy_refusals_total", reason="too_many_connections") == 3
        second.file.close()  # (the socket's file keeps it open)
        second.sock.close()
        _until(lambda: _served(port))  # the proxy saw it close: its place is free


def test_a_grpc_connection_past_the_cap_is_answered_unavailable_and_takes_no_place(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    proxy = start_proxy(served_models.own, "--max-connections", "2")
    address = ("127.0.0.1", proxy.grpc_port)
    held = [socket.create_connection(address, timeout=10) for _ in range(2)]  # silent ones count too
    try:
        _until(lambda: _metric(proxy, "tritonshare_proxy_client_connections", protocol="grpc") == 2)
        client = grpcclient.InferenceServerClient(proxy.grpc_url)
        try:
            for _ in range(2):
                with pytest.raises(grpcclient.InferenceServerException) as refused:
                    client.is_server_live(client_timeout=10)
                assert refused.value.status() == "StatusCode.UNAVAILABLE"
                message = refused.value.message() or ""
                assert "maximum of 2 client connections (--max-connections)" in message
            refusals = {"protocol": "grpc", "route": "ServerLive", "reason": "too_many_connections"}
            assert _metric(proxy, "tritonshare_proxy_refusals_total", **refusals) == 2
            held.pop().close()
            _until(lambda: _metric(proxy, "tritonshare_proxy_client_connections", protocol="grpc") == 1)
            inp = grpcclient.InferInput("INPUT0", [2], "FP32")
            inp.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
            _until(lambda: _infers(client, served_models.own, inp))  # the client reconnects after its backoff
        finally:
            client.close()
        _until(lambda: _metric(proxy, "tritonshare_proxy_client_connections", protocol="grpc") == 1)
    finally:
        for sock in held:
            sock.close()


def test_a_grpc_connection_past_the_cap_is_answered_unavailable_before_its_token_is_asked_for(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels, tmp_path: Path
) -> None:
    """With --auth-token-file, a call without a token past the cap was answered UNAUTHENTICATED, hiding the cap
    (REST answers the connection 503 before reading any request): the connection is turned away as a whole."""
    tokens = tmp_path / "tokens"
    tokens.write_text("token-one\n")
    proxy = start_proxy(served_models.own, "--max-connections", "1", "--auth-token-file", str(tokens))
    with _a_place_held(proxy):
        with grpc.insecure_channel(proxy.grpc_url) as channel, pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata")(b"", timeout=10)
        error = cast(grpc.Call, info.value)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "maximum of 1 client connections (--max-connections)" in (error.details() or "")
        refusals = {"protocol": "grpc", "route": "ModelMetadata", "reason": "too_many_connections"}
        assert _metric(proxy, "tritonshare_proxy_refusals_total", **refusals) == 1
        assert _metric(proxy, "tritonshare_proxy_auth_refused_total") == 0


def _a_place_held(proxy: ProxyProcess) -> socket.socket:
    """A silent gRPC connection holding a place, once the proxy counts it."""
    sock = socket.create_connection(("127.0.0.1", proxy.grpc_port), timeout=10)
    _until(lambda: _metric(proxy, "tritonshare_proxy_client_connections", protocol="grpc") == 1, 5.0)
    return sock


def _infers(client: grpcclient.InferenceServerClient, model: str, inp: grpcclient.InferInput) -> bool:
    try:
        result = client.infer(model, [inp], client_timeout=10)
    except grpcclient.InferenceServerException:
        return False
    return bool(result.as_numpy("OUTPUT0").tolist() == [1.0, 2.0])
