"""Whether every answer of one turn of the proxy yardstick was a success, by the proxy's and Triton's own counts.

h2load counts a gRPC reply with HTTP 200 as a success whatever its grpc-status, and wrk counts any HTTP answer
(its non-2xx count aside): a proxy refusing every request would look fast. bench/proxy_bench.sh saves Triton's
metrics page, and the proxy's, before and after each contestant's turn; this prints one line from the two, which
bench/proxy_summary.py checks:

    LABEL answers ok=N cut=K/LIMIT other=M triton_failed=F (other codes, if any)

``ok``: the proxy's 200 and gRPC OK answers; ``cut``: answers to a client gone (REST 499, gRPC closed, or
cancelled: a call the client left runs on at Triton, counted when Triton ends it — wrk and h2load end a timed run
by closing their connections, requests in flight, at most one per connection: LIMIT);
``other``: any other code; ``triton_failed``: Triton's ``nv_inference_request_failure``. Without the proxy's
pages (nginx, direct to Triton) only Triton's count. A page that cannot be read gives ``LABEL answers
unreadable``: not a success.

usage: answers.py LABEL CUT_LIMIT TRITON_BEFORE TRITON_AFTER [PROXY_BEFORE PROXY_AFTER]
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

SUCCESS = {("rest", "200"), ("grpc", "ok")}
CUT = {("rest", "499"), ("grpc", "closed"), ("grpc", "cancelled")}


def samples(page: str, counter: str) -> Iterator[tuple[dict[str, str], float]]:
    """The series of ``counter`` (the parser names a counter's samples ``_total``, whether the page did or not)."""
    for family in text_string_to_metric_families(page):
        if family.name == counter:
            for sample in family.samples:
                if sample.name in (counter, f"{counter}_total"):
                    yield sample.labels, sample.value


def proxy_codes(page: str) -> dict[tuple[str, str], int]:
    """(protocol, code) → the proxy's answers, summed over its routes (one series each)."""
    codes: dict[tuple[str, str], int] = {}
    for labels, value in samples(page, "tritonshare_proxy_requests"):
        key = (labels["protocol"], labels["code"])
        codes[key] = codes.get(key, 0) + int(value)
    return codes


def turn_codes(before: str, after: str) -> dict[tuple[str, str], int]:
    """(protocol, code) → the proxy's answers between two of its pages (codes that did not move left out)."""
    was, now = proxy_codes(before), proxy_codes(after)
    return {key: n - was.get(key, 0) for key, n in now.items() if n != was.get(key, 0)}


def triton_failures(page: str) -> int:
    """Triton's failed inferences, summed over models, versions and reasons."""
    return sum(int(value) for _, value in samples(page, "nv_inference_request_failure"))


def answers_line(label: str, cut_limit: int, triton: tuple[str, str], proxy: tuple[str, str] | None = None) -> str:
    """The line for one turn from the (before, after) pages of Triton and, for a tritonshare proxy, its own."""
    if not all(triton) or (proxy is not None and not all(proxy)):
        return f"{label} answers unreadable (a metrics page was empty)"
    fields = f"triton_failed={triton_failures(triton[1]) - triton_failures(triton[0])}"
    if proxy is None:
        return f"{label} answers {fields}"
    turn = turn_codes(*proxy)
    ok = sum(n for key, n in turn.items() if key in SUCCESS)
    cut = sum(n for key, n in turn.items() if key in CUT)
    other = {key: n for key, n in turn.items() if key not in SUCCESS | CUT}
    line = f"{label} answers ok={ok} cut={cut}/{cut_limit} other={sum(other.values())} {fields}"
    if other:
        line += " (" + ", ".join(f"{protocol} {code}: {n}" for (protocol, code), n in sorted(other.items())) + ")"
    return line


def main(argv: Sequence[str]) -> int:
    label, cut_limit, *paths = argv
    pages = [Path(path).read_text() if Path(path).exists() else "" for path in paths]
    proxy = (pages[2], pages[3]) if len(pages) == 4 else None
    print(answers_line(label, int(cut_limit), (pages[0], pages[1]), proxy), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
