"""What one REST client can make the proxy hold, against the real Triton: a client that pipelines requests the
proxy refuses itself and never reads the answers is stopped being read (the answers do not pile up in the
proxy's memory, whose limit is the pod's), and gets every answer once it reads; idle keep-alive clients do not
each hold a connection to the node's shared Triton."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.children import socket_inodes
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.proxy.rest_upstream import IDLE_UPSTREAMS, UPSTREAM_IDLE_S

pytestmark = [pytest.mark.triton, pytest.mark.slow]

REFUSED = b"GET /x HTTP/1.1\r\n\r\n"  # 19 bytes in, a 403 of 131 bytes out: the answer is 7 times larger
LAST = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
SEND_LIMIT = 64 << 20  # the old proxy read all of this (and buffered ~500 MB of answers)


@pytest.fixture
def proxy(triton: TritonServer, layout: NodeLayout, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    process = ProxyProcess("rest-resources", triton, layout, log, ["--no-unload"]).start()
    yield process
    process.stop()


def _send_until_blocked(sock: socket.socket, data: bytes, limit: int) -> int:
    """Send ``data`` over and over until ``limit`` bytes or the peer stops taking them for 2 s; bytes sent."""
    sock.setblocking(False)
    sent, blocked_since = 0, None
    view = memoryview(data * 50_000)
    while sent < limit:
        try:
            n = sock.send(view[sent % len(data) :])
        except BlockingIOError:
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since > 2.0:
                break
            time.sleep(0.01)
            continue
        sent, blocked_since = sent + n, None
    sock.setblocking(True)
    return sent


def _read_answers(sock: socket.socket, received: bytearray, status: bytes, wanted: int) -> int:
    """Read until ``wanted`` answers with this status line start are in ``received`` (or the end); how many are."""
    mark, found, scanned = b"HTTP/1.1 " + status, 0, len(received)
    while found < wanted and (chunk := sock.recv(1 << 20)):
        received += chunk
        found += received.count(mark, scanned)
        scanned = len(received) - len(mark) + 1
    return found


def test_a_client_that_pipelines_refusals_and_never_reads_is_stopped_being_read(proxy: ProxyProcess) -> None:
    """Regression: the proxy went on reading such a client and answering into an unbounded write buffer: 42 MB
    of ``GET /x`` took its RSS from 58 MB to 465 MB (the pod's limit is 512 MiB). When the client reads at
    last, every request it sent whole is answered, without it sending anything more (what the proxy had read
    but not parsed when it stopped is parsed when the client catches up)."""
    before = proxy.rss_kib()
    with socket.create_connection(("127.0.0.1", proxy.http_port), timeout=30) as sock:
        sent = _send_until_blocked(sock, REFUSED, SEND_LIMIT)
        grown_mib = (proxy.rss_kib() - before) / 1024
        assert sent < SEND_LIMIT, "the proxy kept reading a client that reads none of its answers"
        assert grown_mib < 24, f"the proxy's RSS grew by {grown_mib:.0f} MiB for {sent >> 20} MiB of refusals"
        received = bytearray()
        whole = sent // len(REFUSED)
        try:
            found = _read_answers(sock, received, b"403 ", whole)
        except TimeoutError:
            found = received.count(b"HTTP/1.1 403 ")
        assert found == whole, f"{whole} requests sent whole, {found} answered"
        sock.sendall(REFUSED[sent % len(REFUSED) :] + LAST if sent % len(REFUSED) else LAST)
        _read_answers(sock, received, b"200 ", 1)
        assert not sock.recv(1), "the proxy did not close after the last request (Connection: close)"
    assert received.count(b"HTTP/1.1 403 ") == -(-sent // len(REFUSED))
    assert received.rindex(b"HTTP/1.1 200 ") > received.rindex(b"HTTP/1.1 403 ")


def _connections_to(pid: int, port: int) -> int:
    """Established TCP connections of process ``pid`` to ``port`` on this host."""
    inodes = socket_inodes(pid)
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes and fields[3] == "01" and int(fields[2].split(":")[1], 16) == port:
            count += 1
    return count


def test_idle_keep_alive_clients_give_their_triton_connections_back(proxy: ProxyProcess, triton: TritonServer) -> None:
    """Regression: each client connection held its connection to Triton until it closed (400 idle clients: 401
    connections on the node's shared Triton). After ``UPSTREAM_IDLE_S`` without a request it goes back to the
    pool (which keeps ``IDLE_UPSTREAMS``), and the client's next request takes one again."""
    ask = b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n"  # forwarded (the probes are answered by the proxy itself)
    clients = [socket.create_connection(("127.0.0.1", proxy.http_port), timeout=10) for _ in range(40)]
    try:
        for sock in clients:
            sock.sendall(ask)
            assert sock.recv(1000).startswith(b"HTTP/1.1 200 ")
        assert _connections_to(proxy.pid, triton.http_port) >= 40
        deadline = time.monotonic() + UPSTREAM_IDLE_S + 3
        while _connections_to(proxy.pid, triton.http_port) > IDLE_UPSTREAMS and time.monotonic() < deadline:
            time.sleep(0.25)
        assert _connections_to(proxy.pid, triton.http_port) <= IDLE_UPSTREAMS
        for sock in clients:  # the same keep-alive connections are served again
            sock.sendall(ask)
            assert sock.recv(1000).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in clients:
            sock.close()
