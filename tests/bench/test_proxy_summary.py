"""bench/proxy_summary.py: issue 4's bars from the yardstick's lines, as medians of each round's ratio (the two
ran back to back) over interleaved rounds."""

from __future__ import annotations

import io
import sys

import pytest
from bench.proxy_summary import all_succeeded, main, milliseconds, parse, report

ROUNDS = """\
direct rest c=1 rps=4600.0 p50=200.00us p99=1.70ms non2xx=0
# round 1
nginx rest c=1 rps=3000.0 p50=250.00us p99=500.00us non2xx=0 cpu_us_per_req=50.0
ours rest c=1 rps=3100.0 p50=240.00us p99=450.00us non2xx=0 cpu_us_per_req=45.0
nginx stream c=16 rps=4000.0 mean=3.5ms p50=3.1ms p99=11.0ms 100ok/0failed cpu_us_per_req=40.0 client_cores=0.2
ours stream c=16 rps=3000.0 mean=3.6ms p50=3.2ms p99=9.0ms 100ok/0failed cpu_us_per_req=64.0 client_cores=0.2
# round 2
ours rest c=1 rps=3100.0 p50=240.00us p99=1.2ms non2xx=0 cpu_us_per_req=60.0
nginx rest c=1 rps=3000.0 p50=250.00us p99=1.0ms non2xx=0 cpu_us_per_req=50.0
ours stream c=16 rps=3400.0 mean=3.6ms p50=3.2ms p99=9.0ms 100ok/0failed cpu_us_per_req=56.0 client_cores=0.2
nginx stream c=16 rps=4000.0 mean=3.5ms p50=3.1ms p99=11.0ms 100ok/0failed cpu_us_per_req=40.0 client_cores=0.2
# round 3: Triton's stub crashed
nginx rest c=1 rps=9000.0 p50=70.00us p99=60.0ms non2xx=18258 cpu_us_per_req=20.0
ours stream c=16 rps=0.0 mean=0.00ms p50=0.00ms p99=0.00ms 0ok/226failed cpu_us_per_req=1.0 client_cores=0.05
"""


def test_latencies_read_in_any_unit_as_milliseconds() -> None:
    assert [milliseconds(t) for t in ("450.00us", "1.2ms", "2s")] == [0.45, 1.2, 2000.0]


def test_each_bar_is_judged_on_the_median_of_the_rounds_ratios_and_direct_lines_are_ignored() -> None:
    skipped: list[str] = []
    values = parse(ROUNDS.splitlines(), skipped)
    assert [line.split(" rps")[0] for line in skipped] == ["nginx rest c=1", "ours stream c=16"]  # failed: left out
    assert values["ours", "rest", 1, "cpu"] == {1: 45.0, 2: 60.0} and ("direct", "rest", 1, "rps") not in values
    rows = {row.split(" | ")[0].lstrip("| "): row for row in report(values)[2:]}
    assert set(rows) == {"rest c=1 cpu ≤ 1×", "rest c=1 p99 ≤ 1×", "stream c=16 cpu ≤ 1.5×", "stream c=16 rps ≥ 0.8×"}
    assert "| 1.05× | 0.90, 1.20 | **no** |" in rows["rest c=1 cpu ≤ 1×"]  # median 52.5 against 50
    assert "| 0.75 | 0.82 | 1.05× | 0.90, 1.20 |" in rows["rest c=1 p99 ≤ 1×"]  # not 0.82 / 0.75 = 1.10
    assert rows["rest c=1 p99 ≤ 1×"].endswith("**no** |")
    assert "| 1.50× | 1.60, 1.40 | yes |" in rows["stream c=16 cpu ≤ 1.5×"]  # at the bar is within it
    assert "| 0.80× |" in rows["stream c=16 rps ≥ 0.8×"] and rows["stream c=16 rps ≥ 0.8×"].endswith("yes |")


def test_a_proxy_from_another_venv_is_judged_on_its_own_lines() -> None:
    lines = [
        "nginx rest c=1 rps=3000.0 p50=250.00us p99=500.00us non2xx=0 cpu_us_per_req=50.0",
        "ours rest c=1 rps=3100.0 p50=240.00us p99=450.00us non2xx=0 cpu_us_per_req=45.0",
        "ours@.venv rest c=1 rps=3000.0 p50=260.00us p99=600.00us non2xx=0 cpu_us_per_req=55.0",
    ]
    values = parse(lines)
    assert values["ours", "rest", 1, "cpu"] == {0: 45.0} and values["ours@.venv", "rest", 1, "cpu"] == {0: 55.0}
    ours, other = report(values), report(values, "ours@.venv")
    assert "| tritonshare (median) |" in ours[0] and "| ours@.venv (median) |" in other[0]
    assert "| 0.90× |" in ours[2] and ours[2].endswith("yes |")
    assert "| 1.10× |" in other[2] and other[2].endswith("**no** |")


