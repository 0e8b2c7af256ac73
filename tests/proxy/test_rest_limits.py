"""Limits of the REST front end against the real Triton: a request body that stops coming is timed out and gives
back its admission slot; a header Triton would not take is refused here (431), not forwarded into a 502;
an upload the proxy still holds for its check when SIGTERM comes is completed, not cut; a body over
``--max-body-bytes`` never reaches Triton whole."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from tests.proxy.conftest import RecordingModel, ServedModels
from tests.proxy.test_rest import LocalRest, Raw, error_of, infer_body, infer_head, request
from tests.proxy.wire import TcpPipe
from tests.support.ports import free_port
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.proxy.http1 import MAX_FIELD_BYTES
from tritonshare.proxy.settings import ProxySettings

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("forwarded", [False, True], ids=["held-for-the-check", "streaming-to-triton"])
def test_a_stalled_request_body_is_timed_out_and_gives_back_its_slot(
    triton: TritonServer, served_models: ServedModels, forwarded: bool
) -> None:
    """Regression: with ``--max-inflight 1``, one client that sent a head and part of its body held the only slot
    for as long as it kept the connection open (the head timeout stopped once a request began)."""
    own = served_models.own
    settings = ProxySettings(name=own, triton_url=triton.url, host="127.0.0.1", http_port=0, max_inflight=1)
    body = infer_body([1.0, 2.0])
    # Raw binary (Inference-Header-Content-Length: 0) is not held: Triton gets the head and the first bytes.
    binary = b"Inference-Header-Content-Length: 0\r\n" if forwarded else b""
    stalled_request = infer_head(own, 1000).replace(b"\r\n\r\n", b"\r\n" + binary + b"\r\n") + body[:10]
    with LocalRest(settings, header_timeout_s=1.0) as local, Raw(local.port) as stalled, Raw(local.port) as other:
        stalled.send(stalled_request)
        time.sleep(0.3)
        started = time.monotonic()
        status, _, answer = other.send(infer_head(own, len(body)) + body).response()
        waited = time.monotonic() - started
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [1.0, 2.0]
        assert 0.5 < waited < 4, f"the second request waited {waited:.1f} s for the stalled one's slot"
        status, headers, answer = stalled.response()
        assert status == 408 and headers["connection"] == "close"
        assert "no byte of it for 1 s" in error_of(answer)
        assert stalled.closed_by_peer()
        assert local.call(lambda: local.state.admission.idle)


def test_a_slow_body_that_keeps_coming_is_not_timed_out(triton: TritonServer, served_models: ServedModels) -> None:
    own = served_models.own
    settings = ProxySettings(name=own, triton_url=triton.url, host="127.0.0.1", http_port=0)
    body = infer_body([3.0])
    with LocalRest(settings, header_timeout_s=1.0) as local, Raw(local.port) as slow:
        slow.send(infer_head(own, len(body)))
        for i in range(0, len(body), len(body) // 5 + 1):  # 2.5 s in all, a piece every 0.5 s
            time.sleep(0.5)
            slow.send(body[i : i + len(body) // 5 + 1])
        status, _, answer = slow.response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [3.0]


def _upstream_errors(proxy: ProxyProcess) -> str:
    text = request(proxy.metrics_port, "GET", "/metrics")[1].decode()
    return "\n".join(line for line in text.splitlines() if line.startswith("tritonshare_proxy_upstream_errors"))


def _triton_answers(triton: TritonServer, line: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", triton.http_port), timeout=10) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n\r\n")
        try:
            return sock.recv(100)
        except ConnectionResetError:
            return b""


def test_a_header_longer_than_triton_takes_is_431_not_a_502(proxy: ProxyProcess, triton: TritonServer) -> None:
    """Regression: a 30 KB header line (under the 64 KiB head limit) was forwarded, Triton closed the connection,
    and the tenant got a 502 while the proxy logged Triton as unavailable and counted an upstream error."""
    longest = b"X-Big: " + b"a" * MAX_FIELD_BYTES
    assert _triton_answers(triton, longest).startswith(b"HTTP/1.1 200")  # the limit is Triton's own
    assert _triton_answers(triton, longest + b"a") == b""
    errors = _upstream_errors(proxy)
    with Raw(proxy.http_port) as conn:
        conn.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + longest + b"\r\n\r\n")
        assert conn.response()[0] == 200
        conn.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 30_000 + b"\r\n\r\n")
        status, headers, body = conn.response()
        assert status == 431 and headers["connection"] == "close"
        assert error_of(body) == (
            f"header 'X-Big': its name or value is longer than {MAX_FIELD_BYTES} bytes (Triton's limit)"
        )
    assert _upstream_errors(proxy) == errors
    assert "answering 503" not in proxy.log_text()


def _probe_head_of(size: int) -> bytes:
    """A readiness probe whose head (request line and header lines, before the blank line) is ``size`` bytes."""
    head = b"GET /v2/health/live HTTP/1.1\r\nHost: x"
    while len(head) < size:
        line = b"\r\nX-Pad: "
        head += line + b"a" * min(8000, size - len(head) - len(line))
    assert len(head) == size
    return head


@pytest.mark.timeout(30)
@pytest.mark.parametrize("split", [0, 1, 2, 3], ids=["whole", "blank-line-split-1", "split-2", "split-3"])
def test_a_head_of_exactly_max_header_bytes_is_served_and_one_byte_more_is_431(proxy: ProxyProcess, split: int) -> None:
    """Regression (split): a head of exactly the limit whose blank line came in two reads was 431 — what came
    before the blank line's last bytes was held to the head's limit, blank line included."""
    limit = ProxySettings.max_header_bytes
    head = _probe_head_of(limit) + b"\r\n\r\n"
    with Raw(proxy.http_port) as conn:
        if split:
            conn.send(head[:-split])
            time.sleep(0.3)  # read by the proxy on its own
        assert conn.send(head[len(head) - split if split else 0 :]).response()[0] == 200
        status, headers, body = conn.send(_probe_head_of(limit + 1) + b"\r\n\r\n").response()
        assert status == 431 and headers["connection"] == "close"
        assert error_of(body) == f"request head larger than {limit} bytes"


@pytest.mark.timeout(30)  # a head kept waiting for its end would wait here for ever
def test_a_head_that_never_ends_is_431_once_past_max_header_bytes_and_its_blank_line(proxy: ProxyProcess) -> None:
    limit = ProxySettings.max_header_bytes
    with Raw(proxy.http_port) as conn:
        status, headers, body = conn.send(_probe_head_of(limit + 4)).response()  # no blank line, ever
        assert status == 431 and headers["connection"] == "close"
        assert error_of(body) == f"request head larger than {limit} bytes"
        assert conn.closed_by_peer()


def test_an_upload_held_for_its_check_at_sigterm_is_completed(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """Regression: the drain counted only requests forwarded to Triton; a JSON body still arriving (held for the
    shared-memory check) was not, so the proxy said "no request in flight" and closed the connection under it."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--drain-timeout-s", "10")
    body = infer_body([5.0, 6.0])
    with Raw(proxy.http_port) as conn:
        conn.send(infer_head(own, len(body)) + body[:20])
        time.sleep(0.3)
        proxy.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        time.sleep(0.5)
        status, headers, answer = conn.send(body[20:]).response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [5.0, 6.0]
        assert headers["connection"] == "close"
    # The one SIGTERM above ends it: a second one (terminate()) could land after the event loop has closed and
    # given the signal its default action back, and the exit code would be the signal's, not the proxy's.
    assert proxy.process.wait(timeout=15) == 0  # type: ignore[union-attr]
    assert "drained: no request in flight" in proxy.log_text()


