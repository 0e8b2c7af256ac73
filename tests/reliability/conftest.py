"""Fixtures for the fault tests: the session's node folder as a :class:`~bench.faults.node.Node` (with its
lease folder), HTTP servers for loader sources (a plain file server, and one that misbehaves the way a full
disk comes about), a node folder on a small tmpfs, and a proxy in front of recording stand-ins for Triton's
HTTP and gRPC ports (what reached "Triton" is checked there)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from bench.faults.node import Node

from tests.support.mounts import tmpfs
from tests.support.ports import free_port
from tests.support.proxy import TRITONSHARE, ProxyProcess
from tests.support.storage import HttpFileServer
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout


@pytest.fixture(scope="session")
def node(node_root: Path) -> Node:
    """The node folder the session's Triton polls (``models/``, ``staging/``) plus ``leases/`` for gc."""
    return Node(node_root).create()


@pytest.fixture
def file_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpFileServer]:
    # A loader killed mid-download resets the connection; aiohttp logs that as an error, which is expected here.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    server = HttpFileServer(tmp_path_factory.mktemp("http-root")).start()
    yield server
    server.stop()


@dataclass
class BlobServer:
    """Serves one file at ``/NAME`` over HTTP (aiohttp, in a thread), and can misbehave the way a node's disk
    gets into trouble: ``chunked`` hides the size (no Content-Length, so no space check can see it coming), and
    ``before_body`` runs after the headers are sent and before the body (another writer taking the space)."""

    data: bytes
    name: str = "model.tar.gz"
    chunked: bool = False
    before_body: Callable[[], None] = lambda: None
    port: int = field(default_factory=free_port)
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _runner: web.AppRunner | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.name}"

    def start(self) -> BlobServer:
        self._thread = threading.Thread(target=self._loop.run_forever, name="blob-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", f"/{self.name}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        if self.chunked:
            response.enable_chunked_encoding()
        else:
            response.content_length = len(self.data)
        await response.prepare(request)
        if request.method == "GET":
            await asyncio.to_thread(self.before_body)
            for start in range(0, len(self.data), 1 << 20):
                await response.write(self.data[start : start + (1 << 20)])
        await response.write_eof()
        return response


@pytest.fixture
def blob_server() -> Iterator[Callable[..., BlobServer]]:
    """``blob_server(data, chunked=..., before_body=...)`` starts a :class:`BlobServer`; all stop at teardown."""
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # the loader hangs up on a full disk
    started: list[BlobServer] = []

    def start(data: bytes, **options: Any) -> BlobServer:
        started.append(BlobServer(data, **options).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Node]:
    """A node folder on its own 16 MiB tmpfs (needs root, or CAP_SYS_ADMIN); unmounted after the test."""
    with tmpfs(tmp_path / "disk", "16m") as disk:
        yield Node(disk).create()


# ------------------------------------------------------------------------------- recording stand-ins for Triton


@dataclass(frozen=True)
class Seen:
    """One request as it reached the stand-in for Triton."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes


@dataclass
class RestRecorder:
    """Stands in for Triton's HTTP port: records every request the proxy sends (method, path, headers, the
    de-chunked body) and answers each with ``200 {}``. The tests judge what reached it, not what the proxy said."""

    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _server: asyncio.Server | None = None
    _thread: threading.Thread | None = None

    def start(self) -> RestRecorder:
        self._thread = threading.Thread(target=self._loop.run_forever, name="rest-recorder", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=1 << 20)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, headers = _parse_head(head)
                body = await _read_body(reader, headers)
                self.seen.append(Seen(method, path, headers, body))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return b""
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        body += await reader.readexactly(size)
        await reader.readexactly(2)
        if size == 0:
            return bytes(body)


class _GrpcRecording(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpcio ships no type hints
    def __init__(self, recorder: GrpcRecorder) -> None:
        self.recorder = recorder

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = str(handler_call_details.method)

        def handle(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            metadata = {key: str(value) for key, value in context.invocation_metadata()}
            for message in requests:
                self.recorder.record(method, message, metadata)
                yield b""  # an empty message of any response type

        return grpc.stream_stream_rpc_method_handler(handle)  # no (de)serializers: raw bytes both ways


@dataclass
class GrpcRecorder:
    """Stands in for Triton's gRPC port (a real grpcio server): records every request message of every method
    that reaches it and answers each with an empty message."""

    seen: list[tuple[str, bytes]] = field(default_factory=list)  # (method, request message)
    metadata: list[dict[str, str]] = field(default_factory=list)  # the call's metadata, one per message
    port: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: grpc.Server | None = None

    def record(self, method: str, message: bytes, metadata: dict[str, str]) -> None:
        with self._lock:
            self.seen.append((method, message))
            self.metadata.append(metadata)

    def start(self) -> GrpcRecorder:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=8), handlers=[_GrpcRecording(self)])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(10)


@dataclass(frozen=True)
class Hostile:
    """A proxy for ``own`` whose "Triton" is the two recorders."""

    own: str
    proxy: ProxyProcess
    rest: RestRecorder
    grpc: GrpcRecorder

    def alive(self) -> bool:
        return self.proxy.process is not None and self.proxy.process.poll() is None

    def proxy_command(self, http_port: int, grpc_port: int, root: Path) -> list[str]:
        """The command of another ``tritonshare proxy`` in front of the same recorders (for tests that need a
        proxy of their own: one they limit, load until it fails, or end)."""
        return [
            TRITONSHARE, "proxy", "--name", self.own, "--host", "127.0.0.1",
            "--triton-url", f"http://127.0.0.1:{self.rest.port}", "--triton-grpc", f"127.0.0.1:{self.grpc.port}",
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()),
            "--repository", str(root), "--staging", str(root), "--no-unload",
        ]  # fmt: skip


HOSTILE_MAX_JSON_BYTES = 1 << 20
RESTRICTED_KEY = "triton-key"  # as if Triton ran with --http-restricted-api / --grpc-restricted-protocol


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    """One proxy for the session's hostile-input tests, in front of recording stand-ins for Triton, with a
    1 MiB ``--max-json-bytes`` so the limits are cheap to reach, and Triton's restricted-API key header to strip."""
    root = tmp_path_factory.mktemp("hostile")
    rest, grpc_recorder = RestRecorder().start(), GrpcRecorder().start()
    stand_in = TritonServer(  # never started: only its addresses are used, which are the recorders'
        repository=root, log_path=root / "no-triton.log", http_port=rest.port, grpc_port=grpc_recorder.port
    )
    layout = NodeLayout(repository=root, staging=root)
    extra = ["--no-unload", "--max-json-bytes", str(HOSTILE_MAX_JSON_BYTES), "--strip-header", RESTRICTED_KEY]
    proxy = ProxyProcess("tenant-own", stand_in, layout, root / "proxy.log", extra).start()
    yield Hostile("tenant-own", proxy, rest, grpc_recorder)
    proxy.stop()
    rest.stop()
    grpc_recorder.stop()
