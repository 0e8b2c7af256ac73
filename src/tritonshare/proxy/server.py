"""``tritonshare proxy``: run the REST and gRPC front ends and /metrics until SIGTERM, then drain and unload.

Shutdown, in order (the pod's terminationGracePeriodSeconds must exceed drain + unload):

1. readiness turns false at once (``state.draining``): probes and ServerReady say "not ready"; what else the
   pod runs in this process is told to stop (``on_drain``: the model's reinstall, :mod:`tritonshare.pod`),
   and is waited for before the unload;
2. listening sockets close, so new connections are refused; clients are told to go away (GOAWAY,
   ``Connection: close``);
3. in-flight requests, streams included, and requests waiting for an admission slot get up to
   ``drain_timeout_s`` to finish; what is left is cut;
4. the model folder is renamed out of the repository and deleted, and the proxy waits (bounded) until
   Triton no longer reports the model ready (:mod:`tritonshare.common.unload`) — unless another pod's lease
   on the model is fresh, and then the folder stays for it; exit 0. If the unload failed (Triton kept the model
   LOADING, did not answer, or still serves it), the proxy exits with the unload's code (13, 16) and writes
   why to ``--termination-log``, as ``tritonshare unload`` would exit: the pod status shows it.

While serving, the proxy holds its pod's lease on the model and refreshes it (:mod:`tritonshare.common.lease`):
if the pod dies without SIGTERM, ``tritonshare gc`` removes the model once the lease expires.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
from collections.abc import Callable

from tritonshare.common.errors import ExitCode
from tritonshare.common.lease import Heartbeat, LeaseStore
from tritonshare.common.repository import read_record
from tritonshare.common.unload import UnloadSettings, ended, unload_model
from tritonshare.proxy.grpc import GrpcFrontend
from tritonshare.proxy.metrics_server import MetricsServer
from tritonshare.proxy.rest import RestFrontend
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import Frontend, ProxyState
from tritonshare.proxy.triton_metrics import TritonModelMetrics, default_url

logger = logging.getLogger(__name__)


SPARE_FILES = 64  # listening sockets, the metrics server, Triton's metrics and readiness, files read


def run(settings: ProxySettings, *, on_drain: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code. ``on_drain`` is called, in a worker thread, when
    the drain begins, and the unload waits for it to return."""
    raise_open_files_limit(settings.max_connections)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        return asyncio.run(serve(settings, on_drain=on_drain))
    return uvloop.run(serve(settings, on_drain=on_drain))


def raise_open_files_limit(max_connections: int) -> None:
    """Lift the soft limit on open files to the hard one (as nginx's worker_rlimit_nofile does): every
    client connection also holds one to Triton, and containers often start with a soft limit of 1024. Warn
    when the limit stays below what ``max_connections`` per port may use: past it accepts fail for everyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
    needed = 4 * max_connections + SPARE_FILES  # two ports; each client connection may hold one to Triton
    if max_connections and soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "the open-files limit (%d) is below the %d that --max-connections %d may use: raise the container's "
            "nofile limit or lower --max-connections",
            soft,
            needed,
            max_connections,
        )


async def serve(
    settings: ProxySettings,
    *,
    stop: asyncio.Event | None = None,
    on_started: Callable[[ProxyState, list[Frontend]], None] | None = None,
    on_drain: Callable[[], None] | None = None,
) -> int:
    state = ProxyState(settings)  # reads the token and TLS files: a bad one stops here, before the lease
    heartbeat = _hold_lease(settings)
    frontends: list[Frontend] = [RestFrontend(state), GrpcFrontend(state)]
    metrics = MetricsServer(state, settings.host, settings.metrics_port, triton_metrics=_triton_metrics(settings))
    for frontend in frontends:
        await frontend.start()
    await metrics.start()
    logger.info(
        "serving model %s: REST on %s:%d, gRPC on %s:%d (%s), %s; Triton at %s and %s; %s",
        settings.name,
        settings.host,
        frontends[0].port,
        settings.host,
        frontends[1].port,
        "TLS" if state.tls else "plain text",
        f"metrics on :{metrics.port}" if metrics.port else "no metrics port (--metrics-port 0)",
        settings.triton_url,
        settings.triton_grpc,
        _controls(state),
    )
    stop = stop or _stop_on_signals()
    if on_started is not None:
        on_started(state, frontends)
    await stop.wait()
    stopping = asyncio.ensure_future(asyncio.to_thread(on_drain)) if on_drain is not None else None
    await _drain(state, frontends)
    if stopping is not None:
        await stopping  # before the unload: nothing is published behind it
    metrics.close()
    if heartbeat is not None:
        heartbeat.stop()
    if settings.unload_on_exit:
        return await asyncio.to_thread(_unload, settings)
    return ExitCode.OK


def _controls(state: ProxyState) -> str:
    """The fairness and access controls in force, for the start-up log line."""
    limits = state.admission.limits
    words = [
        f"max {limits.max_inflight} in flight, queue {limits.max_queue} for {limits.queue_timeout_s:g}s"
        if limits.max_inflight
        else "no in-flight cap",
        f"rate limit {limits.rate_limit_rps:g}/s burst {limits.burst}" if limits.rate_limit_rps else "no rate limit",
        f"bearer tokens from {state.auth.path}" if state.auth else "no authentication",
    ]
    return ", ".join(words)


def _triton_metrics(settings: ProxySettings) -> TritonModelMetrics | None:
    url = settings.triton_metrics_url
    if url is None:
        url = default_url(settings.triton_url)
    if not url:
        return None
    return TritonModelMetrics(url, settings.name, timeout_s=settings.connect_timeout_s)


def _hold_lease(settings: ProxySettings) -> Heartbeat | None:
    """Take this pod's lease on the model (the loader already did; taking it again is harmless) and keep it
    fresh while serving."""
    if settings.holder is None:
        return None
    leases = LeaseStore(settings.layout.leases, ttl_s=settings.lease_ttl_s)
    record = read_record(settings.layout.model_dir(settings.name))
    source, digest = (record.source, record.digest) if record else ("", "")
    lease = leases.acquire(settings.name, settings.holder, source=source, digest=digest)
    return Heartbeat(leases, lease).start()


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _signalled, sig, stop)
    return stop


def _signalled(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():
        return
    logger.info("received %s: draining", sig.name)
    stop.set()


async def _drain(state: ProxyState, frontends: list[Frontend]) -> None:
    state.draining = True
    for frontend in frontends:
        frontend.stop_accepting()
        frontend.begin_drain()
    timeout_s = state.settings.drain_timeout_s
    if await state.wait_idle(timeout_s):  # queued requests too (admission control)
        logger.info("drained: no request in flight")
    else:
        logger.warning(
            "drain timeout (%.1fs) passed with %d requests in flight and %d waiting for a slot; closing them",
            timeout_s,
            state.inflight,
            state.admission.waiting,
        )
    for frontend in frontends:
        frontend.abort()
    state.admission.close()


def _unload(settings: ProxySettings) -> int:
    """Unload the model; the exit code of it (its reason written as the termination message when not 0)."""
    result = unload_model(
        UnloadSettings(
            name=settings.name,
            layout=settings.layout,
            holder=settings.holder,
            lease_ttl_s=settings.lease_ttl_s,
            triton_url=settings.triton_url,
            timeout_s=settings.unload_timeout_s,
        )
    )
    logger.info(
        "unload of %s: folder removed=%s, Triton stopped serving=%s, kept for another pod=%s",
        settings.name,
        result.removed,
        result.unloaded,
        result.kept,
    )
    return ended(result, settings.termination_log)
