"""What the gRPC proxy sends Triton, seen on a recording TCP pipe between them; Triton going away.

The proxy's ``--triton-grpc`` points at the pipe, which forwards to the session's real Triton.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.proxy.conftest import ServedModels
from tests.proxy.test_grpc import identity_input, infer_request, raw_call, raw_status
from tests.proxy.wire import TcpPipe, client_streams
from tests.support.ports import free_port
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.proxy import http2
from tritonshare.proxy.policy import GRPC_SERVICE

pytestmark = pytest.mark.triton

StartProxy = Callable[..., ProxyProcess]


def behind_pipe(
    start_proxy: StartProxy,
    triton: TritonServer,
    model: str,
    tmp_path: Path,
    *extra: str,
    record: bool = False,
    pipe_up: bool = True,
) -> tuple[ProxyProcess, int, TcpPipe | None]:
    """A proxy whose Triton gRPC address is a local port; a pipe to the real Triton listens there
    unless ``pipe_up`` is False (then nothing listens: Triton is "down")."""
    port = free_port()
    target = TritonServer(
        repository=tmp_path, log_path=tmp_path / "unused.log", http_port=triton.http_port, grpc_port=port
    )
    pipe = TcpPipe(port, ("127.0.0.1", triton.grpc_port), record=record) if pipe_up else None
    return start_proxy(model, "--no-unload", *extra, server=target), port, pipe


@pytest.fixture
def pipes() -> Iterator[list[TcpPipe]]:
    opened: list[TcpPipe] = []
    yield opened
    for pipe in opened:
        pipe.close()


def test_refused_calls_never_reach_triton(
    start_proxy: StartProxy,
    triton: TritonServer,
    served_models: ServedModels,
    tmp_path: Path,
    pipes: list[TcpPipe],
) -> None:
    proxy, _, pipe = behind_pipe(start_proxy, triton, served_models.own, tmp_path, record=True)
    assert pipe is not None
    pipes.append(pipe)
    data = np.arange(4, dtype=np.float32)
    other = infer_request(served_models.other, data).SerializeToString()
    own = infer_request(served_models.own, data).SerializeToString()
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        assert raw_status(channel, f"/{GRPC_SERVICE}/RepositoryIndex")[0] == grpc.StatusCode.PERMISSION_DENIED
        assert raw_status(channel, f"/{GRPC_SERVICE}/Unknown")[0] == grpc.StatusCode.UNIMPLEMENTED
        assert raw_call(channel, f"/{GRPC_SERVICE}/ServerReady") == b"\x08\x01"
        assert raw_status(channel, f"/{GRPC_SERVICE}/ModelInfer", other)[0] == grpc.StatusCode.NOT_FOUND
        raw_call(channel, f"/{GRPC_SERVICE}/ModelInfer", own)
    time.sleep(0.2)  # let the pipe's threads record the last bytes

    streams = [s for sent in pipe.sent for s in client_streams(bytes(sent)).values() if s.headers]
    assert [s.headers[":path"] for s in streams] == [f"/{GRPC_SERVICE}/ModelInfer"] * 2
    refused, served = streams
    # The refused message was never complete at Triton, and its stream was cancelled there.
    assert len(refused.data) < 5 + len(other) and not refused.end_stream
    assert refused.reset_code == http2.CANCEL
    assert bytes(served.data) == b"\x00" + len(own).to_bytes(4, "big") + own and served.end_stream

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5).read().decode()
    assert 'protocol="grpc",reason="denied",route="RepositoryIndex"' in metrics
    assert 'protocol="grpc",reason="other_model",route="ModelInfer"' in metrics


def test_stripped_headers_never_reach_triton(
    start_proxy: StartProxy,
    triton: TritonServer,
    served_models: ServedModels,
    tmp_path: Path,
    pipes: list[TcpPipe],
) -> None:
    # e.g. the key of Triton's --grpc-restricted-protocol: tenants must not present it
    proxy, _, pipe = behind_pipe(
        start_proxy, triton, served_models.own, tmp_path, "--strip-header", "X-Admin-Key", record=True
    )
    assert pipe is not None
    pipes.append(pipe)
    data = np.arange(4, dtype=np.float32)
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        for _ in range(2):
            result = client.infer(
                served_models.own, [identity_input(data)], headers={"x-admin-key": "secret", "x-request-tag": "kept"}
            )
            assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    time.sleep(0.2)
    streams = [s for sent in pipe.sent for s in client_streams(bytes(sent)).values() if s.headers]
    assert len(streams) == 2
    for stream in streams:
        assert "x-admin-key" not in stream.headers
        assert stream.headers["x-request-tag"] == "kept"


def test_the_bearer_token_is_checked_and_never_reaches_triton(
    start_proxy: StartProxy,
    triton: TritonServer,
    served_models: ServedModels,
    tmp_path: Path,
    pipes: list[TcpPipe],
) -> None:
    """The tenant's token is for the proxy, not for the Triton every tenant shares (REST strips it too); the
    client's repeated header blocks, re-encoded, keep working call after call."""
    tokens = tmp_path / "tokens"
    tokens.write_text("token-one\n")
    proxy, _, pipe = behind_pipe(
        start_proxy, triton, served_models.own, tmp_path, "--auth-token-file", str(tokens), record=True
    )
    assert pipe is not None
    pipes.append(pipe)
    data = np.arange(4, dtype=np.float32)
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        for _ in range(3):
            result = client.infer(
                served_models.own,
                [identity_input(data)],
                headers={"authorization": "Bearer token-one", "x-request-tag": "kept"},
            )
            assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    time.sleep(0.2)
    streams = [s for sent in pipe.sent for s in client_streams(bytes(sent)).values() if s.headers]
    assert len(streams) == 3
    for stream in streams:
        assert "authorization" not in stream.headers
        assert stream.headers["x-request-tag"] == "kept"


