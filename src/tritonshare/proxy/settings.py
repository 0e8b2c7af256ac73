"""Settings of ``tritonshare proxy``: built by the CLI, read by :func:`tritonshare.proxy.server.run`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tritonshare.common import termination
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import DEFAULT_TTL_S, Holder


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    name: str
    triton_url: str = "http://127.0.0.1:8000"  # Triton HTTP (REST upstream)
    triton_grpc: str = "127.0.0.1:8001"  # Triton gRPC (HTTP/2 upstream)
    host: str = "0.0.0.0"
    http_port: int = 9000
    grpc_port: int = 9001
    metrics_port: int = 9090  # 0 turns the metrics server off
    triton_metrics_url: str | None = None  # re-exported for NAME only; None = Triton's host, port 8002; "" = off
    layout: NodeLayout = field(default_factory=NodeLayout)
    holder: Holder | None = None  # this pod (downward API); None: no lease is taken
    lease_ttl_s: float = DEFAULT_TTL_S  # heartbeats come ten times per TTL
    drain_timeout_s: float = 30.0
    unload_on_exit: bool = True  # after draining, remove the model folder (the unloader)
    unload_timeout_s: float = 30.0
    termination_log: Path | None = termination.DEFAULT_PATH  # why the proxy exits non-zero (its unload failed)
    connect_timeout_s: float = 2.0  # to Triton; a refused/timed-out connect answers 503 / UNAVAILABLE
    max_header_bytes: int = 64 * 1024  # request line + headers (REST)
    max_json_bytes: int = 64 * 1024 * 1024  # JSON part of an infer body, held to check it
    max_body_bytes: int = 1 << 30  # a REST request body (inflated, if compressed), which Triton holds whole; 0 = any
    max_held_bytes: int = 256 * 1024 * 1024  # infer JSON parts held at once, all together (proxy/held.py); 0: no cap
    max_connections: int = 1024  # client connections per port (REST, gRPC); more are turned away; 0 = no cap
    readiness_interval_s: float = 1.0  # how long a cached own-model readiness answer stays fresh
    strip_headers: tuple[str, ...] = ()  # e.g. the header key of Triton's --http-restricted-api
    grpc_max_streams: int = 128  # forwarded gRPC streams open at once per client connection (as nginx's default)
    grpc_idle_timeout_s: float = 300.0  # a gRPC connection with no stream open this long goes away; 0 = never
    # What a client's cancelled gRPC call does at Triton (proxy/grpc_abandon.py): "absorb" never tells Triton (the
    # call runs to its end there, its answer dropped; grpc-timeout is not passed on); "forward" passes the
    # cancellation on, as nginx does — safe only from Triton 24.12 on (triton-inference-server/server#7368).
    grpc_cancellations: Literal["absorb", "forward"] = "absorb"
    # Admission control of the own model's inference requests (proxy/admission.py); 0 turns a limit off.
    max_inflight: int = 0  # at Triton at once, REST and gRPC together (a gRPC stream counts while open)
    max_queue: int = 128  # waiting for a slot; more are refused at once
    queue_timeout_s: float = 10.0  # longest wait for a slot
    rate_limit_rps: float = 0.0  # token bucket refill rate
    rate_limit_burst: int = 0  # bucket size; 0 = one second's worth, ceil(rate_limit_rps)
    # Access control (proxy/auth.py, proxy/tls.py); files are re-read when they change.
    auth_token_file: Path | None = None  # bearer tokens, one per line; None = no authentication
    tls_cert: Path | None = None  # PEM chain; with tls_key, TLS on both ports
    tls_key: Path | None = None
