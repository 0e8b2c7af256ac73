"""Removing a model from the node's Triton: the proxy does it after draining on SIGTERM, and
``tritonshare unload`` does it standalone (preStop hook, operator).

Order matters (REFERENCE §2):
1. wait (bounded) while Triton's index says LOADING — removing a folder mid-load hangs that load and,
   with it, POLL for every tenant;
2. rename the folder out of the repository, then delete it;
3. wait (bounded) until Triton no longer reports the model ready.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tritonshare.common.errors import TritonUnavailable
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import retire, wait_until
from tritonshare.common.triton import TritonClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class UnloadSettings:
    name: str
    layout: NodeLayout
    triton_url: str = "http://127.0.0.1:8000"
    timeout_s: float = 60.0
    poll_interval_s: float = 0.25


@dataclass(frozen=True, kw_only=True)
class UnloadResult:
    removed: bool
    unloaded: bool  # Triton no longer reports the model ready (or could not be asked)


def unload_model(settings: UnloadSettings, *, client: TritonClient | None = None) -> UnloadResult:
    client = client or TritonClient(settings.triton_url)
    name = settings.name
    if not _wait_quiet(client, name, settings):
        logger.warning(
            "%s is still LOADING after %.0fs; removing it anyway would hang Triton's polling, so it stays "
            "— run unload again later, or let gc remove it",
            name,
            settings.timeout_s,
        )
        return UnloadResult(removed=False, unloaded=False)
    removed = retire(settings.layout, name)
    if not removed:
        logger.info("%s is not in %s; nothing to remove", name, settings.layout.repository)
    unloaded = _wait_unloaded(client, name, settings)
    return UnloadResult(removed=removed, unloaded=unloaded)


def _wait_quiet(client: TritonClient, name: str, settings: UnloadSettings) -> bool:
    def not_loading() -> bool:
        try:
            return all(s.state != "LOADING" for s in client.model_states(name))
        except TritonUnavailable:
            return True  # Triton is away: nothing is loading, and the folder must still go

    return wait_until(not_loading, timeout_s=settings.timeout_s, interval_s=settings.poll_interval_s)


def _wait_unloaded(client: TritonClient, name: str, settings: UnloadSettings) -> bool:
    def gone() -> bool:
        try:
            return not client.model_ready(name)
        except TritonUnavailable:
            return True

    ok = wait_until(gone, timeout_s=settings.timeout_s, interval_s=settings.poll_interval_s)
    if ok:
        logger.info("Triton no longer serves %s", name)
    else:
        logger.warning("Triton still reports %s ready after %.0fs", name, settings.timeout_s)
    return ok
