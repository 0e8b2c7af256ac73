"""Whether Triton's GPUs have room for a model, checked before it is published (``--require-gpu-memory-mib``).

Placement is the scheduler's job (``tritonshare.io/gpu-memory`` requests against what ``tritonshare advertise``
put on the node); this check is the last look before Triton is asked to load: free memory is read from
Triton's own metrics page, per GPU ``nv_gpu_memory_total_bytes - nv_gpu_memory_used_bytes`` (label
``gpu_uuid``), and the model must fit on ONE of the GPUs Triton uses: a model instance lives on one GPU, so
two GPUs with 3 GiB free each do not hold a 5 GiB model.

Exit codes, and why:

- not enough free memory → :class:`InsufficientSpace` (15), like too little disk: the model does not fit on
  this node now; the cure is another node or freeing memory.
- no GPU series on the page → 15 too: Triton reports zero GPU memory (no GPU, or ``--allow-gpu-metrics=false``),
  so the model's request is not met here; the message says how to turn the check off.
- the page cannot be read → :class:`TritonUnavailable` (16), the tree's code for "Triton's API cannot be
  reached". Not 13: the loader's 13 is a deadline that passed while waiting for Triton, and here Triton's
  HTTP API has just answered live, so an unreadable metrics page is a wrong ``--triton-metrics-url`` or
  metrics turned off (``--allow-metrics=false``) — node configuration that waiting would not cure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from tritonshare.common.errors import InsufficientSpace, TritonUnavailable
from tritonshare.common.triton_metrics_page import default_metrics_url, fetch_page, samples_named
from tritonshare.loader.settings import LoaderSettings

logger = logging.getLogger(__name__)

MIB = 1 << 20
TOTAL = "nv_gpu_memory_total_bytes"
USED = "nv_gpu_memory_used_bytes"
METRICS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class GpuMemory:
    """GPU memory Triton reports: totals over its GPUs, and the freest GPU's free memory."""

    gpus: int
    total_bytes: float
    free_bytes: float  # over all GPUs
    largest_free_bytes: float  # on the freest GPU: what one model instance can use


def read_gpu_memory(url: str, *, timeout_s: float = METRICS_TIMEOUT_S) -> GpuMemory:
    """Triton's GPU memory from its metrics page at ``url``."""
    totals: dict[str, float] = {}
    used: dict[str, float] = {}
    for sample in samples_named(fetch_page(url, timeout_s=timeout_s), frozenset({TOTAL, USED}), url=url):
        (totals if sample.name == TOTAL else used)[sample.labels.get("gpu_uuid", "")] = sample.value
    # A GPU whose used series is missing counts as full: the check must never promise memory it cannot see.
    free = [max(0.0, total - used.get(gpu, total)) for gpu, total in totals.items()]
    return GpuMemory(
        gpus=len(totals),
        total_bytes=sum(totals.values()),
        free_bytes=sum(free),
        largest_free_bytes=max(free, default=0),
    )


def metrics_url(settings: LoaderSettings) -> str:
    """The metrics page: ``--triton-metrics-url`` (``/metrics`` added to a URL with no path, as Triton serves
    it there and answers any other path too), else Triton's host on port 8002."""
    url = settings.triton_metrics_url
    if not url:
        return default_metrics_url(settings.triton_url)
    return url.rstrip("/") + "/metrics" if urlsplit(url).path in ("", "/") else url


def check_gpu_memory(settings: LoaderSettings, label: str) -> None:
    """Fail unless Triton's GPUs have ``settings.require_gpu_memory_mib`` MiB free (nothing is published yet)."""
    required = settings.require_gpu_memory_mib
    url = metrics_url(settings)
    try:
        memory = read_gpu_memory(url)
    except TritonUnavailable as exc:
        raise TritonUnavailable(
            f"{label}: cannot read Triton's GPU memory: {exc} — Triton must run with metrics on and "
            "--triton-metrics-url must point at its metrics page, or set --require-gpu-memory-mib 0 to skip the check"
        ) from exc
    if memory.gpus == 0:
        raise InsufficientSpace(
            f"{label}: the model asks for {required} MiB of GPU memory but Triton reports no GPU memory at {url} "
            "(no GPU on this node, or Triton runs with --allow-gpu-metrics=false) — schedule it on a GPU node "
            "(tritonshare.io/gpu-memory requests), or set --require-gpu-memory-mib 0 to skip the check"
        )
    largest_mib, free_mib, total_mib = (
        memory.largest_free_bytes / MIB,
        memory.free_bytes / MIB,
        memory.total_bytes / MIB,
    )
    if largest_mib < required:
        raise InsufficientSpace(
            f"{label}: the freest of Triton's {memory.gpus} GPU(s) has {largest_mib:.0f} MiB free ({free_mib:.0f} MiB "
            f"free of {total_mib:.0f} MiB on all), the model asks for {required} MiB on one GPU — schedule it on "
            "another node (tritonshare.io/gpu-memory requests) or free GPU memory"
        )
    logger.info(
        "%s: %d MiB of GPU memory asked, %.0f MiB free on the freest of %d GPU(s) (%.0f MiB free of %.0f MiB on all)",
        label,
        required,
        largest_mib,
        memory.gpus,
        free_mib,
        total_mib,
    )
