"""Triton's Prometheus metrics page: where it is by default, reading it once, picking samples out of it.

Shared by the loader (its GPU memory check) and the proxy (which re-exports its own model's series), so both
find the page at the same default address: Triton's host at Triton's default ``--metrics-port`` (8002).
"""

from __future__ import annotations

import http.client
import urllib.parse

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tritonshare.common.errors import TritonUnavailable, clip

TRITON_METRICS_PORT = 8002  # tritonserver --metrics-port default
MAX_PAGE_BYTES = 32 * 1024 * 1024  # Triton's page grows with the number of models; this is far beyond it


def default_metrics_url(triton_url: str) -> str:
    """Triton's metrics page on the host of ``triton_url`` at Triton's default metrics port:
    ``http://tritonshare-triton.tritonshare.svc:8000`` → ``http://tritonshare-triton.tritonshare.svc:8002/metrics``."""
    parsed = urllib.parse.urlsplit(triton_url if "://" in triton_url else f"http://{triton_url}")
    host = parsed.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{TRITON_METRICS_PORT}/metrics"


def fetch_page(url: str, *, timeout_s: float) -> str:
    """The metrics page at ``url`` as text; :class:`TritonUnavailable` when it cannot be read."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TritonUnavailable(f"Triton metrics URL {url!r} is not http(s)://HOST[:PORT]/PATH")
    cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    conn = cls(parsed.hostname, parsed.port, timeout=timeout_s)
    try:
        conn.request("GET", parsed.path or "/metrics", headers={"Accept": "text/plain"})
        reply = conn.getresponse()
        page = reply.read(MAX_PAGE_BYTES + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise TritonUnavailable(f"GET {url}: {exc or type(exc).__name__}") from exc
    finally:
        conn.close()
    if reply.status != 200:
        raise TritonUnavailable(f"GET {url}: HTTP {reply.status}: {clip(page.decode('utf-8', 'replace'))}")
    if len(page) > MAX_PAGE_BYTES:
        raise TritonUnavailable(f"GET {url}: page larger than {MAX_PAGE_BYTES} bytes")
    return page.decode("utf-8", errors="replace")


def samples_named(text: str, names: frozenset[str], *, url: str) -> list[Sample]:
    """Every sample of ``text`` whose name is in ``names``; :class:`TritonUnavailable` when ``text`` is not
    Prometheus text (something else answers at ``url``)."""
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name in names]
    except ValueError as exc:
        raise TritonUnavailable(f"{url} is not a Prometheus metrics page ({exc}) — check the metrics URL") from exc
