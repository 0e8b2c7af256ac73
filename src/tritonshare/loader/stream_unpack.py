"""A model shipped as one tar archive (``.tar``, ``.tar.gz``, ``.tgz``): downloaded and unpacked in one pass.

``curl URL | tar xz`` without the archive ever landing on disk: the bytes go from the network through a
named pipe into :func:`tritonshare.loader.archive.unpack_tar` — the very function that unpacks a
downloaded archive, so every safety rule (no path escaping, no links out, no devices, the free-space
budget, the standard library's ``data`` filter) applies unchanged. The pipe (1 MiB) is the only buffer, so
memory stays flat, and the two ends run in two threads: one receives and hashes, the other inflates and
writes files, on two cores at once as ``curl`` and ``tar`` do.

Verification still covers the archive as the store describes it: its size and checksum are computed over
the stream (after the end of the tar, the rest of the body is read for them), and only a verified unpack is
kept. A transient failure — network, a stall, a short or corrupted body — discards what was unpacked and
starts again after a backoff, like any download; an unsafe or damaged archive fails at once.

Zip archives keep their directory at the end: they are downloaded, then unpacked (:mod:`tritonshare.loader.run`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tritonshare.common.errors import (
    InsufficientSpace,
    NotAnArchive,
    TransientSourceError,
    TritonshareError,
    UnsafeArchive,
)
from tritonshare.loader.archive import ARCHIVES, HEAD_BYTES, Budget, from_source, unpack_tar
from tritonshare.loader.checksum import Hasher, cheapest, check, check_size, hasher_for
from tritonshare.loader.download_options import MIB, Clock, DownloadOptions, DownloadStats, Random, Sleep, with_retries
from tritonshare.loader.sources.base import RemoteObject, Source
from tritonshare.loader.sources.stream import CHUNK_BYTES, Body, StreamSource

logger = logging.getLogger(__name__)

# Unpacker failures raised without reading the rest of the archive: the archive itself is refused
# (damaged bytes cannot pass these checks by accident), or the disk is full.
_AT_ONCE = (UnsafeArchive, InsufficientSpace)

PIPE_BYTES = 1 << 20  # the pipe's capacity (Linux's default maximum for an unprivileged process)
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named in the fcntl module only from Python 3.10 on some builds
_OPEN_POLL_S = 0.005


def streamable(source: Source, objects: list[RemoteObject]) -> tuple[StreamSource, RemoteObject] | None:
    """The source and archive to stream, when the source's only object is a tar (by its name) and the source
    hands out streams; None otherwise (a folder of files, a zip, a file on a volume: those land, then unpack)."""
    if len(objects) != 1 or "/" in objects[0].relpath or not isinstance(source, StreamSource):
        return None
    name = objects[0].relpath.lower()
    suffix = max((s for s in ARCHIVES if name.endswith(s)), key=len, default="")
    return (source, objects[0]) if suffix and ARCHIVES[suffix] is unpack_tar else None


def fetch_and_unpack(
    source: StreamSource,
    obj: RemoteObject,
    dest: Path,
    options: DownloadOptions,
    *,
    max_bytes: int | None = None,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
    rand: Random = random.random,
) -> DownloadStats:
    """Stream ``obj`` (a tar archive) from ``source`` and unpack it into the existing, empty folder ``dest``,
    retrying transient failures. ``max_bytes`` bounds what the unpacked files may take (the free space).
    Raises as :func:`~tritonshare.loader.download.download_all` and :func:`~tritonshare.loader.archive.unpack`."""
    started = clock()
    deadline = started + options.transfer_s
    retries = 0

    def attempt() -> int:
        _empty(dest)
        return _Stream(source, obj, dest, options, max_bytes, deadline, clock).run()

    def pause(delay: float) -> None:
        nonlocal retries
        retries += 1
        if clock() + delay >= deadline:
            raise TransientSourceError(f"{obj.key}: not downloaded within {options.timeout_text()}")
        sleep(delay)

    received = with_retries(attempt, options, pause, rand)
    stats = DownloadStats(objects=1, bytes=received, seconds=clock() - started, retries=retries)
    logger.info(
        "downloaded and unpacked %s: %.1f MiB in %.1f s (%.1f MiB/s)",
        obj.key,
        stats.bytes / MIB,
        stats.seconds,
        stats.mib_per_s,
    )
    return stats


@dataclass
class _Outcome:
    """What the unpacking thread ended with."""

    members: int = 0
    error: BaseException | None = None


class _Stream:
    """One attempt: this thread receives into the pipe, a second one unpacks from it."""

    def __init__(
        self,
        source: StreamSource,
        obj: RemoteObject,
        dest: Path,
        options: DownloadOptions,
        max_bytes: int | None,
        deadline: float,
        clock: Clock,
    ) -> None:
        self.source, self.obj, self.dest, self.options = source, obj, dest, options
        self.budget_bytes = max_bytes
        self.deadline, self.clock = deadline, clock
        self.received = 0
        self.head = b""  # the body's first bytes, for what an archive that is not one is instead
        self.buffer = memoryview(bytearray(CHUNK_BYTES))
        self.started = self.logged = clock()

    def run(self) -> int:
        """Returns the bytes received. A failure to receive comes first; then the size and checksum (damaged
        bytes make the unpacker fail too, but a retry may cure them); then the unpacker's own failure."""
        pipe_dir = self.dest.parent / f".stream-{os.getpid()}-{threading.get_ident()}"
        pipe = pipe_dir / self.obj.relpath  # the archive's name: unpack_tar's messages name it
        try:
            pipe_dir.mkdir()
            os.mkfifo(pipe, 0o600)
        except OSError as exc:  # made before the body is opened: a full disk stops us before the network
            raise _disk_error(exc, pipe_dir) from exc
        try:
            outcome = self._receive(pipe)
        finally:
            shutil.rmtree(pipe_dir, ignore_errors=True)
        if isinstance(outcome.error, NotAnArchive):  # named by the pipe: name the source instead
            raise from_source(outcome.error, self.obj.key, self.obj.relpath, self.head) from outcome.error
        if outcome.error is not None:
            raise outcome.error
        logger.debug("unpacked %d members of %s", outcome.members, self.obj.relpath)
        return self.received

    def _receive(self, pipe: Path) -> _Outcome:
        # A trickle never stalls a read, and one read fills up to a MiB: at the deadline the source's requests
        # are aborted, so a read in progress ends then (it went on for hours at 20 bytes a second), and so does
        # a request whose answer's headers trickle in.
        watchdog = threading.Timer(max(0.0, self.deadline - self.clock()), self.source.abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            with self._in_time():
                body = self.source.open(self.obj, self.options.stall_timeout_s)
            try:
                expected = cheapest(body.checksum, self.obj.checksum) if self.options.verify_checksums else None
                hasher = hasher_for(expected.algorithm) if expected else None
                outcome = self._pump(pipe, body, hasher)
                if isinstance(outcome.error, _AT_ONCE):
                    raise outcome.error  # the archive itself is refused: the rest of it does not matter
                while self._read(body, hasher):  # after the tar's end: the rest still counts for size and checksum
                    pass
            finally:
                body.close()
        finally:
            watchdog.cancel()
        check_size(self.obj, self.received)
        if expected is not None and hasher is not None:
            check(self.obj, expected, hasher)
        return outcome

    def _pump(self, pipe: Path, body: Body, hasher: Hasher | None) -> _Outcome:
        """Feed the pipe until the body ends or the unpacker stops reading; the unpacker has ended on return."""
        outcome = _Outcome()
        unpacker = threading.Thread(target=self._unpack, args=(pipe, outcome), name="tritonshare-unpack")
        unpacker.start()
        fd = -1
        try:
            fd = _open_writer(pipe, unpacker)
            if fd >= 0:
                self._feed(body, fd, hasher)
        finally:
            if fd >= 0:
                os.close(fd)  # the unpacker sees the end of the archive
            else:
                _release(pipe)  # an unpacker still waiting to open the pipe sees an empty archive
            unpacker.join()
        return outcome

    def _unpack(self, pipe: Path, outcome: _Outcome) -> None:
        try:
            outcome.members = unpack_tar(pipe, self.dest, Budget(pipe, self.budget_bytes))
        except BaseException as exc:  # handed to the receiving thread, which raises it
            outcome.error = exc

    def _feed(self, body: Body, fd: int, hasher: Hasher | None) -> None:
        while count := self._read(body, hasher):
            try:
                _write_all(fd, self.buffer[:count])
            except BrokenPipeError:
                return  # the unpacker stopped reading: at the tar's end, or on an error it reports

    def _read(self, body: Body, hasher: Hasher | None) -> int:
        """The next bytes of the body into ``self.buffer``, hashed and counted; 0 at its end."""
        buffer = self.buffer
        if self.clock() >= self.deadline:
            raise self._too_late()
        with self._in_time():
            count = body.readinto(buffer)
        if count and hasher is not None:
            hasher.update(buffer[:count])
        if self.received < HEAD_BYTES:
            self.head += bytes(buffer[: min(count, HEAD_BYTES - self.received)])
        self.received += count
        self._log_progress()
        return count

    @contextmanager
    def _in_time(self) -> Iterator[None]:
        """A transient failure past the deadline is the watchdog's abort: say why."""
        try:
            yield
        except TransientSourceError:
            if self.clock() >= self.deadline:
                raise self._too_late() from None
            raise

    def _too_late(self) -> TransientSourceError:
        return TransientSourceError(
            f"{self.obj.key}: not downloaded within {self.options.timeout_text()} "
            f"({self.received / MIB:.1f} MiB so far) — raise --download-timeout-s or check the network"
        )

    def _log_progress(self) -> None:
        """Every ``progress_interval_s``, as the download engine does: a long transfer is not silent."""
        now = self.clock()
        if now - self.logged < self.options.progress_interval_s:
            return
        self.logged = now
        of = f" of {self.obj.size / MIB:.1f}" if self.obj.size > 0 else ""
        logger.info(
            "downloading and unpacking %s: %.1f%s MiB, %.1f MiB/s",
            self.obj.key,
            self.received / MIB,
            of,
            self.received / MIB / max(now - self.started, 1e-9),
        )


def _open_writer(pipe: Path, reader: threading.Thread) -> int:
    """Open the pipe for writing once the unpacker has opened it for reading; -1 if it ended before that
    (it failed: its error is in the outcome). Non-blocking, so a reader that never comes cannot hang us."""
    while True:
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            if not reader.is_alive():
                return -1
            time.sleep(_OPEN_POLL_S)
            continue
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        try:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # a smaller pipe only means more switches between the threads
        return fd


def _release(pipe: Path) -> None:
    try:
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waiting: nothing to release


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _disk_error(exc: OSError, folder: Path) -> TritonshareError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpace(f"{folder}: the staging filesystem is full — free space on the node")
    return TritonshareError(f"{folder}: cannot make the pipe to unpack through: {exc}")


def _empty(folder: Path) -> None:
    """Remove what an earlier attempt unpacked; the folder itself stays."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
