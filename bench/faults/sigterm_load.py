"""SIGTERM to ``tritonshare proxy`` under load: do the requests started before the signal all succeed, and is
the drain bounded by ``--drain-timeout-s``?

A real Triton serves an identity model that sleeps ``--delay-s`` per request (``--instances`` instances), so
requests are really in flight. Through one proxy: ``--rest`` REST clients (keep-alive connections), ``--grpc``
gRPC unary clients and ``--streams`` gRPC ``ModelStreamInfer`` clients (each stream carries several requests),
each on its own connection, loop until the proxy exits. After ``--warm-s`` the proxy gets SIGTERM. Figures:

- requests started before the signal, how many were in flight at it, how many failed (the bar: 0);
- the drain: from the proxy's "received SIGTERM" log line to its "drained" (or "drain timeout") line, against
  ``--drain-timeout-s``; the time to exit (drain + unload) and the exit code (the bar: 0).

A second run (``--bounded``) sends requests that take longer than a short drain timeout: the proxy must stop
waiting at the timeout, cut what is left, and still exit 0.

Run from the repository root::

    .venv/bin/python -m bench.faults.sigterm_load [--rest 64 --grpc 48 --streams 16] [--drain-timeout-s 30]
    .venv/bin/python -m bench.faults.sigterm_load --bounded
"""

from __future__ import annotations

import argparse
import http.client
import queue
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc
import numpy as np
from bench.faults.node import Node, start_triton
from tests.support.install import wait_model_ready
from tests.support.models import IDENTITY_CONFIG, write_model
from tests.support.proxy import ProxyProcess
from tritonclient.grpc import service_pb2 as pb

from tritonshare.proxy.policy import GRPC_SERVICE

MODEL = "drained"
SLEEPY_MODEL = """\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({delay_s})
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""
REST_BODY = b'{"inputs":[{"name":"INPUT0","shape":[4],"datatype":"FP32","data":[1,2,3,4]}]}'
STREAM_MESSAGES = 4  # requests per gRPC stream before it is closed and a new one opened


@dataclass
class Outcomes:
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: list[tuple[float, float, str, str]] = field(default_factory=list)  # start, end, kind, error ("" = ok)

    def add(self, start: float, kind: str, error: str) -> None:
        with self.lock:
            self.calls.append((start, time.monotonic(), kind, error))


# ---------------------------------------------------------------------------------------------- clients


def rest_client(port: int, stop: threading.Event, out: Outcomes) -> None:
    conn: http.client.HTTPConnection | None = None
    while not stop.is_set():
        conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        start = time.monotonic()
        try:
            conn.request("POST", f"/v2/models/{MODEL}/infer", REST_BODY, {"Content-Type": "application/json"})
            response = conn.getresponse()
            body = response.read()
            ok = response.status == 200 and b"OUTPUT0" in body
            out.add(start, "rest", "" if ok else f"HTTP {response.status}")
            if response.will_close:
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as exc:
            out.add(start, "rest", type(exc).__name__)
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.05)
    if conn is not None:
        conn.close()


def infer_request() -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


def grpc_client(url: str, stop: threading.Event, out: Outcomes) -> None:
    message = infer_request()
    while not stop.is_set():
        with grpc.insecure_channel(url) as channel:  # a new connection after each failure, as a client would
            infer = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")
            while not stop.is_set():
                start = time.monotonic()
                try:
                    infer(message, timeout=120)
                    out.add(start, "grpc", "")
                except grpc.RpcError as exc:
                    out.add(start, "grpc", str(exc.code().name))
                    time.sleep(0.05)
                    break


def stream_client(url: str, stop: threading.Event, out: Outcomes) -> None:
    """Streams of STREAM_MESSAGES requests, each sent once the previous one's response came back."""
    message = infer_request()
    while not stop.is_set():
        with grpc.insecure_channel(url) as channel:
            if not _one_stream(channel, message, out):
                time.sleep(0.05)


def _one_stream(channel: grpc.Channel, message: bytes, out: Outcomes) -> bool:
    outbox: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item

    responses = channel.stream_stream(f"/{GRPC_SERVICE}/ModelStreamInfer")(requests(), timeout=120)
    start = 0.0
    try:
        for _ in range(STREAM_MESSAGES):
            start = time.monotonic()
            outbox.put(message)
            reply = pb.ModelStreamInferResponse.FromString(next(responses))
            out.add(start, "stream", reply.error_message)
        outbox.put(None)
        for _ in responses:  # the end of the stream
            pass
    except (grpc.RpcError, StopIteration) as exc:
        outbox.put(None)
        code = exc.code().name if isinstance(exc, grpc.RpcError) else "stream ended early"
        out.add(start, "stream", str(code))
        return False
    return True


