"""HTTP/1.1 for the network sources: kept-alive connections per thread, large reads, nothing in between.

Why not an SDK's client: a model pod waits for its download, and on a 2-core node the SDKs' per-request
machinery (botocore's ~2.5 ms of CPU per object, google-cloud-storage's 8 KiB chunks) and their import time
(0.2-0.3 s of CPU) cost more than moving the bytes. The standard library's ``http.client`` parses a
response's headers and then hands ``readinto`` straight to the socket, so a 1 MiB buffer is filled by the
kernel with no copy in Python.

* One connection per thread and origin, reused while the previous response was read to its end (S3 and
  GCS keep connections open); a response abandoned half-read closes its connection.
* A request on a reused connection that the server had already closed (an idle keep-alive timeout) is sent
  again once on a fresh connection: only GET and HEAD are sent, both idempotent.
* ``connect_timeout_s`` bounds the TCP/TLS handshake; the per-request ``read_timeout_s`` bounds every later
  read, which makes it the stall timeout (kserve#5611). A store that trickles bytes never trips it, not even
  while its answer's headers come in: :meth:`Transport.abort` ends every request at once, for a download
  that stops (its deadline passed, another object failed, a signal).
* Proxies from ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY`` (as ``urllib`` reads them): ``https://`` through a
  CONNECT tunnel, ``http://`` in absolute form.

Errors are left as ``OSError``/``http.client.HTTPException``; each source translates them once with its own
advice, using :func:`failure_kind` to tell a timeout from a refused connection or a certificate problem.
"""

from __future__ import annotations

import base64
import errno
import http.client
import os
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from typing import Literal
from urllib.parse import quote, unquote, urlsplit

from tritonshare.common.errors import SourceError, TransientSourceError, TritonshareError, UsageError
from tritonshare.loader.sources.base import Checksum, display_uri

CONNECT_TIMEOUT_S = 10.0
ProxyLookup = Callable[[str, str], str | None]  # (scheme, host) → proxy URL, or None to connect directly


def proxy_from_environment(scheme: str, host: str) -> str | None:
    """The proxy ``urllib`` would use for ``scheme://host`` (``*_PROXY`` and ``NO_PROXY`` variables)."""
    if not any(name.lower().endswith("_proxy") for name in os.environ):
        return None  # what urllib would answer, without importing it (3 ms of every load's start-up)
    import urllib.request

    proxies = urllib.request.getproxies()
    proxy = proxies.get(scheme)
    if proxy is None or urllib.request.proxy_bypass(host):
        return None
    return proxy


