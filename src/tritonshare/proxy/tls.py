"""Optional TLS on the proxy's REST and gRPC ports (``--tls-cert``, ``--tls-key``; issue 9), for clusters
without a service mesh. The certificate is reloaded when its files change, without a restart.

How a rotation reaches new connections: each front end listens with a server context from
:meth:`TlsCertificates.server_context`. Its SNI callback runs on every handshake (OpenSSL calls it after the
ClientHello even when the client sends no server name; checked with asyncio and uvloop) and, at most once
per ``check_interval_s``, stats the two files (``os.stat`` follows symlinks, so a Secret volume's ``..data``
swap shows as a new inode). When they changed it builds fresh contexts from them and, from then on, switches
each new connection to the fresh one (``SSLObject.context = …``, the documented use of the SNI callback).
Connections already open keep the certificate they were made with.

A pair that does not load (cert-manager writes ``tls.crt`` and ``tls.key`` as one atomic swap, but a
hand-made rotation may show a new certificate with the old key for a moment), or whose certificate is expired
or not yet valid (:mod:`tritonshare.proxy.validity`; OpenSSL loads it all the same, and clients would refuse
it), keeps the current certificate in service; the check is repeated at the next interval and the failure is
logged once. At start such a certificate is served (there is nothing else), with a warning; its notAfter is
exported for alerts before it comes to that.

ALPN per front end (:data:`ALPN`): gRPC requires ``h2``; REST speaks HTTP/1.1 only. TLS 1.2 at least, AEAD
ciphers only (RFC 7540 §9.2.2 forbids the rest for HTTP/2), no renegotiation. No client certificates. A
handshake not done within :data:`HANDSHAKE_TIMEOUT_S` ends the connection.

Handshakes count under ``--max-connections`` from accept (:class:`Handshakes`): the front ends listen in
plain TCP and put each connection behind the TLS protocol asyncio's ``create_server(ssl=…)`` would build
(uvloop's own under uvloop), built here so the front end learns when its handshake ends, either way. With
``ssl=`` the connection's protocol hears nothing of a handshake that fails, so handshakes under way could not
be counted, and a flood of them held open files beyond the cap.

A client speaking plain text to a TLS port is told so (:mod:`tritonshare.proxy.plaintext`): with ``plain_text``
given, a connection's first bytes are looked at before TLS sees them (:class:`FirstBytes`, once per connection;
after them the connection reads straight into the TLS protocol, as without it). The TLS protocol is made at accept
all the same, so its handshake timeout bounds the wait for those bytes.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import functools
import logging
import os
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tritonshare.common.errors import UsageError
from tritonshare.proxy.validity import Validity, validity_of

logger = logging.getLogger(__name__)

# A handshake must end within this: until it does, a connection holds an open file and a place under
# --max-connections (asyncio's default is 60 s; a handshake takes milliseconds).
HANDSHAKE_TIMEOUT_S = 10.0
# The ALPN protocols each front end offers, by its Frontend.protocol name.
ALPN: dict[str, tuple[str, ...]] = {"rest": ("http/1.1",), "grpc": ("h2",)}
# TLS 1.2 suites (TLS 1.3 ones are separate and all AEAD): forward secret, AEAD (HTTP/2's rule for gRPC).
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"

_FileIdentity = tuple[int, int, int, int, int]
_HANDSHAKE_RECORD = 0x16  # the first byte of a TLS handshake record (a ClientHello), however it is split
# A front end's answer to a connection whose first bytes are not TLS: the protocol that takes the connection
# (connection_made, then those bytes, are given to it), or None to leave it to TLS (which closes it).
PlainText = Callable[[bytes], asyncio.Protocol | None]


class Handshakes:
    """TLS on one port: each accepted connection is put behind TLS, and counted from then until its
    handshake ends — done (the connection is the front end's from then on), failed, timed out or cut."""

    def __init__(self, context: ssl.SSLContext, *, plain_text: PlainText | None = None) -> None:
        """``plain_text``: shown a connection's first bytes when they are not TLS (:class:`FirstBytes`)."""
        self.context = context
        self.plain_text = plain_text
        self.under_way = 0

    def behind_tls(self, app: asyncio.Protocol) -> asyncio.BaseProtocol:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        waiter.add_done_callback(self._ended)
        self.under_way += 1
        tls: asyncio.BufferedProtocol = _ssl_protocol(loop)(
            loop, app, self.context, waiter, server_side=True, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S
        )
        return tls if self.plain_text is None else FirstBytes(tls, self.plain_text)

    def _ended(self, waiter: asyncio.Future[None]) -> None:
        self.under_way -= 1
        if not waiter.cancelled():
            waiter.exception()  # retrieved: a failed handshake is the client's affair, logged by the protocol


class FirstBytes(asyncio.Protocol):
    """A connection until its first bytes arrive: the TLS protocol starts its handshake (and timeout) at once;
    the first bytes, when TLS, are handed to it and the transport reads into it from then on; otherwise the
    front end's ``plain_text`` may take the connection over, which ends the TLS protocol's part (and its place
    among the handshakes under way)."""

    def __init__(self, tls: asyncio.BufferedProtocol, plain_text: PlainText) -> None:
        self._tls = tls
        self._plain_text = plain_text
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._tls.connection_made(transport)  # server side: writes nothing before the client's hello

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        assert transport is not None
        taker = None if data[0] == _HANDSHAKE_RECORD else self._plain_text(data)
        if taker is None:
            transport.set_protocol(self._tls)
            _feed(self._tls, data, transport)
            return
        self._tls.connection_lost(ConnectionAbortedError("plain text on a TLS port"))  # writes nothing either
        transport.set_protocol(taker)
        taker.connection_made(transport)
        if not transport.is_closing():
            taker.data_received(data)

    def eof_received(self) -> bool | None:
        return self._tls.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._tls.connection_lost(exc)

    def pause_writing(self) -> None:
        self._tls.pause_writing()

    def resume_writing(self) -> None:
        self._tls.resume_writing()


def _feed(protocol: asyncio.BufferedProtocol, data: bytes, transport: asyncio.Transport) -> None:
    """Give ``data`` to a buffered protocol as its transport would (get_buffer, copy, buffer_updated)."""
    view = memoryview(data)
    while view and not transport.is_closing():
        buffer = memoryview(protocol.get_buffer(len(view)))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        protocol.buffer_updated(size)
        view = view[size:]


def _ssl_protocol(loop: asyncio.AbstractEventLoop) -> Callable[..., asyncio.BufferedProtocol]:
    """The protocol ``loop.create_server(ssl=…)`` itself uses: uvloop's under uvloop, asyncio's otherwise."""
    try:
        import uvloop.loop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds (not on Windows)
        return asyncio.sslproto.SSLProtocol
    protocol = getattr(uvloop.loop, "SSLProtocol", None)
    if protocol is not None and isinstance(loop, uvloop.loop.Loop):
        return protocol
    return asyncio.sslproto.SSLProtocol


class TlsCertificates:
    """One certificate and key pair, watched for changes, serving every front end's context."""

    def __init__(
        self,
        cert: Path,
        key: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        check_interval_s: float = 1.0,
        registry: CollectorRegistry | None = None,
        model: str = "",
    ) -> None:
        """``registry``: where the certificate metrics are exported, labelled ``model`` (the proxy's own model)."""
        self.cert = cert
        self.key = key
        self._clock = clock
        self._wall_clock = wall_clock
        self._interval_s = check_interval_s
        self._next_check = clock() + check_interval_s
        self._trouble = ""
        self.reloads = 0
        self.reload_errors = 0
        self._identity = self._identity_or_usage_error()
        self._current, self.validity = self._build_or_usage_error()
        problem = self.validity.problem(wall_clock()) if self.validity is not None else ""
        if problem:
            logger.warning("TLS certificate %s %s; serving it all the same — renew the Secret", cert, problem)
        self._listening: dict[str, ssl.SSLContext] = {}
        if registry is not None:
            registry.register(TlsCollector(self, model))

    @classmethod
    def from_options(
        cls, cert: Path | None, key: Path | None, *, registry: CollectorRegistry | None = None, model: str = ""
    ) -> TlsCertificates | None:
        """None when neither option is given (plain TCP); both or neither."""
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            given, missing = ("--tls-cert", "--tls-key") if cert is not None else ("--tls-key", "--tls-cert")
            raise UsageError(f"{given} needs {missing} too: give both (a PEM certificate chain and its key) or neither")
        return cls(cert, key, registry=registry, model=model)

    def server_context(self, protocol: str) -> ssl.SSLContext:
        """The context to listen with for a front end ("rest" or "grpc"); the same object for the server's
        whole life: rotations reach new connections through its SNI callback."""
        if protocol not in ALPN:
            raise ValueError(f"no TLS settings for protocol {protocol!r}; known: {', '.join(sorted(ALPN))}")
        context = self._listening.get(protocol)
        if context is None:
            context = self._listening[protocol] = self._current[protocol]
            context.sni_callback = functools.partial(self._handshake, protocol)
        return context

    # ------------------------------------------------------------------ per handshake

    def _handshake(
        self,
        protocol: str,
        connection: ssl.SSLObject | ssl.SSLSocket,
        _server_name: str | None,
        listening: ssl.SSLContext,
    ) -> None:
        """SNI callback: hand the connection the newest certificate. Never raises (that would fail the
        handshake); a reload problem is logged and the current certificate stays."""
        if self._clock() >= self._next_check:
            try:
                self._refresh()
            except Exception:  # a bug here must not fail every handshake
                logger.exception("TLS certificate check of %s failed; keeping the current one", self.cert)
        current = self._current[protocol]
        if current is not listening:
            connection.context = current

    def _refresh(self) -> None:
        self._next_check = self._clock() + self._interval_s
        try:
            identity = (_identity(self.cert), _identity(self.key))
            if identity == self._identity:
                return
            contexts, validity = _contexts(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            self._report(_words(exc))
            return
        problem = validity.problem(self._wall_clock()) if validity is not None else ""
        if problem:
            self._report(f"the new certificate {problem}")
            return
        self._identity, self._current, self.validity, self._trouble = identity, contexts, validity, ""
        self.reloads += 1
        logger.info("TLS certificate reloaded from %s and %s; new connections use it", self.cert, self.key)

    def _report(self, problem: str) -> None:
        self.reload_errors += 1
        if problem != self._trouble:
            self._trouble = problem
            logger.warning(
                "TLS certificate %s / key %s changed but %s; still serving the previous certificate, "
                "retrying every %gs",
                self.cert,
                self.key,
                problem,
                self._interval_s,
            )

    # ------------------------------------------------------------------ at start

    def _identity_or_usage_error(self) -> tuple[_FileIdentity, _FileIdentity]:
        try:
            return _identity(self.cert), _identity(self.key)
        except OSError as exc:
            raise UsageError(f"--tls-cert {self.cert} / --tls-key {self.key}: {_words(exc)}") from exc

    def _build_or_usage_error(self) -> tuple[dict[str, ssl.SSLContext], Validity | None]:
        try:
            return _contexts(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--tls-cert {self.cert} / --tls-key {self.key}: {_words(exc)}") from exc


def _contexts(cert: Path, key: Path) -> tuple[dict[str, ssl.SSLContext], Validity | None]:
    """One server context per front end (each loads the pair) and the certificate's validity (None if it cannot be
    read: not checked then). A rotation landing between these reads leaves them of different files for at most a
    check interval: the files' identity changed, so the next check reads them all again."""
    contexts = {protocol: _context(cert, key, alpn) for protocol, alpn in ALPN.items()}
    return contexts, validity_of(cert.read_bytes())


def _context(cert: Path, key: Path, alpn: tuple[str, ...]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    context.set_ciphers(CIPHERS)
    # password=b"": an encrypted key fails to load instead of OpenSSL prompting on the terminal.
    context.load_cert_chain(cert, key, password=b"")
    context.set_alpn_protocols(list(alpn))
    return context


def _identity(path: Path) -> _FileIdentity:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def _words(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError):
        return (
            f"cannot load the pair ({exc.reason or exc}) — both must be PEM, the key unencrypted and "
            "belonging to the certificate"
        )
    return f"cannot read {exc.filename or 'a file'} ({exc.strerror or exc}) — mount the TLS Secret there"


class TlsCollector(Collector):
    """Reloads of the certificate, failed attempts and when the one in service expires, read at scrape time,
    labelled with the proxy's model like its other families."""

    def __init__(self, certificates: TlsCertificates, model: str) -> None:
        self._certificates = certificates
        self._model = model

    def collect(self) -> Iterator[Metric]:
        model = self._model
        reloads = CounterMetricFamily(
            "tritonshare_proxy_tls_reloads", "Certificate reloads after a file change.", labels=["model"]
        )
        reloads.add_metric([model], self._certificates.reloads)
        yield reloads
        errors = CounterMetricFamily(
            "tritonshare_proxy_tls_reload_errors",
            "Changed certificate files that did not load (previous kept).",
            labels=["model"],
        )
        errors.add_metric([model], self._certificates.reload_errors)
        yield errors
        validity = self._certificates.validity
        if validity is not None:
            not_after = GaugeMetricFamily(
                "tritonshare_proxy_tls_certificate_not_after_timestamp_seconds",
                "When the certificate new connections get expires (Unix time): alert on it minus time().",
                labels=["model"],
            )
            not_after.add_metric([model], validity.not_after)
            yield not_after
