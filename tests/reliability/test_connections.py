"""Connections that never send a request: they must not cost the shared Triton anything, and a few hundred of
them must not lock other clients out of the proxy.

Both tests below FAIL today; each docstring says why and what would fix it.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.conftest import Hostile
from tests.support.ports import free_port, wait_port

pytestmark = [pytest.mark.slow]


@pytest.fixture
def idle_clients() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def test_a_grpc_connection_that_sends_nothing_opens_no_connection_to_triton(
    hostile: Hostile, tmp_path: Path, idle_clients: list[socket.socket]
) -> None:
    """BUG, fails today — proxy/grpc_connection.py ``ClientConnection.connection_made`` starts ``_connect()`` to
    Triton's gRPC port as soon as a TCP connection is accepted, before a single byte (not even the HTTP/2
    preface) arrives. So N bare TCP connects to a tenant's proxy hold N connections open on the node's SHARED
    Triton, for as long as the client likes (nothing times them out): a tenant can spend Triton's file
    descriptors and gRPC server resources, which every other tenant needs.

    Fix: open the Triton connection lazily — buffer the client's preface and SETTINGS (``_pending`` already
    does this while connecting) and connect at the first HEADERS frame; plus an idle timeout for connections
    that never start a stream."""
    http_port, grpc_port = free_port(), free_port()
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(hostile.proxy_command(http_port, grpc_port, tmp_path), stdout=log, stderr=log)
    try:
        wait_port(grpc_port)
        time.sleep(0.5)
        before = open_fds(proxy.pid)
        idle_clients += [socket.create_connection(("127.0.0.1", grpc_port)) for _ in range(50)]
        time.sleep(1.5)
        spent = open_fds(proxy.pid) - before - 50  # beyond the 50 client sockets themselves
    finally:
        proxy.kill()
        proxy.wait()
    assert spent <= 0, f"50 silent client connections made the proxy open {spent} connections to Triton"


def test_a_few_hundred_silent_connections_do_not_lock_other_clients_out(
    hostile: Hostile, tmp_path: Path, idle_clients: list[socket.socket]
) -> None:
    """BUG, fails today — a connection that never completes a request head (REST) is kept forever: there is no
    head or idle timeout (proxy/rest.py ``ClientConnection``), and the proxy runs with whatever soft
    RLIMIT_NOFILE its container gives it (often 1024). Once that many sockets are held, every new client is
    reset at accept: here, with a soft limit of 256 (hard 4096), 300 connections that sent half a request line
    lock everyone else out until they close. (Legitimate load hits the same wall: each client connection also
    holds one to Triton, so a soft limit of 1024 caps the proxy near 500 concurrent clients.)

    Fix: raise the soft RLIMIT_NOFILE to the hard limit at start-up (``resource.setrlimit``, as Go programs and
    nginx's worker_rlimit_nofile do) — this test checks that — and close connections whose head does not
    arrive within a deadline (nginx: client_header_timeout 60 s) or that idle between requests
    (keepalive_timeout)."""
    http_port, grpc_port = free_port(), free_port()
    command = ["prlimit", "--nofile=256:4096", "--", *hostile.proxy_command(http_port, grpc_port, tmp_path)]
    with open(tmp_path / "proxy.log", "wb") as log:
        proxy = subprocess.Popen(command, stdout=log, stderr=log)
    try:
        wait_port(http_port)
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", http_port), timeout=5)
            sock.sendall(b"GET /v2/health/li")  # half a request line, and then nothing
            idle_clients.append(sock)
        time.sleep(1.0)
        answer = b""
        try:
            with socket.create_connection(("127.0.0.1", http_port), timeout=5) as sock:
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = sock.recv(200)
        except OSError as exc:
            answer = repr(exc).encode()
    finally:
        proxy.kill()
        proxy.wait()
    assert answer.startswith(b"HTTP/1.1 200 "), f"a normal client beside 300 silent ones got: {answer[:100]!r}"
