"""http(s):// against a real HTTP server that can fail, stall and corrupt on purpose."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import pytest
from aiohttp import web

from tests.loader.test_sources_transport import RawServer
from tests.support.children import die_with_parent
from tests.support.ports import free_port, wait_port
from tests.support.storage import Fault, HttpFileServer, RangeDropper, make_tar
from tritonshare.common.errors import (
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    UsageError,
)
from tritonshare.loader.download import download_all
from tritonshare.loader.download_options import DownloadOptions
from tritonshare.loader.listing import list_objects
from tritonshare.loader.sources.base import RemoteObject
from tritonshare.loader.sources.http import HttpSource, checksum_from

pytestmark = pytest.mark.storage
FAST = DownloadOptions(concurrency=2, retries=2, backoff_base_s=0.01, stall_timeout_s=0.5)


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\n')
    (folder / "1" / "weights.bin").write_bytes(os.urandom(2_500_000))
    return make_tar(folder, tmp_path / "model.tar.gz", arcname="model")


@pytest.fixture(autouse=True)
def _close_sources() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


_OPENED: list[HttpSource] = []


def opened(url: str) -> HttpSource:
    """An HttpSource for ``url``, closed at the end of the test (its connections stay open until then)."""
    _OPENED.append(HttpSource(url))
    return _OPENED[-1]


def download(uri: str, dest: Path, options: DownloadOptions = FAST) -> None:
    source = opened(uri)
    download_all(source, list_objects(source, options), dest, options)


def test_a_url_is_one_file_with_size_version_and_the_servers_checksum(
    http_server: HttpFileServer, archive: Path
) -> None:
    url = http_server.serve(archive)
    (obj,) = opened(url + "?X-Amz-Signature=abc").list()
    data = archive.read_bytes()
    assert (obj.relpath, obj.size, obj.version) == ("model.tar.gz", len(data), f'"{hashlib.md5(data).hexdigest()}"')
    assert obj.checksum is not None and obj.checksum.value == hashlib.sha256(data).hexdigest()


def test_an_archive_downloads_byte_for_byte(http_server: HttpFileServer, archive: Path, tmp_path: Path) -> None:
    (tmp_path / "dest").mkdir()
    download(http_server.serve(archive), tmp_path / "dest")
    assert (tmp_path / "dest" / "model.tar.gz").read_bytes() == archive.read_bytes()


def test_a_missing_file_is_not_found(http_server: HttpFileServer) -> None:
    with pytest.raises(SourceNotFound, match=r"/nope.tar.gz: not found \(HTTP 404 Not Found\) — check the URL"):
        opened(http_server.url("nope.tar.gz")).list()


@pytest.mark.parametrize("status", [401, 403])
def test_a_refusal_is_access_denied(http_server: HttpFileServer, archive: Path, status: int) -> None:
    url = http_server.serve(archive)
    http_server.fail("/model.tar.gz", Fault(status=status))
    with pytest.raises(SourceAccessDenied, match=rf"access denied \(HTTP {status} .*pre-signed URL"):
        opened(url).list()


def test_a_server_refusing_head_is_asked_with_get(http_server: HttpFileServer, archive: Path) -> None:
    url = http_server.serve(archive)
    http_server.fail("/model.tar.gz", Fault(status=405, times=1))
    (obj,) = opened(url).list()
    assert obj.size == archive.stat().st_size
    assert [method for method, _ in http_server.requests] == ["HEAD", "GET"]


def test_a_server_answering_500_is_retried_then_transient(http_server: HttpFileServer, archive: Path) -> None:
    url = http_server.serve(archive)
    http_server.fail("/model.tar.gz", Fault(status=500))
    with pytest.raises(TransientSourceError, match=r"the server failed \(HTTP 500 .*gave up after 3 attempts"):
        list_objects(opened(url), FAST)
    assert len(http_server.requests) == 3


def test_a_failed_transfer_is_retried(http_server: HttpFileServer, archive: Path, tmp_path: Path) -> None:
    url = http_server.serve(archive)
    source = opened(url)
    objects = source.list()
    http_server.fail("/model.tar.gz", Fault(status=503, times=1))
    stats = download_all(source, objects, tmp_path, FAST)
    assert (tmp_path / "model.tar.gz").read_bytes() == archive.read_bytes() and stats.retries == 1


def test_a_stall_mid_body_times_out_and_the_retry_completes(
    http_server: HttpFileServer, archive: Path, tmp_path: Path
) -> None:
    url = http_server.serve(archive)
    source = opened(url)
    objects = source.list()
    http_server.fail("/model.tar.gz", Fault(stall_after_bytes=100_000, times=1))
    stats = download_all(source, objects, tmp_path, FAST)
    assert (tmp_path / "model.tar.gz").read_bytes() == archive.read_bytes() and stats.retries == 1


def test_a_server_that_keeps_stalling_fails_as_transient_in_bounded_time(
    http_server: HttpFileServer, archive: Path, tmp_path: Path
) -> None:
    url = http_server.serve(archive)
    source = opened(url)
    objects = source.list()
    http_server.fail("/model.tar.gz", Fault(stall_after_bytes=0))
    started = time.monotonic()
    with pytest.raises(TransientSourceError, match=r"did not answer in time .*gave up after 3 attempts"):
        download_all(source, objects, tmp_path, FAST)
    assert time.monotonic() - started < 5  # 3 stalls of 0.5 s and two short backoffs


def test_the_overall_deadline_stops_a_download_that_keeps_stalling(
    http_server: HttpFileServer, archive: Path, tmp_path: Path
) -> None:
    url = http_server.serve(archive)
    source = opened(url)
    objects = source.list()
    http_server.fail("/model.tar.gz", Fault(stall_after_bytes=1000))
    options = DownloadOptions(retries=100, backoff_base_s=0.01, stall_timeout_s=0.3, download_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(TransientSourceError, match=r"download did not finish within 1 s"):
        download_all(source, objects, tmp_path, options)
    assert time.monotonic() - started < 2.5  # the deadline plus at most one stall timeout to join the worker


def test_corrupted_bytes_are_caught_by_the_servers_checksum(
    http_server: HttpFileServer, archive: Path, tmp_path: Path
) -> None:
    url = http_server.serve(archive)
    http_server.fail("/model.tar.gz", Fault(corrupt=True))
    with pytest.raises(
        TransientSourceError, match=r"model.tar.gz: sha256 checksum mismatch .*gave up after 3 attempts"
    ):
        download(url, tmp_path)


def test_nobody_listening_is_transient() -> None:
    with pytest.raises(TransientSourceError, match=r"connection failed .*Connection refused"):
        opened(f"http://127.0.0.1:{free_port()}/m.tar.gz").list()


def headers(**values: str) -> Message:
    message = Message()
    for name, value in values.items():
        message[name.replace("_", "-")] = value
    return message


@pytest.mark.parametrize(
    ("given", "algorithm", "value"),
    [
        ({"Digest": "MD5=ICy5YqxZB1uWSwcVLSNLcA==, SHA-256=X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE="},
         "sha256", "5f8f04f6a3a892aaabbddb6cf273894493773960d4a325b105fee46eef4304f1"),
        ({"Content_MD5": "ICy5YqxZB1uWSwcVLSNLcA=="}, "md5", "202cb962ac59075b964b07152d234b70"),
        ({"x_goog_hash": "crc32c=4waSgw==,md5=ICy5YqxZB1uWSwcVLSNLcA=="}, "md5", "202cb962ac59075b964b07152d234b70"),
        ({"x_goog_hash": "crc32c=4waSgw=="}, "crc32c", "4waSgw=="),
    ],
)  # fmt: skip
def test_checksum_headers_are_read_strongest_first(given: dict[str, str], algorithm: str, value: str) -> None:
    checksum = checksum_from(headers(**given))
    assert checksum is not None and (checksum.algorithm, checksum.value) == (algorithm, value)


def test_a_malformed_checksum_header_states_nothing() -> None:
    assert checksum_from(headers(Content_MD5="not base64!", Repr_Digest="sha-256=:c2hvcnQ=:")) is None


class StaticServer:
    """aiohttp's own static file handler (which answers Range requests and says Accept-Ranges: bytes)
    under /files/, and /hops/N/NAME redirecting N times before landing on /files/NAME; /private/NAME wants
    Basic authentication as alice:s3cret, and /away/NAME redirects to /private/NAME on another origin
    (``localhost`` instead of ``127.0.0.1``)."""

    USER, PASSWORD = "alice", "s3cret"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ranges: list[str] = []
        self.authorization: list[tuple[str, str]] = []  # (host, Authorization) of each /private request
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="static-server", daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = free_port()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> StaticServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/files/{name}", self._file)
        app.router.add_get("/hops/{count}/{name}", self._hop)
        app.router.add_get("/private/{name}", self._private)
        app.router.add_get("/away/{name}", self._away)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _file(self, request: web.Request) -> web.StreamResponse:
        if "Range" in request.headers:
            self.ranges.append(request.headers["Range"])
        return web.FileResponse(self.root / request.match_info["name"])

    async def _private(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        self.authorization.append((request.host, given))
        if given != "Basic " + base64.b64encode(f"{self.USER}:{self.PASSWORD}".encode()).decode():
            raise web.HTTPUnauthorized(headers={"WWW-Authenticate": 'Basic realm="models"'})
        return await self._file(request)

    async def _away(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"http://localhost:{self.port}/private/{request.match_info['name']}")

    async def _hop(self, request: web.Request) -> web.StreamResponse:
        count, name = int(request.match_info["count"]), request.match_info["name"]
        target = f"/hops/{count - 1}/{name}" if count > 1 else f"/files/{name}"
        raise web.HTTPFound(target)


@pytest.fixture
def static_server(tmp_path: Path) -> Iterator[StaticServer]:
    (tmp_path / "static").mkdir()
    server = StaticServer(tmp_path / "static").start()
    yield server
    server.stop()


def test_a_big_file_from_a_server_that_serves_ranges_comes_in_parts(
    static_server: StaticServer, tmp_path: Path
) -> None:
    data = os.urandom(1_000_000)
    (static_server.root / "model.tar.gz").write_bytes(data)
    options = DownloadOptions(concurrency=4, retries=1, stall_timeout_s=5, part_bytes=300_000)
    download(static_server.url("/files/model.tar.gz"), tmp_path, options)
    assert (tmp_path / "model.tar.gz").read_bytes() == data
    assert sorted(static_server.ranges) == sorted(
        f"bytes={start}-{min(start + 300_000, len(data)) - 1}" for start in range(0, len(data), 300_000)
    )


class Nginx:
    """nginx serving ``root``: ETags and If-Range as a production file server does them."""

    def __init__(self, root: Path, *, headers: dict[str, str] | None = None) -> None:
        self.root, self.port = root, free_port()
        self.headers = headers or {}  # added to every answer (add_header), as a checksum a server states
        self.run = root.parent / "nginx-run"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def start(self) -> Nginx:
        if shutil.which("nginx") is None:
            pytest.skip("no nginx: run scripts/setup.sh")
        self.run.mkdir()
        temps = " ".join(
            f"{kind}_temp_path {self.run / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        added = " ".join(f'add_header {name} "{value}";' for name, value in self.headers.items())
        (self.run / "nginx.conf").write_text(
            f"daemon off; master_process off; pid {self.run / 'pid'}; error_log {self.run / 'error.log'};\n"
            f"events {{}} http {{ access_log off; {temps}\n"
            f"  server {{ listen 127.0.0.1:{self.port}; root {self.root}; {added} }} }}\n"
        )
        nginx = ["nginx", "-c", str(self.run / "nginx.conf"), "-p", str(self.run)]
        self.process = subprocess.Popen(nginx, preexec_fn=die_with_parent)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


@pytest.mark.parametrize("size", [1_000_000, 1_300_000], ids=["same size", "grown"])
def test_a_file_changed_after_listing_never_lands_as_parts_of_two_versions(tmp_path: Path, size: int) -> None:
    # the parts were asked without a validator and checked only for their start: a grown file landed cut to the
    # listed size, a same-size one as a mix of both versions
    (tmp_path / "www").mkdir()
    server = Nginx(tmp_path / "www").start()
    try:
        _changed_after_listing(server, tmp_path, size)
    finally:
        server.stop()


def _changed_after_listing(server: Nginx, tmp_path: Path, size: int) -> None:
    path = server.root / "model.bin"
    path.write_bytes(os.urandom(1_000_000))
    os.utime(path, (1_700_000_000, 1_700_000_000))
    source = opened(server.url("model.bin"))
    listed = source.list()
    path.write_bytes(os.urandom(size))  # a new version: another mtime, so another ETag
    options = DownloadOptions(concurrency=4, retries=1, backoff_base_s=0.01, stall_timeout_s=5, part_bytes=300_000)
    (tmp_path / "dest").mkdir()
    with pytest.raises(TransientSourceError, match=r"the file changed since it was listed, or the server ignores"):
        download_all(source, listed, tmp_path / "dest", options)
    source.close()


def test_a_whole_file_changed_to_the_same_size_after_listing_is_refused(tmp_path: Path) -> None:
    # a file fetched whole (small, or a server found to ignore Range) was checked for its size only: a new
    # version of the same size, with no digest stated, landed as if it were the one listed
    (tmp_path / "www").mkdir()
    server = Nginx(tmp_path / "www").start()
    try:
        path = server.root / "model.bin"
        path.write_bytes(os.urandom(100_000))
        os.utime(path, (1_700_000_000, 1_700_000_000))
        source = opened(server.url("model.bin"))
        listed = source.list()
        path.write_bytes(os.urandom(100_000))  # the same size, another mtime: another ETag
        options = DownloadOptions(retries=1, backoff_base_s=0.01, stall_timeout_s=5)
        (tmp_path / "dest").mkdir()
        with pytest.raises(TransientSourceError, match=r"the file changed since it was listed \("):
            download_all(source, listed, tmp_path / "dest", options)
        source.close()
    finally:
        server.stop()


@pytest.mark.parametrize("stated", ["its digest", "another file's digest"])
def test_a_big_file_from_a_server_that_ignores_range_comes_whole_verified_by_its_digest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stated: str
) -> None:
    # a 200 to a part's GET failed the part as transient, retried until the loader gave up
    data = os.urandom(1_000_000)
    digest = hashlib.sha256(data if stated == "its digest" else data[::-1]).digest()
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "model.bin").write_bytes(data)
    server = Nginx(tmp_path / "www", headers={"Repr-Digest": f"sha-256=:{base64.b64encode(digest).decode()}:"})
    server.start()
    dropper = RangeDropper(server.port).start()
    url = f"{dropper.endpoint}/model.bin"
    options = DownloadOptions(concurrency=4, retries=1, backoff_base_s=0.01, stall_timeout_s=5, part_bytes=300_000)
    (tmp_path / "dest").mkdir()
    try:
        with caplog.at_level(logging.WARNING):
            if stated == "its digest":
                download(url, tmp_path / "dest", options)
            else:
                with pytest.raises(TransientSourceError, match=r"sha256 checksum mismatch .*gave up after 2 attempts"):
                    download(url, tmp_path / "dest", options)
    finally:
        dropper.stop()
        server.stop()
    if stated == "its digest":
        assert (tmp_path / "dest" / "model.bin").read_bytes() == data
    warned = [r.getMessage() for r in caplog.records if "ignores the Range header" in r.getMessage()]
    assert warned == [
        f"{url}: the server ignores the Range header (a ranged GET got the whole object) — "
        "fetching big objects whole, one stream each, which is slower than in parallel parts; check the web server, "
        "or a proxy in front of it that drops Range"
    ]
    gets = [dropped for line, dropped in dropper.requests if line.startswith("GET ")]
    wholes = 1 if stated == "its digest" else 2  # the retry of a whole file is whole too
    assert 1 <= len(gets) - wholes <= options.concurrency and all(gets[:-wholes]) and gets[-wholes:] == [""] * wholes


def test_a_file_without_a_validator_comes_whole_not_in_parts(tmp_path: Path) -> None:
    source = HttpSource("http://127.0.0.1:1/model.bin")
    source._ranges = True  # as if the server said Accept-Ranges: bytes
    unpinned = RemoteObject(key="k", relpath="model.bin", size=1 << 30)
    assert not source.ranged(unpinned)
    assert not source.ranged(dataclasses.replace(unpinned, version='W/"weak"'))
    assert source.ranged(dataclasses.replace(unpinned, version='"strong"'))


def test_a_body_cut_short_of_its_length_is_not_taken_whole_when_the_listing_had_no_size(tmp_path: Path) -> None:
    server = RawServer(cut_short=True).start()
    try:
        source = opened(server.url + "/model.bin")
        (obj,) = source.list()
        assert obj.size == -1  # HEAD stated no length: nothing to check the body against
        with pytest.raises(TransientSourceError, match=r"IncompleteRead"):
            download_all(source, [obj], tmp_path, FAST)
    finally:
        server.stop()


def test_a_space_in_a_pre_signed_url_is_escaped_and_its_signature_never_shown(tmp_path: Path) -> None:
    server = HttpFileServer(tmp_path / "www").start()
    try:
        (tmp_path / "www").mkdir(exist_ok=True)
        (tmp_path / "www" / "my model.tgz").write_bytes(b"archive")
        url = server.url("my model.tgz") + "?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=deadbeefSECRET"
        (obj,) = opened(url).list()
        assert obj.size == 7 and "deadbeefSECRET" not in obj.key
    finally:
        server.stop()


def test_a_socks_proxy_is_a_usage_error_that_never_shows_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "socks5://proxyuser:Pr0xyS3cret@proxy.corp:1080")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with pytest.raises(UsageError, match=r"is not an http\(s\) URL.*socks is not supported") as info:
        opened("http://models.example/m.tgz").list()
    assert "Pr0xyS3cret" not in str(info.value)


def test_redirects_are_followed(static_server: StaticServer, tmp_path: Path) -> None:
    (static_server.root / "m.tar.gz").write_bytes(b"archive")
    (obj,) = opened(static_server.url("/hops/3/m.tar.gz")).list()
    assert (obj.relpath, obj.size) == ("m.tar.gz", 7)
    download(static_server.url("/hops/3/m.tar.gz"), tmp_path)
    assert (tmp_path / "m.tar.gz").read_bytes() == b"archive"


def test_endless_redirects_are_a_permanent_error(static_server: StaticServer) -> None:
    with pytest.raises(SourceError, match=r"more than 10 redirects — check the URL"):
        opened(static_server.url("/hops/11/m.tar.gz")).list()


def test_credentials_in_the_url_are_sent_as_basic_authentication(static_server: StaticServer, tmp_path: Path) -> None:
    (static_server.root / "m.tar.gz").write_bytes(b"archive")
    url = static_server.url("/private/m.tar.gz").replace("://", f"://{StaticServer.USER}:{StaticServer.PASSWORD}@")
    source = opened(url)
    (obj,) = source.list()
    assert StaticServer.PASSWORD not in source.uri + obj.key
    download(url, tmp_path)
    assert (tmp_path / "m.tar.gz").read_bytes() == b"archive"


def test_a_wrong_password_is_access_denied_and_never_shown(static_server: StaticServer) -> None:
    url = static_server.url("/private/m.tar.gz").replace("://", "://alice:wrong-Pa55@")
    with pytest.raises(SourceAccessDenied) as denied:
        opened(url).list()
    assert "wrong-Pa55" not in str(denied.value) and "alice" not in str(denied.value)


def test_credentials_are_not_sent_to_another_origin_on_a_redirect(static_server: StaticServer) -> None:
    (static_server.root / "m.tar.gz").write_bytes(b"archive")
    url = static_server.url("/away/m.tar.gz").replace("://", f"://{StaticServer.USER}:{StaticServer.PASSWORD}@")
    with pytest.raises(SourceAccessDenied):
        opened(url).list()
    assert static_server.authorization == [(f"localhost:{static_server.port}", "")]


def test_a_signed_urls_query_values_never_appear_in_messages(http_server: HttpFileServer) -> None:
    url = http_server.url("missing.tar.gz") + "?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=deadbeef"
    with pytest.raises(SourceNotFound) as missing:
        opened(url).list()
    message = str(missing.value)
    assert "X-Amz-Signature=…" in message and "deadbeef" not in message and "AKIAEXAMPLE" not in message
