"""``tritonshare proxy`` run as a real subprocess on free ports, as a pod would run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.children import die_with_parent, socket_inodes, vm_kib
from tests.support.ports import free_port
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout

TRITONSHARE = str(Path(sys.executable).parent / "tritonshare")


@dataclass
class ProxyProcess:
    name: str
    triton: TritonServer
    layout: NodeLayout
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def termination_log(self) -> Path:
        """Where the proxy writes why it exited non-zero (the pod's terminationMessagePath)."""
        return self.log_path.with_name(self.log_path.stem + ".termination-log")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, attempt: int = 1) -> ProxyProcess:
        """Run the proxy and wait until it listens on its three ports (:func:`_listening_ports`); a port taken by
        another process between :func:`free_port` and the proxy's bind (the proxy exits 2, "cannot listen on") is
        retried on new ports."""
        cmd = [
            TRITONSHARE,
            "proxy",
            "--name",
            self.name,
            "--host",
            "127.0.0.1",
            "--triton-url",
            self.triton.url,
            "--triton-grpc",
            self.triton.grpc_url,
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            "--triton-metrics-url",
            f"http://127.0.0.1:{self.triton.metrics_port}/metrics",
            "--repository",
            str(self.layout.repository),
            "--staging",
            str(self.layout.staging),
            "--termination-log",
            str(self.termination_log),
            *self.extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
            )
        deadline = time.monotonic() + 15
        while not {self.http_port, self.grpc_port, self.metrics_port} <= _listening_ports(self.process.pid):
            if self.process.poll() is not None:
                said = self.log_path.read_bytes()[logged:].decode(errors="replace")
                if "cannot listen on" in said and attempt < 3:  # another process took a port free_port gave
                    self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
                    return self.start(attempt + 1)
                raise RuntimeError(f"the proxy exited ({self.process.returncode}) at start:\n{said[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the proxy did not listen on its ports within 15 s:\n{self.log_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def terminate(self, timeout_s: float = 60) -> int:
        """SIGTERM, then wait for the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def rss_kib(self, field_name: str = "VmRSS") -> int:
        return vm_kib(self.pid, field_name)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


_LISTEN = "0A"  # TCP_LISTEN, as /proc/net/tcp shows a socket's state


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on, read from the kernel's tables rather than by connecting: a test
    connection would hold one of the proxy's places until the proxy saw it close (a test of ``--max-connections``
    must find every place free), and a port another process took would pass for the proxy's."""
    try:
        inodes = socket_inodes(pid)
    except (FileNotFoundError, ProcessLookupError):  # (it exited; the caller finds out)
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)  # the column names
            for row in rows:
                fields = row.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports
