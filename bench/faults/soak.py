"""Soak: a million requests, REST and gRPC together at c=64, through one ``tritonshare proxy`` — no error, and
the proxy's memory flat.

A real Triton serves the shared yardstick's identity model (``../shared/bench/models/identity``). ``wrk``
(REST, the yardstick's ``infer.lua``) and ``h2load`` (gRPC ModelInfer, a body from ``make_grpc_body.py``) each
hold half the connections and run side by side in rounds of ``--round-s`` seconds until ``--requests`` have been
answered. The proxy's VmRSS is sampled every ``--sample-s`` seconds. Figures:

- requests answered (REST / gRPC), rate, and every error the load generators saw (non-2xx, socket errors,
  h2load failures);
- gRPC status is in trailers, which h2load does not read: the proxy's own count by status code (its /metrics)
  and Triton's statistics of the model say how many succeeded and failed (the bar: only 200 / OK, 0 failed,
  and Triton counting at least as many successes as the clients);
- the proxy's VmRSS: before the load, after the first round (warm), the largest sample, and at the end
  (the bar: the end within ``--rss-slack-mib`` of warm).

Run from the repository root (takes several minutes; not part of CI)::

    .venv/bin/python -m bench.faults.soak [--requests 1000000] [--connections 64]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.answers import CUT
from bench.faults.node import Node, start_triton
from prometheus_client.parser import text_string_to_metric_families
from tests.support.children import vm_kib
from tests.support.install import wait_model_ready
from tests.support.proxy import ProxyProcess
from tests.support.triton import REPO_ROOT, TritonServer

YARDSTICK = REPO_ROOT.parent / "shared" / "bench"
MODEL = "identity"


@dataclass
class Tally:
    rounds: int = 0
    rest_ok: int = 0
    rest_errors: int = 0
    grpc_ok: int = 0
    grpc_errors: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return self.rest_ok + self.grpc_ok


@dataclass
class RssSampler:
    pid: int
    interval_s: float
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, KiB)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> RssSampler:
        started = time.monotonic()

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self.samples.append((time.monotonic() - started, vm_kib(self.pid, "VmRSS")))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---------------------------------------------------------------------------------------------- load generators


def wrk(port: int, connections: int, seconds: float, lua: Path) -> subprocess.Popen[str]:
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer"
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:.0f}s", "-s", str(lua), url]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def h2load(port: int, connections: int, seconds: float, body: Path) -> subprocess.Popen[str]:
    url = f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer"
    cmd = ["h2load", "-D", f"{seconds:.0f}", "-c", str(connections), "-m", "1", "-d", str(body),
           "-H", "content-type: application/grpc", "-H", "te: trailers", url]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def count_wrk(out: str, tally: Tally) -> None:
    done = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if done is None:
        tally.notes.append(f"wrk printed no count: {out[-500:]}")
        return
    errors = int(non2xx[1]) if non2xx else 0
    errors += sum(int(n) for n in sockets.groups()) if sockets else 0
    tally.rest_ok += int(done[1]) - (int(non2xx[1]) if non2xx else 0)
    tally.rest_errors += errors


def count_h2load(out: str, tally: Tally) -> None:
    line = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                     r"(\d+) errored, (\d+) timeout", out)  # fmt: skip
    if line is None:
        tally.notes.append(f"h2load printed no count: {out[-500:]}")
        return
    tally.grpc_ok += int(line[4])
    tally.grpc_errors += int(line[5]) + int(line[6]) + int(line[7])


def one_round(proxy: ProxyProcess, args: argparse.Namespace, lua: Path, body: Path, tally: Tally) -> None:
    half = args.connections // 2
    started = time.monotonic()
    rest, grpc = wrk(proxy.http_port, half, args.round_s, lua), h2load(proxy.grpc_port, half, args.round_s, body)
    rest_out, _ = rest.communicate(timeout=args.round_s + 120)
    grpc_out, _ = grpc.communicate(timeout=args.round_s + 120)
    tally.seconds += time.monotonic() - started
    tally.rounds += 1
    count_wrk(rest_out, tally)
    count_h2load(grpc_out, tally)


# ---------------------------------------------------------------------------------------------- Triton's view


def triton_counts(triton: TritonServer) -> tuple[int, int]:
    """(succeeded, failed) inferences of MODEL, by Triton's statistics."""
    with urllib.request.urlopen(f"{triton.url}/v2/models/{MODEL}/stats", timeout=10) as reply:
        stats = json.load(reply)["model_stats"]
    success = sum(int(s["inference_stats"]["success"]["count"]) for s in stats)
    fail = sum(int(s["inference_stats"]["fail"]["count"]) for s in stats)
    return success, fail


