"""``http(s)://host/path/model.tar.gz``: one file, usually an archive, from any web server.

Requests go over :mod:`~tritonshare.loader.sources.transport` (kept-alive connections, 1 MiB reads,
``HTTPS_PROXY``/``NO_PROXY``), following up to ``MAX_REDIRECTS`` redirects. ``list`` asks with HEAD (falling
back to a GET whose body is not read, for servers and pre-signed URLs that refuse HEAD) for the size, a
version (ETag, else Last-Modified), whether the server serves byte ranges (then a big file comes in
parallel parts) and a checksum when the server states one: ``Repr-Digest``/``Digest`` (RFC 9530/3230),
``Content-MD5``, or ``x-goog-hash``. The file is named by the URL's last path segment, so
``…/model.tar.gz?X-Amz-Signature=…`` lands as ``model.tar.gz``.

Credentials in the URL (``https://user:password@host/…``) are sent as HTTP Basic authentication, as curl
sends them, and only to that origin: a redirect elsewhere does not carry them. Messages, logs and what the
node keeps name the URL without them and with its query values masked
(:func:`~tritonshare.loader.sources.base.display_uri`).

A part's GET answered with 200 and the whole file as listed (the same ETag or Last-Modified: a server, or a proxy
in front of it, that ignores Range) is said once, and the file then comes whole
(:class:`~tritonshare.loader.sources.stream.RangeSupport`), verified against the listed size and checksum. A 200
with another validator is the file changed since it was listed (``If-Range`` did that): a transient failure, as
before, never a file put together from two versions.
"""

from __future__ import annotations

import re
from base64 import b64decode, b64encode
from email.message import Message
from typing import Literal
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from tritonshare import __version__
from tritonshare.common.errors import (
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    TritonshareError,
    UsageError,
    clip,
)
from tritonshare.loader.sources.base import Checksum, RemoteObject, display_uri, register
from tritonshare.loader.sources.stream import Body, Part, RangeSupport, TransportSource
from tritonshare.loader.sources.transport import NETWORK_ERRORS, Response, ResponseBody, Transport, failure_kind

LIST_TIMEOUT_S = 60.0
MAX_REDIRECTS = 10
MAX_ERROR_BYTES = 300
FALLBACK_NAME = "download"  # for a URL whose path has no file name ("https://host/")
HEADERS = {"User-Agent": f"tritonshare/{__version__}", "Accept-Encoding": "identity"}
_HEAD_REFUSED = frozenset({403, 405, 501})  # answered by servers (and signed URLs) that only allow GET
_REDIRECTS = frozenset({301, 302, 303, 307, 308})

_REQUEST_ERRORS: tuple[type[BaseException], ...] = (
    *NETWORK_ERRORS,
    ValueError,
)  # ValueError: a redirect to something not http(s)
_DIGEST_ITEM = re.compile(r"\s*([A-Za-z0-9-]+)\s*=\s*:?([A-Za-z0-9+/=]+):?\s*")


def file_name(uri: str) -> str:
    name = unquote(urlsplit(uri).path.rstrip("/").rsplit("/", 1)[-1])
    return FALLBACK_NAME if name in ("", ".", "..") or "/" in name or "\0" in name else name


