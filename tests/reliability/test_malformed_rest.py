"""Malformed and abusive HTTP at the proxy's REST port: each is refused with the right status and reaches no
"Triton" (the recording stand-in), memory stays bounded (the proxy's VmHWM), and the proxy keeps serving others —
bad request lines, ambiguous framing, smuggling, oversized heads, bodies over the limit, gzip bombs, slowloris.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
import zlib
from collections.abc import Iterator

import pytest

from tests.reliability.conftest import HOSTILE_MAX_JSON_BYTES, Hostile
from tests.reliability.test_hostile_rest import exchange, status_of, still_serves
from tests.support.proxy import ProxyProcess

OWN = "tenant-own"
INFER = f"/v2/models/{OWN}/infer"
MIB = 1 << 20

pytestmark = [pytest.mark.slow]


def head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def refused(hostile: Hostile, raw: bytes, status: int) -> bytes:
    """Send ``raw``; the answer must carry ``status``, nothing may reach Triton, and the proxy must still serve."""
    since = len(hostile.rest.seen)
    answer = exchange(hostile.proxy.http_port, raw)
    assert status_of(answer) == status, answer[:300]
    assert hostile.rest.seen[since:] == [], [f"{s.method} {s.path}" for s in hostile.rest.seen[since:]]
    still_serves(hostile)
    return answer


BAD_REQUEST_LINES = {
    "HTTP/0.9 style": b"GET /v2/health/live\r\n\r\n",
    "two spaces": b"GET  /v2 HTTP/1.1\r\nHost: x\r\n\r\n",
    "absolute form": b"GET http://triton:8000/v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n",
    "authority form": b"CONNECT triton:8000 HTTP/1.1\r\nHost: x\r\n\r\n",
    "asterisk form": b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    "HTTP/2.0": b"GET /v2 HTTP/2.0\r\nHost: x\r\n\r\n",
    "lower-case version": b"GET /v2 http/1.1\r\nHost: x\r\n\r\n",
    "trailing word": b"GET /v2 HTTP/1.1 please\r\nHost: x\r\n\r\n",
    "NUL in method": b"G\x00T /v2 HTTP/1.1\r\nHost: x\r\n\r\n",
    "DEL in path": b"GET /v2\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
    "space in path": b"GET /v2/models/tenant-own /ready HTTP/1.1\r\nHost: x\r\n\r\n",
    "dot-dot path": b"GET /v2/models/tenant-own/../../repository/index HTTP/1.1\r\nHost: x\r\n\r\n",
    "double slash": b"GET //v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n",
    "TLS hello on the plain port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40) + b"\r\n\r\n",
    "HTTP/2 preface on the REST port": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}


@pytest.mark.parametrize("raw", BAD_REQUEST_LINES.values(), ids=BAD_REQUEST_LINES.keys())
def test_a_bad_request_line_is_400(hostile: Hostile, raw: bytes) -> None:
    refused(hostile, raw, 400)


AMBIGUOUS_FRAMING = {
    "Content-Length and Transfer-Encoding": head(
        f"POST {INFER} HTTP/1.1", "Host: x", "Content-Length: 4", "Transfer-Encoding: chunked"
    ) + b"0\r\n\r\n",
    "two equal Content-Lengths": head(f"POST {INFER} HTTP/1.1", "Host: x", "Content-Length: 2", "Content-Length: 2")
    + b"{}",
    "two different Content-Lengths": head(
        f"POST {INFER} HTTP/1.1", "Host: x", "Content-Length: 2", "Content-Length: 40"
    ) + b"{}",
    "a list in Content-Length": head(f"POST {INFER} HTTP/1.1", "Host: x", "Content-Length: 2, 2") + b"{}",
    "a signed Content-Length": head(f"POST {INFER} HTTP/1.1", "Host: x", "Content-Length: +2") + b"{}",
    "a hex Content-Length": head(f"POST {INFER} HTTP/1.1", "Host: x", "Content-Length: 0x2") + b"{}",
    "Transfer-Encoding gzip, chunked": head(
        f"POST {INFER} HTTP/1.1", "Host: x", "Transfer-Encoding: gzip, chunked"
    ) + b"0\r\n\r\n",
    "Transfer-Encoding twice": head(
        f"POST {INFER} HTTP/1.1", "Host: x", "Transfer-Encoding: chunked", "Transfer-Encoding: identity"
    ) + b"0\r\n\r\n",
    "chunked in HTTP/1.0": head(f"POST {INFER} HTTP/1.0", "Host: x", "Transfer-Encoding: chunked") + b"0\r\n\r\n",
    "obs-fold": head("GET /v2 HTTP/1.1", "Host: x", "X-Long: a", " folded"),
    "space before the colon": head("GET /v2 HTTP/1.1", "Host : x"),
    "a bare CR in a value": head("GET /v2 HTTP/1.1", "Host: x", "X-A: b\rc"),
    "a NUL in a value": head("GET /v2 HTTP/1.1", "Host: x", "X-A: b\x00c"),
    "a bad chunk size": head(f"POST {INFER} HTTP/1.1", "Host: x", "Transfer-Encoding: chunked") + b"zz\r\n{}\r\n",
}  # fmt: skip


@pytest.mark.parametrize("raw", AMBIGUOUS_FRAMING.values(), ids=AMBIGUOUS_FRAMING.keys())
def test_ambiguous_framing_is_400(hostile: Hostile, raw: bytes) -> None:
    refused(hostile, raw, 400)


def test_an_unsupported_expectation_is_417(hostile: Hostile) -> None:
    refused(hostile, head(f"POST {INFER} HTTP/1.1", "Host: x", "Expect: 200-ok", "Content-Length: 2") + b"{}", 417)


@pytest.mark.parametrize(
    "raw",
    [
        head("GET /v2 HTTP/1.1", "Host: x", "X-Big: " + "a" * (70 * 1024)),
        head("GET /v2 HTTP/1.1", "Host: x", *[f"X-{i}: {'b' * 1000}" for i in range(70)]),
        head("GET /v2/" + "c" * (70 * 1024) + " HTTP/1.1", "Host: x"),
    ],
    ids=["one huge header", "many headers", "huge request line"],
)
def test_a_head_over_64_kib_is_431(hostile: Hostile, raw: bytes) -> None:
    refused(hostile, raw, 431)


def test_a_request_smuggled_in_a_body_or_pipelined_after_it_never_reaches_triton_as_a_request(
    hostile: Hostile,
) -> None:
    smuggled = head("POST /v2/repository/models/tenant-other/unload HTTP/1.1", "Host: x", "Content-Length: 0")
    body = b'{"inputs":[]}' + smuggled
    carrier = head(f"POST {INFER} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}") + body
    since = len(hostile.rest.seen)
    with socket.create_connection(("127.0.0.1", hostile.proxy.http_port), timeout=10) as sock:
        sock.sendall(carrier + smuggled)  # in the body, then pipelined after it
        answer = b""
        while len(statuses := re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)) < 2 and (data := sock.recv(65536)):
            answer += data
    statuses = [int(code) for code in statuses]
    assert statuses == [200, 403], answer[:500]
    assert [(s.method, s.path, s.body) for s in hostile.rest.seen[since:]] == [("POST", INFER, body)]


# ---------------------------------------------------------------------------------------------- bodies and bombs


def hwm_mib(proxy: ProxyProcess) -> float:
    return proxy.rss_kib("VmHWM") / 1024


def post(hostile: Hostile, body: bytes, *extra: str) -> bytes:
    raw = head(f"POST {INFER} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra) + body
    return refused(hostile, raw, 413)


def json_of(size: int) -> bytes:
    return b'{"inputs":[{"name":"INPUT0","data":"' + b"7" * size + b'"}]}'


def test_json_over_the_limit_is_413_plain_chunked_and_by_its_declared_length(hostile: Hostile) -> None:
    big = json_of(HOSTILE_MAX_JSON_BYTES)
    answer = post(hostile, big)
    assert b"max_json_bytes" in answer
    chunked = b"".join(
        b"%x\r\n%s\r\n" % (len(big[i : i + 65536]), big[i : i + 65536]) for i in range(0, len(big), 65536)
    )
    raw = head(f"POST {INFER} HTTP/1.1", "Host: x", "Transfer-Encoding: chunked") + chunked + b"0\r\n\r\n"
    refused(hostile, raw, 413)
    declared = str(HOSTILE_MAX_JSON_BYTES + 1)
    post(hostile, b"{}" + bytes(HOSTILE_MAX_JSON_BYTES), f"Inference-Header-Content-Length: {declared}")


def gzip_bomb(inflated: int, *, prefix: bytes = b'{"inputs":"') -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(prefix)]
    zeros = bytes(MIB)
    parts += [packer.compress(zeros) for _ in range(inflated // MIB)]
    return b"".join(parts) + packer.flush()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return gzip_bomb(128 * MIB)  # ~128 KiB on the wire


def test_a_gzip_bomb_is_413_in_bounded_memory(hostile: Hostile, bomb: bytes) -> None:
    before = hwm_mib(hostile.proxy)
    answer = post(hostile, bomb, "Content-Encoding: gzip")
    assert b"inflates to more than 100 times its size" in answer  # its inflate ratio gives it away first
    raw = head(f"POST {INFER} HTTP/1.1", "Host: x", "Content-Encoding: deflate", "Transfer-Encoding: chunked")
    refused(hostile, raw + b"%x\r\n%s\r\n0\r\n\r\n" % (len(bomb), bomb), 413)  # gzip framing under "deflate"
    grown = hwm_mib(hostile.proxy) - before
    print(
        f"\nREST gzip bomb ({len(bomb) >> 10} KiB inflating to 128 MiB): 413; "
        f"proxy VmHWM {before:.1f} MiB, +{grown:.1f}"
    )
    assert grown < 16, f"peak memory grew from {before:.0f} MiB by {grown:.0f} MiB"


def test_data_after_the_compressed_stream_is_400(hostile: Hostile) -> None:
    body = zlib.compress(b'{"inputs":[]}') + zlib.compress(b'{"parameters":{"shared_memory_region":"x"}}')
    raw = head(f"POST {INFER} HTTP/1.1", "Host: x", "Content-Encoding: deflate", f"Content-Length: {len(body)}")
    refused(hostile, raw + body, 400)


def test_an_unknown_content_encoding_is_415(hostile: Hostile) -> None:
    raw = head(f"POST {INFER} HTTP/1.1", "Host: x", "Content-Encoding: br", "Content-Length: 2") + b"{}"
    refused(hostile, raw, 415)


# ---------------------------------------------------------------------------------------------- slowloris


def trickle(port: int, stop: threading.Event, opened: list[socket.socket], *, interval_s: float) -> None:
    """A slowloris client: one byte of a request head every ``interval_s``, never the end of it."""
    payload = head("GET /v2/health/live HTTP/1.1", "Host: x", "X-Slow: " + "s" * 400)[:-4]
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    opened.append(sock)
    for byte in payload:
        if stop.wait(interval_s):
            return
        try:
            sock.send(bytes([byte]))
        except OSError:
            return


@pytest.fixture
def slowloris(hostile: Hostile) -> Iterator[list[socket.socket]]:
    """64 connections each sending a request head one byte per second; they are closed after the test."""
    stop, opened = threading.Event(), list[socket.socket]()
    threads = [
        threading.Thread(target=trickle, args=(hostile.proxy.http_port, stop, opened), kwargs={"interval_s": 1.0})
        for _ in range(64)
    ]
    for thread in threads:
        thread.start()
    time.sleep(2.5)
    yield opened
    stop.set()
    for thread in threads:
        thread.join(5)
    for sock in opened:
        sock.close()


def test_slowloris_clients_do_not_keep_others_waiting(hostile: Hostile, slowloris: list[socket.socket]) -> None:
    assert len(slowloris) == 64
    took = []
    for _ in range(20):
        started = time.monotonic()
        still_serves(hostile)
        took.append(time.monotonic() - started)
    assert max(took) < 0.5, f"a normal request took {max(took):.2f}s beside 64 slowloris connections"


def test_slowloris_clients_do_not_hold_a_shutdown_hostage(hostile: Hostile) -> None:
    """SIGTERM drains requests in flight; a head that never completes is not one, and must not hold the exit
    up to the drain timeout (20 s here)."""
    proxy = ProxyProcess(
        OWN, hostile.proxy.triton, hostile.proxy.layout, hostile.proxy.log_path.with_name("sigterm-proxy.log"),
        ["--no-unload", "--drain-timeout-s", "20"],
    ).start()  # fmt: skip
    stop, opened = threading.Event(), list[socket.socket]()
    threads = [
        threading.Thread(target=trickle, args=(proxy.http_port, stop, opened), kwargs={"interval_s": 0.5})
        for _ in range(16)
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        started = time.monotonic()
        proxy.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        code = proxy.process.wait(timeout=30)  # type: ignore[union-attr]
        took = time.monotonic() - started
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        for sock in opened:
            sock.close()
        proxy.stop()
    assert code == 0
    assert took < 5, f"the proxy took {took:.1f}s to exit with 16 slowloris connections open"
