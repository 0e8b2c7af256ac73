"""The sources' HTTP/1.1 transport against a real socket server whose connection handling the test controls:
kept-alive connections reused, stale ones replaced, half-read responses never reused, proxies, timeouts."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import pytest

from tests.support.certs import CertificateAuthority
from tests.support.sockets import accept_each
from tritonshare.loader.sources.transport import (
    NETWORK_ERRORS,
    Origin,
    Transport,
    failure_kind,
    proxy_from_environment,
)

BODY = b"0123456789" * 1000


@dataclass
class RawServer:
    """An HTTP/1.1 server on a loopback port: answers every request with ``BODY``; records each request's
    first line and headers, and how many connections it accepted. ``close_after`` closes each connection
    after that many answers, without saying so (as a server whose idle keep-alive timeout passed). With
    ``cut_short``, HEAD states no length and GET announces ``BODY``'s, sends half of it and closes. With
    ``trickle_s``, the status line and headers go one byte at a time, that far apart: never a stall, for seconds."""

    close_after: int | None = None
    cut_short: bool = False
    stall_s: float = 0.0  # wait this long before answering
    trickle_s: float = 0.0  # send the answer's head a byte at a time, this far apart (42 bytes)
    tls: ssl.SSLContext | None = None  # serve HTTPS with this context
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    connections: int = 0
    _listener: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self._listener.getsockname()[1]}"

    def start(self) -> RawServer:
        accept_each(self._listener, self._serve)
        return self

    def stop(self) -> None:
        self._listener.close()

    def _serve(self, conn: socket.socket) -> None:
        self.connections += 1
        try:
            self._answer(self.tls.wrap_socket(conn, server_side=True) if self.tls else conn)
        except OSError:
            pass  # the client hung up (or refused our certificate): what the tests do on purpose

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            answered = 0
            while self.close_after is None or answered < self.close_after:
                head = self._read_head(reader)
                if head is None:
                    return
                self.requests.append(head)
                time.sleep(self.stall_s)
                if self.cut_short:
                    length = b"" if head[0].startswith("HEAD") else b"Content-Length: %d\r\n" % len(BODY)
                    body = b"" if head[0].startswith("HEAD") else BODY[: len(BODY) // 2]
                    conn.sendall(b"HTTP/1.1 200 OK\r\n%sConnection: close\r\n\r\n%s" % (length, body))
                    return
                body = b"" if head[0].startswith("HEAD") else BODY
                self._send_head(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY))
                conn.sendall(body)
                answered += 1

    def _send_head(self, conn: socket.socket, head: bytes) -> None:
        if not self.trickle_s:
            conn.sendall(head)
            return
        for at in range(len(head)):
            conn.sendall(head[at : at + 1])
            time.sleep(self.trickle_s)

    @staticmethod
    def _read_head(reader: BinaryIO) -> tuple[str, dict[str, str]] | None:
        line = reader.readline()
        if not line:
            return None
        headers: dict[str, str] = {}
        while (header := reader.readline().decode().strip()) != "":
            name, _, value = header.partition(":")
            headers[name.strip().lower()] = value.strip()
        return line.decode().strip(), headers


class ConnectProxy:
    """A forward proxy for ``https://`` through CONNECT: answers 200, then relays bytes both ways."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.tunnels: list[str] = []
        accept_each(self._listener, self._tunnel)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._listener.close()

    def _tunnel(self, client: socket.socket) -> None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += client.recv(1)
        target = head.split()[1].decode()
        self.tunnels.append(target)
        host, port = target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        threading.Thread(target=_relay, args=(upstream, client), daemon=True).start()
        _relay(client, upstream)


def _relay(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        sink.close()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[RawServer, Path]]:
    """An HTTPS server with a certificate from a throw-away CA, and that CA's file."""
    authority = CertificateAuthority()
    cert, key = authority.write_pair(tmp_path, serial=2)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    started = RawServer(tls=context).start()
    yield started, authority.write_ca(tmp_path / "ca.pem")
    started.stop()


