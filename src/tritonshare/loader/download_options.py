"""What a download is asked to do and what it reports: its options (concurrency, retries, deadlines, parts),
its stats, and the retry loop with backoff every phase of a fetch shares (listing, objects, parts, streamed
archives)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from tritonshare.common.errors import TransientSourceError

if TYPE_CHECKING:
    from tritonshare.loader.settings import LoaderSettings

logger = logging.getLogger("tritonshare.loader.download")  # the retries' lines keep the logger they had

Clock = Callable[[], float]
Sleep = Callable[[float], None]
Random = Callable[[], float]  # uniform in [0, 1)
T = TypeVar("T")

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class DownloadOptions:
    concurrency: int = 16  # objects transferred at once
    retries: int = 5  # attempts per object after the first
    stall_timeout_s: float = 60.0  # a read that brings no byte for this long fails the attempt
    download_timeout_s: float = 3600.0  # the listing and the transfer, together
    listing_s: float = 0.0  # what the listing took of download_timeout_s: the transfer has the rest
    backoff_base_s: float = 0.5  # first retry waits 0.5-1x this, doubling per attempt
    backoff_max_s: float = 30.0
    progress_interval_s: float = 5.0
    # Sizes are always checked. Checksums are computed in the same pass as the writes: MD5 costs ~1.5 CPU-s
    # per GiB here, CRC32C ~0.05; off only to measure what verification costs (bench/loader_bench.py).
    verify_checksums: bool = True
    part_bytes: int = 8 * MIB  # objects over twice this are fetched in ranged parts, when the source can
    max_parts: int = 64  # a bigger object gets bigger parts (2 GiB: 32 MiB): fewer requests, same speed

    @classmethod
    def from_settings(cls, settings: LoaderSettings) -> DownloadOptions:
        return cls(
            concurrency=settings.concurrency,
            retries=settings.retries,
            stall_timeout_s=settings.stall_timeout_s,
            download_timeout_s=settings.download_timeout_s,
        )

    @property
    def transfer_s(self) -> float:
        """The transfer's deadline, from its start: what the listing left of ``download_timeout_s``."""
        return max(0.0, self.download_timeout_s - self.listing_s)

    def timeout_text(self) -> str:
        """``download_timeout_s`` for a deadline's message, with what the listing took of it."""
        listed = f" (the listing took {self.listing_s:.1f} s of it)" if self.listing_s >= 0.05 else ""
        return f"{self.download_timeout_s:g} s{listed}"

    def part_size(self, size: int) -> int:
        """The part size for an object of ``size`` bytes: ``part_bytes``, or more (whole MiB) to stay within
        ``max_parts``."""
        needed = -(-size // max(self.max_parts, 1))  # ceil
        if self.part_bytes <= 0 or needed <= self.part_bytes:
            return self.part_bytes
        return -(-needed // MIB) * MIB

    def backoff_s(self, attempt: int, rand: float) -> float:
        """Delay before retry ``attempt`` (0-based): exponential, capped, with "equal jitter" — between
        half and all of the step — so a fleet of loaders restarted together does not retry in lockstep."""
        step = min(self.backoff_max_s, self.backoff_base_s * 2.0**attempt)
        return step / 2 + rand * step / 2


@dataclass(frozen=True, kw_only=True)
class DownloadStats:
    objects: int
    bytes: int
    seconds: float
    retries: int  # attempts repeated after a transient failure, over all objects

    @property
    def mib_per_s(self) -> float:
        return self.bytes / MIB / self.seconds if self.seconds > 0 else 0.0


def with_retries(call: Callable[[], T], options: DownloadOptions, pause: Sleep, rand: Random) -> T:
    """``call()``, repeated after ``pause(backoff)`` while it raises TransientSourceError, at most
    ``options.retries`` more times; ``pause`` may raise TransientSourceError to stop (a deadline)."""
    attempts = options.retries + 1
    for attempt in range(attempts):
        try:
            return call()
        except TransientSourceError as exc:
            if attempt + 1 == attempts:
                tries = f"{attempts} attempts" if attempts != 1 else "1 attempt"
                raise TransientSourceError(f"{exc} (gave up after {tries})") from exc
            delay = options.backoff_s(attempt, rand())
            logger.warning("%s — retry %d of %d in %.1f s", exc, attempt + 1, attempts - 1, delay)
            try:
                pause(delay)
            except TransientSourceError as stop:  # the deadline comes before the next attempt
                raise TransientSourceError(f"{stop}; last error: {exc}") from exc
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises
