"""A minimal Kubernetes API client for agents running in a pod: service-account token, cluster CA, JSON.

Only the standard library: the agents need two calls (GET and PATCH of a node's status), not a client SDK.
The token is read on every request, because projected service-account tokens are rotated by the kubelet.
Failures are translated here, once, into :class:`KubeApiError` subclasses naming what to fix.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonshare.common.errors import TritonshareError, UsageError, clip

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_TOKEN_PATH = SERVICE_ACCOUNT / "token"
DEFAULT_CA_PATH = SERVICE_ACCOUNT / "ca.crt"


class KubeApiError(TritonshareError):
    """The Kubernetes API refused or failed a request."""


class KubeUnavailable(KubeApiError):
    """The API server could not be reached, or the pod has no credentials to talk to it."""


class KubeUnreachable(KubeUnavailable):
    """No answer from the API server (refused, reset, timed out): may pass."""


class KubeBusy(KubeApiError):
    """The API server answered 429 or 5xx: overloaded, or a component behind it is (etcd); may pass."""


class KubeForbidden(KubeApiError):
    """The API server answered 401 or 403: the service account lacks a permission."""


class KubeNotFound(KubeApiError):
    """The object does not exist."""


def in_cluster_url(environ: Mapping[str, str]) -> str | None:
    """The API server URL a pod gets from ``KUBERNETES_SERVICE_HOST``/``_PORT``; None outside a pod."""
    host = environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        return None
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class KubeConfig:
    api_url: str  # https://HOST:PORT (http:// only for tests and local proxies such as `kubectl proxy`)
    token_path: Path | None = DEFAULT_TOKEN_PATH  # None: send no Authorization header
    ca_path: Path | None = DEFAULT_CA_PATH  # None: the system's trust store
    timeout_s: float = 10.0


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def message(self) -> str:
        """The ``message`` of a Kubernetes Status object, or the body cut short."""
        try:
            doc = self.json()
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("message"), str):
            return clip(doc["message"])
        return clip(self.body.decode(errors="replace"))


class KubeClient:
    def __init__(self, config: KubeConfig) -> None:
        parsed = urllib.parse.urlsplit(config.api_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise UsageError(f"Kubernetes API URL {config.api_url!r} is not http(s)://HOST[:PORT]")
        self.config = config
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)

    def get(self, path: str) -> Any:
        return self._document("GET", path, self._checked("GET", path, None, {}))

    def patch(self, path: str, body: Any, content_type: str) -> Any:
        data = json.dumps(body, separators=(",", ":")).encode()
        return self._document("PATCH", path, self._checked("PATCH", path, data, {"Content-Type": content_type}))

    @staticmethod
    def _document(method: str, path: str, response: Response) -> Any:
        """The answer's JSON object (None for an empty body); anything else, such as an HTML page from a proxy
        in the way, is a KubeApiError."""
        if not response.body:
            return None
        try:
            doc = response.json()
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            shown = clip(response.body.decode(errors="replace"))
            raise KubeApiError(f"{method} {path}: the answer is no Kubernetes object ({shown}) — check --kube-api-url")
        return doc

    def _checked(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Response:
        response = self.request(method, path, body, headers)
        if 200 <= response.status < 300:
            return response
        what = f"{method} {path}: HTTP {response.status}: {response.message()}"
        if response.status in (401, 403):
            raise KubeForbidden(what)
        if response.status == 404:
            raise KubeNotFound(what)
        if response.status == 429 or response.status >= 500:
            raise KubeBusy(f"Kubernetes API at {self.config.api_url} answered {what}")
        raise KubeApiError(f"Kubernetes API at {self.config.api_url} answered {what}")

    def request(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]) -> Response:
        all_headers = {"Accept": "application/json", **headers, **self._auth()}
        conn = self._connection()
        try:
            conn.request(method, path, body=body, headers=all_headers)
            reply = conn.getresponse()
            return Response(reply.status, reply.read())
        except ssl.SSLCertVerificationError as exc:  # not worth retrying: the CA does not change
            raise KubeUnavailable(
                f"Kubernetes API at {self.config.api_url}: its certificate is not signed by the CA in "
                f"{self.config.ca_path or 'the system trust store'} ({exc.verify_message}) — check --kube-ca-path"
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise KubeUnreachable(
                f"Kubernetes API at {self.config.api_url} did not answer {method} {path}: {exc} — "
                "check that this runs in a pod (KUBERNETES_SERVICE_HOST) or that --kube-api-url is right"
            ) from exc
        finally:
            conn.close()

    def _auth(self) -> dict[str, str]:
        path = self.config.token_path
        if path is None:
            return {}
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise KubeUnavailable(
                f"no service-account token at {path} ({exc.strerror}) — "
                "the pod needs automountServiceAccountToken: true, or pass --kube-token-path"
            ) from exc
        return {"Authorization": f"Bearer {token}"}

    def _connection(self) -> http.client.HTTPConnection:
        timeout = self.config.timeout_s
        if not self._https:
            return http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._tls())

    def _tls(self) -> ssl.SSLContext:
        ca = self.config.ca_path
        try:
            return ssl.create_default_context(cafile=str(ca) if ca is not None else None)
        except (OSError, ssl.SSLError) as exc:
            raise KubeUnavailable(
                f"cannot load the cluster CA from {ca}: {exc} — pass --kube-ca-path, or mount the "
                "service-account volume"
            ) from exc
