"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores (MinIO, Ceph, rclone...), over plain HTTP/1.1.

The REST calls the loader needs — ListObjectsV2, HeadObject, GetObject with a Range — are three signed
GETs/HEADs, made here on :mod:`~tritonshare.loader.sources.transport` with
:mod:`~tritonshare.loader.sources.s3_auth`'s SigV4: no SDK on the path of the bytes, so a 256 KiB object
costs what its bytes cost (boto3 added ~2.5 ms of CPU per object and ~0.3 s of start-up).

Configuration is AWS's standard one: credentials from the environment, IRSA, profiles or instance metadata
(:class:`~tritonshare.loader.sources.s3_auth.CredentialChain`); ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` for an S3-compatible server, addressed path-style (``http://host/bucket/key``, what
every such server accepts); else AWS itself, virtual-hosted (``https://bucket.s3.REGION.amazonaws.com``);
the region from ``AWS_REGION``/``AWS_DEFAULT_REGION`` or the profile, and a bucket in another region is
followed once when S3 names it (``x-amz-bucket-region``); ``AWS_CA_BUNDLE`` for a private CA.

Listing: ``s3://b/model`` is the folder ``model/`` (never ``model2/``, kserve#3776); only when nothing is
under it and the URI does not end with ``/`` is ``model`` taken as one object's exact key.

Verification: every GET is pinned to the listed ETag (``If-Match``: an object replaced since listing
answers 412, retried); the ETag is the object's MD5 for single-part uploads. S3 also keeps a *flexible*
checksum — CRC64NVME for every object uploaded since 2025 unless the client chose CRC32/CRC32C/SHA —
which is far cheaper to compute than MD5 and, unlike the ETag, covers multipart uploads too. S3-compatible
stores keep the one the client sent (the AWS SDKs send a CRC32 with every upload since 2025), and may not
name it in their listings (``rclone serve s3`` does not). Every GET of a whole object asks for it
(``x-amz-checksum-mode``), a range of all its bytes included (rclone answers it there; S3 and MinIO send no
checksum with a ranged answer); an object fetched in parts gets it from one HEAD
(:meth:`S3Source.whole_checksum`, while its first parts land). The engine verifies the cheapest checksum
stated (speeds measured in :mod:`tritonshare.loader.checksum`: MD5 ~0.6 GB/s on one core, the CRCs 11-73 GB/s).

Whole objects as one range: an object with no flexible checksum listed (S3-compatible stores; objects uploaded
to AWS before 2025) is asked for as ``Range: bytes=0-<size-1>``, pinned by ``If-Match`` and by the answer's
``Content-Range`` total (a store that ignores ``If-Match`` would otherwise cut an object grown since listing
to the listed size), as AWS's transfer manager and s5cmd ask for every object. The bytes and their MD5 check
are the same; what changes is the store's side: ``rclone serve s3`` hashes a file read from its first byte
without a seek (its VFS checks the read against the file's hash), a second MD5 of each object on the server,
which a range (a seek) turns off: 17 % less server CPU, 15 % less time for 200 files of 256 KiB here
(``docs/loader-speed.md``). An object with a listed flexible checksum is fetched whole: S3's ranged answer
would not carry the checksum.

A store that ignores Range (some S3-compatible servers, or a proxy in front of the store that drops the header)
answers a part's GET with 200 and the whole object: :class:`~tritonshare.loader.sources.stream.RangeSupport`
says so once, and the engine fetches each big object whole instead, verified against the listed ETag and size.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import xml.etree.ElementTree as ElementTree
from base64 import b64decode
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote, urlsplit

from tritonshare.common.errors import (
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    TritonshareError,
    UsageError,
    clip,
)
from tritonshare.loader.sources.base import (
    Checksum,
    RemoteObject,
    bucket_and_key,
    folder_or_object,
    register,
)
from tritonshare.loader.sources.s3_auth import DEFAULT_REGION, DENIED_HINT, CredentialChain, Signer
from tritonshare.loader.sources.stream import Body, Part, RangeSupport, TransportSource
from tritonshare.loader.sources.transport import NETWORK_ERRORS, Response, ResponseBody, Transport, transport_error

logger = logging.getLogger(__name__)

LIST_READ_TIMEOUT_S = 60.0
MAX_LISTING_BYTES = 64 << 20  # one page of 1,000 keys is well under 1 MiB
MAX_ERROR_BYTES = 64 << 10

_MD5_ETAG = re.compile(r'"?([0-9a-fA-F]{32})"?')  # a multipart ETag ends in "-<parts>": not an MD5
_DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")  # fits in a TLS wildcard name: no dots
_NOT_FOUND = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound"})
_DENIED = frozenset(
    {
        "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
        "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidClientTokenId",
    }
)  # fmt: skip
_TRANSIENT = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
        "InternalError", "ServiceUnavailable", "PreconditionFailed",
    }
)  # fmt: skip
# response header → algorithm, for the flexible checksums the engine can compute
_FLEXIBLE = {
    "x-amz-checksum-crc64nvme": "crc64nvme",
    "x-amz-checksum-crc32c": "crc32c",
    "x-amz-checksum-crc32": "crc32",
    "x-amz-checksum-sha1": "sha1",
    "x-amz-checksum-sha256": "sha256",
}
_COMPUTABLE = frozenset(_FLEXIBLE.values())
Listing = list[RemoteObject]  # an alias: inside the class, `list` is the method


@dataclass(frozen=True)
class Endpoint:
    """Where a bucket's objects are reached, and the region requests are signed for."""

    base: str  # scheme://host[:port][/path], without the bucket
    region: str
    virtual: bool  # the bucket is part of the host name (AWS), else the first path segment
    custom: bool = False  # AWS_ENDPOINT_URL's, not AWS: named in errors, as a wrong one reads as a wrong bucket

    def locate(self, bucket: str, key: str) -> tuple[str, str, str]:
        """(URL without query, Host header, URI-encoded path as sent and signed) of ``key`` in ``bucket``."""
        parts = urlsplit(self.base)
        host = f"{bucket}.{parts.netloc}" if self.virtual else parts.netloc
        prefix = parts.path.rstrip("/") + ("" if self.virtual else f"/{quote(bucket, safe='')}")
        path = f"{prefix}/{quote(key, safe='/~')}"
        return f"{parts.scheme}://{host}{path}", host, path


def endpoint_for(bucket: str, region: str, environ: Mapping[str, str]) -> Endpoint:
    custom = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")
    if custom:
        parts = urlsplit(custom)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"AWS_ENDPOINT_URL {custom!r} is not an http(s) URL — fix AWS_ENDPOINT_URL")
        return Endpoint(base=custom.rstrip("/"), region=region, virtual=False, custom=True)
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return Endpoint(base=f"https://s3.{region}.{domain}", region=region, virtual=bool(_DNS_BUCKET.fullmatch(bucket)))


def canonical_query(query: Mapping[str, str]) -> str:
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items()))


@register("s3")
class S3Source(TransportSource):
    def __init__(
        self, uri: str, *, environ: Mapping[str, str] = os.environ, transport: Transport | None = None
    ) -> None:
        self.uri = uri
        self.bucket, self.key = bucket_and_key(uri, "s3://BUCKET/PREFIX")
        self._environ = environ
        self._credentials = CredentialChain(environ, uri)
        super().__init__(transport or Transport(ca_file=environ.get("AWS_CA_BUNDLE") or None))
        self._signer: Signer | None = None
        self._endpoint: Endpoint | None = None
        self._lock = threading.Lock()
        self._flexible: set[str] = set()  # keys whose listing names a flexible checksum the engine can compute
        self._range = RangeSupport(
            f"s3://{self.bucket}", "check the server at AWS_ENDPOINT_URL, or a proxy in front of it that drops Range"
        )

    def list(self) -> Listing:
        return folder_or_object(self.uri, f"s3://{self.bucket}", self.key, self._list_folder, self._head)

    def open(self, obj: RemoteObject, stall_timeout_s: float, part: Part | None = None) -> Body:
        what = f"s3://{self.bucket}/{obj.key}"
        pinned = {"if-match": obj.version} if obj.version else {}  # replaced since listing: 412, retried
        ranged = part or self._whole_range(obj)
        signed = {} if part else {"x-amz-checksum-mode": "ENABLED"}  # a whole object's checksum, when kept
        if ranged:
            signed["range"] = ranged.header
        if part:
            what += f" (bytes {part.offset}-{part.offset + part.length - 1})"
            self._range.check(what)  # known from an earlier part: no request
        response = self._request("GET", obj.key, {}, signed, pinned, stall_timeout_s, what)
        if ranged and not _answers_range(response, ranged, whole=part is None):
            response.close()
            if response.status == 200:  # the whole object, for a part: the store ignores Range
                raise self._range.whole_answer(what)
            raise TransientSourceError(f"{what}: the store ignored the Range header")
        if ranged and part is None and response.status != 200 and not _whole(response, obj.size):
            response.close()  # a store that does not honour If-Match: the size tells
            raise TransientSourceError(
                f"{what}: the store holds {response.header('Content-Range')!r}, not the {obj.size} bytes listed "
                "— the object changed since it was listed"
            )
        # (a whole object by now, asked for as one range or not: what a checksum sent with it covers)
        return ResponseBody(response, what, network_error, None if part else flexible_checksum(response))

    def _whole_range(self, obj: RemoteObject) -> Part | None:
        """All of ``obj`` as one range, for an object its ETag alone vouches for (see "Whole objects as one
        range" above); None when a flexible checksum may come with a whole-object answer, or when no ETag pins
        the range to the listed object (one replaced since, and longer, would arrive cut to the listed size)."""
        flexible = obj.key in self._flexible or (obj.checksum is not None and obj.checksum.algorithm != "md5")
        return None if flexible or not obj.version or obj.size <= 0 else Part(0, obj.size)

    def ranged(self, obj: RemoteObject) -> bool:
        """In parts, unless the store turned out to ignore Range."""
        return not self._range.ignored

    def whole_checksum(self, obj: RemoteObject, stall_timeout_s: float) -> Checksum | None:
        """The object's flexible checksum, from a HEAD, asked whether or not its listing named one: an
        S3-compatible store keeps a client's checksum without listing it (one request per object in parts)."""
        what = f"s3://{self.bucket}/{obj.key}"
        pinned = {"if-match": obj.version} if obj.version else {}
        signed = {"x-amz-checksum-mode": "ENABLED"}
        with self._request("HEAD", obj.key, {}, signed, pinned, stall_timeout_s, what) as response:
            return flexible_checksum(response)

    def _list_folder(self, folder: str) -> Listing:
        what = f"s3://{self.bucket}/{folder}"
        objects: Listing = []
        token = ""
        while True:
            query = {"list-type": "2", "prefix": folder} | ({"continuation-token": token} if token else {})
            with self._request("GET", "", query, {}, {}, LIST_READ_TIMEOUT_S, what) as response:
                page = _xml(_read(response, MAX_LISTING_BYTES, what), what)
            for key, size, etag, algorithms in _contents(page):
                objects.append(_remote(key, key[len(folder) :], size, etag))
                if algorithms & _COMPUTABLE:
                    self._flexible.add(key)
            token = _text(page, "NextContinuationToken")
            if _text(page, "IsTruncated") != "true" or not token:
                return [obj for obj in objects if not obj.key.endswith("/")]  # console "folder" markers

    def _head(self, key: str) -> RemoteObject:
        try:
            signed = {"x-amz-checksum-mode": "ENABLED"}
            with self._request("HEAD", key, {}, signed, {}, LIST_READ_TIMEOUT_S, self.uri) as response:
                size, etag = int(response.header("Content-Length") or 0), response.header("ETag") or ""
                flexible = flexible_checksum(response)
        except SourceNotFound as exc:
            raise SourceNotFound(
                f"{self.uri}: no such object and no objects under {self.uri}/ — check the bucket and the key"
            ) from exc
        obj = _remote(key, key.rsplit("/", 1)[-1], size, etag)
        return dataclasses.replace(obj, checksum=flexible) if flexible else obj  # cheaper than the ETag's MD5

    def _request(
        self,
        method: Literal["GET", "HEAD"],
        key: str,
        query: Mapping[str, str],
        signed: Mapping[str, str],
        unsigned: Mapping[str, str],
        read_timeout_s: float,
        what: str,
    ) -> Response:
        """One signed request; a bucket in another region than configured is followed once."""
        for attempt in (1, 2):
            endpoint, signer = self._routing()
            url, host, path = endpoint.locate(self.bucket, key)
            query_string = canonical_query(query)
            headers = signer.sign(method, path, query_string, {"host": host, **signed}, self._credentials.get())
            try:
                response = self._transport.request(
                    method,
                    f"{url}?{query_string}" if query_string else url,
                    {**headers, **unsigned},
                    read_timeout_s=read_timeout_s,
                )
            except NETWORK_ERRORS as exc:
                raise network_error(exc, what) from exc
            if response.status < 300:
                return response
            region = response.header("x-amz-bucket-region") or ""
            listing = method == "GET" and not key  # S3 answers a listing's 404 with an XML error, always
            error = status_error(response, what, endpoint=endpoint.base if endpoint.custom else "", listing=listing)
            if attempt == 1 and region and region != endpoint.region and response.status in (301, 307, 400):
                self._move_to(region)
                continue
            raise error
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _routing(self) -> tuple[Endpoint, Signer]:
        with self._lock:
            if self._endpoint is None or self._signer is None:
                region = self._configured_region()
                self._endpoint = endpoint_for(self.bucket, region, self._environ)
                self._signer = Signer(region)
            return self._endpoint, self._signer

    def _configured_region(self) -> str:
        region = self._environ.get("AWS_REGION") or self._environ.get("AWS_DEFAULT_REGION")
        if region:
            return region
        if not self._credentials.static:
            return self._credentials.region() or DEFAULT_REGION
        return DEFAULT_REGION

    def _move_to(self, region: str) -> None:
        with self._lock:
            self._endpoint = endpoint_for(self.bucket, region, self._environ)
            self._signer = Signer(region)


def flexible_checksum(response: Response) -> Checksum | None:
    """The object's full-object CRC32/CRC32C/SHA checksum, when S3 returned one (multipart "composite"
    checksums, ``…-N``, cover parts, not the object)."""
    if (response.header("x-amz-checksum-type") or "FULL_OBJECT").upper() != "FULL_OBJECT":
        return None
    for header, algorithm in _FLEXIBLE.items():
        value = (response.header(header) or "").strip()
        if value and "-" not in value:
            try:
                return Checksum(
                    algorithm=algorithm, value=value if algorithm.startswith("crc") else b64decode(value).hex()
                )
            except ValueError:
                return None
    return None


def _answers_range(response: Response, asked: Part, *, whole: bool) -> bool:
    """Whether ``response`` carries the bytes asked for: a part's range; for a whole-object range, also a
    store's 200 that ignored the Range header (its body is the whole object all the same)."""
    if whole and response.status == 200:
        return True
    return (response.header("Content-Range") or "").startswith(f"bytes {asked.offset}-")


def _whole(response: Response, size: int) -> bool:
    """Whether a 206 answer to a whole-object range covers the object as listed: ``bytes 0-<size-1>/<size>``."""
    return response.header("Content-Range") == f"bytes 0-{size - 1}/{size}"


def _remote(key: str, relpath: str, size: int, etag: str) -> RemoteObject:
    md5 = _MD5_ETAG.fullmatch(etag)
    return RemoteObject(
        key=key,
        relpath=relpath,
        size=int(size),
        checksum=Checksum(algorithm="md5", value=md5.group(1).lower()) if md5 else None,
        version=etag,
    )


def _read(response: Response, limit: int, what: str) -> bytes:
    try:
        return response.read(limit)
    except NETWORK_ERRORS as exc:
        raise network_error(exc, what) from exc


def _xml(body: bytes, what: str) -> ElementTree.Element:
    try:
        return ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        text = clip(body.decode(errors="replace"))
        raise SourceError(f"{what}: the store's answer is not S3 XML ({exc}): {text}") from exc


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]  # S3 answers in its 2006-03-01 namespace; some servers use none


def _text(element: ElementTree.Element, name: str) -> str:
    return next((child.text or "" for child in element if _local(child.tag) == name), "")


def _contents(page: ElementTree.Element) -> Iterator[tuple[str, int, str, set[str]]]:
    """(key, size, ETag, flexible checksum algorithms named, lower case) of each object listed."""
    for item in page:
        if _local(item.tag) == "Contents":
            algorithms = {(child.text or "").lower() for child in item if _local(child.tag) == "ChecksumAlgorithm"}
            yield _text(item, "Key"), int(_text(item, "Size") or 0), _text(item, "ETag"), algorithms


def network_error(exc: BaseException, what: str) -> TritonshareError:
    return transport_error(
        exc,
        what,
        tls_hint="set AWS_CA_BUNDLE for a private CA",
        connect_hint="check AWS_ENDPOINT_URL and the network",
    )


def status_error(response: Response, what: str, *, endpoint: str = "", listing: bool = False) -> TritonshareError:
    """An S3 error answer → the error tree (reads and closes the response). ``endpoint``: AWS_ENDPOINT_URL's,
    named in the message ("" for AWS); ``listing``: the request listed the bucket, whose 404 S3 always
    explains with an XML error (NoSuchBucket) — one without is another kind of server."""
    code, message = _error_fields(response.error_body(MAX_ERROR_BYTES))
    status = response.status
    detail = f"{code}: {clip(message or response.reason)}" if code else f"HTTP {status} {response.reason}"
    at = f" at {endpoint}" if endpoint else ""
    if not code and status == 404 and endpoint and listing:
        return SourceError(
            f"{what}: not found{at} ({detail}, without an S3 error) — this endpoint does not answer like S3; "
            "check AWS_ENDPOINT_URL"
        )
    if code in _NOT_FOUND or (not code and status == 404):
        hint = "check the bucket and the key" + (" (and AWS_ENDPOINT_URL)" if endpoint else "")
        return SourceNotFound(f"{what}: not found{at} ({detail}) — {hint}")
    if code in _DENIED or status in (401, 403):
        return SourceAccessDenied(f"{what}: access denied{at} ({detail}) — {DENIED_HINT}")
    if code in _TRANSIENT or status >= 500 or status in (408, 412, 429):
        return TransientSourceError(f"{what}: the store failed ({detail})")
    return SourceError(f"{what}: the store refused the request ({detail})")


def _error_fields(body: bytes) -> tuple[str, str]:
    try:
        root = ElementTree.fromstring(body) if body.strip() else None
    except ElementTree.ParseError:
        return "", body.decode(errors="replace")
    if root is None:
        return "", ""
    return _text(root, "Code"), _text(root, "Message")