# ---------------------------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Figures:
    started_before: int
    in_flight: int
    failed_before: list[tuple[float, float, str, str]]
    by_kind: dict[str, int]
    drain_s: float
    drain_line: str
    exit_s: float
    code: int

    def lines(self, drain_timeout_s: float) -> list[str]:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.by_kind.items()))
        return [
            f"requests started before SIGTERM: {self.started_before} ({kinds}); in flight at the signal: "
            f"{self.in_flight}; failed among them: {len(self.failed_before)}",
            f"drain: {self.drain_s:.2f} s (--drain-timeout-s {drain_timeout_s:g}): {self.drain_line}",
            f"exit {self.code} after {self.exit_s:.2f} s (drain + unload)",
        ]


def run_once(proxy: ProxyProcess, args: argparse.Namespace) -> Figures:
    stop, out = threading.Event(), Outcomes()
    targets = [(rest_client, proxy.http_port)] * args.rest + [(grpc_client, proxy.grpc_url)] * args.grpc
    targets += [(stream_client, proxy.grpc_url)] * args.streams
    threads = [threading.Thread(target=fn, args=(where, stop, out), daemon=True) for fn, where in targets]
    for thread in threads:
        thread.start()
    time.sleep(args.warm_s)
    signalled = time.monotonic()
    assert proxy.process is not None
    proxy.process.send_signal(signal.SIGTERM)
    code = proxy.process.wait(timeout=args.drain_timeout_s + 120)
    exited = time.monotonic()
    stop.set()
    for thread in threads:
        thread.join(timeout=130)
    before = [c for c in out.calls if c[0] < signalled]
    drain_s, drain_line = drain_from_log(proxy.log_text())
    return Figures(
        started_before=len(before),
        in_flight=sum(1 for c in before if c[1] > signalled),
        failed_before=[c for c in before if c[3]],
        by_kind={kind: sum(1 for c in before if c[2] == kind) for kind in ("rest", "grpc", "stream")},
        drain_s=drain_s,
        drain_line=drain_line,
        exit_s=exited - signalled,
        code=code,
    )


_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"


def drain_from_log(log: str) -> tuple[float, str]:
    """Seconds from the proxy's "received SIGTERM" line to the end of its drain, and that line."""
    got = re.search(_STAMP + r" .*received SIGTERM", log)
    done = re.search(_STAMP + r" \S+\s+\S+: (drained.*|drain timeout.*)", log)
    if got is None or done is None:
        return float("nan"), "no drain lines in the proxy's log"
    stamp = "%Y-%m-%d %H:%M:%S,%f"
    return (datetime.strptime(done[1], stamp) - datetime.strptime(got[1], stamp)).total_seconds(), done[2]


def main() -> int:
    args = _arguments()
    with tempfile.TemporaryDirectory(prefix="tritonshare-sigterm-") as tmp:
        node = Node(Path(tmp)).create()
        config = IDENTITY_CONFIG.replace("count: 1", f"count: {args.instances}")
        write_model(node.layout.model_dir(MODEL), config=config, model_py=SLEEPY_MODEL.format(delay_s=args.delay_s))
        triton = start_triton(node)
        try:
            wait_model_ready(triton, MODEL, timeout_s=120)
            extra = ["--drain-timeout-s", str(args.drain_timeout_s), "--unload-timeout-s", "60"]
            proxy = ProxyProcess(MODEL, triton, node.layout, node.root / "proxy.log", extra).start()
            try:
                figures = run_once(proxy, args)
            finally:
                proxy.stop()
            log_tail = "\n".join(proxy.log_text().splitlines()[-30:])
        finally:
            triton.stop()
    load = f"c={args.rest} REST + c={args.grpc + args.streams} gRPC ({args.streams} of them streams)"
    print(f"SIGTERM under load: {load}; model sleeps {args.delay_s:g} s per request, {args.instances} instances")
    print("\n".join(figures.lines(args.drain_timeout_s)))
    for call in figures.failed_before[:10]:
        print(f"  failed: {call[2]} started {call[0]:.3f} ended {call[1]:.3f}: {call[3]}")
    bounded = figures.drain_s <= args.drain_timeout_s + 0.5
    passed = figures.code == 0 and bounded and (args.bounded or not figures.failed_before)
    if not passed:
        print("proxy log (tail):\n" + log_tail)
    print(f"RESULT: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rest", type=int, default=64)
    parser.add_argument("--grpc", type=int, default=48)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--delay-s", type=float, default=0.2, help="how long the model takes per request")
    parser.add_argument("--instances", type=int, default=8, help="model instances in Triton")
    parser.add_argument("--warm-s", type=float, default=6.0, help="load before the signal")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument(
        "--bounded",
        action="store_true",
        help="c=16 requests of 5 s each against a 1 s drain timeout: the drain must stop at 1 s",
    )
    args = parser.parse_args()
    if args.bounded:
        args.delay_s, args.drain_timeout_s, args.instances = 5.0, 1.0, 8
        args.rest, args.grpc, args.streams = 8, 4, 4
    return args


if __name__ == "__main__":
    raise SystemExit(main())
