"""Stopping a load that runs in a thread: what SIGTERM is to ``tritonshare load`` in its main thread.

``tritonshare load`` is stopped by a signal: :class:`~tritonshare.common.errors.Stopped` is raised wherever
its main thread is, and every ``finally`` on the way out cleans up (the staging workspace discarded, the
lease dropped, the download's threads cancelled and joined). A load in another thread — the proxy's
reinstall (:mod:`tritonshare.pod`), stopped by the proxy's drain — cannot be interrupted so; it is asked,
with a :class:`Stop`, and raises the same ``Stopped`` itself, at the same places:

* between phases, and in every wait's sleep (:meth:`Stop.check`, :meth:`Stop.sleep`);
* in the download, whose workers are cancelled and whose reads and requests in progress are aborted when the
  stop is asked (:meth:`Stop.aborting`: the abort the download deadline uses);
* never after publishing has been refused: a publish holds the stop's lock (:meth:`Stop.publishing`), so
  once :meth:`Stop.request` returns, no model folder is published by this load any more.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tritonshare.common.errors import Stopped


class Stop:
    """A stop asked of a load from another thread; a load nobody asks to stop runs as it would without one."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self._signal = signum  # what the Stopped raised names: the signal that stopped whoever asks
        self._asked = threading.Event()
        self._lock = threading.Lock()
        self._aborts: list[Callable[[], None]] = []
        self._activity = ""  # what the load does now, as the last check() named it: for the Stopped message

    def request(self) -> None:
        """Ask the load to stop: what it waits on is aborted now; a publish in progress finishes first, and
        none begins after this returns."""
        with self._lock:
            self._asked.set()
            aborts = list(self._aborts)
        for abort in aborts:
            abort()

    @property
    def requested(self) -> bool:
        return self._asked.is_set()

    def check(self, activity: str = "") -> None:
        """Raise Stopped when the stop was asked; ``activity`` (what the load begins) names, until the next
        check names another, what the load was doing in the Stopped message."""
        self._activity = activity or self._activity
        if self._asked.is_set():
            raise Stopped(self._signal, self._activity)

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that ends with Stopped when the stop is asked meanwhile (a wait's pause)."""
        if self._asked.wait(seconds):
            self.check()

    @contextmanager
    def aborting(self, abort: Callable[[], None]) -> Iterator[None]:
        """Meanwhile, a stop calls ``abort`` (from the thread asking it); at once if it was asked already."""
        with self._lock:
            self._aborts.append(abort)
            asked = self._asked.is_set()
        try:
            if asked:
                abort()
            yield
        finally:
            with self._lock:
                self._aborts.remove(abort)

    @contextmanager
    def publishing(self, activity: str = "publishing") -> Iterator[None]:
        """Hold off a stop while publishing: raise Stopped when it was asked, else keep :meth:`request`
        waiting until the block ends (a rename)."""
        with self._lock:
            self.check(activity)
            yield