def test_a_round_where_one_side_failed_is_left_out_not_paired_with_another_round() -> None:
    lines = [
        "# round 1",
        "nginx rest c=16 rps=9000.0 p50=1.00ms p99=60.0ms non2xx=900 cpu_us_per_req=20.0",  # failed
        "ours rest c=16 rps=8000.0 p50=1.00ms p99=2.00ms non2xx=0 cpu_us_per_req=40.0",
        "# round 2",
        "nginx rest c=16 rps=9000.0 p50=1.00ms p99=2.00ms non2xx=0 cpu_us_per_req=50.0",
        "ours rest c=16 rps=9000.0 p50=1.00ms p99=2.00ms non2xx=0 cpu_us_per_req=55.0",
        "# round 3: the machine got busy, for both",
        "ours rest c=16 rps=4500.0 p50=2.00ms p99=4.00ms non2xx=0 cpu_us_per_req=110.0",
        "nginx rest c=16 rps=4500.0 p50=2.00ms p99=4.00ms non2xx=0 cpu_us_per_req=100.0",
    ]
    rows = {row.split(" | ")[0].lstrip("| "): row for row in report(parse(lines))[2:]}
    # 1.10× in both rounds run side by side; round 1's 40 against round 2's 50 (0.80) or medians of unrelated
    # rounds (55 / 75 = 0.73) would meet the bar
    assert "| 75.00 | 82.50 | 1.10× | 1.10, 1.10 | **no** |" in rows["rest c=16 cpu ≤ 1×"]


ANSWERED = """\
# round 1
nginx rest c=1 rps=3000.0 p50=250.00us p99=500.00us non2xx=0 cpu_us_per_req=50.0
nginx answers triton_failed=0
ours rest c=1 rps=9000.0 p50=80.00us p99=150.00us non2xx=0 cpu_us_per_req=15.0
ours answers ok=5 cut=0/34 other=45000 triton_failed=0 (grpc unavailable: 45000)
# round 2
ours rest c=1 rps=3100.0 p50=240.00us p99=450.00us non2xx=0 cpu_us_per_req=55.0
ours answers ok=45000 cut=17/34 other=0 triton_failed=0
nginx rest c=1 rps=3000.0 p50=250.00us p99=500.00us non2xx=0 cpu_us_per_req=50.0
nginx answers triton_failed=0
"""


def test_a_turn_whose_answers_were_not_all_successes_is_left_out_of_every_bar() -> None:
    refused: list[str] = []
    values = parse(ANSWERED.splitlines(), refused=refused)
    assert values["ours", "rest", 1, "cpu"] == {2: 55.0}  # round 1's fast figures timed refusals
    assert refused == ["round 1: ours answers ok=5 cut=0/34 other=45000 triton_failed=0 (grpc unavailable: 45000)"]
    assert "| 1.10× | 1.10 | **no** |" in report(values)[2]


def test_answers_lines_fail_on_triton_failures_too_many_cuts_or_unreadable_pages() -> None:
    assert all_succeeded("triton_failed=0") and all_succeeded("ok=9 cut=34/34 other=0 triton_failed=0")
    assert not all_succeeded("triton_failed=3")
    assert not all_succeeded("ok=9 cut=35/34 other=0 triton_failed=0")
    assert not all_succeeded("ok=9 cut=0/34 other=0 triton_failed=1")
    assert not all_succeeded("unreadable (a metrics page was empty)")


def test_the_summary_and_the_answers_check_exit_1_on_a_turn_not_all_successes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(ANSWERED))
    assert main([]) == 1
    assert "left out (not every answer a success" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO(ANSWERED))
    assert main(["--answers"]) == 1
    assert "not every answer a success, round 1: ours answers" in capsys.readouterr().out
    good = ANSWERED.replace(
        "ok=5 cut=0/34 other=45000 triton_failed=0 (grpc unavailable: 45000)", "ok=9 cut=0/34 other=0 triton_failed=0"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(good))
    assert main(["--answers"]) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("ours rest c=1 rps=1.0 p50=1ms p99=1ms non2xx=0\n"))
    assert main(["--answers"]) == 1  # nothing shows the answers succeeded