def test_https_with_the_stores_ca_reuses_its_connection(tls_server: tuple[RawServer, Path]) -> None:
    server, ca = tls_server
    secure = Transport(ca_file=str(ca))
    try:
        assert [get(secure, f"{server.url}/o{i}") for i in range(3)] == [BODY] * 3
    finally:
        secure.close()
    assert server.connections == 1


def test_a_certificate_from_an_unknown_ca_is_refused(tls_server: tuple[RawServer, Path]) -> None:
    server, _ = tls_server
    with pytest.raises(ssl.SSLError) as caught, closing(Transport()) as strict:
        strict.request("GET", f"{server.url}/o", {}, read_timeout_s=5)
    assert failure_kind(caught.value) == "tls"


def test_https_goes_through_a_connect_proxy(tls_server: tuple[RawServer, Path]) -> None:
    server, ca = tls_server
    proxy = ConnectProxy()
    tunnelled = Transport(ca_file=str(ca), proxy_for=lambda scheme, host: proxy.url)
    try:
        assert get(tunnelled, f"{server.url}/via-proxy") == BODY
    finally:
        tunnelled.close()
        proxy.close()
    assert proxy.tunnels == [server.url.removeprefix("https://")]
    assert server.requests[0][0] == "GET /via-proxy HTTP/1.1"


@pytest.fixture
def server() -> Iterator[RawServer]:
    started = RawServer().start()
    yield started
    started.stop()


@pytest.fixture
def transport() -> Iterator[Transport]:
    opened = Transport()
    yield opened
    opened.close()


def get(transport: Transport, url: str) -> bytes:
    with transport.request("GET", url, {}, read_timeout_s=5) as response:
        return response.read(1 << 20)


def test_one_connection_carries_many_requests(server: RawServer, transport: Transport) -> None:
    bodies = [get(transport, f"{server.url}/object-{i}") for i in range(5)]
    assert bodies == [BODY] * 5 and server.connections == 1
    assert [line for line, _ in server.requests] == [f"GET /object-{i} HTTP/1.1" for i in range(5)]


def test_a_connection_the_server_closed_while_idle_is_replaced_once(transport: Transport) -> None:
    server = RawServer(close_after=1).start()
    try:
        assert [get(transport, f"{server.url}/o") for _ in range(3)] == [BODY] * 3
        assert server.connections == 3
    finally:
        server.stop()


def test_a_half_read_response_closes_its_connection(server: RawServer, transport: Transport) -> None:
    with transport.request("GET", f"{server.url}/a", {}, read_timeout_s=5) as response:
        assert response.read(10) == BODY[:10]
    assert get(transport, f"{server.url}/b") == BODY  # not the rest of /a's body
    assert server.connections == 2


