"""Instructions per request of the proxy next to nginx's, counted by callgrind: the figure of issue 4's CPU bar
that does not move with the machine's load (CPU µs from `bench/proxy_bench.sh` swing ±20 % on a shared node).

One real Triton (the shared yardstick's identity model), then nginx (the yardstick's config, one worker, as a
single process, its gRPC body limit lifted as in proxy_bench.sh) and `tritonshare proxy`, each under
`valgrind --tool=callgrind`. For each target and protocol: warm up, zero the counters, drive one connection
(wrk for REST JSON infer, h2load for gRPC ModelInfer, bench/stream_bench.py's lean client for one bidi
ModelStreamInfer stream, one message in flight) for ``--seconds``, dump, and divide the user-space
instructions of the whole process by the requests (streaming: messages) served. The kernel's share (syscalls,
TCP) is not counted: the proxy makes no more syscalls per request than nginx (6 against 7 at c=1, by strace).

Every counted window's answers are checked by the proxy's own count of them by code and Triton's failure
count (bench/answers.py), read before the counters are zeroed and after the dump: h2load takes a gRPC refusal
(HTTP 200, grpc-status 16) for a success, so a proxy refusing every call would count few instructions.

``--features`` also measures the proxy with each request-path option on, beside it as it runs by default:
admission (``--max-inflight 64``), a bearer token (``--auth-token-file``; the clients send the token) and both
— what each costs per request.

``--floor`` also measures ``bench/relay_floor.py``, a byte relay in Python on the same interpreter and uvloop
that parses nothing: the floor of the proxy's design, what judging nothing would cost.

``--keep DIR`` keeps each counted window's callgrind dump there (``<target>-<protocol>.callgrind``), for
``bench/callgrind_self.py`` to say where the instructions went, by function and by library.

``--connections 16`` drives 16 connections (streams) at once instead, the bar's other concurrency: under
callgrind the target is the bottleneck, so each of its event-loop turns finds more ready events than at full
speed — a lower bound on the batching the real c=16 gets, for both targets alike.

usage: .venv/bin/python bench/instructions.py [--seconds 10] [--connections 1] [--features] [--floor]
       [--keep DIR]
       (needs scripts/setup.sh --bench)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
import answers  # noqa: E402  (bench/ is no package: its modules are imported by path)
import stream_bench  # noqa: E402
import target  # noqa: E402  (which tritonshare to measure: .venv-opt, as the image's interpreter, else .venv)

ROOT = Path(__file__).resolve().parent.parent
YARD = Path(os.environ.get("TRITONSHARE_YARDSTICK", ROOT.parent / "shared" / "bench"))
MODEL = "identity"
TOKEN = "bench-token-2f6c1e0a9d7b4c3e8a5f"
# The proxy's request-path options measured with --features, by the name of their row (TOKENS: the token file).
TOKENS = "@TOKENS@"
FEATURES: dict[str, list[str]] = {
    "tritonshare+admission": ["--max-inflight", "64"],
    "tritonshare+token": ["--auth-token-file", TOKENS],
    "tritonshare+both": ["--max-inflight", "64", "--auth-token-file", TOKENS],
}


@dataclass(frozen=True)
class Ports:
    triton_http: int
    triton_grpc: int
    triton_metrics: int
    http: int
    grpc: int


@dataclass(frozen=True)
class Target:
    """One process measured: its command, what its clients send besides the request, and, for the proxy, the
    port of its own metrics (its answers are checked by its count of them)."""

    command: list[str]
    headers: tuple[tuple[str, str], ...] = ()
    metrics_port: int | None = None


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
        yield Ports(th, tg, tm, free_port(), free_port())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid), signal.SIGTERM)


def nginx_target(run: Path, ports: Ports) -> Target:
    conf = (YARD / "nginx.conf.in").read_text()
    conf = conf.replace("listen 127.0.0.1:@GRPC@ http2;", "listen 127.0.0.1:@GRPC@ http2; client_max_body_size 0;")
    for key, value in {
        "@RUN@": str(run), "@MODEL@": MODEL, "@UP_HTTP@": str(ports.triton_http), "@UP_GRPC@": str(ports.triton_grpc),
        "@HTTP@": str(ports.http), "@GRPC@": str(ports.grpc),
    }.items():  # fmt: skip
        conf = conf.replace(key, value)
    (run / "nginx.conf").write_text("master_process off;\ndaemon off;\n" + conf)  # one process, in the foreground
    return Target(["nginx", "-c", str(run / "nginx.conf"), "-p", str(run)])


def floor_target(ports: Ports) -> Target:
    """``bench/relay_floor.py`` on the proxy's interpreter, relaying both ports to Triton."""
    relay = str(ROOT / "bench" / "relay_floor.py")
    python = str(target.venv() / "bin" / "python")
    ends = (ports.http, ports.triton_http, ports.grpc, ports.triton_grpc)
    return Target([python, relay, *(str(port) for port in ends)])


