"""A small synchronous client for the Triton HTTP endpoints tritonshare itself uses.

Only the standard library: the proxy imports this too, and every proxy pod pays for its imports.
Endpoints (KServe v2 + Triton's repository extension):
``GET /v2/health/live``, ``GET /v2/models/{m}/ready``, ``POST /v2/repository/index``,
``POST /v2/repository/models/{m}/load|unload`` (explicit mode only; POLL refuses them).
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.parse
from dataclasses import dataclass
from typing import Any

from tritonshare.common.errors import TritonUnavailable, UsageError, clip

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ModelState:
    """One entry of Triton's repository index."""

    name: str
    version: str = ""
    state: str = ""  # "" (known, never loaded) | UNKNOWN | READY | UNAVAILABLE | LOADING | UNLOADING
    reason: str = ""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def error_text(self) -> str:
        try:
            doc = self.json()
        except ValueError:
            return clip(self.body.decode(errors="replace"))
        if isinstance(doc, dict) and "error" in doc:
            return clip(str(doc["error"]))
        return clip(self.body.decode(errors="replace"))


class TritonClient:
    """Blocking calls to Triton's HTTP API with a per-call timeout; connection failures raise
    :class:`TritonUnavailable` naming the URL."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        parsed = _split(url)
        self.url = url
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname or ""
        self._port = parsed.port or (443 if self._https else 80)
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: bytes | None = None) -> Reply:
        conn_cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = conn_cls(self._host, self._port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return Reply(resp.status, resp.read())
        except (OSError, http.client.HTTPException) as exc:
            raise TritonUnavailable(
                f"Triton at {self.url} did not answer {method} {path}: {exc} — "
                "check that the node's Triton is running and --triton-url points at it"
            ) from exc
        finally:
            conn.close()

    def server_live(self) -> bool:
        return self.request("GET", "/v2/health/live").status == 200

    def model_ready(self, name: str) -> bool:
        return self.request("GET", f"/v2/models/{_quote(name)}/ready").status == 200

    def repository_index(self) -> list[ModelState]:
        reply = self.request("POST", "/v2/repository/index", b"{}")
        if reply.status != 200:
            raise TritonUnavailable(
                f"Triton at {self.url} refused the repository index ({reply.status}: {reply.error_text()})"
            )
        return [
            ModelState(
                name=str(e.get("name", "")),
                version=str(e.get("version", "")),
                state=str(e.get("state", "")),
                reason=str(e.get("reason", "")),
            )
            for e in reply.json() or []
        ]

    def model_states(self, name: str) -> list[ModelState]:
        """Index entries of one model (one per version Triton knows; a name-only entry if never loaded)."""
        return [s for s in self.repository_index() if s.name == name]

    def load(self, name: str) -> Reply:
        return self.request("POST", f"/v2/repository/models/{_quote(name)}/load", b"{}")

    def unload(self, name: str) -> Reply:
        return self.request("POST", f"/v2/repository/models/{_quote(name)}/unload", b"{}")


def check_triton_url(url: str) -> str:
    """``url`` if it can name Triton's HTTP endpoint (``http(s)://HOST[:PORT]``, or ``HOST:PORT``); else
    UsageError (exit 2) saying what is wrong."""
    _split(url)
    return url


def check_host_port(address: str, what: str = "Triton's gRPC endpoint") -> str:
    """``address`` if it is ``HOST:PORT`` (``[v6]:PORT`` too); else UsageError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{what} {address!r} is not HOST:PORT (e.g. 127.0.0.1:8001)")
    return address


def _split(url: str) -> urllib.parse.SplitResult:
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1 or port == 0:
        raise UsageError(f"Triton URL {url!r} is not http(s)://HOST[:PORT] (e.g. http://127.0.0.1:8000)")
    return parsed


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")