def test_each_thread_has_its_own_connection_and_close_ends_them_all(server: RawServer, transport: Transport) -> None:
    threads = [threading.Thread(target=get, args=(transport, f"{server.url}/t{i}")) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.connections == 3
    transport.close()
    assert get(transport, f"{server.url}/after") == BODY  # a closed transport opens anew when asked again
    transport.close()
    assert get(transport, f"{server.url}/again") == BODY  # this thread's connection, reopened once more
    transport.close()  # ... which close() must still reach
    assert get(transport, f"{server.url}/last") == BODY and server.connections == 3 + 3


def test_the_host_header_and_extra_headers_are_sent(server: RawServer, transport: Transport) -> None:
    with transport.request("HEAD", f"{server.url}/h?x=1", {"Range": "bytes=0-9"}, read_timeout_s=5) as response:
        assert response.status == 200 and response.header("content-length") == str(len(BODY))
    line, headers = server.requests[0]
    assert line == "HEAD /h?x=1 HTTP/1.1"
    assert headers["host"] == Origin.of(server.url).netloc and headers["range"] == "bytes=0-9"


def test_a_plain_http_proxy_gets_the_absolute_url_and_its_credentials(server: RawServer) -> None:
    proxied = Transport(proxy_for=lambda scheme, host: server.url.replace("://", "://user:p%40ss@"))
    try:
        assert get(proxied, "http://models.example:8080/m.tar.gz") == BODY
    finally:
        proxied.close()
    line, headers = server.requests[0]
    assert line == "GET http://models.example:8080/m.tar.gz HTTP/1.1"
    assert headers["host"] == "models.example:8080"
    assert headers["proxy-authorization"] == "Basic dXNlcjpwQHNz"  # user:p@ss


@pytest.mark.parametrize(
    "environment",
    [
        {},
        {"HTTPS_PROXY": "http://proxy.corp:3128"},
        {"https_proxy": "http://proxy.corp:3128", "NO_PROXY": "store.example"},
        {"Https_Proxy": "http://proxy.corp:3128", "no_proxy": ".corp"},
        {"HTTP_PROXY": "http://proxy.corp:3128"},
        {"HTTPS_PROXY": ""},
        {"ALL_PROXY": "http://proxy.corp:3128"},
    ],
)
def test_the_proxy_from_the_environment_is_the_one_urllib_would_use(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]
) -> None:
    """Without any ``*_proxy`` variable urllib is not even imported; the answer must stay urllib's."""
    import urllib.request

    for name in [name for name in os.environ if name.lower().endswith("_proxy")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    for scheme, host in (("https", "store.example"), ("https", "bucket.s3.corp"), ("http", "store.example")):
        expected = urllib.request.getproxies().get(scheme)
        if expected is not None and urllib.request.proxy_bypass(host):
            expected = None
        assert proxy_from_environment(scheme, host) == expected


def test_a_server_that_does_not_answer_is_a_timeout(transport: Transport) -> None:
    server = RawServer(stall_s=2).start()
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as caught:
            transport.request("GET", f"{server.url}/slow", {}, read_timeout_s=0.3)
        assert failure_kind(caught.value) == "timeout" and time.monotonic() - started < 1.5
    finally:
        server.stop()


def test_abort_ends_a_request_whose_headers_trickle_in_and_every_later_one(transport: Transport) -> None:
    server = RawServer(trickle_s=0.25).start()  # its head would take 10 s, no read waiting 5 s for a byte
    failed: list[BaseException] = []

    def wait_for_the_answer() -> None:
        try:
            transport.request("GET", f"{server.url}/trickle", {}, read_timeout_s=5)
        except NETWORK_ERRORS as exc:
            failed.append(exc)

    waiting = threading.Thread(target=wait_for_the_answer)
    try:
        waiting.start()
        time.sleep(0.6)  # a few bytes of the status line are in
        aborted = time.monotonic()
        transport.abort()
        waiting.join(5)
        assert not waiting.is_alive() and time.monotonic() - aborted < 1 and len(failed) == 1
        with pytest.raises(ConnectionAbortedError):
            get(transport, f"{server.url}/after")
        assert server.connections == 1  # the later request was refused before it connected
    finally:
        server.stop()


def test_nobody_listening_is_a_connection_failure(transport: Transport) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectionRefusedError) as caught:
        transport.request("GET", f"http://127.0.0.1:{port}/", {}, read_timeout_s=1)
    assert failure_kind(caught.value) == "connection"


@pytest.mark.parametrize(
    ("url", "netloc"),
    [("http://h/x", "h"), ("http://h:80/x", "h"), ("https://h:8443/x", "h:8443"), ("http://[::1]:9000/", "[::1]:9000")],
)
def test_the_host_header_names_the_port_only_when_not_the_default(url: str, netloc: str) -> None:
    assert Origin.of(url).netloc == netloc


def test_a_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        Origin.of("ftp://h/x")
