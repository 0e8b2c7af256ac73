"""bench/fairness_bench.py: what it reads from wrk, and when it judges the 2x bar."""

from __future__ import annotations

from bench.fairness_bench import Load, Result, _parse, verdict

WRK = """\
Running 10s test @ http://127.0.0.1:40001/v2/models/tenant-b/infer
  1 threads and 1 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     6.10ms    3.20ms  40.00ms   90.00%
  Latency Distribution
     50%    5.70ms
     75%    6.50ms
     90%    9.00ms
     99%   24.40ms
  1630 requests in 10.00s, 300.00KB read
  Socket errors: connect 0, read 2, write 0, timeout 5
  Non-2xx or 3xx responses: 40
Requests/sec:    163.00
Transfer/sec:     30.00KB
"""


def load(p99_ms: float, non_2xx: int = 0, socket_errors: int = 0) -> Load:
    return Load(requests=1000, rps=100.0, p50_ms=5.0, p99_ms=p99_ms, non_2xx=non_2xx, socket_errors=socket_errors)


def test_wrk_output_gives_latencies_and_every_failure_it_counts() -> None:
    assert _parse(WRK) == Load(requests=1630, rps=163.0, p50_ms=5.7, p99_ms=24.4, non_2xx=40, socket_errors=7)
    assert _parse(WRK).failures == 47
    clean = "\n".join(line for line in WRK.splitlines() if "errors" not in line and "Non-2xx" not in line)
    assert _parse(clean).failures == 0


def test_the_bar_is_judged_when_every_request_of_b_succeeded() -> None:
    runs = [Result("solo", load(20.0), None), Result("capped", load(39.0), load(1.0, non_2xx=500))]
    assert verdict(runs) == ("capped B p99 39.00 ms vs solo 20.00 ms: meets the 2x bar", 0)  # A's refusals: its cap
    runs[1] = Result("capped", load(41.0), None)
    assert verdict(runs) == ("capped B p99 41.00 ms vs solo 20.00 ms: MISSES the 2x bar", 0)


def test_no_verdict_and_exit_1_when_any_request_of_b_failed() -> None:
    refused = Result("capped", load(3.0, non_2xx=12), None)  # fast refusals would "meet" the bar
    line, code = verdict([Result("solo", load(20.0), None), refused])
    assert code == 1 and "meets" not in line and line.startswith("no verdict: tenant B's requests failed")
    assert "capped 12 of 1000" in line
    line, code = verdict([Result("solo", load(20.0, socket_errors=3), None), Result("capped", load(30.0), None)])
    assert code == 1 and "solo 3 of 1000" in line
