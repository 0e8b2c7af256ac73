"""What one model pod's containers compose from the layers below (the loader and the proxy never import each
other; this module, above both, may).

A proxy container restarted inside a live pod — a liveness probe, an in-place resize that restarts it — was
stopped by SIGTERM, and its SIGTERM drains and then unloads the model. The loader is an init container and
does not run again, so the restarted proxy would serve a model that is gone and the pod would stay unready
until it is deleted. Given the pod's SOURCE (``--source``, the same ``TRITONSHARE_SOURCE`` the loader reads,
which the manifests give both containers), the proxy installs the model again when it finds it missing at
start, exactly as ``tritonshare load`` does — with the loader's options read from the same TRITONSHARE_*
variables — in a thread while it serves: readiness stays false until Triton serves the model.

A SIGTERM while that install runs (the pod deleted mid-download) stops it as it stops ``tritonshare load``
(:mod:`tritonshare.loader.stop`): the proxy's drain asks it to stop and waits, bounded, until it has cleaned
up — its staging workspace deleted, its lease dropped — and only then unloads; the install publishes nothing
once asked.
"""

from __future__ import annotations

import logging
import threading

from tritonshare.common.errors import ExitCode, Stopped, TritonshareError
from tritonshare.loader.run import run as load
from tritonshare.loader.settings import LoaderSettings
from tritonshare.loader.sources.base import display_uri
from tritonshare.loader.stop import Stop
from tritonshare.proxy.settings import ProxySettings

logger = logging.getLogger("tritonshare")

# How long the drain waits for a stopped install to clean up. Its requests are aborted and its waits end at
# once, so it takes well under a second; an explicit-mode load call in progress is the exception (it ends with
# Triton's load, or gc removes what stays).
STOP_WAIT_S = 10.0


def reinstall_if_missing(loader: LoaderSettings, proxy: ProxySettings) -> Reinstall | None:
    """Start installing the proxy's model with ``loader`` (what ``tritonshare load`` would run in this pod) if
    its folder is not in the repository; returns the install under way (None when the model is there).
    Failures are logged: the proxy keeps serving, unready."""
    if proxy.layout.model_dir(proxy.name).exists():
        return None
    logger.warning(
        "model %s is not in the repository %s at start (this container restarted after unloading it?): "
        "installing it again from %s",
        proxy.name,
        proxy.layout.repository,
        display_uri(loader.source),
    )
    return Reinstall(loader).start()


class Reinstall:
    """The install of the proxy's model in a thread, stopped by the proxy's drain (:meth:`stop`)."""

    def __init__(self, settings: LoaderSettings) -> None:
        self.settings = settings
        self._stop = Stop()
        self.thread = threading.Thread(target=self._install, name=f"reinstall-{settings.name}", daemon=True)

    def start(self) -> Reinstall:
        self.thread.start()
        return self

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop the install unless it has ended, and wait up to ``timeout_s`` for it to clean up. Once this
        is called it publishes nothing; a folder it published before stays for the proxy's unload."""
        if not self.thread.is_alive():
            return
        logger.info("stopping the install of %s: the proxy is draining", self.settings.name)
        self._stop.request()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            logger.warning(
                "the install of %s did not stop within %.0f s: what it staged stays for `tritonshare gc`",
                self.settings.name,
                timeout_s,
            )

    def _install(self) -> None:
        name = self.settings.name
        try:
            code = load(self.settings, stop=self._stop)
        except Stopped as stop:
            logger.warning("install of %s %s: cleaned up", name, stop)
            return
        except TritonshareError as exc:
            if self._stop.requested:  # an error the stop's abort caused
                logger.warning("install of %s stopped by the drain (%s): cleaned up", name, exc)
                return
            logger.error("could not install %s again: %s — the pod stays unready; delete it to retry", name, exc)
            return
        if code != ExitCode.OK:
            logger.error("could not install %s again (exit %d): the pod stays unready", name, code)
