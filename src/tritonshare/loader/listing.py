"""The listing phase: what a source holds, retried like a download and bounded by the same deadline.

Each listing read is bounded by the source's own read timeout (60 s), which a store that answers every page
slowly, but just in time, never trips — nor does a listing with endless continuation pages. So
``--download-timeout-s`` covers the listing too, counted from its start: at the deadline a stream source's
requests are aborted (:meth:`~tritonshare.loader.sources.stream.StreamSource.abort`, which ends a read or a wait
for headers in progress and fails every later request) and the listing fails as transient (exit 11), naming
the phase and the source. What the listing took is then no longer the transfer's: the transfer gets the rest
(:attr:`~tritonshare.loader.download_options.DownloadOptions.listing_s`). A source that cannot be aborted (a local
folder, read from the node's own disk) is checked once its listing returns.
"""

from __future__ import annotations

import random
import threading
import time

from tritonshare.common.errors import TransientSourceError, TritonshareError
from tritonshare.loader.download_options import Clock, DownloadOptions, Random, Sleep, with_retries
from tritonshare.loader.sources.base import RemoteObject, Source
from tritonshare.loader.sources.stream import StreamSource


def list_objects(
    source: Source,
    options: DownloadOptions,
    *,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
    rand: Random = random.random,
) -> list[RemoteObject]:
    """``source.list()``, retried on transient errors like a download, within ``options.download_timeout_s``:
    TransientSourceError naming the listing at that deadline."""
    started = clock()
    deadline = started + options.download_timeout_s

    def pause(delay: float) -> None:
        if clock() + delay >= deadline:
            raise _too_late(source, options)
        sleep(delay)

    watchdog = _Watchdog(source, deadline - started)
    try:
        objects = with_retries(source.list, options, pause, rand)
    except TritonshareError as exc:
        if watchdog.fired:  # the failure is the abort at the deadline (a read cut, a request refused)
            raise _too_late(source, options) from exc
        raise
    finally:
        watchdog.cancel()
    if watchdog.fired or clock() >= deadline:  # just as the listing ended: the source's requests are aborted
        raise _too_late(source, options)
    return objects


class _Watchdog:
    """Aborts ``source``'s requests after ``delay_s``, unless cancelled first; says whether it did."""

    def __init__(self, source: Source, delay_s: float) -> None:
        self._source = source
        self._fired = threading.Event()
        self._timer = threading.Timer(max(0.0, delay_s), self._fire)
        self._timer.daemon = True
        self._timer.start()

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def cancel(self) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        self._fired.set()
        if isinstance(self._source, StreamSource):
            self._source.abort()


def _too_late(source: Source, options: DownloadOptions) -> TransientSourceError:
    return TransientSourceError(
        f"{source.uri}: listing did not finish within {options.download_timeout_s:g} s "
        "(--download-timeout-s covers the listing and the transfer) — check the store and the network to it "
        "(every listing page slow, or no end to its pages?), or raise --download-timeout-s"
    )
