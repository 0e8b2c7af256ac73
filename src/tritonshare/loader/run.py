"""``tritonshare load``: fetch a model, install it atomically into Triton's repository, wait until ready.

Phases, each logged with its duration::

    triton    Triton answers (else exit 13 before anything is downloaded)
    list      the source's objects → listing digest → reuse, conflict (14) or go on — NAME held by another
              install that no pod uses any more (every other lease expired) is retired first; the listing and
              the download share --download-timeout-s (11 past it, naming the phase)
    space     listed bytes vs free space on the staging filesystem (15)
    download  into a fresh staging folder; a source that is one tar archive (.tar, .tar.gz, .tgz) in a store
              that streams (HTTP, S3, GCS) is unpacked as it arrives, the archive never landing on disk (logged
              as "download (unpacked as it arrived)"): its size and checksum are still verified over the
              stream, and the unpacked files must fit in the free space
    unpack    when the source is one archive file that had to land first (a zip, a file on a volume)
    check     find the model root, check it, set config.pbtxt's name
    gpu       only with --require-gpu-memory-mib: Triton's GPUs have that much free (15), checked before the
              download and again before publishing
    publish   record + one rename into repository/NAME
    load      Triton reports it ready (poll) or loaded it (explicit)

A load run in a thread (the proxy's reinstall) is stopped with a :class:`~tritonshare.loader.stop.Stop`
as SIGTERM stops ``tritonshare load``, and cleans up the same way; it publishes nothing once the stop is asked.

On any failure nothing new stays in staging: the staging folder is discarded, and a published folder Triton
could not load is taken back out (rename out, then delete) — only one this loader published (never one it
reused), only while no other pod's lease on NAME is fresh, and never while Triton is LOADING it or does not
answer (it may be starting up and loading it): removing a folder mid-load hangs Triton's polling for every
model (REFERENCE §2).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tritonshare.common.command import doing, held_stops
from tritonshare.common.errors import (
    ExitCode,
    InstallConflict,
    InsufficientSpace,
    NotAnArchive,
    ReadinessTimeout,
    TritonLoadFailed,
)
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Heartbeat, LeaseStore
from tritonshare.common.repository import InstallRecord, discard, flush_tree, make_folder, new_staging_dir
from tritonshare.common.triton import TritonClient
from tritonshare.loader import sources
from tritonshare.loader.download import download_all, listed_bytes
from tritonshare.loader.download_options import MIB, DownloadOptions
from tritonshare.loader.install import (
    Installed,
    Withdrawal,
    existing,
    install,
    listing_digest,
    take_over,
    users,
    withdraw,
)
from tritonshare.loader.listing import list_objects
from tritonshare.loader.model import prepare
from tritonshare.loader.readiness import BEFORE_PUBLISH, MODES, wait_live
from tritonshare.loader.settings import LoaderSettings
from tritonshare.loader.sources.base import RemoteObject, Source, display_uri, query_identity
from tritonshare.loader.sources.stream import StreamSource
from tritonshare.loader.stop import Stop

logger = logging.getLogger(__name__)

DiskFree = Callable[[Path], int]  # bytes free on the filesystem holding a path
SourceOpener = Callable[[str], Source]

STREAMED = "unpacked as it arrived"  # the note on the download phase of a streamed tar
WITHDRAW_TIMEOUT_S = 60.0  # how long a failed model may stay LOADING (Triton re-tries it) before we give up


def disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


# what the loader is doing in each phase, for the message a stop signal leaves ("stopped by SIGTERM while …")
_DOING = {
    "triton": "waiting for Triton to answer",
    "list": "listing the source",
    "space": "checking free space",
    "download": "downloading",
    "unpack": "unpacking",
    "check": "checking the model",
    "gpu": "checking GPU memory",
    "publish": "publishing",
    "load": "waiting for Triton to load the model",
}


class Timings:
    """Durations of the phases of one load, logged as each ends and together at the end. A phase may carry a
    note on how it ran; its name stays one word, which log readers match (``phase (\\w+) took``). A phase
    does not begin once ``stop`` is asked."""

    def __init__(self, stop: Stop | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self.stop = stop or Stop()

    @contextmanager
    def phase(self, name: str, note: str = "") -> Iterator[None]:
        self.stop.check(_DOING.get(name, name))
        started = time.monotonic()
        if note:
            self.notes[name] = f" ({note})"
        try:
            with doing(_DOING.get(name, name)):  # what a stop signal's termination message says
                yield
        finally:
            self.seconds[name] = time.monotonic() - started
            logger.info("phase %s took %.2f s%s", name, self.seconds[name], self.notes.get(name, ""))

    def summary(self) -> str:
        return ", ".join(f"{name} {secs:.2f} s{self.notes.get(name, '')}" for name, secs in self.seconds.items())


def run(
    settings: LoaderSettings,
    *,
    disk_free: DiskFree = disk_free,
    open_source: SourceOpener = sources.open_source,
    client: TritonClient | None = None,
    stop: Stop | None = None,
) -> int:
    """Load ``settings.source`` as ``settings.name``; returns ExitCode.OK or raises from the error tree, or
    Stopped once ``stop`` is asked (from another thread), having cleaned up as after SIGTERM."""
    settings.layout.check()
    client = client or TritonClient(settings.triton_url)
    timings = Timings(stop)
    with timings.phase("triton"):
        wait_live(client, timeout_s=settings.timeout_s, interval_s=settings.poll_interval_s, sleep=timings.stop.sleep)
    with holding_lease(settings) as held:
        installed = _fetch_and_install(settings, client, timings, disk_free, open_source, held)
        _await_ready(settings, client, installed, timings)
    logger.info("%s is ready (%s): %s", settings.name, "reused" if installed.reused else "installed", timings.summary())
    return ExitCode.OK


@dataclass
class Held:
    """What the lease of a load covers: whether this loader published repository/NAME."""

    published: bool = False


@contextmanager
def holding_lease(settings: LoaderSettings) -> Iterator[Held]:
    """This pod's lease on NAME, taken before repository/NAME is looked at (so gc cannot remove a folder this
    loader is about to reuse), kept fresh while downloading and waiting; on success it stays, and the proxy
    keeps it fresh from then on. If the load fails or is stopped, the lease is dropped — or, when a folder
    this loader published stays (Triton was loading it) and no other pod uses it, expired: what stays is then
    abandoned at once to gc and to the next pod's loader (:func:`install.take_over`), where with no lease at
    all a folder this recent would be kept for a TTL, as one installed by hand is."""
    held = Held()
    if settings.holder is None:
        yield held
        return
    leases = LeaseStore(settings.layout.leases, ttl_s=settings.lease_ttl_s)
    lease = leases.acquire(settings.name, settings.holder, source=display_uri(settings.source))
    try:
        with Heartbeat(leases, lease):
            yield held
    except BaseException:
        if held.published and settings.layout.model_dir(settings.name).exists():
            leases.give_up(settings.name, settings.holder)
        else:
            leases.forget(settings.name, settings.holder)
        raise


def _fetch_and_install(
    settings: LoaderSettings,
    client: TritonClient,
    timings: Timings,
    free: DiskFree,
    open_source: SourceOpener,
    held: Held,
) -> Installed:
    with _opened(open_source, settings.source, timings.stop) as source:
        options = DownloadOptions.from_settings(settings)
        with timings.phase("list"):
            started = time.monotonic()
            objects = list_objects(source, options, sleep=timings.stop.sleep)
            options = dataclasses.replace(options, listing_s=time.monotonic() - started)  # the transfer has the rest
        digest = listing_digest(objects, query_identity(settings.source))
        record = InstallRecord(name=settings.name, source=display_uri(settings.source), digest=digest)
        found = _existing_or_free(settings, client, record)
        if found is not None:
            when = datetime.fromtimestamp(found.installed_at, timezone.utc).isoformat(timespec="seconds")
            logger.info(
                "%s already holds %s as installed at %s; reusing it, nothing to download",
                settings.name,
                record.source,
                when,
            )
            return Installed(settings.layout.model_dir(settings.name), reused=True)
        _check_gpu_memory(settings, record.source, timings)  # before downloading: a crash loop must not re-download
        with timings.phase("space"):
            check_space(settings.layout.staging, listed_bytes(objects), free, record.source)
        return _stage(settings, client, source, objects, record, options, timings, free, held)


@contextmanager
def _opened(open_source: SourceOpener, uri: str, stop: Stop) -> Iterator[Source]:
    """The source, closed afterwards; its requests in progress end when the load is stopped."""
    source = open_source(uri)
    try:
        with stop.aborting(source.abort if isinstance(source, StreamSource) else _nothing):
            yield source
    finally:
        source.close()


def _nothing() -> None:
    """The abort of a source that has none: its reads are short (a local file); the download checks the stop."""


def _existing_or_free(settings: LoaderSettings, client: TritonClient, record: InstallRecord) -> InstallRecord | None:
    """NAME's record when it holds this install; None when it is free — or was held by another install that no
    pod uses any more, retired here (:func:`install.take_over`); InstallConflict otherwise."""
    try:
        return existing(settings.layout, record)
    except InstallConflict:
        if take_over(settings.layout, record, client, holder=settings.holder, lease_ttl_s=settings.lease_ttl_s):
            return None
        in_use_by = users(settings.layout, settings.name, settings.holder, settings.lease_ttl_s)
        return existing(settings.layout, record, users=in_use_by)  # raises again, naming the pods that use it


def _stage(
    settings: LoaderSettings,
    client: TritonClient,
    source: Source,
    objects: list[RemoteObject],
    record: InstallRecord,
    options: DownloadOptions,
    timings: Timings,
    free: DiskFree,
    held: Held,
) -> Installed:
    """Fetch into a fresh staging folder, check, publish (in poll mode once Triton no longer serves an earlier
    NAME: :func:`readiness.wait_unserved`), noting in ``held`` whether it did; the folder goes whatever happens."""
    workspace = new_staging_dir(settings.layout, settings.name)
    try:
        top = _fetch(_Fetch(source, objects, options, workspace, free, timings))
        with timings.phase("check"):
            root = prepare(top, settings.name, record.source, lenient=settings.config_check == "lenient")
        _check_gpu_memory(settings, record.source, timings)  # again, the last look before publishing
        with timings.phase("publish"):
            before = BEFORE_PUBLISH[settings.mode]
            folder = settings.layout.model_dir(settings.name)
            before(client, settings.name, folder, timeout_s=settings.timeout_s, sleep=timings.stop.sleep)
            with timings.stop.publishing():  # a stop asked from now on waits for the rename
                flush_tree(root)  # the long part (seconds for a large model), which a stop signal still cuts short
                with held_stops():  # a signal waits for the rename, and for the note that this load published
                    installed = install(settings.layout, root, record, files_flushed=True)
                    held.published = not installed.reused
                    return installed
    finally:
        discard(workspace)


@dataclass(frozen=True)
class _Fetch:
    """What fetching the listed objects into a workspace needs."""

    source: Source
    objects: list[RemoteObject]
    options: DownloadOptions
    workspace: Path
    free: DiskFree
    timings: Timings


def _fetch(job: _Fetch) -> Path:
    """The model's files in the workspace; returns the folder holding them. One tar archive from a source
    that streams is unpacked as it arrives; anything else is downloaded, and one archive file then unpacked."""
    if len(job.objects) != 1 or "/" in job.objects[0].relpath:
        return _download(job)  # a model folder: no archive code needed
    from tritonshare.loader.stream_unpack import fetch_and_unpack, streamable  # tarfile, zipfile: for a lone file

    stream = streamable(job.source, job.objects)
    if stream is None:
        return _unpack_if_archive(_download(job), job)
    unpacked = job.workspace / "unpacked"
    make_folder(unpacked)
    with job.timings.phase("download", note=STREAMED):
        fetch_and_unpack(
            *stream, unpacked, job.options, max_bytes=job.free(job.workspace), sleep=job.timings.stop.sleep
        )
    return unpacked


def _download(job: _Fetch) -> Path:
    files = job.workspace / "download"
    make_folder(files)
    with job.timings.phase("download"):
        download_all(job.source, job.objects, files, job.options, stop=job.timings.stop)
    return files


def _unpack_if_archive(files: Path, job: _Fetch) -> Path:
    """A lone file that is an archive (a zip, or any archive on a volume) is unpacked once it has landed;
    another file is the model itself."""
    from tritonshare.loader.archive import from_source, read_head, unpack, unpacker_for

    obj = job.objects[0]
    archive = files / obj.relpath
    if unpacker_for(archive) is None:
        return files
    unpacked = job.workspace / "unpacked"
    make_folder(unpacked)
    with job.timings.phase("unpack"):
        try:
            unpack(archive, unpacked, max_bytes=job.free(job.workspace))
        except NotAnArchive as exc:  # named by the downloaded file: name the source instead
            raise from_source(exc, obj.key, obj.relpath, read_head(archive)) from exc
    archive.unlink()
    return unpacked


def _check_gpu_memory(settings: LoaderSettings, label: str, timings: Timings) -> None:
    """With --require-gpu-memory-mib: Triton's GPUs have that much free (15)."""
    if not settings.require_gpu_memory_mib:
        return
    from tritonshare.loader.gpu_check import check_gpu_memory  # prometheus_client: only for this check

    with timings.phase("gpu"):
        check_gpu_memory(settings, label)


