"""Instructions per request of the proxy next to nginx's, counted by callgrind: the figure of issue 4's CPU bar
that does not move with the machine's load (CPU µs from `bench/proxy_bench.sh` swing ±20 % on a shared node).

One real Triton (the shared yardstick's identity model), then nginx (the yardstick's config, one worker, as a
single process, its gRPC body limit lifted as in proxy_bench.sh) and `tritonshare proxy`, each under
`valgrind --tool=callgrind`. For each target and protocol: warm up, zero the counters, drive one connection
(wrk for REST JSON infer, h2load for gRPC ModelInfer, bench/stream_bench.py's lean client for one bidi
ModelStreamInfer stream, one message in flight) for ``--seconds``, dump, and divide the user-space
instructions of the whole process by the requests (streaming: messages) served. The kernel's share (syscalls,
TCP) is not counted: the proxy makes no more syscalls per request than nginx (6 against 7 at c=1, by strace).

``--connections 16`` drives 16 connections (streams) at once instead, the bar's other concurrency: under
callgrind the target is the bottleneck, so each of its event-loop turns finds more ready events than at full
speed — a lower bound on the batching the real c=16 gets, for both targets alike.

usage: .venv/bin/python bench/instructions.py [--seconds 10] [--connections 1]  (needs scripts/setup.sh --bench)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stream_bench  # noqa: E402  (bench/ is no package: the streaming client is imported by path)
import target  # noqa: E402  (which tritonshare to measure: .venv-opt, as the image's interpreter, else .venv)

ROOT = Path(__file__).resolve().parent.parent
YARD = Path(os.environ.get("TRITONSHARE_YARDSTICK", ROOT.parent / "shared" / "bench"))
MODEL = "identity"


@dataclass(frozen=True)
class Ports:
    triton_http: int
    triton_grpc: int
    http: int
    grpc: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer within {timeout_s:g} s") from None
            time.sleep(0.2)


@contextlib.contextmanager
def triton(run: Path) -> Iterator[Ports]:
    shutil.copytree(YARD / "models", run / "models")
    (run / "models" / MODEL / "1" / "__pycache__").touch()  # as the loader does (see README: POLL reloads)
    th, tg, tm = free_port(), free_port(), free_port()
    pid = subprocess.run(
        ["bash", str(YARD / "triton-up.sh"), str(ROOT / ".venv-triton"), str(run / "models"), str(th), str(tg),
         str(tm), str(run / "triton.log")],
        check=True, capture_output=True, text=True,
    ).stdout.split()[-1]  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{th}/v2/models/{MODEL}/ready", 120)
        yield Ports(th, tg, free_port(), free_port())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid), signal.SIGTERM)


def nginx_command(run: Path, ports: Ports) -> list[str]:
    conf = (YARD / "nginx.conf.in").read_text()
    conf = conf.replace("listen 127.0.0.1:@GRPC@ http2;", "listen 127.0.0.1:@GRPC@ http2; client_max_body_size 0;")
    for key, value in {
        "@RUN@": str(run), "@MODEL@": MODEL, "@UP_HTTP@": str(ports.triton_http), "@UP_GRPC@": str(ports.triton_grpc),
        "@HTTP@": str(ports.http), "@GRPC@": str(ports.grpc),
    }.items():  # fmt: skip
        conf = conf.replace(key, value)
    (run / "nginx.conf").write_text("master_process off;\ndaemon off;\n" + conf)  # one process, in the foreground
    return ["nginx", "-c", str(run / "nginx.conf"), "-p", str(run)]


def proxy_command(run: Path, ports: Ports) -> list[str]:
    (run / "staging").mkdir()
    return [
        str(target.venv() / "bin" / "tritonshare"), "--log-level", "warning", "proxy", "--name", MODEL,
        "--host", "127.0.0.1",
        "--triton-url", f"http://127.0.0.1:{ports.triton_http}", "--triton-grpc", f"127.0.0.1:{ports.triton_grpc}",
        "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(free_port()),
        "--no-unload", "--repository", str(run / "models"), "--staging", str(run / "staging"),
    ]  # fmt: skip


@contextlib.contextmanager
def under_callgrind(command: list[str], out: Path, ports: Ports) -> Iterator[int]:
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    process = subprocess.Popen(valgrind + command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{ports.http}/v2/health/live", 120)
        yield process.pid
    finally:
        process.send_signal(signal.SIGQUIT if command[0] == "nginx" else signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wrk(port: int, seconds: float, connections: int) -> int:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", str(YARD / "infer.lua"),
         f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return requests_of(out, r"(\d+) requests in", r"Non-2xx")


def h2load(port: int, seconds: float, body: Path, connections: int) -> int:
    out = subprocess.run(
        ["h2load", "-D", f"{seconds:g}", "-c", str(connections), "-m", "1", "-d", str(body),
         "-H", "content-type: application/grpc", "-H", "te: trailers", f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    if not re.search(r"requests: .* (\d+) succeeded, 0 failed", out):
        raise SystemExit(f"h2load saw failures:\n{out}")
    return requests_of(out, r"requests: .* (\d+) succeeded", None)


def stream(port: int, seconds: float, connections: int) -> int:
    """Messages answered on bidi ModelStreamInfer streams (one per connection), one in flight each (closed loop)."""
    load = stream_bench.Load("127.0.0.1", port, MODEL, stream_bench.request_bytes(MODEL), 1)
    result = uvloop.run(stream_bench.run("h2", load, connections, seconds, []))
    if result.tally.failures or not result.tally.latencies:
        raise SystemExit(f"the stream saw failures: {result.tally.first_error}")
    return len(result.tally.latencies)


def requests_of(out: str, pattern: str, failure: str | None) -> int:
    match = re.search(pattern, out)
    if match is None or (failure is not None and failure in out):
        raise SystemExit(f"the load generator did not report clean requests:\n{out}")
    return int(match.group(1))


def count(pid: int, out: Path, drive: Callable[[float], int], seconds: float) -> tuple[int, int]:
    """(requests, instructions) of one driven window: warm up, zero, drive, dump."""
    drive(min(2.0, seconds))
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    served = drive(seconds)
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    dumps = sorted(out.parent.glob(out.name + ".*"), key=lambda p: p.stat().st_mtime)
    totals = re.search(r"^totals: (\d+)", dumps[-1].read_text(), re.MULTILINE)
    assert totals is not None, dumps[-1]
    for dump in dumps:
        dump.unlink()
    return served, int(totals.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="driven seconds per target and protocol")
    parser.add_argument("--connections", type=int, default=1, help="connections (streams) driven at once")
    args = parser.parse_args()
    c = args.connections
    rows: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="tritonshare-instr-") as tmp, triton(Path(tmp)) as ports:
        run = Path(tmp)
        body = run / "infer.grpc"
        py = str(ROOT / ".venv/bin/python")
        subprocess.run([py, str(YARD / "make_grpc_body.py"), MODEL, "16", str(body)], check=True)
        targets = {"nginx": nginx_command(run, ports), "tritonshare": proxy_command(run, ports)}
        for name, command in targets.items():
            out = run / f"{name}.callgrind"
            with under_callgrind(command, out, ports) as pid:
                drives: dict[str, Callable[[float], int]] = {
                    "rest": lambda s: wrk(ports.http, s, c),
                    "grpc": lambda s: h2load(ports.grpc, s, body, c),
                    "stream": lambda s: stream(ports.grpc, s, c),
                }
                for protocol, drive in drives.items():
                    served, instructions = count(pid, out, drive, args.seconds)
                    rows[name, protocol] = instructions / served
                    per = rows[name, protocol]
                    print(f"{name} {protocol} c={c}: {served} requests, {per:,.0f} instructions/request")
    print(f"\ntritonshare from {target.describe()}")
    print(f"\n| protocol (c={c}) | nginx | tritonshare | vs nginx |\n|---|---:|---:|---:|")
    for protocol in ("rest", "grpc", "stream"):
        ours, base = rows["tritonshare", protocol], rows["nginx", protocol]
        print(f"| {protocol} | {base:,.0f} | {ours:,.0f} | {ours / base:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
