"""Removing a model from the node's Triton: the proxy does it after draining on SIGTERM, and
``tritonshare unload`` does it standalone (preStop hook, operator).

Order matters (REFERENCE §2):
1. wait (bounded) while Triton's index says LOADING — removing a folder mid-load hangs that load and,
   with it, POLL for every tenant;
2. drop this pod's lease and, only if no other pod's lease on NAME is fresh (two pods of one model share
   one install), rename the folder out of the repository, then delete it (:mod:`tritonshare.common.lease`);
   without a pod identity (an operator at a shell) the folder goes regardless of leases;
3. wait (bounded) until Triton no longer reports the model ready.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tritonshare.common.errors import TritonUnavailable
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import DEFAULT_TTL_S, Holder, LeaseStore, Release
from tritonshare.common.repository import retire, wait_until
from tritonshare.common.triton import TritonClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class UnloadSettings:
    name: str
    layout: NodeLayout
    holder: Holder | None = None  # this pod; None: remove the folder whoever else holds it
    lease_ttl_s: float = DEFAULT_TTL_S
    triton_url: str = "http://127.0.0.1:8000"
    timeout_s: float = 60.0
    poll_interval_s: float = 0.25


@dataclass(frozen=True, kw_only=True)
class UnloadResult:
    removed: bool
    unloaded: bool  # Triton no longer reports the model ready (or could not be asked)
    kept: bool = False  # not this pod's to remove: another pod's lease is fresh, or this pod holds none

    @property
    def done(self) -> bool:
        return self.unloaded or self.kept


def unload_model(settings: UnloadSettings, *, client: TritonClient | None = None) -> UnloadResult:
    client = client or TritonClient(settings.triton_url)
    name = settings.name
    leases = LeaseStore(settings.layout.leases, ttl_s=settings.lease_ttl_s)
    if not _wait_quiet(client, name, settings):
        if settings.holder is not None:
            leases.forget(name, settings.holder)  # gc removes it once Triton is done, if no one else holds it
        logger.warning(
            "%s is still LOADING after %.0fs; removing it anyway would hang Triton's polling, so it stays "
            "— run unload again later, or let gc remove it",
            name,
            settings.timeout_s,
        )
        return UnloadResult(removed=False, unloaded=False)
    verdict, removed = _release(settings, leases)
    if verdict is not Release.LAST:
        return UnloadResult(removed=False, unloaded=False, kept=True)
    if not removed:
        logger.info("%s is not in %s; nothing to remove", name, settings.layout.repository)
    unloaded = _wait_unloaded(client, name, settings)
    return UnloadResult(removed=removed, unloaded=unloaded)


def _release(settings: UnloadSettings, leases: LeaseStore) -> tuple[Release, bool]:
    """Drop this pod's lease; take the folder out if it was the last fresh one (or with no pod identity)."""
    name, holder, removed = settings.name, settings.holder, [False]

    def remove() -> None:
        removed[0] = retire(settings.layout, name)

    if holder is None:
        with leases.lock(name):
            remove()
            leases.drop(name)
        return Release.LAST, removed[0]
    verdict = leases.release(name, holder, remove=remove)
    if verdict is Release.SHARED:
        logger.info("%s stays in the repository: another pod's lease on it is fresh", name)
    elif verdict is Release.NOT_HELD:
        logger.warning("%s stays in the repository: %s holds no lease on it — not this pod's to remove", name, holder)
    return verdict, removed[0]


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