def test_triton_down_answers_unavailable_quickly_and_recovers(
    start_proxy: StartProxy,
    triton: TritonServer,
    served_models: ServedModels,
    tmp_path: Path,
    pipes: list[TcpPipe],
) -> None:
    proxy, port, _ = behind_pipe(start_proxy, triton, served_models.own, tmp_path, pipe_up=False)
    data = np.arange(4, dtype=np.float32)
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(InferenceServerException) as info:
                client.infer(served_models.own, [identity_input(data)], client_timeout=10)
            assert str(info.value.status()) == "StatusCode.UNAVAILABLE"
            assert "Triton is not reachable" in str(info.value.message())
            assert time.monotonic() - started < 1.0
    pipes.append(TcpPipe(port, ("127.0.0.1", triton.grpc_port)))  # Triton is back
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        result = client.infer(served_models.own, [identity_input(data)], client_timeout=10)
    assert np.array_equal(result.as_numpy("OUTPUT0"), data)


def test_triton_down_is_said_only_to_a_caller_with_a_valid_token(
    start_proxy: StartProxy, triton: TritonServer, served_models: ServedModels, tmp_path: Path
) -> None:
    """Found after the connection opened, Triton down is no reason to skip the token check (REST answers 401
    before it tries Triton): unlike a connection turned away from the start, which hears why first."""
    tokens = tmp_path / "tokens"
    tokens.write_text("token-one\n")
    proxy, _, _ = behind_pipe(
        start_proxy, triton, served_models.own, tmp_path, "--auth-token-file", str(tokens), pipe_up=False
    )
    data = np.arange(4, dtype=np.float32)
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        answers = []
        for headers in (None, {"authorization": "Bearer token-one"}):
            with pytest.raises(InferenceServerException) as info:
                client.infer(served_models.own, [identity_input(data)], headers=headers, client_timeout=10)
            answers.append((str(info.value.status()), str(info.value.message())))
    assert answers[0] == ("StatusCode.UNAUTHENTICATED", "missing or invalid bearer token")
    assert answers[1][0] == "StatusCode.UNAVAILABLE" and "Triton is not reachable" in answers[1][1]


def test_losing_triton_mid_stream_ends_the_call_at_once(
    start_proxy: StartProxy,
    triton: TritonServer,
    served_models: ServedModels,
    tmp_path: Path,
    pipes: list[TcpPipe],
) -> None:
    proxy, _, pipe = behind_pipe(start_proxy, triton, served_models.stream, tmp_path)
    assert pipe is not None
    pipes.append(pipe)
    events: Queue[object] = Queue()
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        client.start_stream(callback=lambda result, error: events.put(error if error is not None else result))
        client.async_stream_infer(served_models.stream, [identity_input(np.ones(2, np.float32))])
        assert not isinstance(events.get(timeout=10), InferenceServerException)
        assert not isinstance(events.get(timeout=10), InferenceServerException)
        pipe.cut()
        started = time.monotonic()
        error = events.get(timeout=10)
        assert isinstance(error, InferenceServerException)
        assert time.monotonic() - started < 2.0
        client.stop_stream()


def test_a_stream_in_flight_finishes_after_sigterm(start_proxy: StartProxy, served_models: ServedModels) -> None:
    proxy = start_proxy(served_models.stream, "--no-unload", "--drain-timeout-s", "20")
    events: Queue[object] = Queue()
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        client.start_stream(callback=lambda result, error: events.put(error if error is not None else result))
        client.async_stream_infer(served_models.stream, [identity_input(np.array([1.0], np.float32))])
        assert float(events.get(timeout=10).as_numpy("OUTPUT0")[0]) == 1.0  # type: ignore[attr-defined]
        assert proxy.process is not None
        proxy.process.send_signal(15)
        time.sleep(0.5)  # GOAWAY has reached the client; the open stream goes on
        client.async_stream_infer(served_models.stream, [identity_input(np.array([2.0, 3.0], np.float32))])
        outputs = [events.get(timeout=10) for _ in range(2)]
        assert [float(o.as_numpy("OUTPUT0")[0]) for o in outputs] == [2.0, 3.0]  # type: ignore[attr-defined]
        with pytest.raises(InferenceServerException):  # no new calls: the proxy stopped accepting
            client.is_model_ready(served_models.stream)
        client.stop_stream()
    assert proxy.process.wait(timeout=30) == 0
