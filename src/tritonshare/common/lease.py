"""Leases: which pods hold an installed model, and whether they are still alive.

A folder in Triton's repository says nothing about who uses it, and a pod killed without SIGTERM (SIGKILL,
OOM, a lost node) never runs its unload. So every pod that uses a model holds a lease on its NAME: a small
JSON file in the node folder, OUTSIDE the repository (any new file inside a model folder is a change that
makes POLL reload the model, REFERENCE §2). Its mtime is the holder's heartbeat::

    /var/lib/tritonshare/leases/
    ├── NAME/
    │   ├── <pod-uid>.json    one lease per holder: pod identity, source, digest; mtime = last heartbeat
    │   └── <pod-uid>.json    a second pod of the same model sharing the one install
    └── .locks/NAME           flock(2) target: "take a lease" and "remove the model" never interleave

Who does what:

- the loader takes its lease (:meth:`LeaseStore.acquire`) *before* it looks at ``repository/NAME`` to
  install or reuse it, and keeps it fresh while it downloads and waits (:class:`Heartbeat`);
- the proxy takes it too (idempotent) and refreshes it while serving;
- unload drops its own lease and removes the folder only if no other holder's lease is fresh
  (:meth:`LeaseStore.release`);
- ``tritonshare gc`` removes a model once every lease on it is older than the TTL.

Lock files are never deleted: deleting a flock target while another process waits on it would let a third
process lock a new file of the same name, and two processes would hold "the" lock. They are empty, one per
model name ever installed on the node.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tritonshare.common.errors import InsufficientSpace, TritonshareError, UsageError
from tritonshare.common.layout import DEFAULT_LEASES, check_model_name, is_model_name

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 600.0

Clock = Callable[[], float]

_LOCKS = ".locks"  # not a valid model name (it starts with '.'), so it never collides with a NAME folder
_SUFFIX = ".json"
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True, kw_only=True)
class Holder:
    """A pod that uses a model, named as the downward API gives it (``metadata.uid``, ``.name``,
    ``.namespace``). The UID is the key: a restarted container keeps it, a new pod gets a new one."""

    uid: str
    name: str = ""
    namespace: str = ""

    def __post_init__(self) -> None:
        if not _UID.fullmatch(self.uid):
            raise UsageError(
                f"pod UID {self.uid!r} is not valid for a lease file name — set --pod-uid (TRITONSHARE_POD_UID) "
                "from the downward API's metadata.uid"
            )

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})" if self.name else self.uid


@dataclass(frozen=True, kw_only=True)
class Lease:
    name: str
    holder: Holder
    source: str = ""
    digest: str = ""
    acquired_at: float = 0.0
    renewed_at: float = 0.0  # the lease file's mtime: the holder's last heartbeat

    def idle_s(self, now: float) -> float:
        return now - self.renewed_at

    @property
    def given_up(self) -> bool:
        """Expired by its holder (:meth:`LeaseStore.give_up`), not by missed heartbeats."""
        return self.renewed_at <= 0


class Release(enum.Enum):
    """What :meth:`LeaseStore.release` found, and so whether the model folder went."""

    LAST = "last"  # the holder's lease was the last fresh one: the folder was removed
    SHARED = "shared"  # another holder's lease is fresh: the folder stays
    NOT_HELD = "not-held"  # the holder had no lease on NAME: the folder is not its to remove


class LeaseStore:
    """The lease folder of one node. ``clock`` (wall time, as file mtimes are) is a seam for tests."""

    def __init__(self, root: Path = DEFAULT_LEASES, *, ttl_s: float = DEFAULT_TTL_S, clock: Clock = time.time) -> None:
        self.root = root
        self.ttl_s = ttl_s
        self.clock = clock

    def path(self, name: str, holder: Holder) -> Path:
        return self.root / check_model_name(name) / f"{holder.uid}{_SUFFIX}"

    def acquire(self, name: str, holder: Holder, *, source: str = "", digest: str = "") -> Lease:
        """Take (or renew) ``holder``'s lease on NAME. Written atomically; idempotent."""
        now = self.clock()
        lease = Lease(name=name, holder=holder, source=source, digest=digest, acquired_at=now, renewed_at=now)
        path = self.path(name, holder)
        try:
            with self.lock(name):
                path.parent.mkdir(exist_ok=True)
                _write_atomic(path, _encode(lease), mtime=now)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the node folder is writable: its disk is full
                raise InsufficientSpace(
                    f"cannot write the lease {path}: the filesystem is full — free space on the node"
                ) from exc
            raise UsageError(
                f"cannot write the lease {path}: {exc} — mount the node folder read-write in this container"
            ) from exc
        logger.info("%s holds a lease on %s", holder, name)
        return lease

    def refresh(self, name: str, holder: Holder) -> bool:
        """Heartbeat: set the lease's mtime to now. False if the lease is gone (released or collected)."""
        now = self.clock()
        try:
            os.utime(self.path(name, holder), (now, now))
        except FileNotFoundError:
            return False
        return True

    def release(self, name: str, holder: Holder, *, remove: Callable[[], object]) -> Release:
        """Drop ``holder``'s lease on NAME; if no other holder's lease is fresh, call ``remove()`` (which takes
        the model folder out) and drop the expired leases of dead holders too. All under NAME's lock, so a
        loader cannot take a lease and reuse the folder between the check and the removal."""
        with self.lock(name):
            try:
                self.path(name, holder).unlink()
            except FileNotFoundError:
                return Release.NOT_HELD
            if self.fresh(name):
                return Release.SHARED
            remove()
            self.drop(name)
            return Release.LAST

    def forget(self, name: str, holder: Holder) -> bool:
        """Drop ``holder``'s lease and touch nothing else (a loader that failed, an unload that must leave a
        LOADING model in place): with no fresh lease left, gc removes the model later. False if none."""
        try:
            self.path(name, holder).unlink()
        except FileNotFoundError:
            return False
        return True

    def give_up(self, name: str, holder: Holder) -> None:
        """``holder`` no longer uses NAME, and leaves what it installed there: if another holder's lease is
        fresh, drop ``holder``'s (that pod uses the install); else leave it expired, its heartbeat set to the
        epoch, so that the install is abandoned at once (with no lease at all, a recent install is kept a TTL,
        as one made by hand is)."""
        with self.lock(name):
            if any(lease.holder.uid != holder.uid for lease in self.fresh(name)):
                self.forget(name, holder)
                return
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path(name, holder), (0, 0))
        logger.info("%s gives %s up: its lease is left expired, for gc or the next pod's loader", holder, name)

    def leases(self, name: str) -> list[Lease]:
        folder = self.root / check_model_name(name)
        try:
            paths = sorted(folder.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = (_read(name, p) for p in paths if p.suffix == _SUFFIX and not p.name.startswith("."))
        return [lease for lease in found if lease is not None]

    def fresh(self, name: str) -> list[Lease]:
        """Leases on NAME whose holder's last heartbeat is within the TTL."""
        now = self.clock()
        return [lease for lease in self.leases(name) if lease.idle_s(now) <= self.ttl_s]

    def expired(self, name: str) -> list[Lease]:
        """Leases on NAME whose holder's last heartbeat is older than the TTL."""
        now = self.clock()
        return [lease for lease in self.leases(name) if lease.idle_s(now) > self.ttl_s]

    def owned_by(self, name: str, holder: Holder) -> bool:
        """Whether ``holder`` holds a lease on NAME (fresh or not: a live pod may be slow to beat)."""
        return self.path(name, holder).is_file()

    def names(self) -> list[str]:
        """Every NAME with a lease folder."""
        try:
            entries = sorted(self.root.iterdir())
        except FileNotFoundError:
            return []
        return [p.name for p in entries if p.is_dir() and is_model_name(p.name)]

    def drop(self, name: str) -> None:
        """Remove every lease on NAME (once the model is gone). Call it under :meth:`lock`."""
        shutil.rmtree(self.root / check_model_name(name), ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Exclusive, cross-process lock on NAME (flock; the node folder is one kernel's hostPath)."""
        path = self.root / _LOCKS / check_model_name(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock


class Heartbeat:
    """Keeps one lease fresh from a daemon thread: a refresh every ``interval_s`` (default: a tenth of the
    TTL, so nine beats can be missed before the lease expires). A lease that vanished (an operator, or gc
    after missed beats) is taken again, and the loss is logged."""

    def __init__(self, store: LeaseStore, lease: Lease, *, interval_s: float | None = None) -> None:
        self.store = store
        self.lease = lease
        self.interval_s = store.ttl_s / 10 if interval_s is None else interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.name}", daemon=True)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def beat(self) -> None:
        lease = self.lease
        try:
            if self.store.refresh(lease.name, lease.holder):
                return
            logger.warning(
                "the lease of %s on %s was gone (missed heartbeats longer than %.0fs?); taking it again",
                lease.holder,
                lease.name,
                self.store.ttl_s,
            )
            self.store.acquire(lease.name, lease.holder, source=lease.source, digest=lease.digest)
        except (OSError, TritonshareError) as exc:  # a full disk too: the next beat tries again
            logger.warning("could not refresh the lease of %s on %s: %s", lease.holder, lease.name, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()


def _encode(lease: Lease) -> bytes:
    doc = {
        "name": lease.name,
        "pod_uid": lease.holder.uid,
        "pod_name": lease.holder.name,
        "pod_namespace": lease.holder.namespace,
        "source": lease.source,
        "digest": lease.digest,
        "acquired_at": lease.acquired_at,
    }
    return (json.dumps(doc, indent=2) + "\n").encode()


def _read(name: str, path: Path) -> Lease | None:
    """One lease file; None if it vanished. An unreadable body still counts by its mtime, keyed by its file
    name: a lease must never be ignored, or its model could be removed under a live pod."""
    try:
        renewed_at = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("lease %s is unreadable (%s); counting it by its mtime", path, exc)
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    return Lease(
        name=name,
        holder=_holder(doc, path.stem),
        source=str(doc.get("source", "")),
        digest=str(doc.get("digest", "")),
        acquired_at=_number(doc.get("acquired_at")),
        renewed_at=renewed_at,
    )


def _holder(doc: dict[str, object], stem: str) -> Holder:
    try:
        return Holder(
            uid=str(doc.get("pod_uid", stem)),
            name=str(doc.get("pod_name", "")),
            namespace=str(doc.get("pod_namespace", "")),
        )
    except UsageError:
        return Holder(uid="unreadable")


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _write_atomic(path: Path, data: bytes, *, mtime: float) -> None:
    """Temp file in the same folder, fsync, rename over, fsync the folder: a reader sees the old or the new
    lease, never a torn one, and a crash leaves at most a dot-file that readers skip."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.utime(tmp, (mtime, mtime))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def judging_ttl(lease_ttl_s: float) -> float:
    """The TTL by which a pod judges OTHER pods' leases: its own, but never below the default. A pod
    heartbeats at a tenth of its own TTL, which may be longer than this pod's: judged by a shorter TTL,
    its live lease would look expired and its model be removed from under it."""
    return max(lease_ttl_s, DEFAULT_TTL_S)
