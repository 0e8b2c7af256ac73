"""Fixtures for the fault tests: the session's node folder as a :class:`~bench.faults.node.Node` (with its
lease folder), HTTP servers for loader sources (a plain file server, and one that misbehaves the way a full
disk comes about), and a node folder on a small tmpfs."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from bench.faults.node import Node

from tests.support.ports import free_port
from tests.support.storage import HttpFileServer


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
    mount = tmp_path / "disk"
    mount.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.strip()}")
    try:
        yield Node(mount).create()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