def test_a_head_held_for_its_body_at_sigterm_is_completed(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """Regression: a head judged before that came alone was held for its body (the short path) without counting
    as held, so a SIGTERM then found nothing in flight and the proxy exited under the client about to send it."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--drain-timeout-s", "10")
    body = infer_body([5.0, 6.0])
    head = infer_head(own, len(body))
    with Raw(proxy.http_port) as conn:
        assert conn.send(head + body).response()[0] == 200  # the head judged
        conn.send(head)
        time.sleep(0.1)
        proxy.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        time.sleep(0.5)
        status, headers, answer = conn.send(body).response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [5.0, 6.0]
        assert headers["connection"] == "close"
    assert proxy.process.wait(timeout=15) == 0  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_requests_pipelined_behind_one_at_triton_are_read_only_up_to_a_bound(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    """A client that pipelines without end while its request is at Triton is not read into the proxy's memory:
    past ``--max-header-bytes`` of waiting bytes the proxy stops reading, so the kernel's buffers fill and stop
    the client; once the answer is out it reads on and serves what waited, in order."""
    model = recording_model(3.0)
    proxy = start_proxy(model.name, "--no-unload")
    body = infer_body([7.0])
    ready = f"GET /v2/models/{model.name}/ready HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    with Raw(proxy.http_port) as client:
        client.send(infer_head(model.name, len(body)) + body)
        time.sleep(0.3)  # it is at Triton for 3 s
        rss_before = proxy.rss_kib()
        client.sock.setblocking(False)
        sent, burst = 0, ready * 8192
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            try:
                sent += client.sock.send(burst)
            except BlockingIOError:
                time.sleep(0.01)
        grown_kib = proxy.rss_kib() - rss_before
        client.sock.settimeout(10)
        # What the kernel's socket buffers took: the client's send buffer (4 MiB here) and the proxy's receive
        # buffer, which stops growing when the proxy stops reading (4.2 MiB in all here). Read on, the proxy took
        # 35 MiB in that time, and held them.
        bound = client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + (2 << 20)
        assert sent < bound, f"{sent >> 20} MiB pipelined were taken"
        assert grown_kib < 2048, f"the proxy grew by {grown_kib} KiB"
        status, _, answer = client.response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [7.0]
        for _ in range(3):  # reading resumed: the requests that waited are served, in order
            assert client.response()[0] == 200


# ---------------------------------------------------------------------------------------------- --max-body-bytes

LIMIT = 4096  # --max-body-bytes of these tests


def _padded(body: bytes, size: int) -> bytes:
    """``body`` (JSON) padded with spaces to ``size`` bytes: what Triton reads is the same."""
    return body + b" " * (size - len(body))


def _refusals(local: LocalRest, reason: str) -> float:
    labels = {"model": local.settings.name, "protocol": "rest", "route": "infer", "reason": reason}
    return local.state.metrics.registry.get_sample_value("tritonshare_proxy_refusals_total", labels) or 0.0


@pytest.fixture
def limited(triton: TritonServer, served_models: ServedModels) -> Iterator[tuple[LocalRest, TcpPipe]]:
    """The REST front end with ``--max-body-bytes`` LIMIT, Triton behind a pipe recording what reaches it."""
    pipe = TcpPipe(free_port(), ("127.0.0.1", triton.http_port), record=True)
    url = f"http://127.0.0.1:{pipe.listener.getsockname()[1]}"
    settings = ProxySettings(
        name=served_models.own, triton_url=url, host="127.0.0.1", http_port=0, max_body_bytes=LIMIT
    )
    try:
        with LocalRest(settings) as local:
            yield local, pipe
    finally:
        pipe.close()


def test_a_content_length_over_max_body_bytes_is_413_from_the_head(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """Triton reads a whole body into memory before it looks at it: a body over the limit is refused from its
    Content-Length, before a byte of it is read (none is sent here), and the connection closes."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--max-body-bytes", str(LIMIT))
    with Raw(proxy.http_port) as raw:
        status, headers, answer = raw.send(infer_head(own, LIMIT + 1)).response()
        assert status == 413 and headers["connection"] == "close"
        assert (
            error_of(answer) == f"the request body is larger than the proxy's limit of {LIMIT} bytes (--max-body-bytes)"
        )
        assert raw.closed_by_peer()
    at_limit = _padded(infer_body([1.0]), LIMIT)
    status, answer = request(proxy.http_port, "POST", f"/v2/models/{own}/infer", at_limit)
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [1.0]


