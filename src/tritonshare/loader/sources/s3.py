"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores through boto3.

Credentials and endpoint come from boto3's standard chain: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
IRSA (``AWS_ROLE_ARN`` + ``AWS_WEB_IDENTITY_TOKEN_FILE``), instance profiles, and ``AWS_ENDPOINT_URL`` for
MinIO, Ceph or any S3-compatible server.

Listing: ``s3://b/model`` is the folder ``model/`` (never ``model2/``, kserve#3776); only when nothing is
under it and the URI does not end with ``/`` is ``model`` taken as one object's exact key.

One client per source is shared by every download thread (boto3 clients are thread-safe; creating one
costs ~50 ms) with a connection pool as large as the engine's concurrency. botocore's own retries are
off: the download engine retries with its own backoff and deadline, and a stalled read must cost one
``stall_timeout_s``, not five. Verification: the listed ETag is the object's MD5 for single-part uploads;
for objects stored with a flexible checksum (CRC32, CRC32C, SHA256...), botocore checks it while streaming.
"""

from __future__ import annotations

import re
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
from tritonshare.loader.sources.stream import copy_to_file, copy_to_range

LIST_READ_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
MAX_POOL_CONNECTIONS = 64  # ≥ the engine's concurrency, so no thread waits for a connection

_MD5_ETAG = re.compile(r'"?([0-9a-f]{32})"?')  # a multipart ETag ends in "-<parts>": not an MD5
_NOT_FOUND = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_DENIED = frozenset(
    {
        "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
        "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidClientTokenId", "401", "403",
    }
)  # fmt: skip
_TRANSIENT = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
        "InternalError", "ServiceUnavailable", "PreconditionFailed",
    }
)  # fmt: skip
Listing = list[RemoteObject]  # an alias: inside the class, `list` is the method
DENIED_HINT = "check the pod's credentials (AWS_* or IRSA)"


def parse(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``."""
    parts = urlsplit(uri)
    key = parts.path.lstrip("/")
    if not parts.netloc:
        raise UsageError(f"source {uri!r}: no bucket — use s3://BUCKET/PREFIX")
    return parts.netloc, key


@register("s3")
class S3Source:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.bucket, self.key = parse(uri)
        self._clients: dict[float, Any] = {}  # by read timeout: listing, then fetching if it differs
        self._session: Any = None
        self._lock = threading.Lock()

    def list(self) -> list[RemoteObject]:
        folder = self.key.rstrip("/") + "/" if self.key else ""
        objects = self._list_folder(folder)
        if objects:
            return objects
        if self.key and not self.key.endswith("/"):
            return [self._head(self.key)]
        raise SourceNotFound(
            f"{self.uri}: no objects under s3://{self.bucket}/{folder} — check the bucket and the prefix"
        )

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        what = f"s3://{self.bucket}/{obj.key}"
        client = self._client(stall_timeout_s)
        condition = {"IfMatch": obj.version} if obj.version else {}  # replaced since listing: 412, retried
        try:
            body = client.get_object(Bucket=self.bucket, Key=obj.key, **condition)["Body"]
        except _sdk_errors() as exc:
            raise translate(exc, what) from exc
        with body:

            def read_into(buffer: memoryview) -> int:
                try:
                    return int(body.readinto(buffer))
                except _sdk_errors() as exc:
                    raise translate(exc, what) from exc

            copy_to_file(read_into, dest, progress)

    def fetch_range(
        self, obj: RemoteObject, dest: Path, offset: int, length: int, progress: Progress, stall_timeout_s: float
    ) -> int:
        """One part of a big object (the engine fetches parts in parallel: one S3 connection carries
        ~100 MB/s at best). Returns the bytes written at ``offset``."""
        what = f"s3://{self.bucket}/{obj.key} (bytes {offset}-{offset + length - 1})"
        client = self._client(stall_timeout_s)
        condition = {"IfMatch": obj.version} if obj.version else {}
        try:
            response = client.get_object(
                Bucket=self.bucket, Key=obj.key, Range=f"bytes={offset}-{offset + length - 1}", **condition
            )
        except _sdk_errors() as exc:
            raise translate(exc, what) from exc
        with response["Body"] as body:
            if not str(response.get("ContentRange", "")).startswith(f"bytes {offset}-"):
                raise TransientSourceError(f"{what}: the store ignored the Range header")

            def read_into(buffer: memoryview) -> int:
                try:
                    return int(body.readinto(buffer))
                except _sdk_errors() as exc:
                    raise translate(exc, what) from exc

            return copy_to_range(read_into, dest, offset, length, progress)

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def _list_folder(self, folder: str) -> Listing:
        paginator = self._client(LIST_READ_TIMEOUT_S).get_paginator("list_objects_v2")
        try:
            return [
                _remote(item["Key"], item["Key"][len(folder) :], item["Size"], item.get("ETag", ""))
                for page in paginator.paginate(Bucket=self.bucket, Prefix=folder)
                for item in page.get("Contents", ())
                if not item["Key"].endswith("/")  # "folder" marker objects made by consoles
            ]
        except _sdk_errors() as exc:
            raise translate(exc, f"s3://{self.bucket}/{folder}") from exc

    def _head(self, key: str) -> RemoteObject:
        try:
            head = self._client(LIST_READ_TIMEOUT_S).head_object(Bucket=self.bucket, Key=key)
        except _sdk_errors() as exc:
            error = translate(exc, self.uri)
            if isinstance(error, SourceNotFound):
                error = SourceNotFound(
                    f"{self.uri}: no such object and no objects under {self.uri}/ — check the bucket and the key"
                )
            raise error from exc
        return _remote(key, key.rsplit("/", 1)[-1], head["ContentLength"], head.get("ETag", ""))

    def _client(self, read_timeout_s: float) -> Any:
        with self._lock:
            client = self._clients.get(read_timeout_s)
            if client is None:
                if self._session is None:
                    import boto3

                    self._session = boto3.session.Session()
                client = self._clients[read_timeout_s] = _new_client(self._session, read_timeout_s, self.uri)
            return client


