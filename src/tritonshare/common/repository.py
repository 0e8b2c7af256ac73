"""Publishing into and removing from Triton's repository, the two filesystem moves that must be atomic.

- publish: a complete folder staged beside the repository enters it by one ``rename(2)``
  (triton#356: POLL loaded a half-copied model), once every file and folder under it is on disk, and the
  repository folder is flushed after it: the rename is the commit. Without the flush, a node that loses
  power soon after a load can come back with the folder and its record in place but files empty or holey
  (ext4 and XFS allocate blocks late), which the next loader would reuse as installed.
- move_out, then discard: a model leaves by a rename out of the repository, then a delete in staging
  (``rm -rf`` in place is not atomic: a poll mid-delete sees a "modified" model); callers delete after they
  release NAME's lock.

Each installed model carries ``tritonshare.json``, the record of what was installed (source URI and
content digest), so a restarted init container can tell "already mine" from "someone else's".
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonshare.common.errors import InstallConflict, InsufficientSpace, TritonshareError, UsageError
from tritonshare.common.layout import ONE_VOLUME, NodeLayout

logger = logging.getLogger(__name__)

RECORD_FILE = "tritonshare.json"
RECORD_MODE = 0o644  # the gc and the proxy read records, maybe as another user than the loader
# Files are flushed this many at once: concurrent fsyncs share journal commits and device cache flushes, so a
# model of many small files costs a few commits rather than one per file (measured in the loader's report).
FLUSH_THREADS = 8


@dataclass(frozen=True, kw_only=True)
class InstallRecord:
    name: str
    source: str
    digest: str
    installed_at: float = 0.0

    def same_content(self, other: InstallRecord) -> bool:
        """The same install: one NAME, one listing, and one source however it was spelled."""
        mine, theirs = (
            (self.name, _canonical(self.source), self.digest),
            (other.name, _canonical(other.source), other.digest),
        )
        return mine == theirs


def _canonical(source: str) -> str:
    """A source as it names its objects: ``s3://b/m/`` and ``s3://b/m`` list the same folder (the digest tells
    an object ``m`` apart), ``file:///p`` and ``/p/`` are ``/p``. An http(s) URL is kept as it is."""
    path = source.removeprefix("file://")
    if "://" not in path:
        return os.path.normpath(path) if path else path
    scheme, rest = path.split("://", 1)
    return f"{scheme}://{rest.rstrip('/')}" if scheme in ("s3", "gs") else path


