"""TLS for the proxy's ports: a real asyncio/uvloop server listening with the proxy's contexts, clients that
verify it against a CA made here, ALPN per front end, and certificate rotation seen by new connections
without a restart (plain file rewrite and a Kubernetes Secret ``..data`` symlink swap)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry

from tests.proxy.conftest import ServedModels
from tests.proxy.test_metrics import _samples
from tests.support.certs import CertificateAuthority, write_atomically
from tests.support.proxy import ProxyProcess
from tritonshare.common.errors import UsageError
from tritonshare.proxy.plaintext import looks_like_http1
from tritonshare.proxy.tls import Handshakes, TlsCertificates

MODEL = {"model": "m"}  # the label every proxy family carries (a node-wide Prometheus tells tenants apart)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pair(tmp_path: Path, ca: CertificateAuthority) -> tuple[Path, Path]:
    cert_pem, key_pem = ca.issue(serial=1001)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    return cert, key


@pytest.fixture
def ca_file(tmp_path: Path, ca: CertificateAuthority) -> Path:
    return ca.write_ca(tmp_path / "ca.crt")


@pytest.fixture
def client(ca_file: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


LoopFactory = Callable[[], asyncio.AbstractEventLoop]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Iterator[Callable[[Coroutine[Any, Any, None]], None]]:
    """Run a scenario on a fresh loop of either kind (the proxy runs on uvloop; tests on both)."""
    factory: LoopFactory = asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        yield runner.run


@contextlib.asynccontextmanager
async def echo_server(context: ssl.SSLContext) -> AsyncIterator[int]:
    """A line-echo server over TLS with the given context; yields its port."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while line := await reader.readline():
                writer.write(line)
                await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        tls = writer.get_extra_info("ssl_object")
        self.serial = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number
        self.alpn: str | None = tls.selected_alpn_protocol()

    async def echo(self, text: bytes) -> bytes:
        self.writer.write(text + b"\n")
        return (await self.reader.readline()).rstrip(b"\n")

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()


async def connect(port: int, client: ssl.SSLContext, host: str = "localhost") -> Connection:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=host)
    return Connection(reader, writer)


def test_each_front_end_negotiates_its_alpn_and_clients_verify_the_server(
    run: Callable[[Coroutine[Any, Any, None]], None], pair: tuple[Path, Path], client: ssl.SSLContext, clock: Clock
) -> None:
    certificates = TlsCertificates(*pair, clock=clock)

    async def scenario() -> None:
        for protocol, alpn in (("rest", "http/1.1"), ("grpc", "h2")):
            async with echo_server(certificates.server_context(protocol)) as port:
                for host in ("localhost", "127.0.0.1"):  # with and without SNI (none is sent for an IP)
                    conn = await connect(port, client, host)
                    assert (conn.serial, conn.alpn) == (1001, alpn)
                    assert await conn.echo(b"ping") == b"ping"
                    await conn.close()

    run(scenario())


def test_a_client_trusting_another_ca_refuses_the_server(
    run: Callable[[Coroutine[Any, Any, None]], None], pair: tuple[Path, Path], clock: Clock, tmp_path: Path
) -> None:
    stranger = ssl.create_default_context(cafile=CertificateAuthority("another CA").write_ca(tmp_path / "other-ca.crt"))
    certificates = TlsCertificates(*pair, clock=clock)

    async def scenario() -> None:
        async with echo_server(certificates.server_context("rest")) as port:
            with pytest.raises(ssl.SSLCertVerificationError):
                await connect(port, stranger)

    run(scenario())


def test_rotated_certificate_reaches_new_connections_while_open_ones_go_on(
    run: Callable[[Coroutine[Any, Any, None]], None],
    pair: tuple[Path, Path],
    client: ssl.SSLContext,
    clock: Clock,
    ca: CertificateAuthority,
) -> None:
    cert, key = pair
    registry = CollectorRegistry()
    certificates = TlsCertificates(cert, key, clock=clock, registry=registry, model="m")

    async def scenario() -> None:
        async with echo_server(certificates.server_context("grpc")) as port:
            before = await connect(port, client)
            new_cert, new_key = ca.issue(serial=2002)
            write_atomically(key, new_key)
            write_atomically(cert, new_cert)
            early = await connect(port, client)  # within the check interval: not looked at yet
            clock.now += 1.01
            after = await connect(port, client)
            assert (before.serial, early.serial, after.serial) == (1001, 1001, 2002)
            assert after.alpn == "h2"  # the fresh context offers the front end's ALPN too
            assert await before.echo(b"still here") == b"still here"
            for conn in (before, early, after):
                await conn.close()

    run(scenario())
    assert registry.get_sample_value("tritonshare_proxy_tls_reloads_total", MODEL) == 1


