"""bench/relay_floor.py, the floor that bench/instructions.py --floor measures: it must relay both ways, as it
came, on each of its two ports (otherwise its count would be of failed requests)."""

from __future__ import annotations

import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.ports import free_port


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data.upper())


@pytest.fixture
def echo_ports() -> Iterator[tuple[int, int]]:
    servers = [socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) for _ in range(2)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers[0].server_address[1], servers[1].server_address[1]
    for server in servers:
        server.shutdown()
        server.server_close()


def test_each_port_relays_both_ways_as_it_came(echo_ports: tuple[int, int]) -> None:
    listen = (free_port(), free_port())
    args = [str(listen[0]), str(echo_ports[0]), str(listen[1]), str(echo_ports[1])]
    relay = subprocess.Popen([sys.executable, "bench/relay_floor.py", *args])
    try:
        for port in listen:
            deadline = time.monotonic() + 10
            while True:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"the relay did not listen on {port}"
                    time.sleep(0.05)
            with sock:
                for message in (b"first", b"second read"):  # the first may come before Triton's side is open
                    sock.sendall(message)
                    assert sock.recv(100) == message.upper()
    finally:
        relay.terminate()
        relay.wait(10)