def test_a_body_over_max_body_bytes_never_reaches_triton(
    limited: tuple[LocalRest, TcpPipe], served_models: ServedModels
) -> None:
    local, pipe = limited
    own = served_models.own
    with Raw(local.port) as raw:
        status, _, _ = raw.send(infer_head(own, LIMIT + 1) + _padded(infer_body([1.0]), LIMIT + 1)).response()
        assert status == 413 and raw.closed_by_peer()
    assert b"/infer" not in b"".join(pipe.sent)
    assert _refusals(local, "too_large") == 1


def _chunked(own: str, body: bytes, *, binary_header: int | None = None) -> bytes:
    extension = f"Inference-Header-Content-Length: {binary_header}\r\n" if binary_header is not None else ""
    head = f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\n{extension}Transfer-Encoding: chunked\r\n\r\n"
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 1000]), body[i : i + 1000]) for i in range(0, len(body), 1000)
    )
    return head.encode() + chunks + b"0\r\n\r\n"


@pytest.mark.parametrize("streamed", [False, True], ids=["held-for-the-check", "streaming-to-triton"])
def test_a_chunked_body_over_max_body_bytes_is_refused_and_triton_loses_its_part(
    limited: tuple[LocalRest, TcpPipe], served_models: ServedModels, streamed: bool
) -> None:
    """A chunked body has no length to judge: it is counted as it passes. Past the limit: 413, the client's
    connection closed, and Triton's too when it had part of the body (it drops the partial request)."""
    local, pipe = limited
    own = served_models.own
    header = infer_body([1.0]) if streamed else b""
    body = header + bytes(LIMIT + 1 - len(header)) if streamed else _padded(infer_body([1.0]), LIMIT + 1)
    wire = _chunked(own, body, binary_header=len(header) if streamed else None)
    with Raw(local.port) as raw:
        raw.send(wire[:2000])  # Triton gets the head and the first chunks (when streamed) before the rest comes
        time.sleep(0.3)
        status, headers, answer = raw.send(wire[2000:]).response()
        assert status == 413 and headers["connection"] == "close" and "--max-body-bytes" in error_of(answer)
        assert raw.closed_by_peer()
    forwarded = b"".join(pipe.sent)
    if not streamed:  # held for its check, refused before any of it went on: Triton's connection stays in the pool
        assert forwarded == b""
    else:
        assert b"/infer" in forwarded and len(forwarded) < LIMIT + 1024
        deadline = time.monotonic() + 5
        while pipe.open and time.monotonic() < deadline:  # Triton's connection, with its partial request, closes
            time.sleep(0.05)
        assert pipe.open == 0
    assert _refusals(local, "too_large") == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["held-for-the-check", "streaming-to-triton"])
def test_a_chunked_body_of_exactly_max_body_bytes_passes(
    limited: tuple[LocalRest, TcpPipe], served_models: ServedModels, streamed: bool
) -> None:
    local, _ = limited
    own = served_models.own
    if streamed:  # the binary-tensor extension: the JSON part, then INPUT0's 4 bytes (2.0, little-endian FP32)
        tensor = {"name": "INPUT0", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
        header = _padded(json.dumps({"inputs": [tensor]}).encode(), LIMIT - 4)
        body = header + b"\x00\x00\x00\x40"
    else:
        body = _padded(infer_body([2.0]), LIMIT)
    with Raw(local.port) as raw:
        status, _, answer = raw.send(_chunked(own, body, binary_header=len(header) if streamed else None)).response()
        assert status == 200, answer
        assert json.loads(answer)["outputs"][0]["data"] == [2.0]
