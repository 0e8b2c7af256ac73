"""``tritonshare proxy`` run as a real subprocess on free ports, as a pod would run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port, wait_port
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
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> ProxyProcess:
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
            *self.extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            wait_port(port, timeout_s=15)
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
        status = Path(f"/proc/{self.pid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith(field_name + ":"))
        return int(line.split()[1])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")