def read_record(model_dir: Path) -> InstallRecord | None:
    try:
        doc = json.loads((model_dir / RECORD_FILE).read_text())
        return InstallRecord(
            name=str(doc["name"]),
            source=str(doc["source"]),
            digest=str(doc["digest"]),
            installed_at=float(doc.get("installed_at", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(model_dir: Path, record: InstallRecord) -> None:
    """Write ``model_dir/tritonshare.json`` whole or not at all: a temporary file, flushed, renamed over it.
    Write it into the staged folder before :func:`publish`, which flushes the folder before the rename that
    publishes it: a record in the repository then proves the files beside it reached the disk.
    A full disk is :class:`InsufficientSpace`, another failed write a :class:`TritonshareError`."""
    path = model_dir / RECORD_FILE
    temp = model_dir / f".{RECORD_FILE}.{uuid.uuid4().hex[:12]}"
    try:
        with open(temp, "x", encoding="utf-8") as out:
            os.fchmod(out.fileno(), RECORD_MODE)  # whatever the umask
            out.write(json.dumps(asdict(record), indent=2) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise disk_error(f"writing {path}", exc) from exc


def new_staging_dir(layout: NodeLayout, name: str, purpose: str = "download") -> Path:
    """A fresh, uniquely named folder in staging (never inside the repository)."""
    path = layout.staging / f"{name}.{purpose}.{uuid.uuid4().hex[:12]}"
    make_folder(path)
    return path


def make_folder(path: Path) -> None:
    """``mkdir`` (0755): a full disk, or no inode left, is InsufficientSpace (exit 15), not a traceback."""
    try:
        path.mkdir(mode=0o755)
    except OSError as exc:
        raise disk_error(f"creating {path}", exc) from exc


def publish(layout: NodeLayout, staged: Path, name: str, *, files_flushed: bool = False) -> Path:
    """Move a complete model folder into the repository with one rename, made durable: every file and folder
    under ``staged`` is flushed first (:func:`flush_tree`; only the folders when the caller says it flushed the
    files), the repository folder after. Refuses to replace an existing folder (``rename`` onto a non-empty
    directory fails, and onto an empty one we check first)."""
    target = layout.model_dir(name)
    flush_tree(staged, files=not files_flushed)
    if os.path.lexists(target):  # checked after the flush, which may take seconds, as close to the rename as can be
        raise InstallConflict(_installing(target, name))
    try:
        os.rename(staged, target)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise InstallConflict(_installing(target, name)) from exc
        raise _move_error(layout, staged, target, exc) from exc
    _flush_repository(layout.repository)
    logger.info("published %s", target)
    return target


def _installing(target: Path, name: str) -> str:
    return f"{target} appeared while installing — another pod is installing {name!r}"


def flush_tree(root: Path, *, files: bool = True) -> None:
    """``fsync`` every regular file under ``root`` (unless ``files`` is False: they were), then every folder,
    deepest first, ``root`` last.

    Only this tree is flushed, not the whole filesystem: ``syncfs(2)`` would also wait for every other
    writer's dirty data on the node's disk (another pod's download: 7x slower with 1 GiB of it here).
    Links are not followed (their targets inside are flushed as themselves). Raises InsufficientSpace when
    the disk is full (a late allocation fails at the flush), TritonshareError for another failure."""
    regular, folders = _tree(root)
    with ThreadPoolExecutor(max_workers=FLUSH_THREADS, thread_name_prefix="flush") as pool:
        for _ in pool.map(_flush, regular if files else []):
            pass
    for folder in folders:
        _flush(folder, os.O_DIRECTORY)


def _tree(root: Path) -> tuple[list[str], list[str]]:
    """The regular files under ``root``, and its folders with each one after everything below it."""
    files, folders, pending = [], [], [str(root)]
    while pending:
        folders.append(folder := pending.pop())
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        files.append(entry.path)
        except OSError as exc:
            raise disk_error(f"listing {folder} to flush it", exc) from exc
    folders.reverse()  # pre-order reversed: below before above
    return files, folders


def _flush(path: str, flags: int = 0) -> None:
    try:
        _fsync(path, flags)
    except OSError as exc:
        raise disk_error(f"flushing {path} to disk", exc) from exc


def _fsync(path: str | Path, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flush_repository(repository: Path) -> None:
    """Make the publishing rename durable. Past the rename the model is published, so a failure here is
    logged, not raised: the model's files are on disk, and at worst a crash forgets the rename."""
    try:
        _fsync(repository, os.O_DIRECTORY)
    except OSError as exc:
        logger.warning("could not flush %s after publishing into it (%s): a node crash may undo it", repository, exc)


def disk_error(doing: str, exc: OSError) -> TritonshareError:
    """A full disk (or quota) is InsufficientSpace; a folder this container may not write, a usage error (exit
    2, like an unwritable lease folder: the pod's volumes or user are wrong); another failed write a node
    problem (exit 1)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpace(f"{doing}: the filesystem is full — free space on the node")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return UsageError(
            f"{doing} failed: {exc.strerror or exc} — mount the node folder read-write in this container, writable "
            "by its user (runAsUser)"
        )
    return TritonshareError(f"{doing} failed: {exc.strerror or exc} — check the node's disk and the folder's owner")


def _move_error(layout: NodeLayout, source: Path, target: Path, exc: OSError) -> TritonshareError:
    """EXDEV: staging and the repository are one filesystem mounted twice, and ``rename(2)`` never crosses
    mounts — two hostPath or subPath volumes where one is needed. The layout check finds this before a
    download; this is for mounts that changed since, or a kernel that did not say."""
    if exc.errno != errno.EXDEV:
        return disk_error(f"moving {source} to {target}", exc)
    return UsageError(
        f"cannot move {source} to {target}: staging {layout.staging} and the repository {layout.repository} "
        f"are separate mounts (rename(2) does not cross mounts, even of one filesystem) — {ONE_VOLUME}"
    )


def move_out(layout: NodeLayout, name: str) -> Path | None:
    """Rename ``repository/NAME`` to a fresh NAME.retired.ID in staging (one rename, nothing created first: it
    works on a full disk); where it went, or None if it was not there."""
    source = layout.model_dir(name)
    trash = layout.staging / f"{name}.retired.{uuid.uuid4().hex[:12]}"
    try:
        os.rename(source, trash)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _move_error(layout, source, trash, exc) from exc
    logger.info("moved %s out of the repository to %s", source, trash)
    return trash


def discard(path: Path) -> None:
    """Delete a staging folder; never raises (a leftover is reported, and gc removes it later)."""
    try:
        try:
            shutil.rmtree(path)
        except RecursionError:  # a tree deeper than rmtree's recursion reaches (Python 3.11)
            _delete_with_a_stack(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)


def _delete_with_a_stack(path: Path) -> None:
    """``rm -r`` without recursion: folders listed depth first, deleted deepest first."""
    pending, folders = [str(path)], []
    while pending:
        folder = pending.pop()
        folders.append(folder)
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                else:
                    os.unlink(entry.path)
    for folder in reversed(folders):  # every folder comes after the one holding it
        os.rmdir(folder)


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate()`` until true or the deadline; returns the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