def proxy_target(run: Path, ports: Ports, options: list[str]) -> Target:
    """``tritonshare proxy`` with ``options`` besides its defaults."""
    (run / "staging").mkdir(exist_ok=True)
    tokens = run / "tokens"
    tokens.write_text(TOKEN + "\n")
    metrics = free_port()
    command = [
        str(target.venv() / "bin" / "tritonshare"), "--log-level", "warning", "proxy", "--name", MODEL,
        "--host", "127.0.0.1",
        "--triton-url", f"http://127.0.0.1:{ports.triton_http}", "--triton-grpc", f"127.0.0.1:{ports.triton_grpc}",
        "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(metrics),
        "--no-unload", "--repository", str(run / "models"), "--staging", str(run / "staging"),
        *(str(tokens) if option == TOKENS else option for option in options),
    ]  # fmt: skip
    headers = (("authorization", f"Bearer {TOKEN}"),) if TOKENS in options else ()
    return Target(command, headers, metrics)


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


def header_options(headers: tuple[tuple[str, str], ...]) -> list[str]:
    return [option for name, value in headers for option in ("-H", f"{name}: {value}")]


def wrk(port: int, seconds: float, connections: int, headers: tuple[tuple[str, str], ...]) -> int:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", str(YARD / "infer.lua"), *header_options(headers),
         f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return requests_of(out, r"(\d+) requests in", r"Non-2xx")


