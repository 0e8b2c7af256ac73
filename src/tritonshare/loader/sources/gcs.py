"""``gs://bucket/prefix``: Google Cloud Storage through google-cloud-storage.

Credentials come from Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, Workload
Identity, the metadata server); when there are none the client is anonymous, which is enough for public
buckets. ``STORAGE_EMULATOR_HOST`` points the client at an emulator (the library reads it).

Listing follows the S3 rule: ``gs://b/model`` is the folder ``model/``, else the exact object ``model``.
Each object is pinned to the generation listed, so a replaced object cannot mix into a download, and
verified with the CRC32C GCS keeps for every object (composite objects have no MD5). The library's own
retries are off: the download engine retries with its backoff and deadline.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tritonshare.common.errors import (
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    TritonshareError,
    UsageError,
    clip,
)
from tritonshare.loader.sources.base import Checksum, Progress, RemoteObject, register
from tritonshare.loader.sources.stream import CountingWriter

LIST_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
DENIED_HINT = "check the pod's credentials (GOOGLE_APPLICATION_CREDENTIALS or Workload Identity)"
Listing = list[RemoteObject]  # an alias: inside the class, `list` is the method


def parse(uri: str) -> tuple[str, str]:
    parts = urlsplit(uri)
    if not parts.netloc:
        raise UsageError(f"source {uri!r}: no bucket — use gs://BUCKET/PREFIX")
    return parts.netloc, parts.path.lstrip("/")


@register("gs")
class GcsSource:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.bucket, self.key = parse(uri)
        self._client: Any = None
        self._lock = threading.Lock()

    def list(self) -> Listing:
        folder = self.key.rstrip("/") + "/" if self.key else ""
        objects = self._list_folder(folder)
        if objects:
            return objects
        if self.key and not self.key.endswith("/"):
            return [self._exact(self.key)]
        raise SourceNotFound(
            f"{self.uri}: no objects under gs://{self.bucket}/{folder} — check the bucket and the prefix"
        )

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        client = self._storage()
        generation = int(obj.version) if obj.version.isdigit() else None
        blob = client.bucket(self.bucket).blob(obj.key, generation=generation)
        try:
            with CountingWriter(dest, progress) as writer:
                blob.download_to_file(
                    writer,
                    client=client,
                    raw_download=True,  # the bytes as stored: what size and crc32c describe
                    checksum=None,  # verified by the engine against the listed crc32c
                    timeout=(CONNECT_TIMEOUT_S, stall_timeout_s),
                    retry=None,
                )
        except _sdk_errors() as exc:
            raise translate(exc, f"gs://{self.bucket}/{obj.key}") from exc

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _list_folder(self, folder: str) -> Listing:
        try:
            blobs = self._storage().list_blobs(self.bucket, prefix=folder, timeout=LIST_TIMEOUT_S, retry=None)
            return [_remote(blob, blob.name[len(folder) :]) for blob in blobs if not blob.name.endswith("/")]
        except _sdk_errors() as exc:
            raise translate(exc, f"gs://{self.bucket}/{folder}") from exc

    def _exact(self, key: str) -> RemoteObject:
        try:
            blob = self._storage().bucket(self.bucket).get_blob(key, timeout=LIST_TIMEOUT_S, retry=None)
        except _sdk_errors() as exc:
            raise translate(exc, self.uri) from exc
        if blob is None:
            raise SourceNotFound(
                f"{self.uri}: no such object and no objects under {self.uri}/ — check the bucket and the name"
            )
        return _remote(blob, key.rsplit("/", 1)[-1])

    def _storage(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = _new_client(self.uri)
            return self._client


def _new_client(uri: str) -> Any:
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage

    try:
        return storage.Client()
    except DefaultCredentialsError:
        return storage.Client.create_anonymous_client()  # public buckets need no credentials
    except _sdk_errors() as exc:
        raise translate(exc, uri) from exc


def _remote(blob: Any, relpath: str) -> RemoteObject:
    return RemoteObject(
        key=blob.name,
        relpath=relpath,
        size=int(blob.size),
        checksum=Checksum(algorithm="crc32c", value=blob.crc32c) if blob.crc32c else None,
        version=str(blob.generation or ""),
    )


def _sdk_errors() -> tuple[type[Exception], ...]:
    from google.api_core.exceptions import GoogleAPIError
    from google.auth.exceptions import GoogleAuthError
    from requests import RequestException

    return (GoogleAPIError, GoogleAuthError, RequestException)


def translate(exc: Exception, what: str) -> TritonshareError:
    """google-api-core, google-auth and requests exceptions → the error tree."""
    from google.api_core import exceptions as api
    from google.auth import exceptions as auth

    detail = clip(str(exc))
    if isinstance(exc, api.NotFound):
        return SourceNotFound(f"{what}: not found ({detail}) — check the bucket and the name")
    if isinstance(exc, api.Forbidden | api.Unauthorized | auth.RefreshError | auth.DefaultCredentialsError):
        return SourceAccessDenied(f"{what}: access denied ({detail}) — {DENIED_HINT}")
    if isinstance(exc, api.TooManyRequests | api.ServerError | api.RetryError):
        return TransientSourceError(f"{what}: the store failed ({detail})")
    if isinstance(exc, api.PreconditionFailed | auth.TransportError):
        return TransientSourceError(f"{what}: {detail}")
    if isinstance(exc, api.GoogleAPIError | auth.GoogleAuthError):
        return SourceError(f"{what}: the store refused the request ({detail})")
    if "timed out" in detail.lower():  # requests wraps a read timeout mid-body in a ConnectionError
        return TransientSourceError(f"{what}: the store did not answer in time ({detail})")
    return TransientSourceError(f"{what}: connection failed ({detail}) — check the network to the store")
