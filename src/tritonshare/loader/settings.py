"""Settings of ``tritonshare load``: built by the CLI, read by :func:`tritonshare.loader.run.run`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import DEFAULT_TTL_S, Holder
from tritonshare.common.termination import DEFAULT_PATH

Mode = Literal["poll", "explicit"]
ConfigCheck = Literal["strict", "lenient"]  # see tritonshare.loader.model.check_schema


@dataclass(frozen=True, kw_only=True)
class LoaderSettings:
    source: str
    name: str
    layout: NodeLayout = field(default_factory=NodeLayout)
    holder: Holder | None = None  # this pod (downward API); None: no lease is taken
    lease_ttl_s: float = DEFAULT_TTL_S  # heartbeats come ten times per TTL
    triton_url: str = "http://127.0.0.1:8000"
    mode: Mode = "poll"
    timeout_s: float = 600.0  # readiness deadline, counted from publishing
    download_timeout_s: float = 3600.0  # overall deadline for the listing and the transfer, together
    stall_timeout_s: float = 60.0  # a read that brings no byte for this long is a transient failure
    retries: int = 5  # attempts per object after the first, with exponential backoff
    concurrency: int = 16  # objects downloaded at once
    poll_interval_s: float = 0.1  # how often readiness and the repository index are asked
    config_check: ConfigCheck = "strict"  # lenient: config fields the vendored schema does not know go through
    require_gpu_memory_mib: int = 0  # free GPU memory Triton must report before publishing; 0 = no check
    triton_metrics_url: str | None = None  # for that check; None = Triton's host, port 8002
    termination_log: Path | None = DEFAULT_PATH
