"""gRPC clients that give up their calls, against the Triton every tenant shares: does Triton survive?

Triton before 24.12 (the tests' and overlays' 2.51 among them) can crash — SIGSEGV in its gRPC handlers — when a
call's cancellation meets the call's end (triton-inference-server/server#7368, #8034; fixed by PR #7840). Clients
with deadlines near the call's latency make such meetings frequent: here ``--clients`` unary clients call an
identity model in a loop, each call with a deadline drawn between ``--min-deadline-ms`` and
``--max-deadline-ms``, and ``--streams`` ModelStreamInfer clients send message after message on a stream whose
deadline ends it mid-flight, for ``--seconds``. The target (``--target``), each run with a Triton of its own:

- ``direct``: the clients talk to Triton (what happens without a proxy, or behind one that passes cancellations
  on);
- ``forward``: through ``tritonshare proxy --grpc-cancellations forward`` (as nginx: RST_STREAM and
  ``grpc-timeout`` passed on);
- ``absorb``: through ``tritonshare proxy`` as it runs by default: Triton is never told (proxy/grpc_abandon.py).

Figures: the calls by outcome (OK, DEADLINE_EXCEEDED, other), the proxy's own count of calls its clients gave up
(``cancelled``), whether Triton was alive at the end (its process, ``/v2/health/live``) and the crash lines in its
log, and when it died if it did, and how many of 100 calls made once the storm is over were answered. The bar
(``absorb``): Triton alive with no crash line, no outcome but OK, DEADLINE_EXCEEDED, and UNAVAILABLE from the
proxy's REFUSED_STREAM (a connection at ``--grpc-max-streams``, calls its client gave up still running at Triton
among them), and all 100 calls after the storm answered. ``direct`` and ``forward`` report what they report (exit
0): they are the reference.

Run from the repository root (the proxy from the source tree; with ``PYTHONPATH=.build/compiled``, compiled)::

    .venv/bin/python -m bench.faults.cancel_storm [--target absorb|forward|direct] [--seconds 60]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from bench.faults.node import Node, start_triton
from tests.support.install import wait_model_ready
from tests.support.models import IDENTITY_CONFIG, write_model
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonclient.grpc import service_pb2 as pb

from tritonshare.proxy.policy import GRPC_SERVICE

MODEL = "storm"
AFTER_CALLS = 100  # calls made once the storm is over
CRASH = re.compile(r"Signal \(11\)|Segmentation fault|SIGSEGV|pthread_mutex_lock")


def request_bytes() -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    return request.SerializeToString()


class Storm:
    """The clients, and what came of their calls."""

    def __init__(self, address: str, args: argparse.Namespace) -> None:
        self._address = address
        self._args = args
        self._body = request_bytes()
        self._until = time.monotonic() + args.seconds
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.stopped = threading.Event()  # Triton is gone: no use going on

    def run(self) -> None:
        workers = [threading.Thread(target=self._unary, args=(n,)) for n in range(self._args.clients)]
        workers += [threading.Thread(target=self._stream, args=(n,)) for n in range(self._args.streams)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    def _going(self) -> bool:
        return time.monotonic() < self._until and not self.stopped.is_set()

    def _deadline(self, rng: np.random.Generator, scale: float = 1.0) -> float:
        return float(rng.uniform(self._args.min_deadline_ms, self._args.max_deadline_ms)) * scale / 1000

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def _unary(self, n: int) -> None:
        rng = np.random.default_rng(n)
        with grpc.insecure_channel(self._address) as channel:
            call = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")
            while self._going():
                try:
                    call(self._body, timeout=self._deadline(rng))
                    self._count("unary OK")
                except grpc.RpcError as exc:
                    self._count(f"unary {outcome(exc)}")

    def _stream(self, n: int) -> None:
        rng = np.random.default_rng(1000 + n)
        with grpc.insecure_channel(self._address) as channel:
            call = channel.stream_stream(f"/{GRPC_SERVICE}/ModelStreamInfer")
            while self._going():
                answers = 0
                try:
                    for _ in call(self._messages(), timeout=self._deadline(rng, scale=10.0)):
                        answers += 1
                    self._count("stream OK")
                except grpc.RpcError as exc:
                    self._count(f"stream {outcome(exc)}")

    def _messages(self) -> Iterator[bytes]:
        for _ in range(1000):  # more than a stream's deadline lets through
            if not self._going():
                return
            yield self._body
            time.sleep(0.0002)


def outcome(exc: grpc.RpcError) -> str:
    """A failed call's code; UNAVAILABLE told apart when it is the proxy's REFUSED_STREAM: the connection has as
    many streams open as ``--grpc-max-streams`` allows, calls its client gave up among them (they hold their
    places until Triton ends them) — backpressure, which clients retry."""
    code: str = exc.code().name  # type: ignore[attr-defined]
    details = exc.details() or ""  # type: ignore[attr-defined]
    return f"{code} (refused stream)" if code == "UNAVAILABLE" and "error code 7" in details else code


def triton_alive(triton: TritonServer) -> bool:
    if triton.process is None or triton.process.poll() is not None:
        return False
    try:
        with urllib.request.urlopen(f"{triton.url}/v2/health/live", timeout=3):
            return True
    except OSError:
        return False


def watch(triton: TritonServer, storm: Storm, started: float, died: list[float]) -> None:
    """Checks Triton twice a second while the storm lasts; stops it when Triton is gone."""
    while not storm.stopped.is_set():
        if not triton_alive(triton):
            died.append(time.monotonic() - started)
            storm.stopped.set()
            return
        time.sleep(0.5)


def served_after(address: str, body: bytes, calls: int = AFTER_CALLS) -> int:
    """Calls without a tight deadline once the storm is over, one after another: how many were answered OK. Calls
    given up but still holding their places (admission, ``--grpc-max-streams``) after Triton ended them would
    show here as refusals."""
    answered = 0
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")
        for _ in range(calls):
            try:
                call(body, timeout=10.0)
                answered += 1
            except grpc.RpcError:
                pass
    return answered


def cancelled_by_clients(proxy: ProxyProcess) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as response:
        page = response.read().decode()
    found = re.findall(
        r'tritonshare_proxy_requests_total\{[^}]*code="cancelled"[^}]*protocol="grpc"[^}]*\} (\S+)', page
    )
    return int(sum(float(value) for value in found))


@dataclass(frozen=True)
class Outcome:
    """What came of one storm."""

    outcomes: Counter[str]  # the calls, by kind and code
    seconds: float  # how long it lasted (until Triton died, if it did)
    cancelled: int | None  # the proxy's count of calls its clients gave up (None: direct)
    died_after: float | None  # when Triton was found gone, into the storm
    alive: bool  # Triton, at the end
    crash_lines: list[str]  # what Triton logged as it died (its backtrace)
    served: int  # of AFTER_CALLS calls once the storm was over, how many were answered OK

    @property
    def unexpected(self) -> dict[str, int]:
        """Outcomes other than OK, DEADLINE_EXCEEDED and the proxy's REFUSED_STREAM."""
        expected = ("OK", "DEADLINE_EXCEEDED", "(refused stream)")
        return {kind: n for kind, n in self.outcomes.items() if not kind.endswith(expected)}

    @property
    def passed(self) -> bool:
        return self.alive and not self.crash_lines and not self.unexpected and self.served == AFTER_CALLS


