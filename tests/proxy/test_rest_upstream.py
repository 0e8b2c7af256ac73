"""The REST front end's connections to Triton (:mod:`tritonshare.proxy.rest_upstream`): what an outage logs."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.support.ports import free_port
from tritonshare.proxy.rest_upstream import Upstream, UpstreamPool
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState


class Owner:
    """A client connection as the pool sees it, recording what it is told."""

    transport = None
    close_after = False

    def __init__(self) -> None:
        self.told: list[str] = []

    def pause(self, reason: int) -> None: ...

    def unpause(self, reason: int) -> None: ...

    def response_done(self, head: object, extra: bool) -> None: ...

    def response_failed(self, *, answered: bool) -> None: ...

    def unavailable(self) -> None:
        self.told.append("unavailable")

    def upstream_lost(self, upstream: Upstream) -> None:
        self.told.append("lost")


def test_a_connect_timeout_is_logged_as_one(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a connect that timed out logged "cannot connect to Triton at HOST:PORT: ; answering 503" (a
    TimeoutError says nothing, and the fallback words were never used: an exception is always true)."""

    async def scenario() -> list[str]:
        state = ProxyState(ProxySettings(name="own"))
        pool = UpstreamPool("127.0.0.1", free_port(), 0.0, state)  # no time at all: the connect times out
        owner = Owner()
        pool.attach(owner)  # type: ignore[arg-type]
        for _ in range(20):
            await asyncio.sleep(0)
        return owner.told

    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.rest_upstream"):
        assert asyncio.run(scenario()) == ["lost", "unavailable"]
    [said] = [r.getMessage() for r in caplog.records]
    assert said.endswith(": timed out; answering 503 until it is back"), said
