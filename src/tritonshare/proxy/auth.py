"""Optional bearer-token authentication of tenant callers (``--auth-token-file PATH``, issue 9).

The file is a mounted Kubernetes Secret holding one or more tokens, one per line (LF or CRLF); blank lines and
lines starting with ``#`` are ignored, and so is a UTF-8 byte order mark at its start (Windows editors write
one: it would otherwise make the first token a line that is not a token). Several tokens allow rotation without
downtime: add the new token, roll the clients, remove the old one. The file is re-read when it changes, checked
at most once per ``check_interval_s`` on the request path with one ``stat`` (no thread, no timer). ``os.stat``
follows symlinks, so the identity watched is the resolved target's: a Secret volume publishes an update by
swapping its ``..data`` symlink to a new folder, which gives the file a new inode even when its size and mtime
match.

A caller presents ``Authorization: Bearer <token>`` (REST) or the gRPC metadata ``authorization: Bearer
<token>`` (tritonclient: ``headers={"authorization": "Bearer …"}``). Tokens are compared in constant time:
the presented token's SHA-256 against each configured token's, with :func:`hmac.compare_digest`, every token
every time (no early exit, no length leak). Refusals are 401 with ``WWW-Authenticate: Bearer`` (REST) or
UNAUTHENTICATED (gRPC), and never say which part was wrong.

Open without a token (policy route labels, :mod:`tritonshare.proxy.policy`):

- REST ``/v2/health/live`` and ``/v2/health/ready``: kubelet probes cannot read a Secret.
- gRPC ``grpc.health.v1.Health/Check``, ``ServerLive`` and ``ServerReady``: the gRPC twins of the REST
  probes (kubelet's gRPC probe and grpc_health_probe send no metadata). They answer only "is the proxy up /
  is MY model served" (ServerReady is rewritten to the own model's readiness), so keeping them open reveals
  nothing the open REST probes do not, and keeps the two protocols symmetrical.
- The metrics port (a separate server) carries counts only and is scraped by Prometheus without a token.

Everything else needs a token, including server and model metadata. Front ends authenticate after judging
the route (to know whether it is open) but before acting on the verdict, so an unauthenticated caller
learns nothing about routes beyond "401".
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tritonshare.common.errors import UsageError

logger = logging.getLogger(__name__)

HTTP_STATUS = 401
GRPC_STATUS = 16  # UNAUTHENTICATED
WWW_AUTHENTICATE = b'Bearer realm="tritonshare"'  # the REST refusal's challenge header value (RFC 6750 §3)
MESSAGE = "missing or invalid bearer token"  # the same words whatever was wrong

OPEN_REST_ROUTES = frozenset({"health_live", "health_ready"})
OPEN_GRPC_ROUTES = frozenset({"HealthCheck", "ServerLive", "ServerReady"})

_BEARER = b"bearer"
_BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark
# The most a Kubernetes Secret holds; a larger file is not a Secret of tokens (and each check hashes against all)
MAX_FILE_BYTES = 1 << 20
_FileIdentity = tuple[int, int, int, int, int]


class BearerTokens:
    """The tokens of one ``--auth-token-file``; :meth:`check_http` / :meth:`check_grpc` per request."""

    def __init__(
        self,
        path: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        check_interval_s: float = 1.0,
        registry: CollectorRegistry | None = None,
        model: str = "",
    ) -> None:
        """``registry``: where the token metrics are exported, labelled ``model`` (the proxy's own model)."""
        self.path = path
        self._clock = clock
        self._interval_s = check_interval_s
        self._next_check = clock() + check_interval_s
        self._digests: tuple[bytes, ...] = ()
        self.generation = 0  # counts the loads of the file: a verdict stamped with an older one no longer holds
        self._identity: _FileIdentity | None = None
        self._trouble = ""  # the last read problem logged, so a lasting one is logged once
        self.stats = {"reloads": 0, "reload_errors": 0, "missing": 0, "invalid": 0}
        self._load_at_start()
        if registry is not None:
            registry.register(AuthCollector(self, model))

    @property
    def count(self) -> int:
        return len(self._digests)

    def check_http(self, authorization: bytes | None) -> bool:
        """The value of the request's ``Authorization`` header (None when absent) carries a valid token."""
        return self._check(authorization)

    def check_grpc(self, metadata_value: bytes | None) -> bool:
        """The value of the call's ``authorization`` metadata (None when absent) carries a valid token."""
        return self._check(metadata_value)

    def current(self) -> int:
        """The :attr:`generation` of the tokens in force, after looking at the file if it is time to (as every
        check does). A front end may keep "this exact presented value is valid" stamped with the generation it
        was checked under, and take the stamp for the check while it equals this: a reload changes it, so a
        revoked token is refused from the first request after the reload, as with a full check."""
        if self._clock() >= self._next_check:
            self._refresh()
        return self.generation

    def _check(self, value: bytes | None) -> bool:
        if self._clock() >= self._next_check:
            self._refresh()
        token = _bearer_token(value)
        if token is None:
            self.stats["missing"] += 1
            return False
        digest = hashlib.sha256(token).digest()
        valid = False
        for known in self._digests:  # every token, every time: the time taken says nothing
            valid |= hmac.compare_digest(digest, known)
        if not valid:
            self.stats["invalid"] += 1
        return valid

    # ------------------------------------------------------------------ the token file

    def _load_at_start(self) -> None:
        try:
            identity, tokens, skipped = _read(self.path)
        except OSError as exc:
            raise UsageError(
                f"--auth-token-file {self.path}: cannot read it ({exc.strerror or exc}) — mount the Secret "
                "holding the tokens there, or drop the option"
            ) from exc
        if skipped:
            raise UsageError(f"--auth-token-file {self.path}: {_skipped_words(skipped)}")
        if not tokens:
            raise UsageError(
                f"--auth-token-file {self.path}: no token in it (one per line; blank lines and # comments "
                "are ignored) — put at least one token in the Secret"
            )
        self._install(identity, tokens)

    def _refresh(self) -> None:
        """At most once per interval: stat the file (following symlinks); re-read it if it changed."""
        self._next_check = self._clock() + self._interval_s
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            self._report(f"cannot stat it ({exc.strerror or exc}); keeping the {self.count} tokens loaded")
            return
        if _identity(stat) == self._identity:
            return
        try:
            identity, tokens, skipped = _read(self.path)
        except OSError as exc:
            self._report(f"cannot read it ({exc.strerror or exc}); keeping the {self.count} tokens loaded")
            return
        self._trouble = ""
        if skipped:
            logger.error("--auth-token-file %s: %s", self.path, _skipped_words(skipped))
        if not tokens:
            logger.error("--auth-token-file %s: no token left in it; every request needing one is refused", self.path)
        self._install(identity, tokens)
        self.stats["reloads"] += 1
        logger.info("auth tokens reloaded from %s: %d tokens", self.path, len(tokens))

    def _install(self, identity: _FileIdentity, tokens: list[bytes]) -> None:
        self._identity = identity
        self._digests = tuple(hashlib.sha256(token).digest() for token in tokens)
        self.generation += 1

    def _report(self, problem: str) -> None:
        self.stats["reload_errors"] += 1
        if problem != self._trouble:
            self._trouble = problem
            logger.warning("--auth-token-file %s: %s", self.path, problem)


def _bearer_token(value: bytes | None) -> bytes | None:
    """The token of ``Bearer <token>`` (scheme case-insensitive, RFC 7235 §2.1), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != _BEARER or not token:
        return None
    return token


def _read(path: Path) -> tuple[_FileIdentity, list[bytes], list[int]]:
    """(file identity, tokens, numbers of the lines that are not tokens). One open, so the identity and the
    content are of the same file even if a symlink swap happens meanwhile."""
    with open(path, "rb") as fh:
        identity = _identity(os.fstat(fh.fileno()))
        text = fh.read(MAX_FILE_BYTES + 1)
    if len(text) > MAX_FILE_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_FILE_BYTES} bytes, the most a Kubernetes Secret holds")
    text = text.removeprefix(_BOM)
    tokens: list[bytes] = []
    skipped: list[int] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        if _is_token(line):
            tokens.append(line)
        else:
            skipped.append(number)
    return identity, tokens, skipped


def _is_token(line: bytes) -> bool:
    # Visible ASCII only: a header value carrying a space or a control character could never match it.
    return all(0x21 <= byte <= 0x7E for byte in line)


def _skipped_words(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:10])
    return f"line(s) {shown} are not tokens (spaces, control or non-ASCII characters) and are ignored — fix the Secret"


def _identity(stat: os.stat_result) -> _FileIdentity:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


class AuthCollector(Collector):
    """Exports the token count and the reload and refusal counters, read at scrape time, labelled with the
    proxy's model like its other families (a node-wide Prometheus tells the tenants apart by it)."""

    def __init__(self, tokens: BearerTokens, model: str) -> None:
        self._tokens = tokens
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats, model = self._tokens.stats, self._model
        loaded = GaugeMetricFamily(
            "tritonshare_proxy_auth_tokens", "Bearer tokens loaded from the token file.", labels=["model"]
        )
        loaded.add_metric([model], self._tokens.count)
        yield loaded
        reloads = CounterMetricFamily(
            "tritonshare_proxy_auth_reloads", "Reloads of the changed token file.", labels=["model"]
        )
        reloads.add_metric([model], stats["reloads"])
        yield reloads
        errors = CounterMetricFamily(
            "tritonshare_proxy_auth_reload_errors",
            "Checks of the token file that could not stat or read it.",
            labels=["model"],
        )
        errors.add_metric([model], stats["reload_errors"])
        yield errors
        refused = CounterMetricFamily(
            "tritonshare_proxy_auth_refused",
            "Requests refused for want of a valid token: missing (no Bearer token) or invalid (unknown token).",
            labels=["model", "reason"],
        )
        refused.add_metric([model, "missing"], stats["missing"])
        refused.add_metric([model, "invalid"], stats["invalid"])
        yield refused
