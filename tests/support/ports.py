"""Free TCP ports on loopback for servers the tests start.

A port is handed to a server that binds it a moment later, often in another process. A port the kernel picks
(bind to port 0) comes from its ephemeral range, the range every outgoing connection takes its local port
from: in between, one of the suite's many client connections can take it, and the server then fails to start
(seen once: a proxy's metrics port "already in use") — or the test finds something else listening there. So
ports are picked at random below that range, where the kernel gives no connection a port, checked free, and
never handed out twice by this process.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

LOWEST = 20000  # above the ports well-known services listen on
_random = random.Random()  # not the module's: a test seeding ``random`` must not make two runs pick alike
_given: set[int] = set()


def ephemeral_start(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    top = ephemeral_start()
    for _ in range(100):
        port = _random.randrange(LOWEST, top) if top - LOWEST >= 1000 else 0
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port in TIME_WAIT is passed over too
            except OSError:
                continue
            found = int(s.getsockname()[1])
        _given.add(found)
        return found
    raise RuntimeError(f"no free port found on 127.0.0.1 in {LOWEST}-{top - 1}")


def wait_port(port: int, *, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s}s")
