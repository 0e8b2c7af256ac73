"""Safe unpacking of a model shipped as one archive: ``.tar``, ``.tar.gz``/``.tgz``, ``.zip``.

Every member is checked before it is written, against the folder as it is at that moment (so a link
unpacked earlier cannot carry a later member outside):

- its path stays inside the folder: no absolute path, no ``..``, no write through a link that leads out
  (a member naming the folder itself, ``./`` as ``tar -C model -czf m.tgz .`` writes it, is skipped);
- a symbolic or hard link points inside the folder;
- it is a regular file, a folder or a link: device files, FIFOs and the like are refused.

A link is checked once more when the whole archive is unpacked (:func:`check_links`): it resolves through
the links unpacked after it, so ``c/c/../../x`` that stayed inside while ``c`` did not exist leads two levels
out once a later member ``c -> .`` does. The loader checks the model root it publishes the same way.
A refused member raises :class:`UnsafeArchive` naming it; the caller discards the half-unpacked folder.
Members that cannot be unpacked as they stand (a file used as a folder, a hard link to a missing member) are
an :class:`InvalidModel`; a member header larger than a path needs (a GNU long name or pax header of
megabytes, read whole by tarfile) is refused before it is read, so memory stays flat whatever the archive
declares.
A tar must also end as a whole one does — its end-of-archive marker, and its compressed stream's own end —
or it is refused as cut short (:mod:`tritonshare.loader.tar_stream`), never installed missing files.
The bytes unpacked are counted against a budget (the free space measured before), so an archive that
inflates beyond the disk fails as :class:`InsufficientSpace` before the disk fills.
Formats are a registry keyed by file-name suffix, with a sniff of the first bytes for names without one
(an ``https://host/download?id=3`` URL).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from tritonshare.common.errors import (
    InsufficientSpace,
    InvalidModel,
    NotAnArchive,
    TritonshareError,
    UnsafeArchive,
    clip,
)
from tritonshare.loader.model import check_links, inside
from tritonshare.loader.tar_stream import IncompleteArchive, TarStream

logger = logging.getLogger(__name__)

Unpacker = Callable[[Path, Path, "Budget"], int]  # (archive, dest, budget) → members unpacked

# The standard library's own "data" filter (Python ≥ 3.11.4) as a second line of defence: it also drops
# set-uid bits and never chowns to the archive's owners when running as root.
_TAR_FILTER: dict[str, str] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
MAX_HEADER_BYTES = 64 << 10  # a GNU long name or pax header: paths and link targets, far below this
MAX_LINK_BYTES = 4096  # PATH_MAX: a zip link's target is its data
MAX_DEPTH = 64  # folders a member's path may go down
HEAD_BYTES = 512  # of a file that is no archive, what from_source looks at
# errors of members that cannot be unpacked as they stand: a file used as a folder, a name too long, …
_MEMBER_ERRNOS = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENAMETOOLONG, errno.EINVAL, errno.ELOOP)


class OversizedHeader(tarfile.ReadError):
    """A member header declares more bytes than any path needs."""


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a GNU long-name or pax header whole into memory (``_proc_gnulong``, ``_proc_pax``, its
    extension points since the module began): a 400 KiB gzip declaring a 400 MiB name took 1.3 GB. Refused
    above :data:`MAX_HEADER_BYTES` before a byte of it is read."""

    def _proc_gnulong(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        self._bounded()
        return super()._proc_gnulong(tarfile)  # type: ignore[misc, no-any-return]

    def _proc_pax(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        self._bounded()
        return super()._proc_pax(tarfile)  # type: ignore[misc, no-any-return]

    def _bounded(self) -> None:
        if self.size > MAX_HEADER_BYTES:
            raise OversizedHeader(
                f"a member header (long name or pax, type {self.type!r}) of {self.size} bytes, more than the "
                f"{MAX_HEADER_BYTES} any path needs"
            )


class Budget:
    """Bytes an unpack may still write; exceeding it raises InsufficientSpace naming the member."""

    def __init__(self, archive: Path, max_bytes: int | None) -> None:
        self.archive = archive
        self.left = max_bytes
        self.used = 0

    def take(self, member: str, size: int) -> None:
        self.used += size
        if self.left is not None and self.used > self.left:
            raise InsufficientSpace(
                f"{self.archive.name}: unpacking {member!r} would bring the model to {self.used} bytes, more "
                f"than the {self.left} bytes free on the staging filesystem — free space on the node"
            )


def member_target(dest: Path, name: str, archive: Path) -> Path:
    """Where member ``name`` lands under ``dest``; refuses paths that leave it, also through links."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or name.startswith(("/", "\\")) or ".." in parts or "\0" in name or ":" in parts[0]:
        raise _escape(archive, name, "its path is absolute or climbs out with '..'")
    if len(parts) > MAX_DEPTH:  # no model nests so deep; Python's own tree walks recurse per level
        raise _escape(archive, name[:200], f"its path is {len(parts)} levels deep, more than {MAX_DEPTH}")
    target = dest.joinpath(*parts)
    if not _inside(dest, os.path.realpath(target)):
        raise _escape(archive, name, "it would be written through a link that leads outside")
    return target


def is_top(name: str) -> bool:
    """``name`` is the folder itself: ``.`` or ``./``."""
    return bool(name) and not name.startswith(("/", "\\")) and not PurePosixPath(name.replace("\\", "/")).parts


def check_link(dest: Path, target: Path, link: str, *, hard: bool, archive: Path, name: str) -> None:
    """A symbolic link resolves from its own folder, a tar hard link from the archive's root."""
    if not link or os.path.isabs(link):
        raise _escape(archive, name, f"it links to the absolute path {link!r}")
    if "\0" in link:
        raise _escape(archive, name, "its link target holds a NUL byte")
    base = dest if hard else target.parent
    if not _inside(dest, os.path.realpath(base / link)):
        raise _escape(archive, name, f"it links to {link!r}, outside the model folder")


def _inside(dest: Path, resolved: str) -> bool:
    return inside(os.path.realpath(dest), resolved)


def _escape(archive: Path, name: str, why: str) -> UnsafeArchive:
    return UnsafeArchive(
        f"{archive.name}: member {name!r} is refused: {why} — rebuild the archive with relative paths that "
        "stay inside the model folder"
    )


def _read_error(archive: Path, kind: str, exc: BaseException) -> TritonshareError:
    """A full disk is InsufficientSpace, another failed write a node problem (exit 1, as in the download
    engine); anything else means the archive itself is damaged or of another kind."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpace(f"unpacking {archive.name}: the staging filesystem is full — free space on the node")
    if (isinstance(exc, OSError) and exc.errno in _MEMBER_ERRNOS) or isinstance(exc, (KeyError, ValueError)):
        return InvalidModel(
            f"{archive.name}: its members cannot be unpacked as they stand ({exc}) — rebuild the archive "
            "(a file used as a folder, or a hard link to a member it does not hold?)"
        )
    if isinstance(exc, OSError) and exc.errno is not None:
        return TritonshareError(f"{archive.name}: unpacking failed: {exc}")
    advice = "upload the whole archive again, or rebuild it" if isinstance(exc, IncompleteArchive) else "check the file"
    return NotAnArchive(archive.name, kind=kind, reason=str(exc), advice=advice)


def from_source(error: NotAnArchive, origin: str, name: str, head: bytes) -> NotAnArchive:
    """``error`` of the archive file ``name``, naming instead where its bytes came from (the source's URL or
    path: the local file is the loader's own), and saying when they are an HTML page — what a web server
    answers with 200 for a login, a missing file or an expired link."""
    if not looks_like_html(head):
        return NotAnArchive(origin, kind=error.kind, reason=error.reason, advice=error.advice)
    expected = next((s for s in sorted(ARCHIVES, key=len, reverse=True) if name.lower().endswith(s)), "")
    return NotAnArchive(
        origin,
        kind=error.kind,
        reason=f"it begins {clip(head.decode('utf-8', 'replace'), 80)!r}",
        advice=f"the server answered an HTML page, not a {expected or error.kind + ' archive'}: check the URL "
        "and its access",
    )


_HTML_TAGS = (b"<!doctype html", b"<html", b"<head", b"<body")


def looks_like_html(head: bytes) -> bool:
    """The first bytes of a file are an HTML page's (after a comment, perhaps); an archive never begins
    with ``<``."""
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return text.startswith(b"<") and any(tag in text for tag in _HTML_TAGS)


def _refuse_kind(archive: Path, name: str, kind: str) -> UnsafeArchive:
    return UnsafeArchive(
        f"{archive.name}: member {name!r} is a {kind}; a model archive may hold only files, folders and links "
        "inside it — rebuild the archive without it"
    )


def unpack_tar(archive: Path, dest: Path, budget: Budget) -> int:
    """Stream the members in order (one pass, even for .tar.gz), checking each before writing it; then check
    that the archive ends as a whole one does (see :mod:`tritonshare.loader.tar_stream`)."""
    count = 0
    try:
        with open(archive, "rb", buffering=0) as raw:
            stream = TarStream(raw)
            with stream.open_tar(BoundedTarInfo) as tar:
                while (member := tar.next()) is not None:
                    # tarfile keeps every header it read (an attribute it has always had, not in typeshed): memory
                    # would grow with the count. Hard links still find their files on disk.
                    tar.members.clear()  # type: ignore[attr-defined]
                    count += 1
                    if is_top(member.name) and member.isdir():
                        continue  # the folder itself: it exists, and keeps the mode the loader gives it
                    _check_tar_member(member, dest, archive, budget)
                    tar.extract(member, dest, **_TAR_FILTER)  # type: ignore[arg-type]
                stream.check_end(tar)
    except tarfile.FilterError as exc:  # our checks come first; this is the standard library agreeing
        raise _escape(archive, exc.tarinfo.name, str(exc)) from exc
    except (tarfile.TarError, EOFError, zlib.error, OSError, KeyError, ValueError) as exc:
        raise _read_error(archive, "tar", exc) from exc
    check_links(dest, archive.name)
    return count


def _check_tar_member(member: tarfile.TarInfo, dest: Path, archive: Path, budget: Budget) -> None:
    target = member_target(dest, member.name, archive)
    if member.issym() or member.islnk():
        check_link(dest, target, member.linkname, hard=member.islnk(), archive=archive, name=member.name)
    elif member.ischr() or member.isblk():
        raise _refuse_kind(archive, member.name, "device file")
    elif member.isfifo():
        raise _refuse_kind(archive, member.name, "FIFO")
    elif not (member.isreg() or member.isdir()):
        raise _refuse_kind(archive, member.name, f"special entry (tar type {member.type!r})")
    budget.take(member.name, member.size if member.isreg() else 0)


def unpack_zip(archive: Path, dest: Path, budget: Budget) -> int:
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if not (is_top(info.filename) and info.is_dir()):
                    _unpack_zip_member(zf, info, dest, archive, budget)
            count = len(zf.infolist())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, OSError, ValueError) as exc:
        raise _read_error(archive, "zip", exc) from exc
    check_links(dest, archive.name)
    return count


def _unpack_zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path, archive: Path, budget: Budget) -> None:
    target = member_target(dest, info.filename, archive)
    mode = info.external_attr >> 16  # the Unix mode, when the archive was made on Unix
    kind = stat.S_IFMT(mode)
    if info.is_dir() or kind == stat.S_IFDIR:
        target.mkdir(parents=True, exist_ok=True)
    elif kind == stat.S_IFLNK:
        if info.file_size > MAX_LINK_BYTES:  # its target is its data: read whole
            raise _escape(archive, info.filename, f"it is a link whose target is {info.file_size} bytes long")
        link = zf.read(info).decode("utf-8", errors="replace")
        check_link(dest, target, link, hard=False, archive=archive, name=info.filename)
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            os.unlink(target)  # a repeated name replaces the earlier member, as with tar
        os.symlink(link, target)
    elif kind in (0, stat.S_IFREG):
        budget.take(info.filename, info.file_size)
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(info) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)  # bounded memory; zipfile stops at the declared size
    else:
        raise _refuse_kind(archive, info.filename, "device file or FIFO")


# suffix (lower case) → unpacker; the longest matching suffix wins (".tar.gz" before ".gz")
ARCHIVES: dict[str, Unpacker] = {
    ".tar": unpack_tar,
    ".tar.gz": unpack_tar,
    ".tgz": unpack_tar,
    ".zip": unpack_zip,
}

# leading bytes → unpacker, for names without a known suffix
_MAGIC: list[tuple[int, bytes, Unpacker]] = [
    (0, b"\x1f\x8b", unpack_tar),  # gzip: a model shipped as gzip is a .tar.gz
    (0, b"PK\x03\x04", unpack_zip),
    (257, b"ustar", unpack_tar),
]


def unpacker_for(path: Path) -> Unpacker | None:
    """The unpacker for ``path`` by its name, else by its first bytes; None when it is no archive."""
    name = path.name.lower()
    for suffix in sorted(ARCHIVES, key=len, reverse=True):
        if name.endswith(suffix):
            return ARCHIVES[suffix]
    head = read_head(path)
    return next((fn for offset, magic, fn in _MAGIC if head[offset : offset + len(magic)] == magic), None)


def read_head(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(HEAD_BYTES)


def unpack(archive: Path, dest: Path, *, max_bytes: int | None = None) -> int:
    """Unpack ``archive`` into the existing folder ``dest``; returns the number of members.
    Raises UnsafeArchive, InvalidModel (not an archive of a known kind, or damaged), InsufficientSpace."""
    unpacker = unpacker_for(archive)
    if unpacker is None:
        raise InvalidModel(
            f"{archive.name}: not an archive of a known kind ({', '.join(ARCHIVES)}) — "
            "point the source at a model folder or an archive of one"
        )
    count = unpacker(archive, dest, Budget(archive, max_bytes))
    logger.debug("unpacked %d members of %s into %s", count, archive.name, dest)
    return count
