"""Python bytecodes the proxy runs per REST infer request, by function, for two kinds of client: one writing each
request in one write (wrk, tritonclient's geventhttpclient, curl) and one writing the body apart from the head
(http.client, and with it requests; httpx), as the yardstick cannot show (wrk writes once).

A real Triton (the tests' identity model) and ``tritonshare proxy`` run by this file under ``sys.settrace`` with
opcode events: after a warm-up, SIGUSR1 starts the count and SIGUSR2 writes it out. Each client sends the
yardstick's JSON infer body over one keep-alive connection. Reported: bytecodes per request (the tracer slows the
proxy, so how often a split request reaches it in two reads differs from an untraced run: this counts work, not
time) and how many heads per request went through the general path's parse (``RequestPath._read_head``).

usage: .venv-opt/bin/python bench/opcodes.py [--requests 2000] [--top 12] [--baseline SRC]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "identity"
BODY = b'{"inputs":[{"name":"INPUT0","shape":[16],"datatype":"FP32","data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}]}'
PATH = f"/v2/models/{MODEL}/infer"


# ----------------------------------------------------------------------------------------- the traced proxy


def serve_traced(out: str, argv: list[str]) -> None:
    """Run ``tritonshare proxy`` with an opcode counter (in this process)."""
    counts: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    on = [False]

    def where(frame: FrameType) -> str:
        code = frame.f_code
        return f"{Path(code.co_filename).name}:{code.co_name}"

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and on[0]:
            counts[where(frame)] += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if on[0]:
            calls[where(frame)] += 1
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    def start(*_: object) -> None:
        counts.clear()
        calls.clear()
        on[0] = True

    def dump(*_: object) -> None:
        on[0] = False
        with open(out, "w") as f:
            for name, n in counts.most_common():
                f.write(f"{n}\t{calls[name]}\t{name}\n")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    sys.settrace(tracer)
    from tritonshare.cli import main

    sys.argv = ["tritonshare", *argv]
    main()


# ----------------------------------------------------------------------------------------- the clients


def together(port: int, n: int) -> None:
    """Each request in one write, as wrk and tritonclient send it."""
    request = (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    with socket.create_connection(("127.0.0.1", port)) as sock:
        reader = sock.makefile("rb")
        for _ in range(n):
            sock.sendall(request)
            _read_response(reader)


def apart(port: int, n: int) -> None:
    """The head in one write, the body in another 2 ms later, so the proxy reads them apart: what http.client
    (requests) and httpx do, writing the body after the head, comes to when the proxy reads between the writes."""
    head = f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(BODY)}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        reader = sock.makefile("rb")
        for _ in range(n):
            sock.sendall(head)
            time.sleep(0.002)
            sock.sendall(BODY)
            _read_response(reader)


def _read_response(reader: Any) -> None:
    status = reader.readline()
    assert status.startswith(b"HTTP/1.1 200"), status
    length = 0
    while (line := reader.readline()) != b"\r\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line[15:])
    reader.read(length)


CLIENTS = {
    "one write (wrk, tritonclient)": together,
    "head and body in two reads (http.client, requests, httpx)": apart,
}


# ----------------------------------------------------------------------------------------- the run


def measure(requests: int, top: int, sources: dict[str, Path]) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.support.install import own_triton_serving

    with tempfile.TemporaryDirectory() as tmp, own_triton_serving(Path(tmp), MODEL) as server:
        for label, src in sources.items():
            print(f"\n## {label} ({src})")
            with _traced_proxy(server, Path(tmp), src) as (proxy, port, out):
                for client_label, client in CLIENTS.items():
                    client(port, 200)  # warm: the heads judged, the connections made
                    proxy.send_signal(signal.SIGUSR1)
                    time.sleep(0.5)
                    client(port, requests)
                    proxy.send_signal(signal.SIGUSR2)
                    time.sleep(1.0)
                    _report(client_label, out, requests, top)


@contextlib.contextmanager
def _traced_proxy(server: Any, tmp: Path, src: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """``tritonshare proxy`` from ``src``, counting opcodes (:func:`serve_traced`): the process, its REST port and
    the file its counts go to."""
    from tests.support.ports import free_port, wait_port

    staging, out, port = tmp / "staging", tmp / "opcodes.tsv", free_port()
    staging.mkdir(exist_ok=True)
    argv = ["proxy", "--name", MODEL, "--host", "127.0.0.1", "--triton-url", server.url]
    argv += ["--triton-grpc", server.grpc_url, "--http-port", str(port), "--grpc-port", str(free_port())]
    argv += ["--metrics-port", "0", "--repository", str(server.repository), "--staging", str(staging), "--no-unload"]
    with open(tmp / "proxy.log", "ab") as log:
        proxy = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(out), *argv],
            env=dict(os.environ, PYTHONPATH=str(src)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_port(port)
        yield proxy, port, out
    finally:
        proxy.terminate()
        proxy.wait(30)


def _report(label: str, out: Path, requests: int, top: int) -> None:
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    total = sum(int(ops) for ops, _, _ in rows)
    parsed = sum(int(calls) for _, calls, name in rows if name == "rest_requests.py:_read_head")
    reads = sum(int(calls) for _, calls, name in rows if name == "rest_connection.py:data_received")
    print(
        f"\n{label}: {total / requests:.0f} bytecodes per request; per request {reads / requests:.2f} reads, "
        f"{parsed / requests:.2f} heads parsed the general way"
    )
    for ops, calls, name in rows[:top]:
        print(f"  {int(ops) / requests:8.1f}  {name}  ({int(calls) / requests:.2f} calls per request)")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve_traced(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="counted requests per client")
    parser.add_argument("--top", type=int, default=12, help="functions shown")
    parser.add_argument("--baseline", type=Path, help="also the proxy from this src (an earlier commit's)")
    args = parser.parse_args()
    sources = {"this tree": ROOT / "src"}
    if args.baseline is not None:
        sources["baseline"] = args.baseline.resolve()
    measure(args.requests, args.top, sources)


if __name__ == "__main__":
    main()
