"""bench/loader_bench.py: the order the tools take their turns in."""

from __future__ import annotations

from collections import Counter

from bench.loader_bench import turns

TOOLS = ["tritonshare", "tritonshare-nosum", "s5cmd", "kserve-storage"]


def test_every_round_runs_every_tool_once_and_who_goes_first_rotates() -> None:
    rounds = [turns(TOOLS, i) for i in range(8)]
    assert all(sorted(order) == sorted(TOOLS) for order in rounds)
    assert Counter(order[0] for order in rounds) == dict.fromkeys(TOOLS, 2)
    assert Counter(order[-1] for order in rounds) == dict.fromkeys(TOOLS, 2)
    assert rounds[1] == ["tritonshare-nosum", "s5cmd", "kserve-storage", "tritonshare"]
