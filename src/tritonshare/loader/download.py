"""The download engine: many objects from one source into a fresh folder, fast and bounded.

* Concurrent across objects: ``options.concurrency`` threads share the one source (its SDK client and
  connection pool); the largest objects start first so a big file does not finish last alone. Objects
  larger than two ``part_bytes`` are fetched as ranged parts by the same threads when the source can
  (:class:`RangedSource`): one connection to S3 carries ~100 MB/s, a model file may be many GiB.
* Bounded memory: sources stream in fixed chunks (:mod:`tritonshare.loader.sources.stream`).
* Retried: an attempt that fails with :class:`TransientSourceError` (network, 5xx, throttling, a stalled
  read, a size or checksum mismatch) is repeated after an exponential backoff with jitter, up to
  ``options.retries`` more times; permanent errors stop the whole download at once.
* Deadlines: each read is bounded by ``stall_timeout_s`` inside the source (kserve#5611), the whole
  transfer by ``download_timeout_s``. On any failure the other transfers are cancelled and their threads
  joined before the error is raised, so nothing writes into the folder afterwards.
* Verified: each object's size and, where the store gives one, its checksum.
* Progress (bytes, MiB/s) is logged every ``progress_interval_s``.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import random
import threading
import time
import zlib
from base64 import b64encode
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Protocol, TypeVar, runtime_checkable

from tritonshare.common.errors import (
    InsufficientSpace,
    InvalidModel,
    TransientSourceError,
    TritonshareError,
    UnsafeArchive,
)
from tritonshare.loader.settings import LoaderSettings
from tritonshare.loader.sources.base import Checksum, Progress, RemoteObject, Source

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], None]
Random = Callable[[], float]  # uniform in [0, 1)
T = TypeVar("T")

MIB = 1 << 20
_HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class DownloadOptions:
    concurrency: int = 16  # objects transferred at once
    retries: int = 5  # attempts per object after the first
    stall_timeout_s: float = 60.0  # a read that brings no byte for this long fails the attempt
    download_timeout_s: float = 3600.0  # the whole transfer
    backoff_base_s: float = 0.5  # first retry waits 0.5-1x this, doubling per attempt
    backoff_max_s: float = 30.0
    progress_interval_s: float = 5.0
    # Sizes are always checked. The checksum pass re-reads each file: MD5 costs ~2 CPU-s per GiB here,
    # CRC32C far less; off only to measure what verification costs (bench/loader_bench.py).
    verify_checksums: bool = True
    part_bytes: int = 32 * MIB  # objects over twice this are fetched in ranged parts, when the source can

    @classmethod
    def from_settings(cls, settings: LoaderSettings) -> DownloadOptions:
        return cls(
            concurrency=settings.concurrency,
            retries=settings.retries,
            stall_timeout_s=settings.stall_timeout_s,
            download_timeout_s=settings.download_timeout_s,
        )

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


@runtime_checkable
class RangedSource(Protocol):
    """What a source adds to be fetched in parallel parts (S3 has it)."""

    def fetch_range(
        self, obj: RemoteObject, dest: Path, offset: int, length: int, progress: Progress, stall_timeout_s: float
    ) -> int:
        """Write bytes ``offset`` to ``offset + length`` of ``obj`` into the existing file ``dest`` at the
        same offset; return how many were written. Errors as for ``Source.fetch``."""
        ...


@dataclass
class _Split:
    """An object fetched as ranged parts; the thread finishing the last part verifies it."""

    obj: RemoteObject
    target: Path
    parts_left: int


class _Cancelled(TritonshareError):
    """Raised inside a worker once the download as a whole has failed; never seen by callers."""


def listed_bytes(objects: Iterable[RemoteObject]) -> int:
    """Total size the store announced (objects of unknown size count 0): what the free-space check needs."""
    return sum(max(obj.size, 0) for obj in objects)


def list_objects(
    source: Source, options: DownloadOptions, *, sleep: Sleep = time.sleep, rand: Random = random.random
) -> list[RemoteObject]:
    """``source.list()``, retried on transient errors like a download."""
    return _retrying(source.list, options, sleep, rand)


def download_all(
    source: Source,
    objects: list[RemoteObject],
    dest_dir: Path,
    options: DownloadOptions,
    *,
    clock: Clock = time.monotonic,
    sleep: Sleep | None = None,
    rand: Random = random.random,
) -> DownloadStats:
    """Download ``objects`` into ``dest_dir`` (an existing, empty folder) at their ``relpath``.

    ``sleep`` waits between retries; by default the wait ends early when the download is cancelled.
    Raises UnsafeArchive for a relpath escaping ``dest_dir``, TransientSourceError after retries or the
    deadline, InsufficientSpace when the disk fills, and whatever permanent SourceError the source raises.
    """
    plan = _plan(objects, dest_dir)
    return _Transfer(source, options, clock, sleep, rand).run(plan)


def target_path(dest_dir: Path, relpath: str) -> Path:
    """Where ``relpath`` lands under ``dest_dir``; refuses absolute paths, ``..`` and empty names."""
    parts = PurePosixPath(relpath).parts
    if not parts or relpath.startswith("/") or ".." in parts or "\0" in relpath:
        raise UnsafeArchive(
            f"object path {relpath!r} would land outside the download folder — "
            "fix the object names in the store (no absolute paths, no '..')"
        )
    return dest_dir.joinpath(*parts)


def _plan(objects: list[RemoteObject], dest_dir: Path) -> list[tuple[RemoteObject, Path]]:
    targets: dict[Path, RemoteObject] = {}
    for obj in objects:
        target = target_path(dest_dir, obj.relpath)
        if target in targets:
            raise InvalidModel(f"{obj.key} and {targets[target].key} both map to {obj.relpath!r} — rename one")
        targets[target] = obj
    folders = {parent for target in targets for parent in target.parents if dest_dir in parent.parents}
    for clash in folders & targets.keys():
        raise InvalidModel(f"{targets[clash].key} is a file but other objects use it as a folder — rename it")
    for folder in sorted(folders):
        folder.mkdir(parents=True, exist_ok=True)
    return sorted(((obj, target) for target, obj in targets.items()), key=lambda pair: -pair[0].size)


class _Transfer:
    """One call of :func:`download_all`: shared counters, the cancel flag, the worker pool."""

    def __init__(
        self, source: Source, options: DownloadOptions, clock: Clock, sleep: Sleep | None, rand: Random
    ) -> None:
        self.source = source
        self.options = options
        self.clock = clock
        self.sleep = sleep
        self.rand = rand
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.bytes_done = 0
        self.objects_done = 0
        self.retries = 0
        self.started = clock()
        self.deadline = self.started + options.download_timeout_s
        self.total = 0

    def run(self, plan: list[tuple[RemoteObject, Path]]) -> DownloadStats:
        self.total = listed_bytes(obj for obj, _ in plan)
        tasks = [task for obj, target in plan for task in self._tasks(obj, target)]
        workers = max(1, min(self.options.concurrency, len(tasks)))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tritonshare-download")
        try:
            futures = [pool.submit(task) for task in tasks]
            self._wait(futures, len(plan))
        finally:
            self.cancelled.set()  # a no-op after success; after a failure it stops the other workers
            pool.shutdown(wait=True, cancel_futures=True)
        stats = DownloadStats(
            objects=len(plan), bytes=self.bytes_done, seconds=self.clock() - self.started, retries=self.retries
        )
        logger.info(
            "downloaded %s: %d objects, %.1f MiB in %.1f s (%.1f MiB/s)",
            self.source.uri,
            stats.objects,
            stats.bytes / MIB,
            stats.seconds,
            stats.mib_per_s,
        )
        return stats

    def _wait(self, futures: list[Future[None]], count: int) -> None:
        pending = set(futures)
        last_log = self.clock()
        while pending:
            remaining = self.deadline - self.clock()
            if remaining <= 0:
                raise self._deadline_error()
            done, pending = wait(
                pending, timeout=min(remaining, self.options.progress_interval_s), return_when=FIRST_EXCEPTION
            )
            for future in done:
                future.result()  # re-raises the first failure
            if self.clock() - last_log >= self.options.progress_interval_s:
                last_log = self.clock()
                self._log_progress(count)

    def _log_progress(self, count: int) -> None:
        elapsed = max(self.clock() - self.started, 1e-9)
        logger.info(
            "downloading %s: %.1f of %.1f MiB, %d of %d objects, %.1f MiB/s",
            self.source.uri,
            self.bytes_done / MIB,
            self.total / MIB,
            self.objects_done,
            count,
            self.bytes_done / MIB / elapsed,
        )

    def _deadline_error(self) -> TransientSourceError:
        return TransientSourceError(
            f"{self.source.uri}: download did not finish within {self.options.download_timeout_s:g} s "
            f"({self.bytes_done / MIB:.1f} of {self.total / MIB:.1f} MiB) — raise --download-timeout-s "
            "or check the network to the store"
        )

    def _tasks(self, obj: RemoteObject, target: Path) -> list[Callable[[], None]]:
        part = self.options.part_bytes
        if part <= 0 or obj.size <= 2 * part or not isinstance(self.source, RangedSource):
            return [lambda: self._object(obj, target)]
        try:
            with open(target, "wb") as fh:
                fh.truncate(obj.size)  # sparse: the parts fill it in place
        except OSError as exc:
            raise _write_error(target, exc) from exc
        offsets = range(0, obj.size, part)
        split = _Split(obj=obj, target=target, parts_left=len(offsets))
        return [partial(self._part, split, offset, min(part, obj.size - offset)) for offset in offsets]

    def _object(self, obj: RemoteObject, target: Path) -> None:
        _retrying(lambda: self._attempt(obj, target), self.options, self._pause, self.rand)
        with self.lock:
            self.objects_done += 1

    def _part(self, split: _Split, offset: int, length: int) -> None:
        _retrying(
            lambda: self._attempt(split.obj, split.target, (offset, length)), self.options, self._pause, self.rand
        )
        with self.lock:
            split.parts_left -= 1
            if split.parts_left:
                return
        try:
            verify(split.obj, split.target, checksum=self.options.verify_checksums)
        except TransientSourceError as exc:  # the parts do not add up: fetch it again, in one piece
            logger.warning("%s — fetching it again in one piece", exc)
            with self.lock:
                self.bytes_done -= split.obj.size
            self._object(split.obj, split.target)
            return
        with self.lock:
            self.objects_done += 1

    def _attempt(self, obj: RemoteObject, target: Path, part: tuple[int, int] | None = None) -> None:
        if self.cancelled.is_set():
            raise _Cancelled(f"{obj.key}: cancelled")
        landed = 0

        def progress(count: int) -> None:
            nonlocal landed
            if self.cancelled.is_set():
                raise _Cancelled(f"{obj.key}: cancelled")
            landed += count
            with self.lock:
                self.bytes_done += count

        try:
            self._transfer(obj, target, part, progress)
        except BaseException as exc:
            with self.lock:
                self.bytes_done -= landed
            if isinstance(exc, OSError):
                raise _write_error(target, exc) from exc
            raise

    def _transfer(self, obj: RemoteObject, target: Path, part: tuple[int, int] | None, progress: Progress) -> None:
        stall = self.options.stall_timeout_s
        if part is None:
            self.source.fetch(obj, target, progress, stall)
            verify(obj, target, checksum=self.options.verify_checksums)
            return
        assert isinstance(self.source, RangedSource)
        offset, length = part
        written = self.source.fetch_range(obj, target, offset, length, progress, stall)
        if written != length:
            raise TransientSourceError(f"{obj.key}: bytes {offset}-{offset + length - 1}: got {written} bytes")

    def _pause(self, delay: float) -> None:
        """Wait before a retry: never past the deadline, and no longer once the download is cancelled."""
        with self.lock:
            self.retries += 1
        remaining = self.deadline - self.clock()
        if remaining <= delay:
            raise self._deadline_error()
        if self.sleep is not None:
            self.sleep(delay)
        elif self.cancelled.wait(delay):
            raise _Cancelled("cancelled while waiting to retry")


def _retrying(call: Callable[[], T], options: DownloadOptions, pause: Sleep, rand: Random) -> T:
    attempts = options.retries + 1
    for attempt in range(attempts):
        try:
            return call()
        except TransientSourceError as exc:
            if attempt + 1 == attempts:
                raise TransientSourceError(f"{exc} (gave up after {attempts} attempts)") from exc
            delay = options.backoff_s(attempt, rand())
            logger.warning("%s — retry %d of %d in %.1f s", exc, attempt + 1, attempts - 1, delay)
            try:
                pause(delay)
            except TransientSourceError as stop:  # the deadline comes before the next attempt
                raise TransientSourceError(f"{stop}; last error: {exc}") from exc
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def _write_error(target: Path, exc: OSError) -> TritonshareError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpace(f"writing {target}: the staging filesystem is full — free space on the node")
    return TritonshareError(f"writing {target} failed: {exc}")


def verify(obj: RemoteObject, path: Path, *, checksum: bool = True) -> None:
    """Size, then checksum when the store gave one. A mismatch is transient: the next attempt may get it
    right (a cut transfer, an object replaced mid-download)."""
    size = path.stat().st_size
    if obj.size >= 0 and size != obj.size:
        raise TransientSourceError(f"{obj.key}: got {size} bytes, the store lists {obj.size}")
    if checksum and obj.checksum is not None:
        actual = file_digest(path, obj.checksum.algorithm)
        if actual != obj.checksum.value:
            raise TransientSourceError(
                f"{obj.key}: {obj.checksum.algorithm} checksum mismatch "
                f"(store {obj.checksum.value}, downloaded {actual}) — the data was corrupted in transit"
            )


def _crc32c(path: Path) -> str:
    import google_crc32c  # C-accelerated; a dependency of google-cloud-storage

    value = 0
    for chunk in _chunks(path):
        value = google_crc32c.extend(value, chunk)
    return b64encode(int(value).to_bytes(4, "big")).decode()


def _crc32(path: Path) -> str:
    value = 0
    for chunk in _chunks(path):
        value = zlib.crc32(chunk, value)
    return b64encode(value.to_bytes(4, "big")).decode()


def _hexdigest(name: str) -> Callable[[Path], str]:
    def digest(path: Path) -> str:
        h = hashlib.new(name)
        for chunk in _chunks(path):
            h.update(chunk)
        return h.hexdigest()

    return digest


# algorithm → digest of a file, in the encoding Checksum.value uses
DIGESTS: dict[str, Callable[[Path], str]] = {
    "md5": _hexdigest("md5"),
    "sha256": _hexdigest("sha256"),
    "crc32c": _crc32c,
    "crc32": _crc32,
}


def file_digest(path: Path, algorithm: str) -> str:
    digest = DIGESTS.get(algorithm)
    if digest is None:
        raise TritonshareError(f"checksum algorithm {algorithm!r} is not one of {sorted(DIGESTS)}")
    return digest(path)


def checksum_of(path: Path, algorithm: str) -> Checksum:
    return Checksum(algorithm=algorithm, value=file_digest(path, algorithm))


def _chunks(path: Path) -> Iterable[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK_BYTES):
            yield chunk
