"""``file:///models/m`` or a plain path: a folder (every file under it) or one file.

A model on a mounted volume (hostPath, PVC, ConfigMap). Symbolic links are followed only when they stay
inside the folder: a ConfigMap volume is made of such links, while a link to ``/etc`` would copy host
files into a model.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tritonshare.common.errors import (
    InvalidModel,
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    UnsafeArchive,
    UsageError,
)
from tritonshare.loader.sources.base import Progress, RemoteObject, register
from tritonshare.loader.sources.stream import copy_to_file


def path_of(uri: str) -> Path:
    """``file:///a/b``, ``file://localhost/a/b``, ``file:/a/b`` (RFC 8089) or ``a/b`` → a local path."""
    if "://" not in uri and not uri.lower().startswith("file:/"):
        return Path(uri)
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise UsageError(f"source {uri!r}: file:// URIs name a local path — drop the host {parts.netloc!r}")
    return Path(unquote(parts.path))


def translate(exc: OSError, what: str) -> SourceError | TransientSourceError:
    if isinstance(exc, FileNotFoundError):
        return SourceNotFound(f"{what}: no such file or folder — check the path and the volume mount")
    if isinstance(exc, PermissionError):
        return SourceAccessDenied(f"{what}: permission denied — check the file modes and the pod's user")
    return TransientSourceError(f"{what}: read failed: {exc}")


@register("file")
class LocalSource:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.root = path_of(uri)

    def list(self) -> list[RemoteObject]:
        try:
            if self.root.is_file():
                return [self._object(self.root, self.root.name)]
            if not self.root.is_dir():
                raise SourceNotFound(f"{self.uri}: no such file or folder — check the path and the volume mount")
            objects = [
                self._object(path, path.relative_to(self.root).as_posix()) for path in _walk(self.root, self.uri)
            ]
        except OSError as exc:
            raise translate(exc, self.uri) from exc
        if not objects:
            raise SourceNotFound(f"{self.uri}: the folder is empty — check the path and the volume mount")
        return objects

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        try:
            src = open(obj.key, "rb")  # closed below; opening is the step that may fail
        except OSError as exc:
            raise translate(exc, obj.key) from exc
        with src:

            def read_into(buffer: memoryview) -> int:
                try:
                    return src.readinto(buffer)
                except OSError as exc:
                    raise translate(exc, obj.key) from exc

            copy_to_file(read_into, dest, progress)

    def close(self) -> None:
        pass

    def _object(self, path: Path, relpath: str) -> RemoteObject:
        stat = path.stat()
        return RemoteObject(
            key=str(path), relpath=relpath, size=stat.st_size, version=f"{stat.st_mtime_ns}-{stat.st_size}"
        )


def _walk(top: Path, uri: str) -> list[Path]:
    """Every file under ``top``, in a stable order, links inside it followed (a link to a folder too: its files
    are listed under the link's name); refuses links that leave it, and links to a folder holding them."""
    root = top.resolve()
    found: list[Path] = []
    above: dict[str, frozenset[str]] = {str(top): frozenset({str(root)})}  # real folders from top down to each
    for folder, dirs, files in os.walk(top, onerror=_raise, followlinks=True):
        dirs.sort()
        for name in dirs:
            path = Path(folder, name)
            real = _inside(path, root, uri)
            if real in above[folder]:
                raise InvalidModel(
                    f"{uri}: {path.relative_to(top)} links to a folder holding it ({real}), so the model would never "
                    "end — remove the link"
                )
            above[str(path)] = above[folder] | {real}
        for name in sorted(files):
            path = Path(folder, name)
            if path.is_symlink():  # (a folder's real path is needed above; a file's only when it is a link)
                _inside(path, root, uri)
            if path.is_file():
                found.append(path)
    return found


def _inside(path: Path, root: Path, uri: str) -> str:
    """The real path of ``path``; UnsafeArchive when it is a link that leads out of ``root``."""
    real = path.resolve()
    if path.is_symlink() and not real.is_relative_to(root):
        raise UnsafeArchive(
            f"{uri}: {path} links outside the model folder (to {real}) — copy the file into the folder instead"
        )
    return str(real)


def _raise(exc: OSError) -> None:
    raise exc