def h2load(port: int, seconds: float, body: Path, connections: int, headers: tuple[tuple[str, str], ...]) -> int:
    out = subprocess.run(
        ["h2load", "-D", f"{seconds:g}", "-c", str(connections), "-m", "1", "-d", str(body), *header_options(headers),
         "-H", "content-type: application/grpc", "-H", "te: trailers", f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    if not re.search(r"requests: .* (\d+) succeeded, 0 failed", out):
        raise SystemExit(f"h2load saw failures:\n{out}")
    return requests_of(out, r"requests: .* (\d+) succeeded", None)


def stream(port: int, seconds: float, connections: int, headers: tuple[tuple[str, str], ...]) -> int:
    """Messages answered on bidi ModelStreamInfer streams (one per connection), one in flight each (closed loop)."""
    load = stream_bench.Load("127.0.0.1", port, MODEL, stream_bench.request_bytes(MODEL), 1, headers)
    result = uvloop.run(stream_bench.run("h2", load, connections, seconds, []))
    if result.tally.failures or not result.tally.latencies:
        raise SystemExit(f"the stream saw failures: {result.tally.first_error}")
    return len(result.tally.latencies)


def requests_of(out: str, pattern: str, failure: str | None) -> int:
    match = re.search(pattern, out)
    if match is None or (failure is not None and failure in out):
        raise SystemExit(f"the load generator did not report clean requests:\n{out}")
    return int(match.group(1))


def drives(ports: Ports, body: Path, c: int, headers: tuple[tuple[str, str], ...]) -> dict[str, Callable[[float], int]]:
    """Each protocol's load for ``seconds``, returning the requests (messages) served."""
    return {
        "rest": lambda seconds: wrk(ports.http, seconds, c, headers),
        "grpc": lambda seconds: h2load(ports.grpc, seconds, body, c, headers),
        "stream": lambda seconds: stream(ports.grpc, seconds, c, headers),
    }


def metrics_pages(ports: Ports, measured: Target) -> tuple[str, str]:
    """Triton's metrics page and the measured proxy's ("" for nginx)."""
    return page(ports.triton_metrics), page(measured.metrics_port)


def page(port: int | None) -> str:
    if port is None:
        return ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        return str(answer.read().decode())


def check_answers(label: str, before: tuple[str, str], after: tuple[str, str], connections: int) -> None:
    """Every answer of the window a success: no Triton failure, and by the proxy's count (a Target with metrics)
    only OK answers and at most one per connection cut as the load generator ends its run."""
    failed = answers.triton_failures(after[0]) - answers.triton_failures(before[0])
    codes = answers.turn_codes(before[1], after[1])
    cut = sum(n for key, n in codes.items() if key in answers.CUT)
    other = {key: n for key, n in codes.items() if key not in answers.SUCCESS | answers.CUT}
    if failed or other or cut > connections:
        raise SystemExit(f"{label}: not every answer was a success: Triton failed {failed}, cut {cut}, other {other}")


def count(
    pid: int,
    out: Path,
    drive: Callable[[float], int],
    seconds: float,
    pages: Callable[[], tuple[str, str]],
    keep: Path | None = None,
) -> tuple[int, int, tuple[str, str], tuple[str, str]]:
    """(requests, instructions, metrics pages before and after) of one driven window: warm up, read the pages,
    zero, drive, dump, read the pages (neither read is counted). ``keep``: where the window's dump goes."""
    drive(min(2.0, seconds))
    before = pages()
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    served = drive(seconds)
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    after = pages()
    dumps = sorted(out.parent.glob(out.name + ".*"), key=lambda p: p.stat().st_mtime)
    totals = re.search(r"^totals: (\d+)", dumps[-1].read_text(), re.MULTILINE)
    assert totals is not None, dumps[-1]
    if keep is not None:
        shutil.copyfile(dumps[-1], keep)
    for dump in dumps:
        dump.unlink()
    return served, int(totals.group(1)), before, after


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="driven seconds per target and protocol")
    parser.add_argument("--connections", type=int, default=1, help="connections (streams) driven at once")
    parser.add_argument("--features", action="store_true", help="also the proxy with admission and a token on")
    parser.add_argument("--floor", action="store_true", help="also a byte relay in Python that parses nothing")
    parser.add_argument("--keep", type=Path, help="keep each window's callgrind dump in this directory")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    c = args.connections
    rows: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="tritonshare-instr-") as tmp, triton(Path(tmp)) as ports:
        run = Path(tmp)
        body = run / "infer.grpc"
        py = str(ROOT / ".venv/bin/python")
        subprocess.run([py, str(YARD / "make_grpc_body.py"), MODEL, "16", str(body)], check=True)
        targets = {"nginx": nginx_target(run, ports), "tritonshare": proxy_target(run, ports, [])}
        if args.features:
            targets |= {name: proxy_target(run, ports, options) for name, options in FEATURES.items()}
        if args.floor:
            targets["python-relay"] = floor_target(ports)
        for name, measured in targets.items():
            out = run / f"{name}.callgrind"
            pages = functools.partial(metrics_pages, ports, measured)
            with under_callgrind(measured.command, out, ports) as pid:
                for protocol, drive in drives(ports, body, c, measured.headers).items():
                    kept = args.keep / f"{name}-{protocol}.callgrind" if args.keep is not None else None
                    served, instructions, before, after = count(pid, out, drive, args.seconds, pages, kept)
                    check_answers(f"{name} {protocol}", before, after, c)
                    rows[name, protocol] = instructions / served
                    per = rows[name, protocol]
                    print(f"{name} {protocol} c={c}: {served} requests, {per:,.0f} instructions/request")
                    if kept is not None:
                        kept.with_suffix(".served").write_text(f"{served}\n")
    print(f"\ntritonshare from {target.describe()}")
    print(f"\n| protocol (c={c}) | nginx | tritonshare | vs nginx |\n|---|---:|---:|---:|")
    for protocol in ("rest", "grpc", "stream"):
        ours, base = rows["tritonshare", protocol], rows["nginx", protocol]
        print(f"| {protocol} | {base:,.0f} | {ours:,.0f} | {ours / base:.2f}× |")
    if args.floor:
        print(f"\n| protocol (c={c}) | python-relay (the floor) | tritonshare above it |\n|---|---:|---:|")
        for protocol in ("rest", "grpc", "stream"):
            floor = rows["python-relay", protocol]
            print(f"| {protocol} | {floor:,.0f} | +{rows['tritonshare', protocol] - floor:,.0f} |")
    if args.features:
        names = list(FEATURES)
        print(f"\n| protocol (c={c}) | tritonshare | " + " | ".join(names) + " |\n|---|---:|" + "---:|" * len(names))
        for protocol in ("rest", "grpc", "stream"):
            plain = rows["tritonshare", protocol]
            cells = [f"{rows[name, protocol]:,.0f} ({rows[name, protocol] - plain:+,.0f})" for name in names]
            print(f"| {protocol} | {plain:,.0f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