@dataclass(frozen=True)
class Origin:
    scheme: str  # "http" | "https"
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {display_uri(url)!r}")  # never its credentials
        return cls(scheme, parts.hostname, parts.port or (443 if scheme == "https" else 80))

    @property
    def netloc(self) -> str:
        """The Host header: the port only when it is not the scheme's default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass
class _Route:
    """How one thread reaches one origin: its connection, and what a plain-HTTP proxy needs."""

    connection: http.client.HTTPConnection
    absolute: bool = False  # send the target in absolute form (through an http:// proxy)
    headers: dict[str, str] = field(default_factory=dict)  # Proxy-Authorization, with an http:// proxy


_TARGET_SAFE = "!#$%&'()*+,/:;=?@[]~"  # reserved and already-escaped characters: kept as they are


class Response:
    """One response: status and headers at once, the body through :meth:`readinto`. Close it (or use it as a
    context manager); its connection is reused only if the body was read to its end."""

    def __init__(self, raw: http.client.HTTPResponse, connection: http.client.HTTPConnection) -> None:
        self._raw = raw
        self._connection = connection
        self.status = raw.status
        self.reason = raw.reason
        self.headers: Message = raw.headers

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def readinto(self, buffer: memoryview) -> int:
        """Fill ``buffer`` with the next bytes of the body; 0 at its end. A body cut short of its Content-Length
        raises ``http.client.IncompleteRead`` (http.client itself ends it with 0, and a listing that stated no
        size had nothing to check it against)."""
        count = self._raw.readinto(buffer)
        if not count and buffer.nbytes and self._raw.length:  # bytes still announced, none coming
            raise http.client.IncompleteRead(b"", self._raw.length)
        return count

    def read(self, limit: int) -> bytes:
        """At most ``limit`` bytes: for listings and error bodies."""
        return self._raw.read(limit)

    def error_body(self, limit: int) -> bytes:
        """An error answer's body, at most ``limit`` bytes (empty if the connection fails meanwhile: the status
        says enough), and the response closed."""
        try:
            return self._raw.read(limit)
        except NETWORK_ERRORS:
            return b""
        finally:
            self.close()

    def abort(self) -> None:
        """Wake a thread blocked reading this response (another thread's call)."""
        _shut_down(self._connection)

    def close(self) -> None:
        if not self._raw.isclosed():
            self._connection.close()  # unread bytes would be taken for the next response
        self._raw.close()

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ResponseBody:
    """A download's bytes from one response, for the download engine (:class:`~.stream.Body`): transport
    errors are translated into the error tree by the source's ``translate`` (with its own hints)."""

    def __init__(
        self,
        response: Response,
        what: str,
        translate: Callable[[BaseException, str], TritonshareError],
        checksum: Checksum | None = None,
    ) -> None:
        self._response = response
        self._what = what
        self._translate = translate
        self.checksum = checksum  # one the response states for the whole object (else the listing's is checked)

    def readinto(self, buffer: memoryview, /) -> int:
        try:
            return self._response.readinto(buffer)
        except NETWORK_ERRORS as exc:
            raise self._translate(exc, self._what) from exc

    def abort(self) -> None:
        self._response.abort()

    def close(self) -> None:
        self._response.close()


class Transport:
    """Connections to any number of origins, shared by the threads of one download. Thread-safe."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        ca_file: str | None = None,
        proxy_for: ProxyLookup = proxy_from_environment,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._ca_file = ca_file
        self._proxy_for = proxy_for
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[http.client.HTTPConnection] = []
        self._tls: ssl.SSLContext | None = None
        self._aborted = False  # abort() was called: every request fails (guarded by _lock)

    def request(
        self, method: Literal["GET", "HEAD"], url: str, headers: Mapping[str, str], *, read_timeout_s: float
    ) -> Response:
        """Send one request and return the response once its headers are in (any status)."""
        origin = Origin.of(url)
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # characters a request line may not hold (a space, a control character) are escaped, as curl and
        # requests do; what is escaped already stays (http.client refused them, quoting the whole target:
        # a pre-signed URL's signature went into the message)
        target = quote(target, safe=_TARGET_SAFE)
        route = self._route(origin)
        if route.absolute:
            target = f"http://{origin.netloc}{target}"  # absolute form, for the proxy to forward
        headers = {**headers, **route.headers} if route.headers else headers
        reused = route.connection.sock is not None
        try:
            return self._send(route.connection, method, target, headers, read_timeout_s)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
            # the server had closed this idle connection: once more on a new one
            return self._send(route.connection, method, target, headers, read_timeout_s)

    def abort(self) -> None:
        """From another thread, when the download stops: end every request in progress now — one still waiting
        for its answer's headers as well as one whose body is being read — and make every later one fail at
        once (``ConnectionAbortedError``), on this transport for good. ``read_timeout_s`` cannot do it: a store
        that sends a byte now and then never lets a read time out."""
        with self._lock:
            self._aborted = True
            opened = list(self._opened)
        for connection in opened:
            _shut_down(connection)

    def close(self) -> None:
        """Close every connection any thread opened. They stay listed: a thread that asks again reconnects the
        same connection object, which a later close() or abort() must still reach."""
        with self._lock:
            opened = list(self._opened)
        for connection in opened:
            connection.close()

    def _send(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        target: str,
        headers: Mapping[str, str],
        read_timeout_s: float,
    ) -> Response:
        try:
            self._refuse_if_aborted()
            if connection.sock is None:
                connection.connect()
                self._refuse_if_aborted()  # an abort() while this connected found no socket to shut down
            connection.sock.settimeout(read_timeout_s)
            connection.request(method, target, headers=dict(headers))
            return Response(connection.getresponse(), connection)
        except BaseException:
            connection.close()
            raise

    def _refuse_if_aborted(self) -> None:
        with self._lock:
            if self._aborted:
                raise ConnectionAbortedError(errno.ECONNABORTED, "the download was stopped")

    def _route(self, origin: Origin) -> _Route:
        pool: dict[Origin, _Route] | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = {}
        route = pool.get(origin)
        if route is None:
            route = pool[origin] = self._open(origin)
            with self._lock:
                self._opened.append(route.connection)
        return route

    def _open(self, origin: Origin) -> _Route:
        proxy = self._proxy_for(origin.scheme, origin.host)
        if proxy is None:
            return _Route(self._new(origin.scheme, origin.host, origin.port))
        try:
            via = Origin.of(proxy if "://" in proxy else f"http://{proxy}")
        except ValueError:
            raise UsageError(
                f"proxy {display_uri(proxy)!r} (HTTPS_PROXY / HTTP_PROXY) is not an http(s) URL — tritonshare reaches "
                "stores through an HTTP proxy (CONNECT for https); socks is not supported"
            ) from None
        auth = {"Proxy-Authorization": value} if (value := _proxy_authorization(proxy)) else {}
        if origin.scheme == "http":
            return _Route(self._new(via.scheme, via.host, via.port), absolute=True, headers=auth)
        connection = self._new("https", via.host, via.port)  # TCP to the proxy, CONNECT, then TLS to the origin
        connection.set_tunnel(origin.host, origin.port, headers=auth or None)
        return _Route(connection)

    def _new(self, scheme: str, host: str, port: int) -> http.client.HTTPConnection:
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=self.connect_timeout_s, context=self._context())
        return http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s)

    def _context(self) -> ssl.SSLContext:
        with self._lock:
            if self._tls is None:
                self._tls = ssl.create_default_context(cafile=self._ca_file)
            return self._tls


def _shut_down(connection: http.client.HTTPConnection) -> None:
    """Shut ``connection``'s socket down, which a read blocked on it in another thread sees at once (closing the
    descriptor would leave it blocked); the connection is closed by its own thread."""
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, already closed or reset: nothing is blocked on it


def _proxy_authorization(proxy: str) -> str:
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if parts.username is None:
        return ""
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(pair.encode()).decode()


FailureKind = Literal["timeout", "tls", "connection"]


def failure_kind(exc: BaseException) -> FailureKind:
    """What kind of network failure ``exc`` is, for the source's message."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "tls"
    return "connection"


NETWORK_ERRORS: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


def transport_error(exc: BaseException, what: str, *, tls_hint: str, connect_hint: str) -> TritonshareError:
    """A failure to reach a store → the error tree: timeouts and lost connections are transient, a TLS
    verification failure is not. The hints say what to check for that store."""
    kind = failure_kind(exc)
    if kind == "timeout":
        return TransientSourceError(f"{what}: the store did not answer in time ({exc})")
    if kind == "tls":
        return SourceError(f"{what}: TLS certificate verification failed ({exc}) — {tls_hint}")
    return TransientSourceError(f"{what}: connection failed ({exc or type(exc).__name__}) — {connect_hint}")