def check_space(staging: Path, needed: int, free: DiskFree, label: str) -> None:
    """Fail before downloading when the listed bytes do not fit (runtime-adapter#48, kserve#3792: a volume
    filled mid-download gets the pod evicted)."""
    available = free(staging)
    if needed > available:
        raise InsufficientSpace(
            f"{label}: the model is {needed / MIB:.1f} MiB but {staging} has {available / MIB:.1f} MiB free — "
            "free space on the node or give the staging volume more room"
        )
    logger.info("%s: %.1f MiB to download, %.1f MiB free in %s", label, needed / MIB, available / MIB, staging)


def _await_ready(settings: LoaderSettings, client: TritonClient, installed: Installed, timings: Timings) -> None:
    """Wait for Triton; on failure take the folder back out if this loader published it, no other pod's
    lease on it is fresh, and Triton answers that it is not loading it (:func:`install.withdraw`)."""
    ready = MODES[settings.mode]
    try:
        with timings.phase("load"):
            ready(
                client,
                settings.name,
                timeout_s=settings.timeout_s,
                interval_s=settings.poll_interval_s,
                reused=installed.reused,
                sleep=timings.stop.sleep,
            )
    except (TritonLoadFailed, ReadinessTimeout) as exc:
        # A failed model is loaded again at Triton's next poll: wait that load out. Past the deadline: one look.
        wait_s = WITHDRAW_TIMEOUT_S if isinstance(exc, TritonLoadFailed) else 0.0
        outcome = withdraw(
            settings.layout,
            settings.name,
            client,
            timeout_s=wait_s,
            holder=settings.holder,
            lease_ttl_s=settings.lease_ttl_s,
            reused=installed.reused,
        )
        if outcome is not Withdrawal.REMOVED:
            raise type(exc)(f"{exc}; {_left_in_place(settings.layout, settings.name, outcome)}") from exc
        raise


def _left_in_place(layout: NodeLayout, name: str, outcome: Withdrawal) -> str:
    return f"{layout.model_dir(name)} stays in the repository: {outcome.why(name)}"
