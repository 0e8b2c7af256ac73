"""Triton's Prometheus metrics page: where it is by default, reading it once, picking samples out of it.

Shared by the loader (its GPU memory check) and the proxy (which re-exports its own model's series), so both
find the page at the same default address: Triton's host at Triton's default ``--metrics-port`` (8002).
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tritonshare.common.errors import TritonUnavailable, clip

TRITON_METRICS_PORT = 8002  # tritonserver --metrics-port default
MAX_PAGE_BYTES = 32 * 1024 * 1024  # Triton's page grows with the number of models; this is far beyond it

Sieve = Callable[[Iterable[bytes]], Iterable[bytes]]  # the page's lines in, the lines to keep out


def default_metrics_url(triton_url: str) -> str:
    """Triton's metrics page on the host of ``triton_url`` at Triton's default metrics port:
    ``http://tritonshare-triton.tritonshare.svc:8000`` → ``http://tritonshare-triton.tritonshare.svc:8002/metrics``."""
    parsed = urllib.parse.urlsplit(triton_url if "://" in triton_url else f"http://{triton_url}")
    host = parsed.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{TRITON_METRICS_PORT}/metrics"


def fetch_page(url: str, *, timeout_s: float, sieve: Sieve | None = None) -> str:
    """The metrics page at ``url`` as text, whole within ``timeout_s`` (connecting takes up to ``timeout_s`` more);
    :class:`TritonUnavailable` when it cannot be read so.

    ``timeout_s`` bounds the whole answer, not each read: a port that sends its page a byte at a time, each
    within a read timeout, would otherwise hold the reader for as long as it likes (a proxy's scrapes then
    pile up behind it, each holding a thread and a connection of the metrics port).

    With ``sieve`` the page is read a line at a time and only the lines the sieve passes on are held: the page
    holds every tenant's series, so its size is the tenants' to grow (a Python model's custom metrics), and a
    reader that wants one model's lines must not hold, nor parse, everyone's."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TritonUnavailable(f"Triton metrics URL {url!r} is not http(s)://HOST[:PORT]/PATH")
    cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = cls(parsed.hostname, parsed.port, timeout=timeout_s)
    late = threading.Event()
    try:
        conn.connect()
        with _cut_at(conn.sock, timeout_s, late):
            conn.request("GET", parsed.path or "/metrics", headers={"Accept": "text/plain"})
            reply = conn.getresponse()
            kept = _body(reply, sieve, url)
    except (OSError, http.client.HTTPException) as exc:
        if late.is_set():
            raise TritonUnavailable(f"GET {url}: no whole page within {timeout_s:g}s") from exc
        raise TritonUnavailable(f"GET {url}: {str(exc) or type(exc).__name__}") from exc
    finally:
        conn.close()
    if late.is_set():  # the page may look whole: one without a length ends where the socket was cut
        raise TritonUnavailable(f"GET {url}: no whole page within {timeout_s:g}s")
    if reply.status != 200:
        raise TritonUnavailable(f"GET {url}: HTTP {reply.status}: {clip(kept.decode('utf-8', 'replace'))}")
    return kept.decode("utf-8", errors="replace")


def _body(reply: http.client.HTTPResponse, sieve: Sieve | None, url: str) -> bytes:
    """What is kept of the answer: the page's lines the sieve passes on (all without one); the start of an
    error answer, for its message."""
    if reply.status != 200:
        return reply.read(4096)
    lines = _lines(reply, url)
    return b"".join(lines if sieve is None else sieve(lines))


def _lines(reply: http.client.HTTPResponse, url: str) -> Iterator[bytes]:
    """The page's lines as they are read, each with its newline; past :data:`MAX_PAGE_BYTES`, TritonUnavailable.
    A page that ends short of its Content-Length (the connection closed mid-answer) is an HTTPException: its
    last line may be a value cut short (``12345`` read as ``12``), and ``readline`` does not raise for it."""
    read = 0
    while line := reply.readline(MAX_PAGE_BYTES + 1 - read):
        read += len(line)
        if read > MAX_PAGE_BYTES:
            raise TritonUnavailable(f"GET {url}: page larger than {MAX_PAGE_BYTES} bytes")
        yield line
    if reply.length:  # bytes of the Content-Length never came (None: no length, 0: all came)
        raise http.client.HTTPException(f"the page ended {reply.length} bytes short of its Content-Length")


@contextmanager
def _cut_at(sock: socket.socket, timeout_s: float, late: threading.Event) -> Iterator[None]:
    """Shut ``sock`` down once ``timeout_s`` has passed (setting ``late``): a read blocked on it returns."""

    def cut() -> None:
        late.set()
        with suppress(OSError):  # closed meanwhile
            sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def samples_named(text: str, names: frozenset[str], *, url: str) -> list[Sample]:
    """Every sample of ``text`` whose name is in ``names``; :class:`TritonUnavailable` when ``text`` is not
    Prometheus text (something else answers at ``url``)."""
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name in names]
    except ValueError as exc:
        raise TritonUnavailable(f"{url} is not a Prometheus metrics page ({exc}) — check the metrics URL") from exc
