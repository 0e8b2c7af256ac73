"""Triton's own metrics, cut down to the proxy's own model, for the proxy's ``/metrics``.

Triton's metrics port serves every tenant's series (and server-wide ones) on one page, so the proxy never
exposes it (REFERENCE §3). Instead, at scrape time, it reads that page (short timeout, small cache), parses
it (``prometheus_client.parser``), and re-exports only the series whose ``model`` label is its own model. The
page is every tenant's, so it is sifted as it is read (:func:`own_model_lines`): only lines that may be the
own model's are held and parsed (an 8 MiB page: under 4 MiB held and 0.1 s, where the whole page took 51 MiB
and 1.6 s). A PodMonitor on model pods then gives per-model ``nv_inference_queue_duration_us``,
``nv_inference_request_success`` and so on — what a per-model HPA scales on — and nothing of other tenants.

The result is Prometheus text rendered here rather than a ``prometheus_client`` Collector on purpose: the
client library renames every counter to ``<name>_total`` on output, and the series must keep Triton's own
names so NVIDIA's dashboards and autoscaling rules work unchanged.

Fetching blocks for up to ``timeout_s`` for the whole page (plus as much to connect): call
:meth:`TritonModelMetrics.exposition` off the event loop (``asyncio.to_thread``). A failed scrape yields only
``tritonshare_proxy_triton_metrics_up 0``.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tritonshare.common.errors import TritonUnavailable
from tritonshare.common.triton_metrics_page import default_metrics_url, fetch_page

logger = logging.getLogger(__name__)

OURS = "tritonshare_"  # the proxy's own series' prefix, never Triton's
UP = OURS + "proxy_triton_metrics_up"

_TYPE_LINE = re.compile(r"^#\s+TYPE\s+(\S+)\s+counter\s*$", re.MULTILINE)


default_url = default_metrics_url  # Triton's host, port 8002 (shared with the loader's GPU check)


class ScrapeError(Exception):
    """Triton's metrics page could not be read or parsed (internal: reported as ``up 0``, never raised)."""


class TritonModelMetrics:
    """The own model's series from Triton's metrics page, re-read at most every ``ttl_s`` seconds."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        timeout_s: float = 1.0,
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"Triton metrics URL {url!r} is not http(s)://HOST[:PORT]/PATH")
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: bytes | None = None
        self._expires = 0.0
        self._up = True

    def exposition(self) -> bytes:
        """Prometheus text (format 0.0.4) of the own model's Triton series plus the ``up`` gauge."""
        with self._lock:  # concurrent scrapes share one fetch
            if self._cached is None or self._clock() >= self._expires:
                self._cached = self._scrape()
                # Kept from when the answer came: scrapes that waited for a slow one take it, not a fetch each.
                self._expires = self._clock() + self.ttl_s
            return self._cached

    def _scrape(self) -> bytes:
        try:
            body = own_model_series(self._fetch(), self.model)
        except ScrapeError as exc:
            self._report(False, str(exc))
            return up_gauge(self.model, False).encode()
        self._report(True, "")
        return (body + up_gauge(self.model, True)).encode()

    def _fetch(self) -> str:
        try:
            return fetch_page(
                self.url, timeout_s=self.timeout_s, sieve=functools.partial(own_model_lines, model=self.model)
            )
        except TritonUnavailable as exc:
            raise ScrapeError(str(exc)) from exc

    def _report(self, up: bool, reason: str) -> None:
        """Log changes of state only: a scrape every 15 s must not repeat the same warning forever."""
        if up and not self._up:
            logger.info("Triton metrics at %s readable again", self.url)
        elif not up and self._up:
            logger.warning(
                "Triton metrics for model %s unavailable (%s) — check --triton-metrics-url", self.model, reason
            )
        self._up = up


def own_model_lines(lines: Iterable[bytes], model: str) -> Iterator[bytes]:
    """The lines of Triton's page that may hold a series of ``model``, each after the HELP and TYPE lines of its
    family; the rest is dropped as it is read (the page is every tenant's and may be large).

    A superset, cheap to find: a sample line is kept when it holds ``"MODEL"`` (escaped as in the exposition
    format) anywhere, which every line whose ``model`` label is MODEL does; :func:`own_model_series` then
    parses what is kept and checks that it is the ``model`` label's value. Other comments are dropped."""
    quoted = f'"{_escape_label(model)}"'.encode()
    header: dict[bytes, bytes] = {}  # HELP and TYPE of the family being read
    family = b""  # its name
    shown = False
    for line in lines:
        if line.startswith(b"#"):
            words = line.split(None, 3)
            if len(words) < 3 or words[1] not in (b"HELP", b"TYPE"):
                continue
            if words[2] != family:  # a HELP or TYPE of another name begins the next family
                header, family = {}, words[2]
            header[words[1]] = line if line.endswith(b"\n") else line + b"\n"
            shown = False
        elif line.strip():
            if quoted in line:
                if not shown:
                    yield from (header[kind] for kind in (b"HELP", b"TYPE") if kind in header)
                    shown = True
                yield line if line.endswith(b"\n") else line + b"\n"


def own_model_series(text: str, model: str) -> str:
    """The families of ``text`` reduced to samples whose ``model`` label equals ``model``, as text.

    Series named like the proxy's own (``tritonshare_*``) are dropped: Triton names none so, and any tenant's
    Python model can add series of any name and labels to Triton's page (its custom metrics API), which here
    would have posed as the proxy's own (a second ``tritonshare_proxy_triton_metrics_up``, say, reading 1)."""
    counters = set(_TYPE_LINE.findall(text))
    out: list[str] = []
    try:
        for family in text_string_to_metric_families(text):
            samples = [s for s in family.samples if s.labels.get("model") == model and not s.name.startswith(OURS)]
            if samples:
                out.extend(_family(family.name, family.type, family.documentation, samples, counters))
    except ValueError as exc:
        raise ScrapeError(f"Triton's metrics page is not Prometheus text: {exc}") from exc
    return "".join(out)


def up_gauge(model: str, up: bool) -> str:
    return (
        f"# HELP {UP} Whether the proxy could read Triton's metrics for its model at the last scrape.\n"
        f"# TYPE {UP} gauge\n"
        f'{UP}{{model="{_escape_label(model)}"}} {1.0 if up else 0.0}\n'
    )


def _family(name: str, kind: str, help_text: str, samples: list[Sample], counters: set[str]) -> Iterable[str]:
    # The parser turns a counter `x` into family `x` with samples `x_total`; give Triton's names back.
    declared = name + "_total" if kind == "counter" and name + "_total" in counters else name
    kind = "untyped" if kind == "unknown" else kind
    yield f"# HELP {declared} {_escape_help(help_text)}\n# TYPE {declared} {kind}\n"
    for sample in samples:
        sample_name = sample.name
        if kind == "counter" and declared == name and sample_name == name + "_total":
            sample_name = name
        yield _sample_line(sample_name, sample)


def _sample_line(name: str, sample: Sample) -> str:
    labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels.items())
    line = f"{name}{{{labels}}} {_number(sample.value)}"
    if sample.timestamp is not None:
        line += f" {int(float(sample.timestamp) * 1000)}"
    return line + "\n"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")
