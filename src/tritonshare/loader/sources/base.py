"""What every model source provides, and the registry that picks one by URI scheme.

A source lists the objects under a URI (a prefix is a folder: ``s3://b/model`` never matches
``model2/``, kserve#3776; an exact key is one file) and streams one object to a local file.
The download engine (:mod:`tritonshare.loader.download`) does concurrency, retries and verification;
a source only translates its SDK's errors into the error tree, once, here at the boundary.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from tritonshare.common.errors import SourceNotFound, UsageError

Progress = Callable[[int], None]  # called with the number of bytes just written


@dataclass(frozen=True, kw_only=True)
class Checksum:
    algorithm: str  # "md5" (hex) | "crc32c" (base64, big-endian) | "sha256" (hex)
    value: str


@dataclass(frozen=True, kw_only=True)
class RemoteObject:
    key: str  # the object's full name in its store (or absolute path / URL)
    relpath: str  # posix path relative to the source's folder; the file name for a single-file source
    size: int  # bytes, as listed; -1 when the store does not say (HTTP without Content-Length)
    checksum: Checksum | None = None  # verified after download when present
    version: str = ""  # etag / generation / mtime: what changes when the content changes


class Source(Protocol):
    """One model location. Instances are used from several threads at once by the download engine."""

    uri: str

    def list(self) -> list[RemoteObject]:
        """The objects to download. Raises SourceNotFound (nothing there), SourceAccessDenied,
        TransientSourceError."""
        ...

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        """Stream ``obj`` into ``dest`` (created or truncated), calling ``progress`` as bytes land.
        Raises TransientSourceError for what a retry may fix, SourceError for what it won't."""
        ...

    def close(self) -> None: ...


def bucket_and_key(uri: str, usage: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``, the key read literally: ``#`` and ``?`` are characters of an
    object's name, as the aws and gcloud CLIs read them, not a URL's fragment and query (``urlsplit`` cut
    ``models/v1#final`` to ``models/v1``: another model, installed without a word). ``usage``: the form to
    suggest when there is no bucket."""
    bucket, _, key = uri.partition("://")[2].partition("/")
    if not bucket:
        raise UsageError(f"source {uri!r}: no bucket — use {usage}")
    return bucket, key.lstrip("/")


def folder_or_object(
    uri: str,
    bucket_uri: str,
    key: str,
    list_folder: Callable[[str], list[RemoteObject]],
    exact: Callable[[str], RemoteObject],
) -> list[RemoteObject]:
    """A bucket store's listing of ``key``: the objects under it taken as a folder, else the one object named
    exactly ``key`` (not when it ends in ``/``); SourceNotFound when neither is there. ``bucket_uri`` is
    ``s3://bucket``, as the error shows it."""
    folder = key.rstrip("/") + "/" if key else ""
    objects = list_folder(folder)
    if objects:
        return objects
    if key and not key.endswith("/"):
        return [exact(key)]
    raise SourceNotFound(f"{uri}: no objects under {bucket_uri}/{folder} — check the bucket and the prefix")


SourceFactory = Callable[[str], Source]
SOURCES: dict[str, SourceFactory] = {}


def register(*schemes: str) -> Callable[[SourceFactory], SourceFactory]:
    def add(factory: SourceFactory) -> SourceFactory:
        for scheme in schemes:
            SOURCES[scheme] = factory
        return factory

    return add


def display_uri(uri: str) -> str:
    """``uri`` as it may be shown and kept on the node: no ``user:password@``, and the values of its query
    masked (a pre-signed URL's signature is a secret, and changes with every signing while the object does
    not): ``https://u:p@host/m.tgz?X-Amz-Signature=ab`` → ``https://host/m.tgz?X-Amz-Signature=…``."""
    if "://" not in uri:
        return uri  # a path
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = "&".join(f"{item.partition('=')[0]}=…" if "=" in item else item for item in parts.query.split("&"))
    return urlunsplit(parts._replace(netloc=netloc, query=query if parts.query else "", fragment=""))


# Query parameters that sign a URL (S3/GCS/CloudFront/Azure SAS): they change with every signing while the
# object does not, so they are no part of what a URL names.
_SIGNING = re.compile(
    r"x-amz-.*|x-goog-.*|signature|expires|key-pair-id|policy|googleaccessid|awsaccesskeyid"
    r"|sig|se|st|sp|sv|sr|spr|sip|skoid|sktid|skt|ske|sks|skv|sdd|ses",
    re.IGNORECASE,
)


def query_identity(uri: str) -> str:
    """What ``uri``'s query says about WHICH object it names — its parameters other than a signature's,
    sorted — for the install's identity: :func:`display_uri` masks every value, and ``…?model=a`` and
    ``…?model=b`` must not pass for one install. "" for a URL without such parameters."""
    if "://" not in uri:
        return ""
    pairs = parse_qsl(urlsplit(uri).query, keep_blank_values=True)
    return "&".join(sorted(f"{key}={value}" for key, value in pairs if not _SIGNING.fullmatch(key)))


# ``scheme:/rest`` without the ``//``: a URI typed with one slash (``s3:/bucket/m``), which read as a path
# would be a folder ``s3:`` of the working directory, not found — ``file:/path`` (RFC 8089) is a path.
_ONE_SLASH = re.compile(r"([a-z][a-z0-9+.-]*):/(?!/)", re.IGNORECASE)


def scheme_of(uri: str) -> str:
    """``s3://b/k`` → ``s3``; ``file:/p`` or a plain path → ``file``."""
    head, sep, _ = uri.partition("://")
    return head.lower() if sep else "file"


def check_uri(uri: str) -> None:
    """Refuse, as a usage error, a SOURCE that cannot be what was meant: an empty one (the working directory,
    read as a path), or a URI with one slash after its scheme (``s3:/bucket/m``, read as a path)."""
    if not uri.strip():
        raise UsageError("source '': empty — give an s3://, gs://, http(s)://, file:// URI or a path")
    typo = _ONE_SLASH.match(uri)
    if typo is None or typo.group(1).lower() == "file":
        return
    scheme, rest = typo.group(1).lower(), uri[typo.end() :]
    if scheme in SOURCES:
        meant = f"did you mean {display_uri(f'{scheme}://{rest}')}?"
    else:
        meant = f"unsupported scheme {scheme!r}: use one of {_supported()}"
    raise UsageError(
        f"source {display_uri(uri)!r}: one slash after {scheme + ':'!r} — {meant} "
        "(a local path that looks so: start it with ./)"
    )


def _supported() -> str:
    return ", ".join(sorted(f"{s}://" for s in SOURCES)) + " or a path"


def open_source(uri: str) -> Source:
    check_uri(uri)
    scheme = scheme_of(uri)
    factory = SOURCES.get(scheme)
    if factory is None:
        raise UsageError(f"source {display_uri(uri)!r}: unsupported scheme {scheme!r} — use one of {_supported()}")
    return factory(uri)