def kubernetes_tls_secret(root: Path, version: str, cert_pem: bytes, key_pem: bytes) -> tuple[Path, Path]:
    """A kubernetes.io/tls Secret volume: ``tls.crt -> ..data/tls.crt``, ``..data -> ..<version>``."""
    folder = root / f"..{version}"
    folder.mkdir(parents=True)
    (folder / "tls.crt").write_bytes(cert_pem)
    (folder / "tls.key").write_bytes(key_pem)
    os.symlink(folder.name, root / "..data_tmp")
    os.rename(root / "..data_tmp", root / "..data")  # one atomic swap, as the kubelet does
    for name in ("tls.crt", "tls.key"):
        if not (root / name).is_symlink():
            os.symlink(f"..data/{name}", root / name)
    return root / "tls.crt", root / "tls.key"


def test_kubernetes_secret_swap_is_picked_up_without_restart(
    run: Callable[[Coroutine[Any, Any, None]], None],
    client: ssl.SSLContext,
    clock: Clock,
    ca: CertificateAuthority,
    tmp_path: Path,
) -> None:
    root = tmp_path / "secret"
    cert, key = kubernetes_tls_secret(root, "2024_01", *ca.issue(serial=3001))
    certificates = TlsCertificates(cert, key, clock=clock)

    async def scenario() -> None:
        async with echo_server(certificates.server_context("rest")) as port:
            first = await connect(port, client)
            kubernetes_tls_secret(root, "2024_02", *ca.issue(serial=3002))
            shutil.rmtree(root / "..2024_01")
            clock.now += 1.01
            second = await connect(port, client)
            assert (first.serial, second.serial) == (3001, 3002)
            await first.close()
            await second.close()

    run(scenario())


def test_half_rotated_pair_keeps_the_old_certificate_until_the_key_arrives(
    run: Callable[[Coroutine[Any, Any, None]], None],
    pair: tuple[Path, Path],
    client: ssl.SSLContext,
    clock: Clock,
    ca: CertificateAuthority,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cert, key = pair
    registry = CollectorRegistry()
    certificates = TlsCertificates(cert, key, clock=clock, registry=registry, model="m")
    new_cert, new_key = ca.issue(serial=4004)

    async def scenario() -> None:
        async with echo_server(certificates.server_context("rest")) as port:
            write_atomically(cert, new_cert)  # the new certificate, the old key: does not load
            serials = []
            for _ in range(3):
                clock.now += 1.01
                conn = await connect(port, client)
                serials.append(conn.serial)
                await conn.close()
            write_atomically(key, new_key)
            clock.now += 1.01
            conn = await connect(port, client)
            serials.append(conn.serial)
            await conn.close()
            assert serials == [1001, 1001, 1001, 4004]

    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.tls"):
        run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "KEY_VALUES_MISMATCH" in warnings[0] and "still serving the previous" in warnings[0]
    assert registry.get_sample_value("tritonshare_proxy_tls_reload_errors_total", MODEL) == 3


def test_bad_files_at_start_are_usage_errors(tmp_path: Path, ca: CertificateAuthority, pair: tuple[Path, Path]) -> None:
    cert, key = pair
    other_key = tmp_path / "other.key"
    other_key.write_bytes(ca.issue(serial=5)[1])
    encrypted = tmp_path / "encrypted.key"
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    encrypted.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
        )
    )
    cases = [
        (tmp_path / "missing.crt", key, "cannot read"),
        (cert, other_key, "KEY_VALUES_MISMATCH"),
        (cert, encrypted, "the key unencrypted"),  # refused, never an interactive password prompt
        (key, key, "cannot load the pair"),
    ]
    for bad_cert, bad_key, words in cases:
        with pytest.raises(UsageError) as err:
            TlsCertificates(bad_cert, bad_key)
        assert str(err.value).startswith(f"--tls-cert {bad_cert} / --tls-key {bad_key}: "), err.value
        assert words in str(err.value)


def test_options_are_both_or_neither(pair: tuple[Path, Path]) -> None:
    cert, key = pair
    assert TlsCertificates.from_options(None, None) is None
    assert isinstance(TlsCertificates.from_options(cert, key), TlsCertificates)
    with pytest.raises(UsageError, match="--tls-cert needs --tls-key too"):
        TlsCertificates.from_options(cert, None)
    with pytest.raises(UsageError, match="--tls-key needs --tls-cert too"):
        TlsCertificates.from_options(None, key)


