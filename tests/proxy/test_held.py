"""The budget of request bytes held to check them (``--max-held-bytes``, proxy/held.py), against the real Triton:
concurrent JSON bodies past it are refused 503 with ``Retry-After`` while the others go through, what was
reserved comes back on every path (aborted connections included), the proxy's memory stays bounded, and a budget
smaller than ``--max-json-bytes`` stops the proxy before it listens."""

from __future__ import annotations

import gzip
import json
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.proxy.conftest import ServedModels
from tests.proxy.test_rest import LocalRest, Raw, error_of, infer_body, request
from tests.support.proxy import TRITONSHARE, ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.proxy.held import HeldBudget
from tritonshare.proxy.settings import ProxySettings

pytestmark = pytest.mark.triton

MIB = 1 << 20


def _head(own: str, length: int | None, *extra: str) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    lines = [f"POST /v2/models/{own}/infer HTTP/1.1", "Host: x", framing, *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json_of(size: int) -> bytes:
    """An identity infer body of about ``size`` bytes of JSON."""
    return infer_body([0.5] * (size // 5))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _assert_refused_for_the_budget(answer: tuple[int, dict[str, str], bytes], budget: int) -> None:
    status, headers, body = answer
    assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
    message = error_of(body)
    assert f"--max-held-bytes {budget}" in message and "Inference-Header-Content-Length" in message, message


def test_the_budget_counts_and_bounds() -> None:
    budget = HeldBudget(100)
    assert budget.reserve(60) and not budget.reserve(41) and budget.reserve(40)
    assert budget.held == 100
    budget.release(100)
    assert budget.held == 0
    unbounded = HeldBudget(0)
    assert unbounded.reserve(1 << 40) and unbounded.held == 1 << 40


def test_concurrent_declared_json_past_the_budget_gets_503_while_the_others_go_through(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    own = served_models.own
    body = _json_of(900 * 1024)
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", str(MIB), "--max-held-bytes", str(2 * MIB))
    port = proxy.http_port
    with Raw(port) as first, Raw(port) as second, Raw(port) as third:
        for conn in (first, second):  # each reserves its whole JSON at its head
            conn.send(_head(own, len(body)) + body[:1000])
        _wait_until(lambda: _held_bytes(proxy) == 2 * len(body))
        third.send(_head(own, len(body)) + body[:1000])
        _assert_refused_for_the_budget(third.response(), 2 * MIB)
        assert third.closed_by_peer()
        for conn in (first, second):
            status, _, answer = conn.send(body[1000:]).response()
            assert status == 200 and len(json.loads(answer)["outputs"][0]["data"]) == 900 * 1024 // 5
        _wait_until(lambda: _held_bytes(proxy) == 0)
        assert 'reason="held_budget"' in request(proxy.metrics_port, "GET", "/metrics")[1].decode()
        with Raw(port) as again:  # the budget came back
            assert again.send(_head(own, len(body)) + body).response()[0] == 200


def test_a_whole_compressed_body_in_one_read_holds_nothing_so_is_not_refused_for_the_budget(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """A gzip body that came whole with its head is checked within that read: it needs no room in the budget,
    even when its declared JSON (Inference-Header-Content-Length, of the inflated body) is larger than the
    compressed bytes that came and than what is left of the budget."""
    own = served_models.own
    filler = _json_of(900 * 1024)
    json_part = _json_of(400 * 1024)
    packed = gzip.compress(json_part)  # ~1 KiB (inflating 400x within the first MiB: the grace)
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", str(MIB), "--max-held-bytes", str(2 * MIB))
    with Raw(proxy.http_port) as first, Raw(proxy.http_port) as second, Raw(proxy.http_port) as whole:
        for conn in (first, second):  # 1.8 MiB of the 2 MiB reserved
            conn.send(_head(own, len(filler)) + filler[:1000])
        _wait_until(lambda: _held_bytes(proxy) == 2 * len(filler))
        head = _head(own, len(packed), "Content-Encoding: gzip", f"Inference-Header-Content-Length: {len(json_part)}")
        status, _, answer = whole.send(head + packed).response()
        assert status == 200, answer
        assert len(json.loads(answer)["outputs"][0]["data"]) == 400 * 1024 // 5
        for conn in (first, second):
            assert conn.send(filler[1000:]).response()[0] == 200
        _wait_until(lambda: _held_bytes(proxy) == 0)


def test_chunked_json_reserves_as_it_is_held_and_past_the_budget_gets_503(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    own = served_models.own
    big, small = _json_of(1500 * 1024), _json_of(900 * 1024)
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", str(2 * MIB), "--max-held-bytes", str(2 * MIB))
    with Raw(proxy.http_port) as holder, Raw(proxy.http_port) as late:
        holder.send(_head(own, None) + _chunk(big[:-10]))
        _wait_until(lambda: _held_bytes(proxy) == len(big) - 10)  # what it held so far, no more
        late.send(_head(own, None) + _chunk(small))
        _assert_refused_for_the_budget(late.response(), 2 * MIB)
        assert late.closed_by_peer()
        status, _, answer = holder.send(_chunk(big[-10:]) + b"0\r\n\r\n").response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"][:2] == [0.5, 0.5]
        _wait_until(lambda: _held_bytes(proxy) == 0)


def _wait_until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.05)


def _binary_body(json_part: bytes, tail: int) -> tuple[bytes, str]:
    """A binary-extension body: ``json_part`` then ``tail`` bytes of tensor data."""
    return json_part + b"\0" * tail, f"Inference-Header-Content-Length: {len(json_part)}"


def test_every_reservation_comes_back_when_clients_abort_mid_body(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """Plain, binary-extension, chunked and gzip bodies, cut at many points (some while held, some refused for the
    budget, some whole), by a close or a reset: the budget returns to zero and the proxy still serves."""
    own = served_models.own
    json_part = _json_of(300 * 1024)
    binary, ihcl = _binary_body(json_part, 200 * 1024)
    packed = gzip.compress(json_part)
    kinds = {
        "plain": (_head(own, len(json_part)), json_part),
        "binary": (_head(own, len(binary), ihcl), binary),
        "chunked": (_head(own, None), _chunk(json_part[:200_000]) + _chunk(json_part[200_000:]) + b"0\r\n\r\n"),
        "gzip": (_head(own, len(packed), "Content-Encoding: gzip"), packed),
    }
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", str(MIB), "--max-held-bytes", str(2 * MIB))
    conns = []
    for i in range(48):
        head, body = list(kinds.values())[i % len(kinds)]
        cut = len(body) * (i % 12) // 12 + (i % 7)  # from the head alone to most of the body
        conn = socket.create_connection(("127.0.0.1", proxy.http_port), timeout=10)
        conn.sendall(head + body[:cut])
        conns.append(conn)
    time.sleep(0.3)
    assert _held_bytes(proxy) > 0, "no body was held: the test holds nothing to give back"
    for i, conn in enumerate(conns):
        if i % 2:  # a reset rather than a close
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    _wait_until(lambda: _held_bytes(proxy) == 0)
    with Raw(proxy.http_port) as conn:
        assert conn.send(kinds["plain"][0] + kinds["plain"][1]).response()[0] == 200


def _run_proxy(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
    return subprocess.run(
        [TRITONSHARE, "proxy", "--name", "m", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
        + ["--repository", str(tmp_path), "--staging", str(tmp_path), "--no-unload", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--max-json-bytes", "2000", "--max-held-bytes", "1999"], {}),
        (["--max-json-bytes", "2000"], {"TRITONSHARE_MAX_HELD_BYTES": "1024"}),
        ([], {"TRITONSHARE_MAX_HELD_BYTES": str(MIB)}),  # under the default --max-json-bytes (64 MiB)
    ],
)
def test_a_budget_smaller_than_the_largest_json_is_a_usage_error(
    args: list[str], env: dict[str, str], tmp_path: Path
) -> None:
    result = _run_proxy(tmp_path, *args, env=env)
    assert result.returncode == 2, result.stderr
    assert "is smaller than --max-json-bytes" in result.stderr and "or 0 for no cap" in result.stderr


def test_the_budget_and_its_default_are_in_the_help() -> None:
    result = subprocess.run([TRITONSHARE, "proxy", "--help"], capture_output=True, text=True, timeout=30)
    text = " ".join(result.stdout.split())
    assert "--max-held-bytes" in text and "TRITONSHARE_MAX_HELD_BYTES" in text
    assert "default: 268435456" in text and "0 = no cap" in text


def test_no_budget_lets_every_body_be_held(triton: TritonServer, served_models: ServedModels) -> None:
    """``--max-held-bytes 0``: bodies are counted, never refused for it. (In this process: the state is read;
    no connection is closed by the proxy, which left LocalRest's uvloop hanging at close now and then.)"""
    own = served_models.own
    body = _json_of(900 * 1024)
    settings = ProxySettings(
        name=own, triton_url=triton.url, host="127.0.0.1", http_port=0, max_json_bytes=MIB, max_held_bytes=0
    )
    with LocalRest(settings) as local:
        conns = [Raw(local.port) for _ in range(4)]
        try:
            for conn in conns:
                conn.send(_head(own, len(body)) + body[:1000])
            _wait_until(lambda: local.call(lambda: local.state.held_budget.held) == 4 * len(body))
            for conn in conns:
                assert conn.send(body[1000:]).response()[0] == 200
        finally:
            for conn in conns:
                conn.__exit__()
        assert local.call(lambda: (local.state.held_budget.held, local.state.held)) == (0, 0)


def test_the_proxy_memory_stays_bounded_under_concurrent_large_json(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """8 clients send a 16 MiB JSON body at once (all but its last bytes) to a proxy with a 32 MiB budget: two are
    held, the others refused, and the proxy's peak RSS grows by far less than the 8 × 16 MiB it would hold."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", str(16 * MIB), "--max-held-bytes", str(32 * MIB))
    body = _json_of(16 * MIB - 4096)
    head = _head(own, len(body))
    before = proxy.rss_kib("VmRSS")
    refused: list[int] = []

    def send(conn: socket.socket) -> None:
        try:
            conn.sendall(head + body[:-100])
            refused.append(0)
        except OSError:  # refused and closed under its upload
            refused.append(1)

    conns = [socket.create_connection(("127.0.0.1", proxy.http_port), timeout=30) for _ in range(8)]
    try:
        threads = [threading.Thread(target=send, args=(conn,)) for conn in conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        time.sleep(0.5)
        grown_mib = (proxy.rss_kib("VmHWM") - before) / 1024
        held = _held_bytes(proxy)
    finally:
        for conn in conns:
            conn.close()
    print(
        f"\n8 × 16 MiB JSON at once, budget 32 MiB: held {held / MIB:.1f} MiB; proxy VmRSS {before / 1024:.1f} MiB "
        f"before, VmHWM +{grown_mib:.1f} MiB"
    )
    assert held <= 32 * MIB
    assert grown_mib < 48, f"the proxy's peak RSS grew by {grown_mib:.1f} MiB for 32 MiB held"
    _wait_until(lambda: _held_bytes(proxy) == 0)


def _held_bytes(proxy: ProxyProcess) -> int:
    text = request(proxy.metrics_port, "GET", "/metrics")[1].decode()
    line = next(line for line in text.splitlines() if line.startswith("tritonshare_proxy_held_bytes{"))
    return int(float(line.rsplit(" ", 1)[1]))
