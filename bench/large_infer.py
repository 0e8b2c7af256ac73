"""A 16 MiB binary-tensor infer through tritonshare's REST proxy and through nginx, timed side by side.

Starts a real Triton (../shared/bench, the identity model), nginx twice from bench/nginx-large.conf.in (its
defaults, which buffer whole bodies, and streaming both ways), and ``tritonshare proxy``; then sends the same
request (binary tensor extension: a small JSON header, then 16 MiB of FP32) round after round to each target
in turn, reading the whole 16 MiB answer, and prints the median wall time per target, its ratio to the best
nginx, and the proxy's CPU per request and peak RSS.

usage: .venv/bin/python bench/large_infer.py [--rounds 15] [--mib 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import target  # noqa: E402  (which tritonshare to measure: .venv-opt, as the image's interpreter, else .venv)

ROOT = Path(__file__).resolve().parent.parent
YARD = Path(os.environ.get("TRITONSHARE_YARDSTICK", ROOT.parent / "shared" / "bench"))
STREAMING = "proxy_request_buffering off; proxy_buffering off;"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(port: int, path: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"nothing answered 200 on 127.0.0.1:{port}{path} within {timeout_s}s")


def request_bytes(mib: int) -> tuple[bytes, bytes]:
    """(JSON header, whole body) of an identity infer with one FP32 tensor of ``mib`` MiB, binary both ways."""
    count = mib * (1 << 20) // 4
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [count], "datatype": "FP32", "parameters": {"binary_data_size": count * 4}}
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header, header + os.urandom(count * 4)


def infer_once(port: int, header: bytes, body: bytes) -> float:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(
        "POST",
        "/v2/models/identity/infer",
        body=body,
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    response = conn.getresponse()
    answer = response.read()
    took = time.perf_counter() - started
    conn.close()
    if response.status != 200 or len(answer) < len(body) - len(header):
        raise RuntimeError(f"port {port}: status {response.status}, {len(answer)} bytes back: {answer[:200]!r}")
    return took


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def start_nginx(run: Path, name: str, triton_http: int, streaming: bool) -> tuple[int, Path]:
    folder = run / name
    folder.mkdir()
    conf = (ROOT / "bench" / "nginx-large.conf.in").read_text()
    port = free_port()
    for key, value in {
        "@RUN@": str(folder),
        "@MODEL@": "identity",
        "@UP_HTTP@": str(triton_http),
        "@UP_GRPC@": str(free_port()),
        "@HTTP@": str(port),
        "@GRPC@": str(free_port()),
        "@STREAMING@": STREAMING if streaming else "",
    }.items():
        conf = conf.replace(key, value)
    (folder / "nginx.conf").write_text(conf)
    subprocess.run(["nginx", "-c", str(folder / "nginx.conf"), "-p", str(folder)], check=True)
    return port, folder / "nginx.pid"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mib", type=int, default=16)
    args = parser.parse_args()
    run = Path(tempfile.mkdtemp(prefix="tritonshare-large."))
    run.chmod(0o755)  # nginx workers (user nobody) write buffered bodies under it
    stops: list[tuple[str, int]] = []
    try:
        (run / "models").mkdir()
        (run / "staging").mkdir()
        shutil.copytree(YARD / "models" / "identity", run / "models" / "identity")
        th, tg, tm = free_port(), free_port(), free_port()
        triton = subprocess.run(
            ["bash", str(YARD / "triton-up.sh"), str(ROOT / ".venv-triton"), str(run / "models"), str(th), str(tg),
             str(tm), str(run / "triton.log")],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        stops.append(("group", int(triton)))
        wait_http(th, "/v2/models/identity/ready", timeout_s=120)
        targets = {"direct": th}
        for name, streaming in (("nginx", False), ("nginx-stream", True)):
            port, pidfile = start_nginx(run, name, th, streaming)
            stops.append(("nginx", int(pidfile.read_text())))
            targets[name] = port
        ph = free_port()
        proxy = subprocess.Popen(
            [str(target.venv() / "bin" / "tritonshare"), "--log-level", "warning", "proxy", "--name", "identity",
             "--host", "127.0.0.1", "--triton-url", f"http://127.0.0.1:{th}", "--triton-grpc", f"127.0.0.1:{tg}",
             "--http-port", str(ph), "--grpc-port", str(free_port()), "--metrics-port", "0", "--no-unload",
             "--repository", str(run / "models"), "--staging", str(run / "staging")],
            stderr=open(run / "proxy.log", "wb"),
        )  # fmt: skip
        stops.append(("pid", proxy.pid))
        targets["ours"] = ph
        for port in targets.values():
            wait_http(port, "/v2/health/live")
        header, body = request_bytes(args.mib)
        times: dict[str, list[float]] = {name: [] for name in targets}
        for port in targets.values():  # warm-up: connections, pools, page cache
            infer_once(port, header, body)
        cpu_before = cpu_ticks(proxy.pid)
        for round_ in range(args.rounds):
            order = list(targets.items())
            for name, port in order if round_ % 2 == 0 else reversed(order):
                times[name].append(infer_once(port, header, body))
        cpu_us = (cpu_ticks(proxy.pid) - cpu_before) * 1e6 / os.sysconf("SC_CLK_TCK") / args.rounds
        best_nginx = min(statistics.median(times["nginx"]), statistics.median(times["nginx-stream"]))
        print(f"# {args.mib} MiB binary infer (identity, binary output), {args.rounds} rounds, order alternating")
        for name, values in times.items():
            median = statistics.median(values)
            print(
                f"{name:13s} median {median * 1000:7.1f} ms  min {min(values) * 1000:7.1f} ms  "
                f"x{median / best_nginx:.2f} of the best nginx"
            )
        hwm = next(line for line in Path(f"/proc/{proxy.pid}/status").read_text().splitlines() if "VmHWM" in line)
        print(f"tritonshare proxy: {cpu_us / 1000:.1f} ms CPU per request; peak RSS {hwm.split()[1]} kB")
        return 0
    finally:
        for kind, pid in reversed(stops):
            try:
                if kind == "group":
                    os.killpg(pid, signal.SIGTERM)
                elif kind == "nginx":
                    os.kill(pid, signal.SIGQUIT)
                else:
                    os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(1)
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
