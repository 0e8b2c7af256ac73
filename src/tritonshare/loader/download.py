"""The download engine: many objects from one source into a fresh folder, fast and bounded.

* Concurrent across objects: ``options.concurrency`` threads share the one source (its connections); the
  largest objects start first so a big file does not finish last alone. Objects larger than two
  ``part_bytes`` are fetched as ranged parts by the same threads when the source can
  (:class:`~tritonshare.loader.sources.stream.StreamSource`): one connection to S3 carries ~100 MB/s, a
  model file may be many GiB. A store that turns out to ignore Range (``RangeIgnored``) gets the object
  fetched whole instead, as one never split.
* One pass over the bytes: a stream source's bytes are read into one reused buffer per thread, written
  with ``pwrite`` and fed to the checksum from that same buffer; big objects are hashed along a frontier as
  their parts land (:mod:`tritonshare.loader.parts`). Memory stays at one buffer per thread.
* Retried: an attempt that fails with :class:`TransientSourceError` (network, 5xx, throttling, a stalled
  read, a size or checksum mismatch) is repeated after an exponential backoff with jitter, up to
  ``options.retries`` more times; a part resumes where it stopped; permanent errors stop the whole download.
* Deadlines: each read is bounded by ``stall_timeout_s`` inside the source (kserve#5611), the whole
  listing and transfer together by ``download_timeout_s`` (:mod:`tritonshare.loader.listing`: the transfer gets
  what the listing left, ``listing_s``). On any failure the other transfers are cancelled — a stream source's
  requests aborted, so a worker waiting on a store that trickles bytes wakes too — and their threads joined
  before the error is raised, so nothing writes into the folder afterwards. A load stopped from another
  thread (:mod:`tritonshare.loader.stop`) cancels the transfer the same way, at once.
* Verified: each object's size and, where the store states one, its cheapest checksum
  (:mod:`tritonshare.loader.checksum`).
* Progress (bytes, MiB/s) is logged every ``progress_interval_s``.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from functools import partial
from pathlib import Path, PurePosixPath

from tritonshare.common.errors import (
    InsufficientSpace,
    InvalidModel,
    RangeIgnored,
    TransientSourceError,
    TritonshareError,
    UnsafeArchive,
)
from tritonshare.loader.checksum import cheapest, check, check_size, hasher_for, verify_file
from tritonshare.loader.download_options import (
    MIB,
    Clock,
    DownloadOptions,
    DownloadStats,
    Random,
    Sleep,
    with_retries,
)
from tritonshare.loader.parts import Split, hashing_slots, reserve
from tritonshare.loader.sources.base import Progress, RemoteObject, Source
from tritonshare.loader.sources.stream import CHUNK_BYTES, Body, Part, StreamSource, write_all
from tritonshare.loader.stop import Stop

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0  # for the HEAD that asks a store for a big object's checksum (else the listed one is used)


class _Cancelled(TritonshareError):
    """Raised inside a worker once the download as a whole has failed; never seen by callers."""


def listed_bytes(objects: Iterable[RemoteObject]) -> int:
    """Total size the store announced (objects of unknown size count 0): what the free-space check needs."""
    return sum(max(obj.size, 0) for obj in objects)


def download_all(
    source: Source,
    objects: list[RemoteObject],
    dest_dir: Path,
    options: DownloadOptions,
    *,
    clock: Clock = time.monotonic,
    sleep: Sleep | None = None,
    rand: Random = random.random,
    stop: Stop | None = None,
) -> DownloadStats:
    """Download ``objects`` into ``dest_dir`` (an existing, empty folder) at their ``relpath``.

    ``sleep`` waits between retries; by default the wait ends early when the download is cancelled.
    Raises UnsafeArchive for a relpath escaping ``dest_dir``, TransientSourceError after retries or the
    deadline, InsufficientSpace when the disk fills, and whatever permanent SourceError the source raises;
    Stopped once ``stop`` is asked, its workers cancelled and joined.
    """
    plan = _plan(objects, dest_dir)
    return _Transfer(source, options, clock, sleep, rand, stop or Stop()).run(plan)


def target_path(dest_dir: Path, relpath: str) -> Path:
    """Where ``relpath`` lands under ``dest_dir``; refuses absolute paths, ``..`` and empty names."""
    return dest_dir.joinpath(*_parts(relpath))


def _parts(relpath: str) -> tuple[str, ...]:
    parts = PurePosixPath(relpath).parts
    if not parts or relpath.startswith("/") or ".." in parts or "\0" in relpath:
        raise UnsafeArchive(
            f"object path {relpath!r} would land outside the download folder — "
            "fix the object names in the store (no absolute paths, no '..')"
        )
    return parts


def _plan(objects: list[RemoteObject], dest_dir: Path) -> list[tuple[RemoteObject, Path]]:
    """Each object with its target, largest first, once their folders exist. Worked out on path parts: with
    ``Path`` objects the folder set cost ~17 µs an object (3.4 ms for 200), 0.6 ms now."""
    targets: dict[tuple[str, ...], RemoteObject] = {}
    for obj in objects:
        parts = _parts(obj.relpath)
        if parts in targets:
            raise InvalidModel(f"{obj.key} and {targets[parts].key} both map to {obj.relpath!r} — rename one")
        targets[parts] = obj
    folders = {parts[:end] for parts in targets for end in range(1, len(parts))}
    for clash in folders & targets.keys():
        raise InvalidModel(f"{targets[clash].key} is a file but other objects use it as a folder — rename it")
    for folder in sorted(folders):  # a folder sorts before what it holds
        path = dest_dir.joinpath(*folder)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:  # a full disk (or out of inodes) is exit 15, as for a file
            raise _write_error(path, exc) from exc
    plan = [(obj, dest_dir.joinpath(*parts)) for parts, obj in targets.items()]
    return sorted(plan, key=lambda pair: -pair[0].size)


class _Transfer:
    """One call of :func:`download_all`: shared counters, the cancel flag, the worker pool."""

    def __init__(
        self, source: Source, options: DownloadOptions, clock: Clock, sleep: Sleep | None, rand: Random, stop: Stop
    ) -> None:
        self.source = source
        self.stop = stop
        # checked once: isinstance against a runtime-checkable protocol costs ~40 µs, per object it added up
        self.stream: StreamSource | None = source if isinstance(source, StreamSource) else None
        self.options = options
        self.clock = clock
        self.sleep = sleep
        self.rand = rand
        self.cancelled = threading.Event()
        self.local = threading.local()
        self.splits: list[Split] = []  # closed (their hasher threads) when the transfer ends, however it ends
        self.reading: set[Body] = set()  # bodies being read now: aborted when the transfer stops
        self.hashing = hashing_slots()  # shared by the splits' hashers
        self.lock = threading.Lock()
        self.bytes_done = 0
        self.objects_done = 0
        self.retries = 0
        self.started = clock()
        self.deadline = self.started + options.transfer_s
        self.total = 0

    def run(self, plan: list[tuple[RemoteObject, Path]]) -> DownloadStats:
        self.total = listed_bytes(obj for obj, _ in plan)
        pool: ThreadPoolExecutor | None = None
        finished = False
        try:
            with self.stop.aborting(self._cancel):
                tasks = [task for obj, target in plan for task in self._tasks(obj, target)]
                workers = max(1, min(self.options.concurrency, len(tasks)))
                pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tritonshare-download")
                futures = [pool.submit(task) for task in tasks]
                self._wait(futures, len(plan))
            finished = True
        finally:
            self.cancelled.set()  # a no-op after success; after a failure it stops the other workers
            self._abort_reads()  # a worker blocked on a stalled store wakes now, not after --stall-timeout-s
            if not finished and self.stream is not None:
                self.stream.abort()  # and one still waiting for an answer (headers trickling in: the deadline)
            for split in self.splits:  # their hashers stop within one window
                split.close()
            if pool is not None:
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

    def _cancel(self) -> None:
        """A stop asked from another thread: every worker ends now, as after a failure (:meth:`run`)."""
        self.cancelled.set()
        self._abort_reads()
        if self.stream is not None:
            self.stream.abort()

    def _abort_reads(self) -> None:
        with self.lock:
            reading = list(self.reading)
        for body in reading:
            body.abort()

    def _wait(self, futures: list[Future[None]], count: int) -> None:
        pending = set(futures)
        last_log = self.clock()
        while pending:
            self.stop.check("downloading")
            remaining = self.deadline - self.clock()
            if remaining <= 0:
                raise self._deadline_error()
            done, pending = wait(
                pending, timeout=min(remaining, self.options.progress_interval_s), return_when=FIRST_EXCEPTION
            )
            _raise_first_failure(done)
            if self.clock() - last_log >= self.options.progress_interval_s:
                last_log = self.clock()
                self._log_progress(count)
        self.stop.check("downloading")  # the workers may all have ended cancelled

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
            f"{self.source.uri}: download did not finish within {self.options.timeout_text()} "
            f"({self.bytes_done / MIB:.1f} of {self.total / MIB:.1f} MiB) — raise --download-timeout-s "
            "or check the network to the store"
        )

    def _tasks(self, obj: RemoteObject, target: Path) -> list[Callable[[], None]]:
        part_bytes = self.options.part_size(obj.size)
        source = self.stream
        if part_bytes <= 0 or obj.size <= 2 * part_bytes or source is None:
            return [partial(self._object, obj, target)]
        if not source.ranged(obj):
            return [partial(self._object, obj, target)]
        try:
            reserve(target, obj.size)
        except OSError as exc:
            raise _write_error(target, exc) from exc
        if self.options.verify_checksums:
            # (bounded below the stall timeout: verifying the parts waits for this answer)
            ask = partial(source.whole_checksum, obj, min(self.options.stall_timeout_s, ASK_TIMEOUT_S))
            split = Split(obj, target, part_bytes, obj.checksum, self.hashing, ask)
        else:
            split = Split(obj, target, part_bytes, None, self.hashing)
        self.splits.append(split)
        return [partial(self._part, split, index) for index in range(len(split.parts))]

    def _object(self, obj: RemoteObject, target: Path) -> None:
        self._settled(lambda: with_retries(lambda: self._attempt(obj, target), self.options, self._pause, self.rand))
        with self.lock:
            self.objects_done += 1

    def _part(self, split: Split, index: int) -> None:
        split.begin()
        attempt = partial(self._attempt_part, split, index)
        self._settled(lambda: with_retries(attempt, self.options, self._pause, self.rand))
        if not split.complete(index):
            return
        if split.given_up:  # the store ignores Range: the object comes whole, now that no part writes any more
            self._whole_instead(split)
            return
        try:
            self._guarded(split.target, split.verify)
        except TransientSourceError as exc:  # the parts do not add up: fetch it again, in one piece
            logger.warning("%s — fetching it again in one piece", exc)
            self._whole_instead(split)
            return
        with self.lock:
            self.objects_done += 1

    def _whole_instead(self, split: Split) -> None:
        """Fetch ``split``'s object in one piece, over what its parts wrote, which no longer counts as done."""
        split.close()  # its hasher stops reading the file before the file is truncated
        with self.lock:
            self.bytes_done -= split.landed_bytes()
        self._object(split.obj, split.target)

    def _settled(self, call: Callable[[], None]) -> None:
        """``call``; when it fails for good, no other worker starts anything more (the main thread may be
        slow to notice on a busy node)."""
        try:
            call()
        except BaseException:
            self.cancelled.set()
            raise

    def _attempt(self, obj: RemoteObject, target: Path) -> None:
        """One attempt at a whole object; on failure its bytes no longer count as done."""
        landed = 0

        def progress(count: int) -> None:
            nonlocal landed
            landed += count
            self._progress(obj, count)

        try:
            self._guarded(target, lambda: self._fetch(obj, target, progress))
        except BaseException:
            with self.lock:
                self.bytes_done -= landed
            raise

    def _attempt_part(self, split: Split, index: int) -> None:
        """One attempt at what part ``index`` still needs; the bytes it lands stay landed."""
        remaining = split.remaining(index)
        if remaining is None:
            return

        def landed(data: memoryview) -> None:
            split.landed(index, data)
            self._progress(split.obj, len(data))

        try:
            self._guarded(split.target, lambda: self._fetch_part(split, remaining, landed))
        except RangeIgnored:
            split.give_up()  # the store cannot serve parts (the source has said so): the object comes whole
            return
        if split.remaining(index) is not None:
            part = split.parts[index]
            raise TransientSourceError(
                f"{split.obj.key}: bytes {part.offset}-{part.offset + part.length - 1}: the store sent fewer bytes"
            )

    def _fetch(self, obj: RemoteObject, target: Path, progress: Progress) -> None:
        source = self.stream
        if source is None:  # a source that writes its files itself
            self.source.fetch(obj, target, progress, self.options.stall_timeout_s)
            verify_file(obj, target, checksum=self.options.verify_checksums)
            return
        body = source.open(obj, self.options.stall_timeout_s)
        try:
            expected = cheapest(body.checksum, obj.checksum) if self.options.verify_checksums else None
            hasher = hasher_for(expected.algorithm) if expected else None

            def landed(data: memoryview) -> None:
                if hasher is not None:
                    hasher.update(data)
                progress(len(data))

            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                size = self._copy(body, fd, 0, None, landed)
            finally:
                os.close(fd)
        finally:
            body.close()
        check_size(obj, size)
        if expected is not None and hasher is not None:
            check(obj, expected, hasher)

    def _fetch_part(self, split: Split, part: Part, landed: Callable[[memoryview], None]) -> None:
        assert self.stream is not None
        body = self.stream.open(split.obj, self.options.stall_timeout_s, part)
        try:
            fd = os.open(split.target, os.O_WRONLY)
            try:
                self._copy(body, fd, part.offset, part.length, landed)
            finally:
                os.close(fd)
        finally:
            body.close()

    def _copy(self, body: Body, fd: int, offset: int, limit: int | None, landed: Callable[[memoryview], None]) -> int:
        """Read ``body`` (at most ``limit`` bytes) into the thread's buffer and write it at ``offset``, handing
        each piece written to ``landed`` (which hashes it, while it is in the CPU's cache, and counts it)."""
        buffer = self._buffer()
        total = 0
        with self._reading(body):
            while limit is None or total < limit:
                count = body.readinto(buffer if limit is None else buffer[: min(len(buffer), limit - total)])
                if not count:
                    break
                chunk = buffer[:count]
                write_all(fd, chunk, offset + total)
                total += count
                landed(chunk)
        return total

    @contextmanager
    def _reading(self, body: Body) -> Iterator[None]:
        """``body`` is read meanwhile: a stop aborts it (:meth:`_abort_reads`), even one that came just before."""
        with self.lock:
            self.reading.add(body)
        try:
            if self.cancelled.is_set():
                body.abort()
            yield
        finally:
            with self.lock:
                self.reading.discard(body)

    def _progress(self, obj: RemoteObject, count: int) -> None:
        if self.cancelled.is_set():
            raise _Cancelled(f"{obj.key}: cancelled")
        with self.lock:
            self.bytes_done += count

    def _guarded(self, target: Path, call: Callable[[], None]) -> None:
        """``call``, unless the download was cancelled; a failed write (a full disk) named as such."""
        if self.cancelled.is_set():
            raise _Cancelled(f"{target.name}: cancelled")
        try:
            call()
        except OSError as exc:
            raise _write_error(target, exc) from exc

    def _buffer(self) -> memoryview:
        """This thread's read buffer: one per thread, reused for every object it transfers."""
        buffer: memoryview | None = getattr(self.local, "buffer", None)
        if buffer is None:
            buffer = self.local.buffer = memoryview(bytearray(CHUNK_BYTES))
        return buffer

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


def _raise_first_failure(done: Iterable[Future[None]]) -> None:
    """The failure that stopped the download. Workers merely cancelled because of it may finish first: they
    are passed over, and the caller keeps waiting for the worker that failed."""
    for future in done:
        exc = future.exception()
        if exc is not None and not isinstance(exc, _Cancelled):
            raise exc


def _write_error(target: Path, exc: OSError) -> TritonshareError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpace(f"writing {target}: the staging filesystem is full — free space on the node")
    if exc.errno in (errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR):  # the object's name, not the node
        return InvalidModel(f"{target}: the filesystem cannot hold this name ({exc.strerror}) — rename the object")
    return TritonshareError(f"writing {target} failed: {exc}")