def test_tls_1_2_clients_get_aead_ciphers_only(
    run: Callable[[Coroutine[Any, Any, None]], None], pair: tuple[Path, Path], client: ssl.SSLContext, ca_file: Path
) -> None:
    """HTTP/2 (so gRPC) forbids TLS 1.2's CBC suites (RFC 7540 §9.2.2): a client offering only those fails."""
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    cbc_only = ssl.create_default_context(cafile=ca_file)
    cbc_only.maximum_version = ssl.TLSVersion.TLSv1_2
    cbc_only.set_ciphers("ECDHE-ECDSA-AES128-SHA256")
    certificates = TlsCertificates(*pair)

    async def scenario() -> None:
        async with echo_server(certificates.server_context("grpc")) as port:
            conn = await connect(port, client)
            tls = conn.writer.get_extra_info("ssl_object")
            assert tls.version() == "TLSv1.2" and "GCM" in tls.cipher()[0]
            await conn.close()
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await connect(port, cbc_only)

    run(scenario())


def _days(days: float) -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=days)


def test_a_rotation_to_an_expired_or_not_yet_valid_certificate_keeps_the_current_one(
    run: Callable[[Coroutine[Any, Any, None]], None],
    pair: tuple[Path, Path],
    client: ssl.SSLContext,
    clock: Clock,
    ca: CertificateAuthority,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """OpenSSL loads a certificate whatever its dates, and every verifying client would refuse an expired one
    (a backup restored by mistake, a certificate issued for a wrong date): the valid one stays until a valid
    one comes."""
    cert, key = pair
    registry = CollectorRegistry()
    certificates = TlsCertificates(cert, key, clock=clock, registry=registry, model="m")
    expired = ca.issue(serial=6001, not_before=_days(-30), not_after=_days(-1))
    future = ca.issue(serial=6002, not_before=_days(1), not_after=_days(30))

    async def serial_after_rotation_to(port: int, pem: tuple[bytes, bytes]) -> int:
        write_atomically(key, pem[1])
        write_atomically(cert, pem[0])
        clock.now += 1.01
        conn = await connect(port, client)
        await conn.close()
        return conn.serial

    async def scenario() -> None:
        async with echo_server(certificates.server_context("grpc")) as port:
            served = [await serial_after_rotation_to(port, pem) for pem in (expired, future, ca.issue(serial=6003))]
            assert served == [1001, 1001, 6003]

    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.tls"):
        run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("still serving the previous certificate" in w for w in warnings)
    assert "changed but the new certificate expired at 20" in warnings[0]
    assert "changed but the new certificate is not valid before 20" in warnings[1]
    assert registry.get_sample_value("tritonshare_proxy_tls_reload_errors_total", MODEL) == 2
    assert registry.get_sample_value("tritonshare_proxy_tls_reloads_total", MODEL) == 1


def test_an_expired_certificate_at_start_is_served_with_a_warning_and_its_expiry_is_exported(
    tmp_path: Path, ca: CertificateAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_pem, key_pem = ca.issue(serial=7, not_before=_days(-30), not_after=_days(-2))
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.tls"):
        TlsCertificates(cert, key, registry=registry, model="m")
    assert [r.getMessage() for r in caplog.records] == [
        f"TLS certificate {cert} expired at "
        f"{x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}; "
        "serving it all the same — renew the Secret"
    ]
    exported = registry.get_sample_value("tritonshare_proxy_tls_certificate_not_after_timestamp_seconds", MODEL)
    assert exported == x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc.timestamp()


class Told(asyncio.Protocol):
    """What a front end answers a plain-text client with: ``answer``, then the connection is closed."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        writer.write(self.answer)
        writer.close()


class LineEcho(asyncio.Protocol):
    """The front end's protocol once the handshake is done: echoes what it reads."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


@contextlib.asynccontextmanager
async def sniffing_server(context: ssl.SSLContext, seen: list[bytes]) -> AsyncIterator[tuple[int, Handshakes]]:
    """A server putting connections behind TLS as the front ends do, whose plain-text answer takes what
    starts like HTTP/1.x (and records every first read that was not TLS)."""

    def plain_text(first: bytes) -> asyncio.Protocol | None:
        seen.append(first)
        return Told(b"speak TLS\n") if looks_like_http1(first) else None

    handshakes = Handshakes(context, plain_text=plain_text)
    server = await asyncio.get_running_loop().create_server(lambda: handshakes.behind_tls(LineEcho()), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], handshakes
    finally:
        server.close()
        await server.wait_closed()


def _split_hello_echo(port: int, client: ssl.SSLContext, text: bytes) -> tuple[str | None, bytes]:
    """A TLS client whose ClientHello arrives in two reads (its first byte alone): (ALPN, the echo of ``text``)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = client.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with contextlib.suppress(ssl.SSLWantReadError):
            tls.do_handshake()
        hello = outgoing.read()
        sock.sendall(hello[:1])
        time.sleep(0.1)  # two reads at the server
        sock.sendall(hello[1:])
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536))
        tls.write(text)
        sock.sendall(outgoing.read())
        echoed = b""
        while len(echoed) < len(text):
            incoming.write(sock.recv(65536))
            with contextlib.suppress(ssl.SSLWantReadError):
                echoed += tls.read()
        return tls.selected_alpn_protocol(), echoed


def _plain(port: int, sent: bytes) -> bytes:
    """What a plain-text client sending ``sent`` reads until the connection ends."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(sent)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
        return answer


async def _none_under_way(handshakes: Handshakes) -> int:
    for _ in range(100):
        if not handshakes.under_way:
            break
        await asyncio.sleep(0.01)
    return handshakes.under_way


def test_a_plain_text_client_is_answered_by_the_front_end_and_tls_clients_go_on_as_before(
    run: Callable[[Coroutine[Any, Any, None]], None], pair: tuple[Path, Path], client: ssl.SSLContext, clock: Clock
) -> None:
    """The first read decides: 0x16 goes to TLS (a ClientHello split after its first byte too), plain HTTP is
    the front end's to answer, other bytes end in TLS's failed handshake as before; none stays counted under way."""
    certificates = TlsCertificates(*pair, clock=clock)
    seen: list[bytes] = []

    async def scenario() -> None:
        async with sniffing_server(certificates.server_context("rest"), seen) as (port, handshakes):
            conn = await connect(port, client)
            assert (conn.serial, conn.alpn) == (1001, "http/1.1")
            assert await conn.echo(b"ping") == b"ping"
            await conn.close()
            split = await asyncio.to_thread(_split_hello_echo, port, client, b"split hello\n")
            assert split == ("http/1.1", b"split hello\n")
            answer = await asyncio.to_thread(_plain, port, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer == b"speak TLS\n"
            assert await asyncio.to_thread(_plain, port, b"\x00\x01 not tls, not http\r\n") == b""
            assert await _none_under_way(handshakes) == 0

    run(scenario())
    assert seen == [b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00\x01 not tls, not http\r\n"]


# ---------------------------------------------------------------------------------------- the real proxy

LIVE = "/inference.GRPCInferenceService/ServerLive"


METADATA = "/inference.GRPCInferenceService/ModelMetadata"


def _start_tls_proxy(
    start_proxy: Callable[..., ProxyProcess], own: str, ca: CertificateAuthority, tmp_path: Path, *extra: str
) -> ProxyProcess:
    folder = tmp_path / "tls"
    folder.mkdir()
    cert, key = ca.write_pair(folder, serial=8001)
    return start_proxy(own, "--no-unload", "--tls-cert", str(cert), "--tls-key", str(key), *extra)


@pytest.fixture
def tls_proxy(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels, ca: CertificateAuthority, tmp_path: Path
) -> ProxyProcess:
    return _start_tls_proxy(start_proxy, served_models.own, ca, tmp_path)


def _plain_text_refusals(proxy: ProxyProcess) -> dict[tuple[str, str], float]:
    return {
        (labels["protocol"], labels["route"]): value
        for name, labels, value in _samples(proxy)
        if name == "tritonshare_proxy_refusals_total" and labels["reason"] == "plain_http_on_tls"
    }


def _auth_refusals(proxy: ProxyProcess) -> float:
    return sum(value for name, _, value in _samples(proxy) if name == "tritonshare_proxy_auth_refused_total")


@pytest.mark.triton
def test_plain_http_to_the_proxys_tls_port_gets_400_saying_to_use_https(
    tls_proxy: ProxyProcess, served_models: ServedModels, ca_file: Path
) -> None:
    """What curl shows for http:// on the TLS port (it showed "Empty reply from server"), counted; https goes on."""
    plain = subprocess.run(
        ["curl", "-sS", "-i", f"http://{tls_proxy.url}/v2/models/{served_models.own}/ready"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    head, _, body = plain.stdout.partition("\n\n")  # text=True: CRLF read as LF
    assert head.startswith("HTTP/1.1 400 Bad Request\n") and "Connection: close" in head.split("\n"), plain
    assert json.loads(body) == {"error": "this port speaks TLS: use https:// (the request was sent in plain HTTP)"}
    secure = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(ca_file)]
        + [f"https://{tls_proxy.url}/v2/models/{served_models.own}/ready"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert secure.stdout == "200", secure
    assert _plain_text_refusals(tls_proxy) == {("rest", "connection"): 1}


@pytest.mark.triton
def test_an_insecure_grpc_channel_to_the_proxys_tls_port_is_told_to_use_a_secure_one(
    tls_proxy: ProxyProcess, ca_file: Path
) -> None:
    """What a grpcio user sees: UNAVAILABLE with the hint, at once (it was a bare UNAVAILABLE). A GOAWAY carrying the
    hint as debug data, before any stream, was tried with grpcio 1.85: it reconnected in a loop without showing it,
    and the call ended "Deadline Exceeded"; so each stream is answered, as for a connection past the cap."""
    started = time.monotonic()
    with grpc.insecure_channel(tls_proxy.grpc_url) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(LIVE)(b"", timeout=10)
    error = cast(grpc.Call, info.value)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "this port speaks TLS: use a secure channel (grpc.secure_channel), not an insecure one"
    assert time.monotonic() - started < 5
    credentials = grpc.ssl_channel_credentials(ca_file.read_bytes())
    with grpc.secure_channel(f"localhost:{tls_proxy.grpc_port}", credentials) as channel:
        assert channel.unary_unary(LIVE)(b"", timeout=10) == b"\x08\x01"  # live: true
    assert _plain_text_refusals(tls_proxy) == {("grpc", "ServerLive"): 1}


@pytest.mark.triton
def test_an_insecure_grpc_channel_is_told_to_use_a_secure_one_before_its_token_is_asked_for(
    start_proxy: Callable[..., ProxyProcess],
    served_models: ServedModels,
    ca: CertificateAuthority,
    ca_file: Path,
    tmp_path: Path,
) -> None:
    """With --auth-token-file, a call without a token on an insecure channel was answered UNAUTHENTICATED: the
    user added a token and still failed. The connection is turned away as a whole, so every call hears why first."""
    tokens = tmp_path / "tokens"
    tokens.write_text("token-one\n")
    proxy = _start_tls_proxy(start_proxy, served_models.own, ca, tmp_path, "--auth-token-file", str(tokens))
    with grpc.insecure_channel(proxy.grpc_url) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(METADATA)(b"", timeout=10)
    error = cast(grpc.Call, info.value)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "this port speaks TLS: use a secure channel (grpc.secure_channel), not an insecure one",
    )
    assert _plain_text_refusals(proxy) == {("grpc", "ModelMetadata"): 1}
    assert _auth_refusals(proxy) == 0
    credentials = grpc.ssl_channel_credentials(ca_file.read_bytes())
    with grpc.secure_channel(f"localhost:{proxy.grpc_port}", credentials) as channel:
        with pytest.raises(grpc.RpcError) as info:  # over TLS the token is asked for, as before
            channel.unary_unary(METADATA)(b"", timeout=10)
        assert cast(grpc.Call, info.value).code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.triton
def test_plain_http_to_the_proxys_grpc_tls_port_gets_400_saying_it_speaks_grpc_over_tls(
    tls_proxy: ProxyProcess, ca_file: Path
) -> None:
    """What `curl http://host:grpcport/` shows (it was "Empty reply from server"), counted as REST's is; the port
    goes on serving secure channels."""
    answer = _plain(tls_proxy.grpc_port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 400 Bad Request" and b"Connection: close" in lines, answer
    assert json.loads(body) == {"error": "this port speaks gRPC over TLS: use a secure gRPC channel (not plain HTTP)"}
    assert _plain_text_refusals(tls_proxy) == {("grpc", "connection"): 1}
    credentials = grpc.ssl_channel_credentials(ca_file.read_bytes())
    with grpc.secure_channel(f"localhost:{tls_proxy.grpc_port}", credentials) as channel:
        assert channel.unary_unary(LIVE)(b"", timeout=10) == b"\x08\x01"  # live: true
