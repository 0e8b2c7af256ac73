"""Connections that never send a request: they must not cost the shared Triton anything, and a few hundred of
them must not lock other clients out of the proxy.

The first test FAILS today; its docstring says why and what would fix it.
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
    """Regression (found by this test): the proxy connected to Triton's gRPC port as soon as a TCP connection
    was accepted, so N bare connects to a tenant's proxy held N connections on the node's SHARED Triton.
    Triton's connection now opens with the client's first bytes, and a silent connection is closed after
    ``grpc_opening.SILENT_TIMEOUT_S``."""
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
    """Silent or half-sent connections hold a socket each until a timeout (REST: 30 s for the first head, 75 s
    idle after a request); at the proxy's soft RLIMIT_NOFILE every new client would be reset at accept. The
    container gives whatever soft limit it gives (often 1024; each client connection also holds one to Triton),
    so the proxy lifts its soft limit to the hard one at start-up: here, started with 256 soft / 4096 hard, 300
    connections that sent half a request line leave room for everyone else."""
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
