"""Issue 4's bars from `bench/proxy_bench.sh SECONDS ROUNDS` output (read on stdin): each point of the proxy
against nginx's in the same round (the two ran back to back), the median of those ratios over the rounds, and
whether each bar is met. A round where either side's point failed is left out of that bar, and so is every point
of a contestant in a round whose ``answers`` line (bench/answers.py: the proxy's and Triton's own counts) shows
an answer that was not a success; either makes the exit code 1. ``--answers`` only checks the answers lines.

usage: bash bench/proxy_bench.sh 5 3        (calls this at the end)   or   ... | .venv/bin/python bench/proxy_summary.py
       ... | .venv/bin/python bench/proxy_summary.py --answers
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
ROUND = re.compile(r"^# round (\d+)")
ANSWERS = re.compile(r"^(\S+) answers (.*)$")
Values = dict[tuple[str, str, int, str], dict[int, float]]  # (target, protocol, concurrency, measure) → round → value


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


def all_succeeded(rest: str) -> bool:
    """Whether an ``answers`` line shows every answer of the turn a success: Triton failed none and, where the
    proxy's own count is there, it gave no other answer than a success, and cut no more than the limit."""
    fields = dict(item.split("=", 1) for item in rest.split() if "=" in item)
    if fields.get("triton_failed") != "0":
        return False  # a failure, or the pages were unreadable
    if "cut" not in fields:
        return True  # nginx, direct: Triton's count only
    cut, limit = fields["cut"].split("/")
    return fields.get("other") == "0" and int(cut) <= int(limit)


def by_round(lines: Iterable[str]) -> list[tuple[int, str]]:
    """Each line, stripped, with its round (0 before any ``# round N`` line)."""
    out, round_ = [], 0
    for line in lines:
        if heading := ROUND.match(line.strip()):
            round_ = int(heading.group(1))
        out.append((round_, line.strip()))
    return out


def unanswered(lines: list[tuple[int, str]]) -> dict[tuple[str, int], str]:
    """(target, round) → its answers line, for each turn whose answers were not all successes."""
    found = ((round_, ANSWERS.match(line)) for round_, line in lines)
    return {(m.group(1), round_): m.group(0) for round_, m in found if m and not all_succeeded(m.group(2))}


def parse(lines: Iterable[str], skipped: list[str] | None = None, refused: list[str] | None = None) -> Values:
    """(target, protocol, concurrency, measure) -> round -> value (round 0 before any ``# round N`` line); points
    with failed requests are left out (and added to ``skipped``), and so are a contestant's points in a round
    whose answers were not all successes (its answers line added to ``refused``)."""
    values: Values = defaultdict(dict)
    numbered = by_round(lines)
    bad = unanswered(numbered)
    if refused is not None:
        refused.extend(f"round {round_}: {line}" for (_, round_), line in bad.items())
    for round_, line in numbered:
        match = LINE.match(line)
        if match is None:
            continue
        target, protocol, c, rest = match.group(1), match.group(2), int(match.group(3)), match.group(4)
        if (target, round_) in bad:
            continue
        if failed(rest):
            if skipped is not None:
                skipped.append(line)
            continue
        fields = dict(item.split("=", 1) for item in rest.split() if "=" in item)
        key = (target, protocol, c)
        if "rps" in fields:
            values[(*key, "rps")][round_] = float(fields["rps"])
        if "cpu_us_per_req" in fields:
            values[(*key, "cpu")][round_] = float(fields["cpu_us_per_req"])
        if "p99" in fields:
            values[(*key, "p99")][round_] = milliseconds(fields["p99"])
    return values


def number(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def report(values: Values, target: str = "ours") -> list[str]:
    """The bars for one proxy (``ours``, or ``ours@VENV``) against nginx, each judged on the median of the
    ratios of the rounds where both have the point (medians of unrelated rounds would mix the load each saw)."""
    label = "tritonshare" if target == "ours" else target
    out = [
        f"| bar (CPU µs/req, rps, p99 ms) | nginx (median) | {label} (median) | ratio (median) | rounds (ratio each) "
        "| met |",
        "|---|---:|---:|---:|---|:---:|",
    ]
    for bar in BARS:
        theirs = values.get(("nginx", bar.protocol, bar.concurrency, bar.measure), {})
        ours = values.get((target, bar.protocol, bar.concurrency, bar.measure), {})
        rounds = sorted(theirs.keys() & ours.keys())
        if not rounds:
            continue
        ratios = [ours[r] / theirs[r] for r in rounds]
        ratio = statistics.median(ratios)
        each = ", ".join(f"{r:.2f}" for r in ratios)
        met = ratio >= bar.limit if bar.measure == "rps" else ratio <= bar.limit
        sign = "≥" if bar.measure == "rps" else "≤"
        name = f"{bar.protocol} c={bar.concurrency} {bar.measure} {sign} {bar.limit:g}×"
        nginx, proxy = (number(statistics.median(side[r] for r in rounds)) for side in (theirs, ours))
        out.append(f"| {name} | {nginx} | {proxy} | {ratio:.2f}× | {each} | {'yes' if met else '**no**'} |")
    return out


def main(argv: list[str]) -> int:
    lines = sys.stdin.readlines()
    if argv == ["--answers"]:
        numbered = by_round(lines)
        for (_, round_), line in unanswered(numbered).items():
            print(f"not every answer a success, round {round_}: {line}")
        turns = sum(1 for _, line in numbered if ANSWERS.match(line))
        print(f"answers checked in {turns} turns" + ("" if turns else ": none found, nothing shows they succeeded"))
        return 1 if unanswered(numbered) or not turns else 0
    skipped: list[str] = []
    refused: list[str] = []
    values = parse(lines, skipped, refused)
    others = sorted({key[0] for key in values if key[0].startswith("ours@")})
    print("\n".join(report(values)))
    for target in others:
        print("\n" + "\n".join(report(values, target)))
    for line in skipped:
        print(f"left out (requests failed): {line}")
    for line in refused:
        print(f"left out (not every answer a success: the contestant's points of that round): {line}")
    if not any(ANSWERS.match(line.strip()) for line in lines):
        print("no answers lines (bench/answers.py): whether every answer was a success is not checked")
    return 1 if skipped or refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