def proxy_codes(proxy: ProxyProcess) -> dict[str, int]:
    """The proxy's own count of answered requests by ``protocol code`` (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=10) as reply:
        return codes_of(reply.read().decode())


def codes_of(page: str) -> dict[str, int]:
    """``protocol code`` → answers on a metrics page, summed over every series of that pair: the proxy keeps one
    per route (infer, the probes, metadata), so taking any one of them undercounts."""
    codes: dict[str, int] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "tritonshare_proxy_requests_total":
                key = f"{sample.labels['protocol']} {sample.labels['code']}"
                codes[key] = codes.get(key, 0) + int(sample.value)
    return codes


def main() -> int:
    args = _arguments()
    for tool in ("wrk", "h2load"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (scripts/setup.sh installs it)")
            return 2
    with tempfile.TemporaryDirectory(prefix="tritonshare-soak-") as tmp:
        node = Node(Path(tmp)).create()
        shutil.copytree(YARDSTICK / "models" / MODEL, node.layout.model_dir(MODEL))
        # As the loader does: a plain __pycache__ file keeps the Python backend from writing bytecode into the
        # model folder, which POLL takes for a change: Triton would reload the model mid-soak (and reset its
        # statistics, which this figure reads).
        (node.layout.model_dir(MODEL) / "1" / "__pycache__").touch()
        lua, body = node.root / "infer.lua", node.root / "infer.grpc"
        shutil.copy(YARDSTICK / "infer.lua", lua)
        subprocess.run([sys.executable, str(YARDSTICK / "make_grpc_body.py"), MODEL, "16", str(body)], check=True)
        triton = start_triton(node)
        try:
            wait_model_ready(triton, MODEL, timeout_s=120)
            proxy = ProxyProcess(MODEL, triton, node.layout, node.root / "proxy.log", ["--no-unload"]).start()
            try:
                return soak(triton, proxy, args, lua, body)
            finally:
                proxy.stop()
        finally:
            triton.stop()


def soak(triton: TritonServer, proxy: ProxyProcess, args: argparse.Namespace, lua: Path, body: Path) -> int:
    idle_kib = vm_kib(proxy.pid, "VmRSS")
    before = triton_counts(triton)
    sampler = RssSampler(proxy.pid, args.sample_s).start()
    tally = Tally()
    warm_kib = 0
    while tally.answered < args.requests:
        one_round(proxy, args, lua, body, tally)
        warm_kib = warm_kib or vm_kib(proxy.pid, "VmRSS")
        print(f"  {tally.answered:,} answered, {tally.rest_errors + tally.grpc_errors} errors, "
              f"RSS {vm_kib(proxy.pid, 'VmRSS') / 1024:.1f} MiB", flush=True)  # fmt: skip
    sampler.stop()
    end_kib = vm_kib(proxy.pid, "VmRSS")
    codes = proxy_codes(proxy)
    succeeded, failed = (after - was for after, was in zip(triton_counts(triton), before, strict=True))
    peak_kib = max([kib for _, kib in sampler.samples] + [end_kib])
    flat = end_kib - warm_kib <= args.rss_slack_mib * 1024
    # h2load -D ends a round by closing its connections: the calls then in flight count as "cancelled" (the client
    # went away; they run to their end at Triton: proxy/grpc_abandon.py), or "closed" with --grpc-cancellations
    # forward, at most one per connection per round; Triton completes them (its count is checked).
    left = tuple(f"{protocol} {code}" for protocol, code in sorted(CUT) if protocol == "grpc")
    cut = sum(codes.get(code, 0) for code in left)
    bad_codes = {code: n for code, n in codes.items() if code not in ("rest 200", "grpc ok", *left)}
    if cut > tally.rounds * (args.connections // 2):
        bad_codes["grpc cut"] = cut
    errors = tally.rest_errors or tally.grpc_errors or failed or bad_codes or tally.notes
    passed = not errors and succeeded >= tally.answered
    passed = passed and flat and proxy.process is not None and proxy.process.poll() is None
    mib = 1024.0
    print(f"soak: c={args.connections} ({args.connections // 2} REST wrk + {args.connections // 2} gRPC h2load)")
    print(f"answered: {tally.answered:,} (REST {tally.rest_ok:,}, gRPC {tally.grpc_ok:,}) in {tally.seconds:.0f} s, "
          f"{tally.answered / tally.seconds:,.0f} req/s")  # fmt: skip
    print(f"errors seen by the clients: REST {tally.rest_errors}, gRPC {tally.grpc_errors}")
    print(f"the proxy's own count by protocol and code: {', '.join(f'{c} {n:,}' for c, n in sorted(codes.items()))}"
          f" ('grpc cancelled': calls in flight when h2load closed its connections at the end of each of the "
          f"{tally.rounds} rounds)")  # fmt: skip
    print(f"Triton's statistics of the model: {succeeded:,} succeeded, {failed} failed")
    print(f"proxy VmRSS: idle {idle_kib / mib:.1f} MiB, warm {warm_kib / mib:.1f} MiB, max {peak_kib / mib:.1f} MiB, "
          f"end {end_kib / mib:.1f} MiB ({len(sampler.samples)} samples every {args.sample_s:g} s)")  # fmt: skip
    for note in tally.notes:
        print("  " + note)
    print(f"RESULT: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--connections", type=int, default=64, help="split evenly between REST and gRPC")
    parser.add_argument("--round-s", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--rss-slack-mib", type=float, default=8.0, help="how much the RSS may grow after warm-up")
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(main())
