"""The proxy process's start-up: the open-files limit (pure logic, the resource calls replaced)."""

from __future__ import annotations

import logging

import pytest

from tritonshare.proxy import server


@pytest.mark.parametrize(
    ("soft", "hard", "cap", "warned"),
    [
        (1024, 1024, 1024, True),  # 4 x 1024 + spare files needed
        (1024, 1 << 20, 1024, False),  # lifted to the hard limit
        (1024, 1024, 200, False),
        (1024, 1024, 0, False),  # no cap: nothing to compare
    ],
)
def test_the_open_files_limit_is_lifted_and_a_short_one_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, soft: int, hard: int, cap: int, warned: bool
) -> None:
    limits = [soft, hard]
    monkeypatch.setattr(server.resource, "getrlimit", lambda _: tuple(limits))
    monkeypatch.setattr(server.resource, "setrlimit", lambda _, new: limits.__setitem__(slice(0, 2), new))
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        server.raise_open_files_limit(cap)
    assert limits == [hard, hard]
    assert ("below the" in caplog.text and f"--max-connections {cap}" in caplog.text) == warned
