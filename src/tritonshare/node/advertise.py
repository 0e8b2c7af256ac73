"""``tritonshare advertise``: publish the node's GPU memory as an extended resource the scheduler counts.

Model pods request ``tritonshare.io/gpu-memory: N`` (MiB); the stock kube-scheduler then never places more
models on a node than its Triton's GPUs hold. The value goes into the node's status the documented way
(Kubernetes task "Advertise Extended Resources for a Node"): a JSON patch of ``/status/capacity`` through
``PATCH /api/v1/nodes/{node}/status``, with ``/`` in the resource name escaped as ``~1`` (RFC 6901).
``/status/allocatable`` is patched in the same request so the resource is schedulable at once; the kubelet
copies capacity into allocatable on its next status update anyway.

Re-runs are idempotent: the node's status is read first and nothing is written when it already holds the
value. An unreachable or busy (429, 5xx) API server is retried for ``retry_for_s`` before giving up. With
``interval_s`` the agent stays up as a sidecar and re-advertises (a re-registered node loses extended
resources it did not get from a device plugin).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
import urllib.parse
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tritonshare.common.errors import ExitCode, UsageError
from tritonshare.node.gpu import FixedMemory, GpuMemoryReader, NvmlMemory
from tritonshare.node.kube import (
    KubeApiError,
    KubeBusy,
    KubeClient,
    KubeConfig,
    KubeForbidden,
    KubeNotFound,
    KubeUnreachable,
)

logger = logging.getLogger(__name__)

DEFAULT_RESOURCE = "tritonshare.io/gpu-memory"
JSON_PATCH = "application/json-patch+json"
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0  # backoff of the first advertising's retries
RBAC_HINT = (
    "the pod's service account needs get and patch on nodes/status "
    "(ClusterRole tritonshare-advertise in k8s/components/advertise)"
)

# An extended resource is a fully qualified name outside the kubernetes.io domains: DOMAIN/NAME.
_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True, kw_only=True)
class AdvertiseSettings:
    node_name: str
    kube: KubeConfig
    resource: str = DEFAULT_RESOURCE
    gpu_memory_mib: int | None = None  # None: read with NVML; set it for MIG and vGPU slices
    reserve_mib: int = 0  # kept back for Triton itself (CUDA context, pinned buffers)
    interval_s: float = 0.0  # 0: advertise once and exit (init container); > 0: re-advertise (sidecar)
    retry_for_s: float = 60.0  # the first advertising retries an unreachable or busy API server this long


def check_resource(name: str) -> str:
    domain = name.partition("/")[0]
    if not _RESOURCE.fullmatch(name) or domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise UsageError(
            f"{name!r} is not an extended resource name: use DOMAIN/NAME outside kubernetes.io, e.g. {DEFAULT_RESOURCE}"
        )
    return name


def json_pointer(*tokens: str) -> str:
    """RFC 6901: '~' becomes '~0' and '/' becomes '~1' inside a reference token."""
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


def patch_for(resource: str, mib: int) -> list[dict[str, str]]:
    return [
        {"op": "add", "path": json_pointer("status", field, resource), "value": str(mib)}
        for field in ("capacity", "allocatable")
    ]


def status_path(node_name: str) -> str:
    return f"/api/v1/nodes/{urllib.parse.quote(node_name, safe='')}/status"


class Advertiser:
    """Reads the GPU memory and writes it into one node's status."""

    def __init__(
        self, settings: AdvertiseSettings, *, reader: GpuMemoryReader | None = None, client: KubeClient | None = None
    ) -> None:
        self.settings = settings
        self.resource = check_resource(settings.resource)
        self.reader = reader or _default_reader(settings)
        self.client = client or KubeClient(settings.kube)

    def mib(self) -> int:
        """The figure to advertise: GPU memory minus the reserve."""
        total = self.reader.total_mib()
        value = total - self.settings.reserve_mib
        if value <= 0:
            raise UsageError(
                f"--reserve-mib {self.settings.reserve_mib} leaves nothing of the node's {total} MiB of GPU memory"
            )
        return value

    def once(self) -> bool:
        """Advertise; True if the node's status was patched, False if it already held the value."""
        mib = self.mib()
        node = self.settings.node_name
        try:
            if self._advertised(mib):
                logger.info("node %s already advertises %s=%d MiB; nothing to do", node, self.resource, mib)
                return False
            self.client.patch(status_path(node), patch_for(self.resource, mib), JSON_PATCH)
        except KubeForbidden as exc:
            raise KubeForbidden(f"node {node}: {exc} — {RBAC_HINT}") from exc
        except KubeNotFound as exc:
            raise KubeNotFound(
                f"node {node} not found ({exc}) — --node-name must be the pod's spec.nodeName (downward API)"
            ) from exc
        logger.info("node %s now advertises %s=%d MiB", node, self.resource, mib)
        return True

    def _advertised(self, mib: int) -> bool:
        status = (self.client.get(status_path(self.settings.node_name)) or {}).get("status") or {}
        wanted = Decimal(mib)
        return all(_quantity(status, field, self.resource) == wanted for field in ("capacity", "allocatable"))


