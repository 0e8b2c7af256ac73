"""Who the loader is to S3, and the AWS Signature Version 4 that proves it on each request.

Credentials follow AWS's standard chain. Its first link — ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
(+ ``AWS_SESSION_TOKEN``) in the environment, what a Kubernetes Secret provides — is read here directly;
only when it is absent is botocore imported (≈0.15 s of CPU) for the rest of the chain: IRSA web identity,
shared config and credentials files with their profiles and SSO, ECS and EC2 instance metadata. botocore's
credentials refresh themselves; they are asked again for each request.

Signing is the SigV4 header scheme for a request without a body (AWS "Authenticating Requests: Using the
Authorization Header"), checked against AWS's published examples in the tests. The derived signing key is
cached per secret, day and region, so a request costs two SHA-256 and one HMAC.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tritonshare.common.errors import SourceAccessDenied, clip

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload hash of a request without a body
ALGORITHM = "AWS4-HMAC-SHA256"
DEFAULT_REGION = "us-east-1"  # what AWS's SDKs use when none is configured; a bucket elsewhere says so
DENIED_HINT = "check the pod's credentials (AWS_* or IRSA)"

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True, kw_only=True)
class Credentials:
    access_key: str
    secret_key: str
    token: str = ""  # a session token (STS): sent as x-amz-security-token

    def __repr__(self) -> str:  # never print a secret into a log or a traceback
        return f"Credentials(access_key={self.access_key!r}, secret_key=***, token={'***' if self.token else ''!r})"


def from_environment(environ: Mapping[str, str]) -> Credentials | None:
    key, secret = environ.get("AWS_ACCESS_KEY_ID", ""), environ.get("AWS_SECRET_ACCESS_KEY", "")
    if not key or not secret:
        return None
    return Credentials(access_key=key, secret_key=secret, token=environ.get("AWS_SESSION_TOKEN", ""))


class CredentialChain:
    """The environment first; else botocore's chain, loaded on first use. Thread-safe."""

    def __init__(self, environ: Mapping[str, str], what: str) -> None:
        self._static = from_environment(environ)
        self._what = what  # the URI, for messages
        self._provider: Any = None
        self._region = ""
        self._lock = threading.Lock()

    @property
    def static(self) -> bool:
        """True when the environment holds the keys, so botocore is never loaded."""
        return self._static is not None

    def region(self) -> str:
        """The region from the shared config file (``AWS_PROFILE``'s), when botocore was loaded; else ""."""
        self.get()
        return self._region

    def get(self) -> Credentials:
        """Current credentials; raises SourceAccessDenied when the chain has none."""
        if self._static is not None:
            return self._static
        with self._lock:
            if self._provider is None:
                self._provider = self._load()
            provider = self._provider
        return _frozen(provider, self._what)

    def _load(self) -> Any:
        import botocore.exceptions
        import botocore.session

        session = botocore.session.get_session()
        try:
            self._region = session.get_config_variable("region") or ""
            provider = session.get_credentials()
        except botocore.exceptions.BotoCoreError as exc:
            raise SourceAccessDenied(f"{self._what}: no usable credentials ({clip(str(exc))}) — {DENIED_HINT}") from exc
        if provider is None:
            raise SourceAccessDenied(
                f"{self._what}: no usable credentials (none in the environment, the config files or IRSA) — "
                f"{DENIED_HINT}"
            )
        return provider


def _frozen(provider: Any, what: str) -> Credentials:
    import botocore.exceptions

    try:
        frozen = provider.get_frozen_credentials()  # refreshes temporary credentials when near expiry
    except botocore.exceptions.BotoCoreError as exc:
        raise SourceAccessDenied(f"{what}: no usable credentials ({clip(str(exc))}) — {DENIED_HINT}") from exc
    return Credentials(access_key=frozen.access_key, secret_key=frozen.secret_key, token=frozen.token or "")


class Signer:
    """SigV4 for one region and service. Thread-safe; cheap to call per request."""

    def __init__(self, region: str, *, service: str = "s3", clock: Clock = utc_now) -> None:
        self.region = region
        self.service = service
        self._clock = clock
        self._keys: dict[tuple[str, str], bytes] = {}  # (secret, day) → signing key
        self._lock = threading.Lock()

    def sign(
        self, method: str, path: str, query: str, headers: Mapping[str, str], credentials: Credentials
    ) -> dict[str, str]:
        """The headers to send: ``headers`` (which must hold ``host``; all of them are signed) plus
        ``x-amz-date``, ``x-amz-content-sha256``, the session token if any, and ``Authorization``.
        ``path`` is the URI-encoded path as sent, ``query`` the canonical query (sorted, encoded)."""
        stamp = self._clock().strftime("%Y%m%dT%H%M%SZ")
        signed = {name.lower(): " ".join(str(value).split()) for name, value in headers.items()}
        signed |= {"x-amz-date": stamp, "x-amz-content-sha256": EMPTY_SHA256}
        if credentials.token:
            signed["x-amz-security-token"] = credentials.token
        names = sorted(signed)
        canonical = "\n".join(
            [method, path, query, *(f"{name}:{signed[name]}" for name in names), "", ";".join(names), EMPTY_SHA256]
        )
        scope = f"{stamp[:8]}/{self.region}/{self.service}/aws4_request"
        to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        key = self._signing_key(credentials.secret_key, stamp[:8])
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        signed["authorization"] = (
            f"{ALGORITHM} Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return signed

    def _signing_key(self, secret: str, day: str) -> bytes:
        with self._lock:
            key = self._keys.get((secret, day))
            if key is None:
                key = ("AWS4" + secret).encode()
                for part in (day, self.region, self.service, "aws4_request"):
                    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
                self._keys = {(secret, day): key}  # one day's key at a time
            return key
