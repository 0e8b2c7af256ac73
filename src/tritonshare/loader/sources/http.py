"""``http(s)://host/path/model.tar.gz``: one file, usually an archive, from any web server.

The standard library's client is enough for one streamed file and honours ``HTTPS_PROXY``/``NO_PROXY``.
``list`` asks with HEAD (falling back to a GET whose body is not read, for servers and pre-signed URLs
that refuse HEAD) for the size, a version (ETag, else Last-Modified) and a checksum when the server states
one: ``Repr-Digest``/``Digest`` (RFC 9530/3230), ``Content-MD5``, or ``x-goog-hash``. The file is named
by the URL's last path segment, so ``…/model.tar.gz?X-Amz-Signature=…`` lands as ``model.tar.gz``.
"""

from __future__ import annotations

import http.client
import re
import ssl
import urllib.error
import urllib.request
from base64 import b64decode
from email.message import Message
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tritonshare import __version__
from tritonshare.common.errors import (
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    TritonshareError,
    clip,
)
from tritonshare.loader.sources.base import Checksum, Progress, RemoteObject, register
from tritonshare.loader.sources.stream import copy_to_file

LIST_TIMEOUT_S = 60.0
FALLBACK_NAME = "download"  # for a URL whose path has no file name ("https://host/")
HEADERS = {"User-Agent": f"tritonshare/{__version__}", "Accept-Encoding": "identity"}
_HEAD_REFUSED = frozenset({403, 405, 501})  # answered by servers (and signed URLs) that only allow GET

_DIGEST_ITEM = re.compile(r"\s*([A-Za-z0-9-]+)\s*=\s*:?([A-Za-z0-9+/=]+):?\s*")


def file_name(uri: str) -> str:
    name = unquote(urlsplit(uri).path.rstrip("/").rsplit("/", 1)[-1])
    return FALLBACK_NAME if name in ("", ".", "..") or "/" in name or "\0" in name else name


@register("http", "https")
class HttpSource:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.name = file_name(uri)

    def list(self) -> list[RemoteObject]:
        headers = self._headers()
        length = headers.get("Content-Length")
        return [
            RemoteObject(
                key=self.uri,
                relpath=self.name,
                size=int(length) if length and length.isdigit() else -1,
                checksum=checksum_from(headers),
                version=headers.get("ETag") or headers.get("Last-Modified") or "",
            )
        ]

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        with _open(obj.key, "GET", stall_timeout_s) as response:

            def read_into(buffer: memoryview) -> int:
                try:
                    return response.readinto(buffer)
                except (OSError, http.client.HTTPException) as exc:
                    raise translate(exc, obj.key) from exc

            copy_to_file(read_into, dest, progress)

    def close(self) -> None:
        pass

    def _headers(self) -> Message:
        request = urllib.request.Request(self.uri, method="HEAD", headers=HEADERS)
        try:
            with urllib.request.urlopen(request, timeout=LIST_TIMEOUT_S) as response:
                headers: Message = response.headers
                return headers
        except urllib.error.HTTPError as exc:
            if exc.code not in _HEAD_REFUSED:
                raise translate(exc, self.uri) from exc
            exc.close()
        except (OSError, http.client.HTTPException) as exc:
            raise translate(exc, self.uri) from exc
        with _open(self.uri, "GET", LIST_TIMEOUT_S) as response:  # closed unread: only the headers count
            return response.headers


def _open(url: str, method: str, timeout_s: float) -> http.client.HTTPResponse:
    request = urllib.request.Request(url, method=method, headers=HEADERS)
    try:
        response: http.client.HTTPResponse = urllib.request.urlopen(request, timeout=timeout_s)
    except (OSError, http.client.HTTPException) as exc:
        raise translate(exc, url) from exc
    return response


def translate(exc: OSError | http.client.HTTPException, url: str) -> TritonshareError:
    if isinstance(exc, urllib.error.HTTPError):
        return _status_error(exc, url)
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, ssl.SSLCertVerificationError):
        return SourceError(f"{url}: TLS certificate verification failed ({reason}) — fix the server's certificate")
    if isinstance(reason, TimeoutError):
        return TransientSourceError(f"{url}: the server did not answer in time ({reason})")
    return TransientSourceError(f"{url}: connection failed ({reason or type(reason).__name__}) — check the URL")


def _status_error(exc: urllib.error.HTTPError, url: str) -> TritonshareError:
    try:
        body = exc.read(300).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        body = ""
    finally:
        exc.close()
    detail = f"HTTP {exc.code} {exc.reason}" + (f": {clip(body)}" if body.strip() else "")
    if exc.code in (404, 410):
        return SourceNotFound(f"{url}: not found ({detail}) — check the URL")
    if exc.code in (401, 403):
        return SourceAccessDenied(
            f"{url}: access denied ({detail}) — check the URL's credentials or signature (an expired pre-signed URL?)"
        )
    if exc.code in (408, 429) or exc.code >= 500:
        return TransientSourceError(f"{url}: the server failed ({detail})")
    return SourceError(f"{url}: the server refused the request ({detail})")


def checksum_from(headers: Message) -> Checksum | None:
    """The strongest checksum of the whole file the server states, if any."""
    items: dict[str, str] = {}
    for header in ("Repr-Digest", "Digest", "x-goog-hash"):
        for item in ",".join(headers.get_all(header) or ()).split(","):
            match = _DIGEST_ITEM.fullmatch(item)
            if match:
                items.setdefault(match.group(1).lower(), match.group(2))
    if "Content-MD5" in headers:
        items.setdefault("md5", headers["Content-MD5"].strip())
    for name, algorithm, size in (("sha-256", "sha256", 32), ("md5", "md5", 16), ("crc32c", "crc32c", 4)):
        raw = _b64(items.get(name, ""))
        if raw is not None and len(raw) == size:
            return Checksum(algorithm=algorithm, value=items[name] if algorithm == "crc32c" else raw.hex())
    return None


def _b64(text: str) -> bytes | None:
    try:
        return b64decode(text, validate=True) if text else None
    except ValueError:  # a malformed header states nothing we can check against
        return None
