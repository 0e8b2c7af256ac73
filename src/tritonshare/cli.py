"""The ``tritonshare`` command: a thin click shell. Options → frozen settings → ``run(settings)``.

Every option can also be set as ``TRITONSHARE_<OPTION>`` (``--triton-url`` → ``TRITONSHARE_TRITON_URL``),
the same name for every subcommand, so one ConfigMap can feed the loader and the proxy of a pod.
Each command imports its modules inside its body, so a command loads only what it runs: the proxy none of
the loader, the loader none of the proxy (and within the loader, a source's scheme, the archive code and the
GPU check only when used).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tritonshare import __version__
from tritonshare.common.command import (
    F,
    Group,
    leases_option,
    log_options,
    operator_termination_log_option,
    option,
    repository_option,
    run_command,
    staging_option,
    termination_log_option,
    triton_url_option,
)
from tritonshare.common.errors import TritonshareError
from tritonshare.common.layout import (
    NodeLayout,
    check_model_name,
)
from tritonshare.common.lease import DEFAULT_TTL_S, Holder
from tritonshare.common.logs import configure_logging
from tritonshare.common.triton import check_host_port
from tritonshare.node.commands import advertise
from tritonshare.node.gc_command import gc

if TYPE_CHECKING:
    from tritonshare.loader.settings import LoaderSettings
    from tritonshare.proxy.settings import ProxySettings


def _name(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return check_model_name(value)
    except TritonshareError as exc:
        raise click.BadParameter(str(exc)) from exc


def _source(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    from tritonshare.loader.sources.base import check_uri

    try:
        check_uri(value)  # before Triton is waited for: an empty SOURCE would install the working directory
    except TritonshareError as exc:
        raise click.BadParameter(str(exc)) from exc
    return value


def common_options(fn: F) -> F:
    for decorator in reversed(
        [
            option("--name", required=True, callback=_name, help="Model name: its folder in the repository."),
            repository_option,
            staging_option,
            triton_url_option(),
        ]
    ):
        fn = decorator(fn)
    return fn


def _host_port(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return check_host_port(value)
    except TritonshareError as exc:
        raise click.BadParameter(str(exc)) from exc


def _pod_uid(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    try:
        return Holder(uid=value).uid if value else None
    except TritonshareError as exc:
        raise click.BadParameter(str(exc)) from exc


def lease_options(fn: F) -> F:
    """Who this pod is (the downward API) and where its lease on the model lives (common/lease.py)."""
    for decorator in reversed(
        [
            leases_option,
            option(
                "--lease-ttl-s",
                type=click.FloatRange(min=1),
                default=DEFAULT_TTL_S,
                help="A lease not refreshed for this long is a dead pod's; give `tritonshare gc` the same value.",
            ),
            option(
                "--pod-uid",
                default=None,
                callback=_pod_uid,
                help="This pod's UID (downward API metadata.uid), the key of its lease. Unset: no lease is "
                "taken, and unload removes the model even if other pods use it.",
            ),
            option("--pod-name", default="", help="This pod's name (downward API metadata.name), for its lease."),
            option("--pod-namespace", default="", help="This pod's namespace (metadata.namespace), for its lease."),
        ]
    ):
        fn = decorator(fn)
    return fn


def holder_of(uid: str | None, name: str, namespace: str) -> Holder | None:
    return Holder(uid=uid, name=name, namespace=namespace) if uid else None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@log_options
@click.version_option(__version__, prog_name="tritonshare")
def main(log_format: str, log_level: str) -> None:
    """Share one Triton Inference Server per GPU node among many model pods."""
    configure_logging(log_format, log_level)


@main.command()
@click.argument("source", envvar="TRITONSHARE_SOURCE", callback=_source)
@common_options
@lease_options
@option(
    "--mode",
    type=click.Choice(["poll", "explicit"]),
    default="poll",
    help="How Triton picks the model up: its repository POLL, or an explicit load call.",
)
@option("--timeout-s", type=click.FloatRange(min=0), default=600.0, help="Readiness deadline after publishing.")
@option(
    "--download-timeout-s",
    type=click.FloatRange(min=0),
    default=3600.0,
    help="Deadline for listing the source and transferring the model, together (exit 11 past it).",
)
@option(
    "--stall-timeout-s",
    type=click.FloatRange(min=0.1),
    default=60.0,
    help="A read that brings nothing for this long counts as a transient failure.",
)
@option("--retries", type=click.IntRange(min=0), default=5, help="Retries per object on transient errors.")
@option("--concurrency", type=click.IntRange(min=1, max=256), default=16, help="Objects downloaded at once.")
@option(
    "--poll-interval-s",
    type=click.FloatRange(min=0.01),
    default=0.1,
    help="How often Triton is asked whether the model is ready (and, until it is, for its repository index).",
)
@option(
    "--config-check",
    type=click.Choice(["strict", "lenient"]),
    default="strict",
    help="strict: config.pbtxt must fit the ModelConfig schema tritonshare ships. lenient: fields that schema "
    "does not know (a newer Triton's) go to Triton unchecked, with a warning; the rest is checked as strictly.",
)
@option(
    "--require-gpu-memory-mib",
    type=click.IntRange(min=0),
    default=0,
    help="Before publishing, Triton's metrics must show this much free memory on one of its GPUs; 0 = no check.",
)
@option(
    "--triton-metrics-url",
    default=None,
    help="Triton's metrics page, read by the GPU memory check.  [default: Triton's host, port 8002]",
)
@termination_log_option
def load(**params: Any) -> None:
    """Fetch SOURCE (s3://, gs://, http(s)://, file:// or a path), install it as NAME, wait until ready.

    SOURCE, like every option, may come from the environment instead: TRITONSHARE_SOURCE.

    Exit codes: 0 ready; 1 unexpected error (a bug: its traceback is logged); 2 usage; 10 permanent source
    error; 11 transient source failure; 12 Triton failed to load the model; 13 readiness deadline (also: Triton
    not answering at all); 14 NAME installed from a different source;
    15 not enough disk space, or GPU memory (--require-gpu-memory-mib); 16 Triton's metrics unreadable
    (GPU memory check); 143 (130) stopped by SIGTERM (SIGINT), after cleaning up: nothing staged, no lease.
    """
    from tritonshare.loader.run import run

    settings = loader_settings(params)
    termination_log = settings.termination_log
    run_command(lambda: run(settings), termination_log=termination_log)


def loader_settings(params: dict[str, Any]) -> LoaderSettings:
    """The loader's settings from ``load``'s parsed options (the command line, else TRITONSHARE_* variables)."""
    from tritonshare.loader.settings import LoaderSettings

    return LoaderSettings(
        source=params["source"],
        name=params["name"],
        layout=NodeLayout(repository=params["repository"], staging=params["staging"], leases=params["leases"]),
        holder=holder_of(params["pod_uid"], params["pod_name"], params["pod_namespace"]),
        lease_ttl_s=params["lease_ttl_s"],
        triton_url=params["triton_url"],
        mode=params["mode"],
        timeout_s=params["timeout_s"],
        download_timeout_s=params["download_timeout_s"],
        stall_timeout_s=params["stall_timeout_s"],
        retries=params["retries"],
        concurrency=params["concurrency"],
        poll_interval_s=params["poll_interval_s"],
        config_check=params["config_check"],
        require_gpu_memory_mib=params["require_gpu_memory_mib"],
        triton_metrics_url=params["triton_metrics_url"] or None,
        termination_log=params["termination_log"],
    )


@main.command()
@common_options
@lease_options
@option(
    "--timeout-s",
    type=click.FloatRange(min=0),
    default=60.0,
    help="Bound on each wait: for a LOADING model to settle, and for Triton to stop serving it.",
)
@option(
    "--force",
    is_flag=True,
    default=False,
    help="Without --pod-uid: remove NAME even while pods hold fresh leases on it (they lose their model).",
)
@operator_termination_log_option
def unload(
    name: str,
    repository: Path,
    staging: Path,
    triton_url: str,
    leases: Path,
    lease_ttl_s: float,
    pod_uid: str | None,
    pod_name: str,
    pod_namespace: str,
    timeout_s: float,
    force: bool,
    termination_log: Path | None,
) -> None:
    """Drop this pod's lease on NAME and, unless another pod still uses it, remove NAME from the repository
    (rename out, then delete) and wait until Triton unloads it. Without --pod-uid (an operator), NAME is
    removed only if no pod holds a fresh lease on it, or with --force.

    Exit codes: 0 removed, or kept for another pod; 13 Triton kept it LOADING past --timeout-s; 14 (without
    --pod-uid) pods hold fresh leases on it, named in the message; 16 Triton did not answer (it may be starting
    up and loading it): the folder stays for `tritonshare gc`. In the 13 and 16 cases this pod's lease is
    dropped. On any exit but 0, the reason goes to --termination-log.
    """
    from tritonshare.common.termination import container_default
    from tritonshare.common.unload import UnloadSettings, ended, unload_model

    settings = UnloadSettings(
        name=name,
        layout=NodeLayout(repository=repository, staging=staging, leases=leases),
        holder=holder_of(pod_uid, pod_name, pod_namespace),
        lease_ttl_s=lease_ttl_s,
        triton_url=triton_url,
        timeout_s=timeout_s,
        force=force,
    )

    termination_log = termination_log or container_default()
    run_command(lambda: ended(unload_model(settings), termination_log), termination_log=termination_log)


@main.command()
@common_options
@lease_options
@option("--triton-grpc", default="127.0.0.1:8001", callback=_host_port, help="Triton's gRPC endpoint (HOST:PORT).")
@option("--host", default="0.0.0.0", help="Address the proxy listens on.")
@option("--http-port", type=click.IntRange(0, 65535), default=9000, help="REST (KServe v2) port.")
@option("--grpc-port", type=click.IntRange(0, 65535), default=9001, help="gRPC port.")
@option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=9090,
    help="Prometheus /metrics, and the kubelet's probes (/v2/health/ready, /v2/health/live) outside the REST "
    "port's --max-connections; 0 = off.",
)
@option(
    "--triton-metrics-url",
    default=None,
    help="Triton's metrics page, re-exported for NAME only on /metrics (read within --connect-timeout-s, else "
    "reported down).  [default: Triton's host, port 8002; '' = off]",
)
@option(
    "--drain-timeout-s",
    type=click.FloatRange(min=0),
    default=30.0,
    help="On SIGTERM, how long in-flight requests may take to finish.",
)
@option(
    "--unload/--no-unload",
    "unload_on_exit",
    default=True,
    help="After draining, remove the model folder so Triton unloads it.",
)
@option(
    "--unload-timeout-s",
    type=click.FloatRange(min=0),
    default=30.0,
    help="Bound on each wait of the unload: for a LOADING model to settle, and for Triton to stop serving it.",
)
@option(
    "--max-json-bytes",
    type=click.IntRange(min=1024),
    default=64 * 1024 * 1024,
    help="Largest JSON part of an infer request (it is held in memory to be checked); larger → 413.",
)
@option(
    "--max-body-bytes",
    type=click.IntRange(min=0),
    default=1 << 30,
    help="Largest REST request body, inflated size if compressed (the shared Triton holds a body whole in "
    "memory); larger → 413, refused from its Content-Length before Triton sees it. 0 = no limit.",
)
@option(
    "--max-held-bytes",
    type=click.IntRange(min=0),
    default=256 * 1024 * 1024,
    help="Bytes of infer requests held at once to be checked, all connections together (the proxy's memory grows "
    "by about this much): REST JSON, and gRPC parameter fields (parameters, inputs with their contents, outputs) "
    "kept across reads. A REST request that does not fit → 503 with Retry-After: 1, a gRPC one → "
    "RESOURCE_EXHAUSTED. At least --max-json-bytes; 0 = no cap.",
)
@option(
    "--strip-header",
    "strip_headers",
    multiple=True,
    help="Header removed from tenant requests (e.g. Triton's --http-restricted-api key). Repeatable.",
)
@option(
    "--connect-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    help="Bound on connecting to Triton; past it the request gets 503 / UNAVAILABLE.",
)
@option(
    "--max-connections",
    type=click.IntRange(min=0),
    default=1024,
    help="Client connections per port (REST, gRPC; each may hold one to Triton); more are turned away with "
    "503 / UNAVAILABLE. 0 = no cap.",
)
@option(
    "--max-inflight",
    type=click.IntRange(min=0),
    default=0,
    help="Inference requests of NAME at Triton at once (REST and gRPC together; a gRPC stream counts while "
    "open); the excess waits in a queue. 0 = no cap.",
)
@option("--max-queue", type=click.IntRange(min=0), default=128, help="Requests waiting for a slot; more → 429.")
@option(
    "--grpc-max-streams",
    type=click.IntRange(min=1),
    default=128,
    help="gRPC streams forwarded at once per client connection (advertised in SETTINGS); more → REFUSED_STREAM.",
)
@option(
    "--grpc-idle-timeout-s",
    type=click.FloatRange(min=0),
    default=300.0,
    help="A gRPC connection with no stream open this long is sent away (GOAWAY); 0 = never.",
)
@option(
    "--grpc-cancellations",
    type=click.Choice(["absorb", "forward"]),
    default="absorb",
    help="What a client's cancelled gRPC call (RST_STREAM, its deadline, its connection gone) does at Triton. "
    "absorb: Triton is not told; the call runs to its end there and its answer is dropped (grpc-timeout is not "
    "passed on; the client's own deadline still holds). forward: the cancellation goes on, as nginx does, and "
    "frees Triton's work — only for Triton 24.12 or later: earlier releases can crash on a cancellation that "
    "races a call's end (triton-inference-server/server#7368), taking every tenant's model down.",
)
@option(
    "--queue-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    help="Longest wait for a slot; then 429 (REST) / RESOURCE_EXHAUSTED (gRPC).",
)
@option(
    "--rate-limit-rps",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Inference requests per second (token bucket in front of the queue); over it → 429. Metadata, config "
    "and statistics requests get a bucket of their own at the same rate. 0 = off.",
)
@option(
    "--rate-limit-burst",
    type=click.IntRange(min=0),
    default=0,
    show_default="0: one second's worth, ceil(rps)",
    help="Requests allowed at once above the rate (the bucket's size).",
)
@option(
    "--auth-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Bearer tokens (a mounted Secret, one per line), re-read on change; callers must send "
    "'authorization: Bearer TOKEN'. Health probes stay open. Unset: no authentication.",
)
@option(
    "--tls-cert",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="PEM certificate chain: TLS on the REST and gRPC ports (with --tls-key), reloaded on change.",
)
@option(
    "--tls-key",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="PEM private key (unencrypted) of --tls-cert.",
)
@option(
    "--source",
    default=None,
    help="The model's SOURCE, as given to `tritonshare load`: if NAME is missing from the repository when the "
    "proxy starts (restarted in a live pod after its SIGTERM unloaded it), it is installed again from there.",
)
@termination_log_option
def proxy(
    repository: Path,
    staging: Path,
    leases: Path,
    pod_uid: str | None,
    pod_name: str,
    pod_namespace: str,
    strip_headers: tuple[str, ...],
    source: str | None,
    **options: Any,
) -> None:
    """Serve NAME only: forward its REST and gRPC calls to Triton, refuse everything else.

    On SIGTERM: readiness turns false, in-flight requests drain, then the model is unloaded. Exit codes: 0
    unloaded, or kept for another pod (or --no-unload); as `tritonshare unload` when the unload failed (13 Triton
    kept it LOADING, or still serves it; 16 Triton did not answer); 2 at start: a port in use, an unreadable
    --auth-token-file, --tls-cert or --tls-key; 1 unexpected error (a bug: its traceback is logged). The reason
    goes to --termination-log.
    """
    from tritonshare.proxy.server import run
    from tritonshare.proxy.settings import ProxySettings

    held, largest = options["max_held_bytes"], options["max_json_bytes"]
    if held and held < largest:
        raise click.UsageError(
            f"--max-held-bytes {held} is smaller than --max-json-bytes {largest}: a request of the largest JSON "
            "allowed could never be held; give --max-held-bytes at least --max-json-bytes, or 0 for no cap"
        )
    settings = ProxySettings(
        layout=NodeLayout(repository=repository, staging=staging, leases=leases),
        holder=holder_of(pod_uid, pod_name, pod_namespace),
        strip_headers=tuple(h.lower() for h in strip_headers),
        **options,  # the remaining option names are ProxySettings' field names
    )
    on_drain = None
    if source:
        from tritonshare.pod import reinstall_if_missing

        reinstall = reinstall_if_missing(_reinstall_settings(source, settings), settings)
        on_drain = reinstall.stop if reinstall is not None else None
    # The proxy drains on SIGTERM itself; it writes its unload's failure to the termination log itself too.
    run_command(
        lambda: run(settings, on_drain=on_drain), termination_log=settings.termination_log, stop_on_signals=False
    )


def _reinstall_settings(source: str, proxy: ProxySettings) -> LoaderSettings:
    """What ``tritonshare load`` would run in this pod: its options from the same TRITONSHARE_* variables (the
    pod's ConfigMap), NAME, the node folders, Triton and the lease holder from the proxy's own settings, and
    no termination message (the proxy's is its own exit's)."""
    layout = proxy.layout
    args = [source, "--name", proxy.name, "--triton-url", proxy.triton_url, "--repository", str(layout.repository)]
    args += ["--staging", str(layout.staging), "--leases", str(layout.leases)]
    with load.make_context("load", args) as context:
        settings = loader_settings(context.params)
    return dataclasses.replace(settings, holder=proxy.holder, lease_ttl_s=proxy.lease_ttl_s, termination_log=None)


main.add_command(advertise)
main.add_command(gc)

if __name__ == "__main__":  # pragma: no cover
    main()