@register("http", "https")
class HttpSource(TransportSource):
    def __init__(self, uri: str, *, transport: Transport | None = None) -> None:
        parts = urlsplit(uri)
        if not parts.hostname:
            raise UsageError(f"source {display_uri(uri)!r}: no host — use http(s)://HOST/PATH")
        self.uri = display_uri(uri)  # for messages, logs and the node's records
        self.name = file_name(uri)
        self._url = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))  # what is fetched
        self._origin = _origin(self._url)
        self._auth = _basic_auth(parts.username, parts.password)
        super().__init__(transport or Transport())
        self._ranges = False  # the server said Accept-Ranges: bytes
        self._range = RangeSupport(
            self.uri, "check the web server, or a proxy in front of it that drops Range", noun="server"
        )

    def list(self) -> list[RemoteObject]:
        headers = self._headers()
        length = headers.get("Content-Length")
        self._ranges = (headers.get("Accept-Ranges") or "").strip().lower() == "bytes"
        return [
            RemoteObject(
                key=self.uri,
                relpath=self.name,
                size=int(length) if length and length.isdigit() else -1,
                checksum=checksum_from(headers),
                version=_version(headers),
            )
        ]

    def open(self, obj: RemoteObject, stall_timeout_s: float, part: Part | None = None) -> Body:
        """The file, or ``part`` of it, pinned to the file as listed: a part is asked ``If-Range`` its ETag
        or Last-Modified (a file changed since comes whole, with 200, and is refused) and must come as
        exactly that range of a file of the listed size."""
        headers = HEADERS
        if part:
            headers = {**HEADERS, "Range": part.header, "If-Range": obj.version}
        what = f"{obj.key} (bytes {part.offset}-{part.offset + part.length - 1})" if part else obj.key
        if part:
            self._range.check(what)  # known from an earlier part: no request
        response = self._request("GET", self._url, headers, stall_timeout_s, what)
        expected = f"bytes {part.offset}-{part.offset + part.length - 1}/{obj.size}" if part else ""
        if part and (response.status != 206 or (response.header("Content-Range") or "").strip() != expected):
            response.close()
            if response.status == 200 and _version(response.headers) == obj.version:  # the file as listed, whole
                raise self._range.whole_answer(what)
            raise TransientSourceError(
                f"{what}: the server did not answer with that range of the {obj.size}-byte file listed "
                f"(HTTP {response.status}, {response.header('Content-Range') or 'no Content-Range'}): the file "
                "changed since it was listed, or the server ignores Range"
            )
        current = _version(response.headers)
        if not part and obj.version and current and current != obj.version:  # a whole file: still the one listed?
            response.close()
            raise TransientSourceError(
                f"{what}: the file changed since it was listed ({obj.version} then, {current} now) — retried"
            )
        return ResponseBody(response, what, network_error)

    def ranged(self, obj: RemoteObject) -> bool:
        """In parts only a file a validator pins (its ETag, unless weak, or Last-Modified): parts of a file
        the server cannot tell apart from a newer one could mix two versions."""
        pinned = bool(obj.version) and not obj.version.startswith("W/")
        return self._ranges and obj.size > 0 and pinned and not self._range.ignored

    def whole_checksum(self, obj: RemoteObject, stall_timeout_s: float) -> Checksum | None:
        return None  # a server states none beyond what a whole answer's headers say

    def _headers(self) -> Message:
        response = self._follow("HEAD", self._url, HEADERS, LIST_TIMEOUT_S, self.uri)
        if response.status in _HEAD_REFUSED:
            response.close()
            response = self._follow("GET", self._url, HEADERS, LIST_TIMEOUT_S, self.uri)
        if response.status >= 300:
            raise status_error(response, self.uri)
        response.close()  # a GET's body is not read: only the headers count
        return response.headers

    def _request(
        self, method: Literal["GET", "HEAD"], url: str, headers: dict[str, str], read_timeout_s: float, what: str
    ) -> Response:
        """A request, following redirects; any final answer but 2xx raises."""
        response = self._follow(method, url, headers, read_timeout_s, what)
        if response.status >= 300:
            raise status_error(response, what)
        return response

    def _follow(
        self, method: Literal["GET", "HEAD"], url: str, headers: dict[str, str], read_timeout_s: float, what: str
    ) -> Response:
        for _ in range(MAX_REDIRECTS + 1):
            sent = {**headers, **self._auth} if self._auth and _origin(url) == self._origin else headers
            try:
                response = self._transport.request(method, url, sent, read_timeout_s=read_timeout_s)
            except _REQUEST_ERRORS as exc:
                raise network_error(exc, what) from exc
            location = response.header("Location")
            if response.status not in _REDIRECTS or not location:
                return response
            response.close()
            url = urljoin(url, location)
        raise SourceError(f"{what}: more than {MAX_REDIRECTS} redirects — check the URL")


def _version(headers: Message) -> str:
    """What an answer's headers say of the file's version: its ETag, else its Last-Modified ("" when neither)."""
    return headers.get("ETag") or headers.get("Last-Modified") or ""


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)


def _basic_auth(user: str | None, password: str | None) -> dict[str, str]:
    if user is None:
        return {}
    pair = f"{unquote(user)}:{unquote(password or '')}".encode()
    return {"Authorization": "Basic " + b64encode(pair).decode()}


def network_error(exc: BaseException, url: str) -> TritonshareError:
    kind = failure_kind(exc)
    if kind == "tls":
        return SourceError(f"{url}: TLS certificate verification failed ({exc}) — fix the server's certificate")
    if kind == "timeout":
        return TransientSourceError(f"{url}: the server did not answer in time ({exc})")
    if isinstance(exc, ValueError):  # a redirect to something that is not an http(s) URL
        return SourceError(f"{url}: {exc} — check the URL")
    return TransientSourceError(f"{url}: connection failed ({exc or type(exc).__name__}) — check the URL")


def status_error(response: Response, url: str) -> TritonshareError:
    """An error answer → the error tree (reads a little of the body, closes the response)."""
    body = response.error_body(MAX_ERROR_BYTES).decode("utf-8", "replace")
    status = response.status
    detail = f"HTTP {status} {response.reason}" + (f": {clip(body)}" if body.strip() else "")
    if status in (404, 410):
        return SourceNotFound(f"{url}: not found ({detail}) — check the URL")
    if status in (401, 403):
        return SourceAccessDenied(
            f"{url}: access denied ({detail}) — check the URL's credentials or signature (an expired pre-signed URL?)"
        )
    if status in (408, 429) or status >= 500:
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
