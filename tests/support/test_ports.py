"""The suite's port picker: below the kernel's ephemeral range, free, and never handed out twice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import ports


def test_ports_are_below_the_ephemeral_range_and_distinct() -> None:
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST <= port < ports.ephemeral_start() for port in picked)


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws: list[int] = []
        draw = ports._random.randrange

        def busy_first(lo: int, hi: int) -> int:
            draws.append(busy if not draws else draw(ports.LOWEST, 32768))
            return draws[-1]

        monkeypatch.setattr(ports, "ephemeral_start", lambda: 65536)
        monkeypatch.setattr(ports._random, "randrange", busy_first)
        assert ports.free_port() not in (busy, 0)
        assert draws[0] == busy and len(draws) >= 2


def test_the_ephemeral_start_is_read_from_the_kernel(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ports.ephemeral_start(tmp_path / "range") == 40000
    assert ports.ephemeral_start(tmp_path / "missing") == 32768
