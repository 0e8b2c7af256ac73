"""The proxy process's start-up: the open-files limit (pure logic, the resource calls replaced), and a port in
use (the real command, which stops before it would reach Triton)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.proxy import TRITONSHARE
from tritonshare.proxy import server

PORTS = ("--http-port", "--grpc-port", "--metrics-port")


@pytest.mark.parametrize(
    ("soft", "hard", "cap", "warned"),
    [
        (1024, 1024, 1024, True),  # 4 x 1024 + spare files needed
        (1024, 1 << 20, 1024, False),  # lifted to the hard limit
        (1024, 1024, 200, False),
        (1024, 1024, 0, False),  # no cap: nothing to compare
    ],
)
def test_the_open_files_limit_is_lifted_and_a_short_one_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, soft: int, hard: int, cap: int, warned: bool
) -> None:
    limits = [soft, hard]
    monkeypatch.setattr(server.resource, "getrlimit", lambda _: tuple(limits))
    monkeypatch.setattr(server.resource, "setrlimit", lambda _, new: limits.__setitem__(slice(0, 2), new))
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        server.raise_open_files_limit(cap)
    assert limits == [hard, hard]
    assert ("below the" in caplog.text and f"--max-connections {cap}" in caplog.text) == warned


@pytest.mark.parametrize("taken", ["--http-port", "--grpc-port", "--metrics-port"])
def test_a_port_in_use_exits_2_naming_the_port_and_the_option(tmp_path: Path, taken: str) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        ports = {option: str(port if option == taken else free_port()) for option in PORTS}
        args = [arg for option, value in ports.items() for arg in (option, value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
        termination = tmp_path / "termination-log"
        done = subprocess.run(
            [TRITONSHARE, "proxy", "--name", "m", "--host", "127.0.0.1", "--no-unload", *args,
             "--repository", str(tmp_path / "models"), "--staging", str(tmp_path / "staging"),
             "--termination-log", str(termination)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and f"choose another {taken}" in done.stderr
    assert "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in termination.read_text()  # the pod status says it too


@pytest.mark.parametrize(
    ("metrics_port", "said"), [("0", "no metrics port (--metrics-port 0)"), (None, "metrics on :")]
)
def test_the_start_up_line_says_whether_metrics_are_served(tmp_path: Path, metrics_port: str | None, said: str) -> None:
    """`--metrics-port 0` turns metrics off: the start-up line says so rather than "metrics on :0"."""
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    ports = {option: str(free_port()) for option in PORTS}
    if metrics_port is not None:
        ports["--metrics-port"] = metrics_port
    args = [arg for option, value in ports.items() for arg in (option, value)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
    log = tmp_path / "proxy.log"
    with open(log, "wb") as out:
        proxy = subprocess.Popen(
            [TRITONSHARE, "proxy", "--name", "m", "--host", "127.0.0.1", "--no-unload", *args,
             "--repository", str(tmp_path / "models"), "--staging", str(tmp_path / "staging")],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "serving model m" not in log.read_text() and proxy.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    line = next(line for line in log.read_text().splitlines() if "serving model m" in line)
    assert said in line and "metrics on :0" not in line
