"""bench/stream_bench.py (the streaming half of the proxy yardstick) against the session's real Triton: it
drives ModelStreamInfer with each of its clients, directly and through ``tritonshare proxy``, and reports
a rate, the latencies, the target's CPU per request and every failure."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.install import install_model
from tests.support.proxy import ProxyProcess
from tests.support.triton import REPO_ROOT, TritonServer
from tritonshare.common.layout import NodeLayout

pytestmark = pytest.mark.triton

SCRIPT = REPO_ROOT / "bench" / "stream_bench.py"
LINE = re.compile(
    r"^(?P<label>\S+) stream c=(?P<c>\d+) rps=(?P<rps>[\d.]+) mean=[\d.]+ms p50=[\d.]+ms p99=(?P<p99>[\d.]+)ms "
    r"(?P<ok>\d+)ok/(?P<failed>\d+)failed( cpu_us_per_req=(?P<cpu>[\d.]+))? client_cores=[\d.]+$"
)


@pytest.fixture(scope="module")
def identity(triton: TritonServer, layout: NodeLayout) -> str:
    name = "bench-identity"
    install_model(layout, triton, name)
    return name


@pytest.fixture
def proxy(triton: TritonServer, layout: NodeLayout, identity: str, tmp_path: Path) -> Iterator[ProxyProcess]:
    process = ProxyProcess(identity, triton, layout, tmp_path / "proxy.log", ["--no-unload"]).start()
    yield process
    process.stop()


def bench(target: str, *args: str) -> tuple[int, list[re.Match[str]], str]:
    """Run the script for 1 s per concurrency level: its exit code, its lines, its stderr."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), target, "--seconds", "1", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [LINE.match(line) for line in out.stdout.splitlines()]
    assert all(lines), f"unexpected output:\n{out.stdout}\n{out.stderr}"
    return out.returncode, [m for m in lines if m], out.stderr


@pytest.mark.parametrize("client", ["h2", "grpcio"])
def test_streams_to_triton_answered_without_failure(triton: TritonServer, identity: str, client: str) -> None:
    code, lines, err = bench(triton.grpc_url, "--model", identity, "--client", client, "--concurrency", "1", "4")
    assert code == 0, err
    assert [(m["label"], m["c"]) for m in lines] == [("target", "1"), ("target", "4")]
    for m in lines:
        assert float(m["rps"]) > 0 and int(m["ok"]) > 0 and m["failed"] == "0", m.string
        assert m["cpu"] is None  # no --pids


def test_cpu_per_request_of_the_proxy(proxy: ProxyProcess, identity: str) -> None:
    code, lines, err = bench(proxy.grpc_url, "--model", identity, "--concurrency", "2", "--pids", str(proxy.pid))
    assert code == 0, err
    (m,) = lines
    assert m["failed"] == "0" and int(m["ok"]) > 0
    assert m["cpu"] is not None and float(m["cpu"]) > 0, m.string


def test_refused_requests_count_as_failures(proxy: ProxyProcess, identity: str) -> None:
    """A stream for a model the proxy does not serve: every attempt fails, the script says so and exits 1."""
    code, lines, err = bench(proxy.grpc_url, "--model", "not-" + identity, "--concurrency", "1")
    (m,) = lines
    assert code == 1
    assert m["ok"] == "0" and int(m["failed"]) > 0, m.string
    # NOT_FOUND, worded as Triton words it: the proxy answers so for any model but its own
    assert f"first failure: grpc-status 5: Request for unknown model: 'not-{identity}'" in err, err
