"""Issue 4's bars from `bench/proxy_bench.sh SECONDS ROUNDS` output (read on stdin): the median of each point
over the rounds, for nginx and for the proxy, and whether each bar is met.

usage: bash bench/proxy_bench.sh 5 3        (calls this at the end)   or   ... | .venv/bin/python bench/proxy_summary.py
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}  # to milliseconds
LINE = re.compile(r"^(nginx|ours(?:@\S+)?) (rest|grpc|stream) c=(\d+) (.*)$")  # ours@VENV: one more proxy


@dataclass(frozen=True)
class Bar:
    protocol: str
    concurrency: int
    measure: str  # "cpu" | "rps" | "p99"
    limit: float  # ours / nginx must be <= limit ("cpu", "p99") or >= limit ("rps")


BARS = [
    *(Bar("rest", c, "cpu", 1.0) for c in (1, 16)),
    Bar("rest", 16, "rps", 1.0),
    *(Bar("rest", c, "p99", 1.0) for c in (1, 16)),
    *(Bar(p, c, "cpu", 1.5) for p in ("grpc", "stream") for c in (1, 16)),
    *(Bar(p, 16, "rps", 0.8) for p in ("grpc", "stream")),
]


def milliseconds(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if match is None:
        raise ValueError(f"not a latency: {text!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def failed(rest: str) -> bool:
    """A point whose requests did not all succeed (Triton's Python stub has crashed under load here): its
    figures measure error answers, not forwarding."""
    errors = re.search(r"non2xx=(\d+)", rest) or re.search(r"\d+ok/(\d+)failed", rest)
    return errors is None or int(errors.group(1)) > 0


def parse(lines: Iterable[str], skipped: list[str] | None = None) -> dict[tuple[str, str, int, str], list[float]]:
    """(target, protocol, concurrency, measure) -> the values of every round; points with failed requests are
    left out (and added to ``skipped``)."""
    values: dict[tuple[str, str, int, str], list[float]] = defaultdict(list)
    for line in lines:
        match = LINE.match(line.strip())
        if match is None:
            continue
        target, protocol, c, rest = match.group(1), match.group(2), int(match.group(3)), match.group(4)
        if failed(rest):
            if skipped is not None:
                skipped.append(line.strip())
            continue
        fields = dict(item.split("=", 1) for item in rest.split() if "=" in item)
        key = (target, protocol, c)
        if "rps" in fields:
            values[(*key, "rps")].append(float(fields["rps"]))
        if "cpu_us_per_req" in fields:
            values[(*key, "cpu")].append(float(fields["cpu_us_per_req"]))
        if "p99" in fields:
            values[(*key, "p99")].append(milliseconds(fields["p99"]))
    return values


def number(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def report(values: dict[tuple[str, str, int, str], list[float]], target: str = "ours") -> list[str]:
    """The bars for one proxy (``ours``, or ``ours@VENV``) against nginx."""
    label = "tritonshare" if target == "ours" else target
    out = [
        f"| bar (CPU µs/req, rps, p99 ms) | nginx (median) | {label} (median) | ratio | rounds (ratio each) | met |",
        "|---|---:|---:|---:|---|:---:|",
    ]
    for bar in BARS:
        theirs = values.get(("nginx", bar.protocol, bar.concurrency, bar.measure), [])
        ours = values.get((target, bar.protocol, bar.concurrency, bar.measure), [])
        if not theirs or not ours:
            continue
        ratio = statistics.median(ours) / statistics.median(theirs)
        each = ", ".join(f"{o / t:.2f}" for o, t in zip(ours, theirs, strict=False))
        met = ratio >= bar.limit if bar.measure == "rps" else ratio <= bar.limit
        sign = "≥" if bar.measure == "rps" else "≤"
        name = f"{bar.protocol} c={bar.concurrency} {bar.measure} {sign} {bar.limit:g}×"
        medians = f"{number(statistics.median(theirs))} | {number(statistics.median(ours))}"
        out.append(f"| {name} | {medians} | {ratio:.2f}× | {each} | {'yes' if met else '**no**'} |")
    return out


def main() -> int:
    skipped: list[str] = []
    values = parse(sys.stdin, skipped)
    others = sorted({key[0] for key in values if key[0].startswith("ours@")})
    print("\n".join(report(values)))
    for target in others:
        print("\n" + "\n".join(report(values, target)))
    for line in skipped:
        print(f"left out (requests failed): {line}")
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
