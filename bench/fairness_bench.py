"""Fairness figure (issue 9): does ``--max-inflight`` keep a flooding tenant from starving a quiet one?

Two models share one real Triton, each behind its own ``tritonshare proxy`` (as two pods would be):

- tenant A floods at concurrency 64; its model has ``--a-instances`` instances (default 2), so uncapped it
  can keep every core of this machine busy;
- tenant B sends one request at a time (concurrency 1).

Both models burn a fixed amount of CPU per request (``--cpu-ms``, default 5 ms of thread CPU time, so a
request takes longer when it has to share a core: contention shows as latency). B's p50/p99 is measured by
``wrk --latency`` in three runs: B alone, B with A uncapped, and B with A's proxy started with
``--max-inflight CAP --max-queue 256 --queue-timeout-s 60``. The issue's bar: the cap keeps B's p99 within
2x of its solo p99. If any of B's requests failed (non-2xx, socket errors) the run gives no verdict and exits 1.

Run from the repository root after ``scripts/setup.sh`` (needs .venv-triton and wrk)::

    .venv/bin/python -m bench.fairness_bench [--seconds 15] [--cap 1] [--runs solo,uncapped,capped]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.install import wait_model_ready
from tests.support.models import IDENTITY_CONFIG, write_model
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer, triton_available

from tritonshare.common.layout import NodeLayout

A, B = "tenant-a", "tenant-b"
RUNS = ("solo", "uncapped", "capped")

BUSY_MODEL = """\
import time

import triton_python_backend_utils as pb_utils

CPU_S = {cpu_s}


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            end = time.thread_time() + CPU_S  # CPU time, not wall time: sharing a core makes it slower
            while time.thread_time() < end:
                pass
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""

WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body   = '{"inputs":[{"name":"INPUT0","shape":[4],"datatype":"FP32","data":[1,2,3,4]}]}'
wrk.headers["Content-Type"] = "application/json"
"""


@dataclass(frozen=True)
class Load:
    """What one wrk run saw."""

    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int  # connect, read, write errors and timeouts

    @property
    def failures(self) -> int:
        return self.non_2xx + self.socket_errors


@dataclass(frozen=True)
class Result:
    run: str
    b: Load
    a: Load | None


def main() -> int:
    args = _arguments()
    if not triton_available() or shutil.which("wrk") is None:
        print("needs .venv-triton (scripts/setup.sh) and wrk on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tritonshare-fairness-") as tmp:
        root = Path(tmp)
        layout = _node(root, args)
        triton = TritonServer(repository=layout.repository, log_path=root / "triton.log").start()
        try:
            for name in (A, B):
                wait_model_ready(triton, name, timeout_s=120)
            results = [result for run in args.runs if (result := _attempt(run, triton, layout, root, args))]
        finally:
            triton.stop()
    _report(results, args)
    line, code = verdict(results)
    if line:
        print(f"\n{line}")
    return code


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each measured run")
    parser.add_argument("--cap", type=int, default=1, help="--max-inflight of tenant A's proxy in the capped run")
    parser.add_argument("--cpu-ms", type=float, default=5.0, help="CPU time each request burns in Triton")
    parser.add_argument("--a-instances", type=int, default=2, help="instances of A's model in Triton")
    parser.add_argument("--a-concurrency", type=int, default=64)
    parser.add_argument("--runs", type=lambda s: s.split(","), default=list(RUNS), help="subset of " + ",".join(RUNS))
    args = parser.parse_args()
    if unknown := set(args.runs) - set(RUNS):
        parser.error(f"unknown runs {sorted(unknown)}; choose from {','.join(RUNS)}")
    return args


def _node(root: Path, args: argparse.Namespace) -> NodeLayout:
    layout = NodeLayout(repository=root / "models", staging=root / "staging")
    layout.staging.mkdir(parents=True)
    busy = BUSY_MODEL.format(cpu_s=args.cpu_ms / 1000)
    write_model(layout.model_dir(A), config=_instances(args.a_instances), model_py=busy)
    write_model(layout.model_dir(B), config=_instances(1), model_py=busy)
    (root / "infer.lua").write_text(WRK_SCRIPT)
    return layout


def _instances(count: int) -> str:
    return IDENTITY_CONFIG.replace("count: 1", f"count: {count}")


class ProxyDidNotStart(Exception):
    pass


def _attempt(run: str, triton: TritonServer, layout: NodeLayout, root: Path, args: argparse.Namespace) -> Result | None:
    try:
        return _run(run, triton, layout, root, args)
    except ProxyDidNotStart as exc:
        print(f"skipping the {run!r} run: {exc}", file=sys.stderr)
        return None


def _run(run: str, triton: TritonServer, layout: NodeLayout, root: Path, args: argparse.Namespace) -> Result:
    limits = ["--max-inflight", str(args.cap), "--max-queue", "256", "--queue-timeout-s", "60"]
    proxies = [_proxy(B, triton, layout, root, run, [])]
    if run != "solo":
        proxies.append(_proxy(A, triton, layout, root, run, limits if run == "capped" else []))
    try:
        flood = None
        if run != "solo":
            flood = _wrk(proxies[1], root, args.a_concurrency, args.seconds + 2)
            time.sleep(1.0)  # A's flood is at full strength before B is measured
        b = _parse(_wrk(proxies[0], root, 1, args.seconds).communicate()[0])
        a = _parse(flood.communicate()[0]) if flood is not None else None
    finally:
        for proxy in proxies:
            proxy.stop()
    print(f"{run}: B {b}; A {a}", file=sys.stderr)
    return Result(run, b, a)


def _proxy(name: str, triton: TritonServer, layout: NodeLayout, root: Path, run: str, extra: list[str]) -> ProxyProcess:
    log = root / f"proxy-{name}-{run}.log"
    proxy = ProxyProcess(name, triton, layout, log, ["--no-unload", *extra])
    try:
        return proxy.start()
    except TimeoutError:
        proxy.stop()
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
        raise ProxyDidNotStart(
            f"the proxy of {name} did not start ({' '.join(extra) or 'no options'}):\n{tail}"
        ) from None


def _wrk(proxy: ProxyProcess, root: Path, concurrency: int, seconds: float) -> subprocess.Popen[str]:
    url = f"http://{proxy.url}/v2/models/{proxy.name}/infer"
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "--latency", "-s", str(root / "infer.lua"), url]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _parse(out: str) -> Load:
    def number(pattern: str, default: str | None = None) -> str:
        match = re.search(pattern, out, re.MULTILINE)
        if match is None:
            if default is not None:
                return default
            raise SystemExit(f"unexpected wrk output (no {pattern!r}):\n{out}")
        return match.group(1)

    return Load(
        requests=int(number(r"^\s*(\d+) requests in")),
        rps=float(number(r"^Requests/sec:\s*([\d.]+)")),
        p50_ms=_ms(number(r"^\s*50%\s+(\S+)")),
        p99_ms=_ms(number(r"^\s*99%\s+(\S+)")),
        non_2xx=int(number(r"Non-2xx or 3xx responses:\s*(\d+)", "0")),
        socket_errors=_socket_errors(out),
    )


def _socket_errors(out: str) -> int:
    """wrk's ``Socket errors: connect 0, read 2, write 0, timeout 5`` (a line printed only when there are some)."""
    line = re.search(r"^\s*Socket errors:(.*)$", out, re.MULTILINE)
    return sum(int(n) for n in re.findall(r"\d+", line.group(1))) if line else 0


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def _report(results: list[Result], args: argparse.Namespace) -> None:
    solo = next((r.b.p99_ms for r in results if r.run == "solo"), None)
    print(
        f"# fairness: B at c=1 next to A at c={args.a_concurrency}; {args.cpu_ms:g} ms CPU per request, "
        f"A has {args.a_instances} instances; {args.seconds:g} s per run; capped = --max-inflight {args.cap}"
    )
    print("| run | B p50 ms | B p99 ms | B p99 / solo | B rps | B failed | A rps | A refused |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r.b.p99_ms / solo:.2f}x" if solo else "-"
        a_rps, a_refused = (f"{r.a.rps:.0f}", str(r.a.non_2xx)) if r.a else ("-", "-")
        print(
            f"| {r.run} | {r.b.p50_ms:.2f} | {r.b.p99_ms:.2f} | {ratio} | {r.b.rps:.0f} | {r.b.failures} | {a_rps} "
            f"| {a_refused} |"
        )


def verdict(results: list[Result]) -> tuple[str, int]:
    """The line judging the 2x bar (none without a solo and a capped run) and the exit code. A run in which any of
    B's requests failed gives no verdict and exits 1: its latencies would time error answers (a refusal comes
    back fast), not the service B gets."""
    if failing := [r for r in results if r.b.failures]:
        runs = ", ".join(f"{r.run} {r.b.failures} of {r.b.requests}" for r in failing)
        return f"no verdict: tenant B's requests failed (non-2xx or socket errors: {runs})", 1
    solo = next((r.b.p99_ms for r in results if r.run == "solo"), None)
    capped = next((r for r in results if r.run == "capped"), None)
    if not solo or capped is None:
        return "", 0
    met = "meets" if capped.b.p99_ms <= 2 * solo else "MISSES"
    return f"capped B p99 {capped.b.p99_ms:.2f} ms vs solo {solo:.2f} ms: {met} the 2x bar", 0


if __name__ == "__main__":
    sys.exit(main())
