"""What a client's gRPC deadline costs the proxy: CPU µs per unary call with and without one.

With cancellations absorbed (``--grpc-cancellations absorb``, the default; proxy/grpc_abandon.py) the proxy does not
pass ``grpc-timeout`` on to Triton, whose gRPC server would cancel the call at the deadline: the connection's header
blocks are re-encoded without it. grpcio sends the time left rounded, indexed in HPACK's table, so most calls repeat
the last block's bytes and take the short path (re-encoded); now and then a new value changes the table, and that
call and the next one or two are new blocks to the proxy: decoded, judged and re-encoded. One real Triton
(the shared yardstick's identity model) and one proxy (``bench/target.py``: ``.venv-opt``, compiled); a grpcio client
makes ``--calls`` ModelInfer calls one after another without a deadline, then as many with one (``--deadline-s``),
``--rounds`` times; the proxy's CPU time (user + system, /proc) over each batch, divided by the calls.
``--cancellations forward`` measures the proxy passing deadlines on instead.

usage: .venv/bin/python bench/grpc_deadlines.py [--calls 20000] [--rounds 3] [--cancellations absorb|forward]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import instructions  # noqa: E402  (bench/ is no package: its modules are imported by path)
import target  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request() -> bytes:
    message = pb.ModelInferRequest(model_name=instructions.MODEL)
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    message.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    return message.SerializeToString()


def batch(port: int, pid: int, calls: int, deadline_s: float | None) -> tuple[float, float]:
    """CPU µs of the proxy per call, and calls a second, over ``calls`` calls on one channel (after 200 unmeasured)."""
    body = request()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(200):
            call(body, timeout=deadline_s)
        cpu, start = cpu_seconds(pid), time.monotonic()
        for _ in range(calls):
            call(body, timeout=deadline_s)
        return 1e6 * (cpu_seconds(pid) - cpu) / calls, calls / (time.monotonic() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=10.0)
    parser.add_argument("--cancellations", choices=["absorb", "forward"], default="absorb")
    args = parser.parse_args()
    target.current()
    results: dict[str, list[float]] = {"no deadline": [], f"deadline {args.deadline_s:g} s": []}
    with tempfile.TemporaryDirectory(prefix="tritonshare-deadlines-") as tmp:
        run = Path(tmp)
        with instructions.triton(run) as ports:
            proxy = instructions.proxy_target(run, ports, ["--grpc-cancellations", args.cancellations])
            process = subprocess.Popen(proxy.command)
            try:
                instructions.wait_http(f"http://127.0.0.1:{ports.http}/v2/health/live", 60)
                for round_ in range(1, args.rounds + 1):
                    for label, deadline_s in zip(results, (None, args.deadline_s), strict=True):
                        us, rate = batch(ports.grpc, process.pid, args.calls, deadline_s)
                        results[label].append(us)
                        print(
                            f"round {round_} {label}: {us:.1f} µs of proxy CPU a call, {rate:,.0f} calls/s", flush=True
                        )
            finally:
                process.terminate()
                process.wait(30)
    print(f"\n{target.describe()}, --grpc-cancellations {args.cancellations}")
    for label, values in results.items():
        median = sorted(values)[len(values) // 2]
        print(f"{label}: median {median:.1f} µs of proxy CPU a call ({args.calls:,} calls a round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
