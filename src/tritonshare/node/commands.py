"""Click commands of the node agents; ``tritonshare.cli`` adds them to the ``tritonshare`` group.

The conventions are those of :mod:`tritonshare.cli`: every option is also ``TRITONSHARE_<OPTION>``, options
become a frozen settings object, errors of the tree become exit codes and a termination message, and the
command body imports its modules lazily (:mod:`tritonshare.common.command`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

from tritonshare.common.command import Command, option, run_command, termination_log_option
from tritonshare.common.errors import ExitCode
from tritonshare.common.termination import write_termination_message

logger = logging.getLogger("tritonshare")

# Same as tritonshare.node.kube.SERVICE_ACCOUNT, not imported from there: kube pulls in http.client and ssl,
# which every other command would then pay for at start-up.
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@click.command(cls=Command)
@option("--node-name", required=True, help="This node's name (downward API: spec.nodeName).")
@option(
    "--gpu-memory-mib",
    type=click.IntRange(min=1),
    default=None,
    help="GPU memory to advertise instead of NVML's total (MIG or vGPU slices).  [default: read with NVML]",
)
@option("--reserve-mib", type=click.IntRange(min=0), default=0, help="GPU memory kept back, not advertised.")
@option("--resource", default="tritonshare.io/gpu-memory", help="Extended resource name (MiB) model pods request.")
@option(
    "--interval-s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Re-advertise this often, as a sidecar; 0 advertises once and exits (init container).",
)
@option(
    "--kube-api-url",
    default=None,
    help="Kubernetes API server.  [default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT]",
)
@option(
    "--kube-token-path",
    type=click.Path(path_type=Path),
    default=SERVICE_ACCOUNT / "token",
    help="Bearer token for the API server (the pod's service account token, re-read on each request).",
)
@option(
    "--kube-ca-path",
    type=click.Path(path_type=Path),
    default=SERVICE_ACCOUNT / "ca.crt",
    help="CA bundle the API server's certificate is checked against.",
)
@option("--kube-timeout-s", type=click.FloatRange(min=0.1), default=10.0, help="Per-request timeout.")
@option(
    "--retry-for-s",
    type=click.FloatRange(min=0),
    default=60.0,
    help="How long an unreachable or busy (429, 5xx) API server is retried, with backoff, before giving up.",
)
@option(
    "--best-effort",
    is_flag=True,
    default=False,
    help="On failure, log the error and exit 0: as an init container, never keep Triton from starting.",
)
@termination_log_option
def advertise(
    node_name: str,
    gpu_memory_mib: int | None,
    reserve_mib: int,
    resource: str,
    interval_s: float,
    kube_api_url: str | None,
    kube_token_path: Path,
    kube_ca_path: Path,
    kube_timeout_s: float,
    retry_for_s: float,
    best_effort: bool,
    termination_log: Path,
) -> None:
    """Advertise this node's GPU memory (MiB, minus the reserve) as an extended resource in its status.

    Model pods then request it (e.g. tritonshare.io/gpu-memory: 4096) and the scheduler never places more
    models on a node than its GPUs hold. Needs get and patch on nodes/status.

    Exit codes: 0 advertised (or any failure, with --best-effort); 2 a bad option (a reserve larger than the
    memory, no API server to talk to); 1 the memory could not be read (no NVML: pass --gpu-memory-mib) or the
    API server refused the patch or stayed out of reach past --retry-for-s (the message says which).
    """
    from tritonshare.node.advertise import AdvertiseSettings, run
    from tritonshare.node.kube import KubeConfig, in_cluster_url

    api_url = kube_api_url or in_cluster_url(os.environ)
    if api_url is None:
        raise click.UsageError("not in a pod (no KUBERNETES_SERVICE_HOST): pass --kube-api-url")
    settings = AdvertiseSettings(
        node_name=node_name,
        resource=resource,
        gpu_memory_mib=gpu_memory_mib,
        reserve_mib=reserve_mib,
        interval_s=interval_s,
        retry_for_s=retry_for_s,
        kube=KubeConfig(api_url=api_url, token_path=kube_token_path, ca_path=kube_ca_path, timeout_s=kube_timeout_s),
    )

    def action() -> int:
        try:
            return run(settings)
        except Exception as exc:  # best effort means any failure, a bug included, leaves Triton free to start
            if not best_effort:
                raise
            # The node keeps what an earlier run advertised; the reason stays visible in the pod status.
            logger.error("not advertised, continuing (--best-effort): %s", exc)
            write_termination_message(f"not advertised: {exc}", termination_log)
            return ExitCode.OK

    run_command(action, termination_log=termination_log)