def _new_client(session: Any, read_timeout_s: float, uri: str) -> Any:
    from botocore.config import Config

    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=read_timeout_s,
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=MAX_POOL_CONNECTIONS,
        tcp_keepalive=True,
        parameter_validation=False,  # our parameters are plain strings; saves ~10% CPU per small object
    )
    try:
        return session.client("s3", config=config)
    except ValueError as exc:  # an AWS_ENDPOINT_URL that is not a URL
        raise UsageError(f"{uri}: {exc} — fix AWS_ENDPOINT_URL") from exc
    except _sdk_errors() as exc:
        raise translate(exc, uri) from exc


def _remote(key: str, relpath: str, size: int, etag: str) -> RemoteObject:
    md5 = _MD5_ETAG.fullmatch(etag)
    return RemoteObject(
        key=key,
        relpath=relpath,
        size=int(size),
        checksum=Checksum(algorithm="md5", value=md5.group(1)) if md5 else None,
        version=etag,
    )


def _sdk_errors() -> tuple[type[Exception], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def translate(exc: Exception, what: str) -> TritonshareError:
    """botocore's exceptions → the error tree."""
    from botocore import exceptions as boto

    if isinstance(exc, boto.ClientError):
        return _client_error(exc, what)
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError | boto.CredentialRetrievalError):
        return SourceAccessDenied(f"{what}: no usable credentials ({exc}) — {DENIED_HINT}")
    if isinstance(exc, boto.FlexibleChecksumError):
        return TransientSourceError(f"{what}: checksum mismatch ({exc}) — the data was corrupted in transit")
    if isinstance(exc, boto.ReadTimeoutError | boto.ConnectTimeoutError):
        return TransientSourceError(f"{what}: the store did not answer in time ({exc})")
    if isinstance(exc, boto.ConnectionError | boto.HTTPClientError | boto.IncompleteReadError):
        return TransientSourceError(f"{what}: connection failed ({exc}) — check AWS_ENDPOINT_URL and the network")
    return SourceError(f"{what}: {clip(str(exc))}")


def _client_error(exc: Any, what: str) -> TritonshareError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    detail = f"{code}: {clip(str(error.get('Message') or exc))}" if code else clip(str(exc))
    if code in _NOT_FOUND or status == 404:
        return SourceNotFound(f"{what}: not found ({detail}) — check the bucket and the key")
    if code in _DENIED or status in (401, 403):
        return SourceAccessDenied(f"{what}: access denied ({detail}) — {DENIED_HINT}")
    if code in _TRANSIENT or status >= 500 or status in (408, 412, 429):
        return TransientSourceError(f"{what}: the store failed ({detail})")
    return SourceError(f"{what}: the store refused the request ({detail})")