def storm(args: argparse.Namespace, root: Path) -> Outcome:
    """A Triton of its own in ``root`` (and the proxy, unless ``direct``), then the storm."""
    node = Node(root).create()
    write_model(node.layout.model_dir(MODEL), config=IDENTITY_CONFIG.replace("count: 1", "count: 2"))
    triton = start_triton(node)
    proxy = None
    try:
        wait_model_ready(triton, MODEL, timeout_s=120)
        address = triton.grpc_url
        if args.target != "direct":
            extra = ["--no-unload", "--grpc-cancellations", args.target]
            proxy = ProxyProcess(MODEL, triton, node.layout, node.root / "proxy.log", extra).start()
            address = proxy.grpc_url
        clients, died = Storm(address, args), []
        started = time.monotonic()
        watcher = threading.Thread(target=watch, args=(triton, clients, started, died))
        watcher.start()
        clients.run()
        seconds = time.monotonic() - started
        time.sleep(1.0)  # calls the clients gave up end at Triton
        alive = not died and triton_alive(triton)
        clients.stopped.set()
        watcher.join()
        served = served_after(address, request_bytes()) if alive else 0
        cancelled = cancelled_by_clients(proxy) if proxy is not None and proxy.process else None
        log = triton.log_path.read_text(errors="replace").splitlines()
        crashes = [n for n, line in enumerate(log) if CRASH.search(line)]
        crash_lines = log[crashes[0] : crashes[0] + 12] if crashes else []
    finally:
        if proxy is not None:
            proxy.stop()
        triton.kill()  # its process group: a Triton that died leaves its Python backend stubs running
    return Outcome(clients.outcomes, seconds, cancelled, died[0] if died else None, alive, crash_lines, served)


def main() -> int:
    args = arguments()
    with tempfile.TemporaryDirectory(prefix="tritonshare-cancel-storm-") as tmp:
        outcome = storm(args, Path(tmp))
    calls = sum(outcome.outcomes.values())
    deadline = f"{args.min_deadline_ms:g}-{args.max_deadline_ms:g} ms (streams ×10)"
    clients = f"{args.clients} unary + {args.streams} stream clients"
    print(f"cancel storm, target {args.target}: {clients}, deadlines {deadline}")
    counts = ", ".join(f"{kind} {n:,}" for kind, n in sorted(outcome.outcomes.items()))
    print(f"calls: {calls:,} in {outcome.seconds:.1f} s: {counts}")
    if outcome.cancelled is not None:
        gave_up = f"{outcome.cancelled:,}"
        print(f"the proxy's count of calls its clients gave up (run on at Triton, or cancelled there): {gave_up}")
    gone = f" (gone {outcome.died_after:.1f} s into the storm)" if outcome.died_after is not None else ""
    print(f"Triton: {'alive' if outcome.alive else 'DEAD'}{gone}")
    print(f"after the storm: {outcome.served} of {AFTER_CALLS} calls (10 s deadline) answered OK")
    for line in outcome.crash_lines:
        print(f"  triton.log: {line.strip()[:160]}")
    if args.target != "absorb":
        print("RESULT: REFERENCE (no bar)")
        return 0
    print(f"RESULT: {'PASS' if outcome.passed else 'FAIL'}")
    return 0 if outcome.passed else 1


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["absorb", "forward", "direct"], default="absorb")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8, help="unary clients")
    parser.add_argument("--streams", type=int, default=4, help="ModelStreamInfer clients")
    parser.add_argument("--min-deadline-ms", type=float, default=0.2)
    parser.add_argument("--max-deadline-ms", type=float, default=3.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
