"""What one model pod's containers compose from the layers below (the loader and the proxy never import each
other; this module, above both, may).

A proxy container restarted inside a live pod — a liveness probe, an in-place resize that restarts it — was
stopped by SIGTERM, and its SIGTERM drains and then unloads the model. The loader is an init container and
does not run again, so the restarted proxy would serve a model that is gone and the pod would stay unready
until it is deleted. Given the pod's SOURCE (``--source``, the same ``TRITONSHARE_SOURCE`` the loader reads,
which the manifests give both containers), the proxy installs the model again when it finds it missing at
start, exactly as ``tritonshare load`` does — with the loader's options read from the same TRITONSHARE_*
variables — in a thread while it serves: readiness stays false until Triton serves the model.
"""

from __future__ import annotations

import logging
import threading

from tritonshare.common.errors import ExitCode, TritonshareError
from tritonshare.loader.run import run as load
from tritonshare.loader.settings import LoaderSettings
from tritonshare.loader.sources.base import display_uri
from tritonshare.proxy.settings import ProxySettings

logger = logging.getLogger("tritonshare")


def reinstall_if_missing(loader: LoaderSettings, proxy: ProxySettings) -> threading.Thread | None:
    """Start installing the proxy's model with ``loader`` (what ``tritonshare load`` would run in this pod) if
    its folder is not in the repository; returns the thread doing it (None when the model is there). Failures
    are logged: the proxy keeps serving, unready."""
    if proxy.layout.model_dir(proxy.name).exists():
        return None
    logger.warning(
        "model %s is not in the repository %s at start (this container restarted after unloading it?): "
        "installing it again from %s",
        proxy.name,
        proxy.layout.repository,
        display_uri(loader.source),
    )
    thread = threading.Thread(target=_install, args=(loader,), name=f"reinstall-{proxy.name}", daemon=True)
    thread.start()
    return thread


def _install(settings: LoaderSettings) -> None:
    try:
        code = load(settings)
    except TritonshareError as exc:
        logger.error("could not install %s again: %s — the pod stays unready; delete it to retry", settings.name, exc)
        return
    if code != ExitCode.OK:
        logger.error("could not install %s again (exit %d): the pod stays unready", settings.name, code)