def run(
    settings: AdvertiseSettings,
    *,
    reader: GpuMemoryReader | None = None,
    client: KubeClient | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Advertise once, or every ``interval_s`` until ``stop`` (SIGTERM by default) is set."""
    advertiser = Advertiser(settings, reader=reader, client=client)
    _first(advertiser, settings.retry_for_s)
    if settings.interval_s <= 0:
        return ExitCode.OK
    stop = stop or _stop_on_sigterm()
    while not stop.wait(settings.interval_s):
        try:
            advertiser.once()
        except (KubeForbidden, KubeNotFound):
            raise  # a permission or a node gone: waiting will not fix it
        except KubeApiError as exc:  # unreachable, 5xx, conflicts: the next round may succeed
            logger.warning("re-advertising failed, trying again in %.0fs: %s", settings.interval_s, exc)
    return ExitCode.OK


def _first(advertiser: Advertiser, retry_for_s: float) -> None:
    """Advertise, retrying an API server that is unreachable or busy for ``retry_for_s``, with backoff.

    Worth waiting for: as an init container with ``--best-effort``, a failure here leaves the node without
    the resource until Triton's pod restarts, and every model pod that requests it unschedulable there;
    a pod's first seconds (its NetworkPolicy not yet in force on some CNIs) or an API server busy with
    nodes that boot together are such failures. Permissions and a wrong node name are not retried."""
    deadline = time.monotonic() + retry_for_s
    delay_s = RETRY_FIRST_S
    while True:
        try:
            advertiser.once()
            return
        except (KubeUnreachable, KubeBusy) as exc:
            if time.monotonic() + delay_s > deadline:
                raise
            logger.warning("advertising failed, trying again in %.1fs: %s", delay_s, exc)
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, RETRY_MAX_S)


def _default_reader(settings: AdvertiseSettings) -> GpuMemoryReader:
    if settings.gpu_memory_mib is not None:
        return FixedMemory(settings.gpu_memory_mib)
    return NvmlMemory()


def _stop_on_sigterm() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: stop.set())
    return stop


# Kubernetes quantities (apimachinery resource.Quantity): the API server returns them canonicalised, so
# "16000" comes back as "16k"; compare values, never strings.
_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
    **{s + "i": Decimal(1024) ** (i + 1) for i, s in enumerate("KMGTPE")},
    **{s: Decimal(1000) ** -(i + 1) for i, s in enumerate("mun")},
}
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|([a-zA-Z]*))")


def parse_quantity(text: str) -> Decimal | None:
    """A Kubernetes quantity as a number; None if it is not one."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        return None
    number, exponent, suffix = Decimal(match[1]), match[2], match[3] or ""
    if exponent is not None:
        return number.scaleb(int(exponent))
    return number * _SUFFIXES[suffix] if suffix in _SUFFIXES else None


def _quantity(status: dict[str, Any], field: str, resource: str) -> Decimal | None:
    value = (status.get(field) or {}).get(resource)
    return parse_quantity(value) if isinstance(value, str) else None
