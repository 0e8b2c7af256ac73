"""``gs://bucket/prefix``: Google Cloud Storage through its JSON API, over plain HTTP/1.1.

Two calls are all the loader needs — list the objects (``GET /storage/v1/b/B/o?prefix=P``) and read one
(``GET /download/storage/v1/b/B/o/NAME?alt=media``, with a Range for the parts of a big object) — so they
are made here on :mod:`~tritonshare.loader.sources.transport`, as the engine's 1 MiB reads, rather than
through google-cloud-storage, which reads in 8 KiB chunks one object at a time and costs ~0.3 s of CPU to
import.

Credentials come from Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, Workload
Identity, the metadata server) through google-auth, imported only for real GCS; when there are none the
requests are anonymous, which is enough for public buckets. ``STORAGE_EMULATOR_HOST`` points the source at
an emulator (no credentials, as google-cloud-storage does).

Listing follows the S3 rule: ``gs://b/model`` is the folder ``model/``, else the exact object ``model``.
Each object is pinned to the generation listed, so a replaced object cannot mix into a download, and
verified with the CRC32C GCS keeps for every object (composite objects have no MD5). Bytes are asked for as
stored (``Accept-Encoding: gzip``: no decompressive transcoding), which is what size and CRC32C describe.

A part's GET answered with 200 and the whole object (an emulator, or a proxy in front of GCS, that ignores Range)
is said once and big objects then come whole (:class:`~tritonshare.loader.sources.stream.RangeSupport`), pinned
to the listed generation and verified against the listed size and CRC32C.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

from tritonshare.common.errors import (
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    TritonshareError,
    clip,
)
from tritonshare.loader.sources.base import (
    Checksum,
    RemoteObject,
    bucket_and_key,
    folder_or_object,
    register,
)
from tritonshare.loader.sources.stream import Body, Part, RangeSupport, TransportSource
from tritonshare.loader.sources.transport import NETWORK_ERRORS, Response, ResponseBody, Transport, transport_error

logger = logging.getLogger(__name__)

LIST_TIMEOUT_S = 60.0
MAX_LISTING_BYTES = 64 << 20
MAX_ERROR_BYTES = 64 << 10
PUBLIC_ENDPOINT = "https://storage.googleapis.com"
READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
LIST_FIELDS = "items(name,size,crc32c,generation),nextPageToken"
DENIED_HINT = "check the pod's credentials (GOOGLE_APPLICATION_CREDENTIALS or Workload Identity)"
Listing = list[RemoteObject]  # an alias: inside the class, `list` is the method


def endpoint_of(environ: Mapping[str, str]) -> tuple[str, bool]:
    """(base URL, emulated): ``STORAGE_EMULATOR_HOST`` (``http://host:port`` or ``host:port``), else GCS."""
    emulator = environ.get("STORAGE_EMULATOR_HOST", "").strip().rstrip("/")
    if not emulator:
        return PUBLIC_ENDPOINT, False
    return (emulator if "://" in emulator else f"http://{emulator}"), True


class GoogleAuth:
    """The ``Authorization`` header for GCS requests: Application Default Credentials, refreshed as they
    expire; none (anonymous) when there are none. Thread-safe."""

    def __init__(self, what: str, *, environ: Mapping[str, str] = os.environ) -> None:
        self._what = what
        self._key_file = environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")  # google-auth reads it from os.environ
        self._credentials: Any = None
        self._request: Any = None
        self._resolved = False
        self._lock = threading.Lock()

    def headers(self) -> dict[str, str]:
        with self._lock:
            if not self._resolved:
                self._credentials, self._request = _default_credentials(self._what, self._key_file)
                self._resolved = True
            if self._credentials is None:
                return {}
            headers: dict[str, str] = {}
            try:
                self._credentials.before_request(self._request, "GET", PUBLIC_ENDPOINT, headers)
            except _auth_errors() as exc:
                raise translate(exc, self._what) from exc
            return headers


def _default_credentials(what: str, key_file: str) -> tuple[Any, Any]:
    """Application Default Credentials, else (None, None): anonymous. A ``GOOGLE_APPLICATION_CREDENTIALS``
    file that is set but cannot be used is an error: falling back to anonymous would hide it behind a 403,
    or read a public copy of the bucket instead."""
    import google.auth
    import google.auth.transport.requests
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, _ = google.auth.default(scopes=[READ_ONLY_SCOPE])
    except DefaultCredentialsError as exc:
        if key_file:
            raise SourceAccessDenied(
                f"{what}: GOOGLE_APPLICATION_CREDENTIALS={key_file} cannot be used ({clip(str(exc))}) — mount the "
                "service account key file there, or unset the variable for anonymous access to a public bucket"
            ) from exc
        logger.info("%s: no Google credentials found: anonymous requests", what)
        return None, None  # public buckets need no credentials
    except _auth_errors() as exc:
        raise translate(exc, what) from exc
    return credentials, google.auth.transport.requests.Request()


def _auth_errors() -> tuple[type[Exception], ...]:
    from google.auth.exceptions import GoogleAuthError

    return (GoogleAuthError,)


@register("gs")
class GcsSource(TransportSource):
    def __init__(
        self, uri: str, *, environ: Mapping[str, str] = os.environ, transport: Transport | None = None
    ) -> None:
        self.uri = uri
        self.bucket, self.key = bucket_and_key(uri, "gs://BUCKET/PREFIX")
        self.endpoint, emulated = endpoint_of(environ)
        self._auth = None if emulated else GoogleAuth(uri, environ=environ)
        super().__init__(transport or Transport())
        where = "the server at STORAGE_EMULATOR_HOST" if emulated else "the proxy between the node and GCS"
        self._range = RangeSupport(f"gs://{self.bucket}", f"check {where}, which drops Range or ignores it")

    def list(self) -> Listing:
        return folder_or_object(self.uri, f"gs://{self.bucket}", self.key, self._list_folder, self._exact)

    def open(self, obj: RemoteObject, stall_timeout_s: float, part: Part | None = None) -> Body:
        what = f"gs://{self.bucket}/{obj.key}"
        query = {"alt": "media"} | ({"generation": obj.version} if obj.version.isdigit() else {})
        headers = {"Accept-Encoding": "gzip"} | ({"Range": part.header} if part else {})
        if part:
            what += f" (bytes {part.offset}-{part.offset + part.length - 1})"
            self._range.check(what)  # known from an earlier part: no request
        path = f"/download/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(obj.key, safe='')}"
        response = self._get(path, query, headers, stall_timeout_s, what)
        if part and not (response.header("Content-Range") or "").startswith(f"bytes {part.offset}-"):
            response.close()
            if response.status == 200:  # the whole object (of the listed generation): Range is ignored
                raise self._range.whole_answer(what)
            raise TransientSourceError(
                f"{what}: the store answered with other bytes (HTTP {response.status}, "
                f"{response.header('Content-Range') or 'no Content-Range'})"
            )
        return ResponseBody(response, what, network_error)  # the listed CRC32C is checked

    def ranged(self, obj: RemoteObject) -> bool:
        """In parts, unless the store turned out to ignore Range."""
        return not self._range.ignored

    def whole_checksum(self, obj: RemoteObject, stall_timeout_s: float) -> Checksum | None:
        return None  # the listing's CRC32C covers the whole object

    def _list_folder(self, folder: str) -> Listing:
        what = f"gs://{self.bucket}/{folder}"
        path = f"/storage/v1/b/{quote(self.bucket, safe='')}/o"
        objects: Listing = []
        token = ""
        while True:
            query = {"prefix": folder, "fields": LIST_FIELDS} | ({"pageToken": token} if token else {})
            page = self._json(path, query, what)
            items = page.get("items", [])
            objects += [_remote(item, item["name"][len(folder) :]) for item in items]
            token = str(page.get("nextPageToken") or "")
            if not token:
                return [obj for obj in objects if not obj.key.endswith("/")]

    def _exact(self, key: str) -> RemoteObject:
        path = f"/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(key, safe='')}"
        try:
            item = self._json(path, {}, self.uri)
        except SourceNotFound as exc:
            raise SourceNotFound(
                f"{self.uri}: no such object and no objects under {self.uri}/ — check the bucket and the name"
            ) from exc
        return _remote(item, key.rsplit("/", 1)[-1])

    def _json(self, path: str, query: Mapping[str, str], what: str) -> dict[str, Any]:
        with self._get(path, query, {}, LIST_TIMEOUT_S, what) as response:
            try:
                body = response.read(MAX_LISTING_BYTES)
            except NETWORK_ERRORS as exc:
                raise network_error(exc, what) from exc
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise SourceError(f"{what}: the store's answer is not JSON: {clip(body.decode(errors='replace'))}") from exc
        if not isinstance(parsed, dict):
            raise SourceError(f"{what}: the store's answer is not a JSON object: {clip(str(parsed))}")
        return parsed

    def _get(
        self, path: str, query: Mapping[str, str], headers: Mapping[str, str], read_timeout_s: float, what: str
    ) -> Response:
        url = f"{self.endpoint}{path}?{urlencode(query)}" if query else f"{self.endpoint}{path}"
        auth = self._auth.headers() if self._auth is not None else {}
        try:
            response = self._transport.request("GET", url, {**headers, **auth}, read_timeout_s=read_timeout_s)
        except NETWORK_ERRORS as exc:
            raise network_error(exc, what) from exc
        if response.status >= 300:
            emulator = "" if self.endpoint == PUBLIC_ENDPOINT else self.endpoint
            raise status_error(response, what, pinned="generation" in query, endpoint=emulator)
        return response


def _remote(item: Mapping[str, Any], relpath: str) -> RemoteObject:
    crc32c = str(item.get("crc32c") or "")
    return RemoteObject(
        key=str(item["name"]),
        relpath=relpath,
        size=int(item.get("size", -1)),
        checksum=Checksum(algorithm="crc32c", value=crc32c) if crc32c else None,
        version=str(item.get("generation") or ""),
    )


def network_error(exc: BaseException, what: str) -> TritonshareError:
    return transport_error(
        exc, what, tls_hint="check the node's CA certificates", connect_hint="check the network to the store"
    )


def status_error(response: Response, what: str, *, pinned: bool = False, endpoint: str = "") -> TritonshareError:
    """A GCS error answer → the error tree (reads and closes the response). ``pinned``: the request named the
    listed generation, whose 404 means the object was replaced since it was listed (S3 answers such a GET 412):
    transient, as a new listing finds the new generation. ``endpoint``: STORAGE_EMULATOR_HOST's, named in the
    message ("" for GCS): a wrong one reads as a wrong bucket. (No "not GCS" guess from a 404's body: the
    emulator answers a missing bucket with an empty 404, as another web server would.)"""
    body = response.error_body(MAX_ERROR_BYTES)
    status = response.status
    detail = f"HTTP {status} {response.reason}" + (f": {clip(_message(body))}" if body.strip() else "")
    at = f" at {endpoint}" if endpoint else ""
    if status == 404 and pinned:
        return TransientSourceError(f"{what}: the generation listed is gone ({detail}) — replaced since it was listed")
    if status == 404:
        hint = "check the bucket and the name" + (" (and STORAGE_EMULATOR_HOST)" if endpoint else "")
        return SourceNotFound(f"{what}: not found{at} ({detail}) — {hint}")
    if status in (401, 403):
        return SourceAccessDenied(f"{what}: access denied{at} ({detail}) — {DENIED_HINT}")
    if status >= 500 or status in (408, 412, 429):
        return TransientSourceError(f"{what}: the store failed ({detail})")
    return SourceError(f"{what}: the store refused the request ({detail})")


def _message(body: bytes) -> str:
    """The ``error.message`` of a JSON API error, else the body as text."""
    text = body.decode(errors="replace")
    try:
        error = json.loads(text).get("error", {})
    except (ValueError, AttributeError):
        return text
    return str(error.get("message") or text) if isinstance(error, dict) else text


def translate(exc: Exception, what: str) -> TritonshareError:
    """google-auth's exceptions → the error tree."""
    from google.auth import exceptions as auth

    detail = clip(str(exc))
    if getattr(exc, "retryable", False) or isinstance(exc, auth.TransportError):
        return TransientSourceError(f"{what}: fetching a token failed ({detail})")
    if isinstance(exc, auth.RefreshError | auth.DefaultCredentialsError):
        return SourceAccessDenied(f"{what}: access denied ({detail}) — {DENIED_HINT}")
    return SourceError(f"{what}: {detail}")
