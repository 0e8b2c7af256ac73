"""tritonshare.loader.stop: asking a load in another thread to stop (the proxy's drain stopping its reinstall)."""

from __future__ import annotations

import threading
import time

import pytest

from tritonshare.common.errors import Stopped
from tritonshare.loader.stop import Stop


def test_a_stop_asked_during_a_publish_waits_for_it_and_no_publish_begins_after() -> None:
    stop = Stop()
    renaming, asked = threading.Event(), threading.Event()
    published: list[str] = []

    def publish() -> None:
        with stop.publishing():
            renaming.set()
            time.sleep(0.3)
            published.append("first")

    thread = threading.Thread(target=publish)
    thread.start()
    renaming.wait(5)
    started = time.monotonic()
    stop.request()  # returns only once the rename in progress has ended
    asked.set()
    assert published == ["first"] and time.monotonic() - started >= 0.2
    with pytest.raises(Stopped, match="stopped by SIGTERM while publishing"), stop.publishing():
        published.append("second")
    assert published == ["first"]
    thread.join(5)


def test_a_stop_aborts_what_the_load_waits_on_and_ends_its_sleep_naming_the_phase() -> None:
    stop = Stop()
    aborted: list[str] = []
    stop.check("downloading")
    with stop.aborting(lambda: aborted.append("source")):
        threading.Timer(0.1, stop.request).start()
        started = time.monotonic()
        with pytest.raises(Stopped, match="while downloading"):
            stop.sleep(30)
        assert time.monotonic() - started < 5
    assert aborted == ["source"]
    with stop.aborting(lambda: aborted.append("late")):  # asked already: aborted at once
        assert aborted == ["source", "late"]


def test_a_load_nobody_stops_sleeps_and_publishes_as_without_one() -> None:
    stop = Stop()
    stop.check("downloading")
    stop.sleep(0.01)
    with stop.publishing():
        pass
    assert not stop.requested
