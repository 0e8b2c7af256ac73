"""bench/loader_bench.py: the order the tools take their turns in, and which bars judge which store."""

from __future__ import annotations

from collections import Counter

from bench.loader_bench import MIB, Model, Run, bars, store_bars, turns

TOOLS = ["tritonshare", "tritonshare-nosum", "s5cmd", "kserve-storage"]


def test_every_round_runs_every_tool_once_and_who_goes_first_rotates() -> None:
    rounds = [turns(TOOLS, i) for i in range(8)]
    assert all(sorted(order) == sorted(TOOLS) for order in rounds)
    assert Counter(order[0] for order in rounds) == dict.fromkeys(TOOLS, 2)
    assert Counter(order[-1] for order in rounds) == dict.fromkeys(TOOLS, 2)
    assert rounds[1] == ["tritonshare-nosum", "s5cmd", "kserve-storage", "tritonshare"]


def test_the_s3_bars_judge_the_sdk_store_too_under_its_own_name() -> None:
    s3 = [bar[1:] for bar in store_bars(["s3"])]
    assert s3
    assert store_bars(["s3", "s3-sdk"]) == [("s3", *bar) for bar in s3] + [("s3-sdk", *bar) for bar in s3]
    assert store_bars(["s3-sdk", "gcs"])[: len(s3)] == [("s3-sdk", *bar) for bar in s3]


def test_each_store_is_judged_on_its_own_runs() -> None:
    big = Model("big", "1 x 20 MiB", 20 * MIB, runs=1)
    rows = {
        (store, big.label, tool): [Run(seconds=seconds, cpu_seconds=seconds, peak_rss_mib=30.0)]
        for store, tool, seconds in (
            ("s3", "tritonshare", 1.0),
            ("s3", "s5cmd", 0.5),
            ("s3-sdk", "tritonshare", 1.0),
            ("s3-sdk", "s5cmd", 0.9),
        )
    }
    lines = bars(rows, [big]).splitlines()
    assert "| s3: ≥ 0.8x s5cmd | 1 x 20 MiB | 0.50x | **no** | - |" in lines
    assert "| s3-sdk: ≥ 0.8x s5cmd | 1 x 20 MiB | 0.90x | yes | - |" in lines
