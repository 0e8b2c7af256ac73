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

from tritonshare.common.errors import SourceAccessDenied, TransientSourceError, TritonshareError, clip

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload hash of a request without a body
ALGORITHM = "AWS4-HMAC-SHA256"
DEFAULT_REGION = "us-east-1"  # what AWS's SDKs use when none is configured; a bucket elsewhere says so
DENIED_HINT = "check the pod's credentials (AWS_* or IRSA)"
TRUST_HINT = "check the role's trust policy for this service account (and the pod's serviceAccountName)"
TOKEN_HINT = "check the projected token volume and AWS_WEB_IDENTITY_TOKEN_FILE"
# what STS or a throttled SDK answers when a retry later may succeed
_STS_TRANSIENT = frozenset(
    {"Throttling", "ThrottlingException", "RequestLimitExceeded", "ServiceUnavailable", "InternalFailure",
     "IDPCommunicationError"}
)  # fmt: skip

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
        self._role = environ.get("AWS_ROLE_ARN", "")  # for messages: IRSA's role, when set in the environment
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
        try:
            frozen = provider.get_frozen_credentials()  # refreshes temporary credentials when near expiry
        except Exception as exc:  # botocore's chain raises OSError and ClientError as well as its own
            raise self._translate(exc) from exc
        return Credentials(access_key=frozen.access_key, secret_key=frozen.secret_key, token=frozen.token or "")

    def _load(self) -> Any:
        import botocore.exceptions
        import botocore.session

        session = botocore.session.get_session()
        try:
            self._region = session.get_config_variable("region") or ""
            provider = session.get_credentials()
        except Exception as exc:  # botocore's chain raises OSError and ClientError as well as its own
            raise self._translate(exc) from exc
        if provider is None:
            raise SourceAccessDenied(
                f"{self._what}: no usable credentials (none in the environment, the config files or IRSA) — "
                f"{DENIED_HINT}"
            )
        return provider

    def _translate(self, exc: Exception) -> TritonshareError:
        """An error of botocore's credential chain → the error tree: a token file that cannot be read, STS
        refusing the role (IRSA), STS unreachable or throttled (transient), or no usable credentials."""
        from botocore import exceptions as boto

        what, detail = self._what, clip(str(exc))
        role = f"role {self._role}" if self._role else "the role"
        if isinstance(exc, OSError):
            name = exc.filename or "a credentials file"
            reason = exc.strerror or detail
            return SourceAccessDenied(f"{what}: cannot read {name} for credentials ({reason}) — {TOKEN_HINT}")
        if isinstance(exc, boto.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            detail = f"{exc.operation_name}: {code}: {clip(str(error.get('Message', '')))}"
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in _STS_TRANSIENT or status >= 500 or status == 429:
                return TransientSourceError(f"{what}: fetching credentials for {role} failed ({detail})")
            return SourceAccessDenied(f"{what}: STS refused credentials for {role} ({detail}) — {TRUST_HINT}")
        if isinstance(exc, boto.ConnectionError | boto.HTTPClientError):
            return TransientSourceError(
                f"{what}: fetching credentials for {role} failed ({detail}) — check the network to STS "
                "(AWS_ENDPOINT_URL_STS, AWS_STS_REGIONAL_ENDPOINTS)"
            )
        if isinstance(exc, boto.BotoCoreError):
            return SourceAccessDenied(f"{what}: no usable credentials ({detail}) — {DENIED_HINT}")
        raise exc  # not the chain's trouble: a bug, shown as one


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
