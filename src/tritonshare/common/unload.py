"""Removing a model from the node's Triton: the proxy does it after draining on SIGTERM, and
``tritonshare unload`` does it standalone (preStop hook, operator).

Order matters (REFERENCE §2):

1. wait (bounded) until Triton *answers* that its index does not say LOADING for NAME — removing a folder
   mid-load hangs that load and, with it, POLL for every tenant. No answer is not "nothing is loading":
   Triton loads every model of its repository before it opens its HTTP port, so a Triton that does not
   answer may be loading this very folder (:func:`wait_quiet`). If the deadline passes first, this pod's
   lease is dropped and the folder stays; ``tritonshare gc``, which removes nothing while Triton does not
   answer, takes it once Triton is quiet and no lease on NAME is fresh;
2. drop this pod's lease and, only if no other pod's lease on NAME is fresh (two pods of one model share
   one install), and Triton, asked again under NAME's lock, still does not say LOADING, rename the folder
   out of the repository (:mod:`tritonshare.common.lease`), then delete it once the lock is released (a
   loader of NAME must not wait behind a large delete); without a pod identity (an operator at a shell) the
   folder goes only while no pod's lease on NAME is fresh (else exit 14, naming the pods), or with ``force``;
3. ask Triton to unload NAME (:func:`request_unload`): in explicit mode Triton serves a model whose folder
   is gone until it is told to unload it; POLL mode refuses the call, and there the removal was the unload;
4. wait (bounded) until Triton no longer reports the model ready.

What a command exits with (:attr:`UnloadResult.exit_code`): 0 when the model is gone or stays for another
pod; 14 when, without a pod identity or force, pods hold fresh leases on it; 13 when Triton kept it LOADING past
the deadline, or still served it past the deadline after its folder was removed; 16 when Triton did not answer
— when the folder is left, for gc, this pod's lease is already dropped.
:attr:`UnloadResult.reason` says which, in one line: the termination message of the command (:func:`ended`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

from tritonshare.common.errors import ExitCode, TritonUnavailable
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import DEFAULT_TTL_S, Holder, LeaseStore, Release, judging_ttl
from tritonshare.common.repository import discard, move_out, wait_until
from tritonshare.common.termination import write_termination_message
from tritonshare.common.triton import TritonClient

logger = logging.getLogger(__name__)

# What Triton 2.51 answers (503) to POST /v2/repository/models/NAME/unload in POLL mode (checked here).
POLL_REFUSAL = "explicit model load / unload is not allowed if polling is enabled"


class Activity(enum.Enum):
    """What Triton says it is doing with NAME, as far as removing NAME's folder goes."""

    QUIET = "quiet"  # Triton answered, and its index does not say LOADING: the folder may go
    LOADING = "loading"  # the index says LOADING: removing the folder now would hang the load
    UNANSWERED = "unanswered"  # no answer, or an error: Triton may be starting up, loading this very folder


def activity(client: TritonClient, name: str) -> Activity:
    try:
        states = client.model_states(name)
    except TritonUnavailable:
        return Activity.UNANSWERED
    return Activity.LOADING if any(s.state == "LOADING" for s in states) else Activity.QUIET


def wait_quiet(client: TritonClient, name: str, *, timeout_s: float, interval_s: float) -> Activity:
    """Look until Triton answers that NAME is not LOADING, or the deadline passes; returns the last look."""
    last = [Activity.UNANSWERED]

    def quiet() -> bool:
        last[0] = activity(client, name)
        return last[0] is Activity.QUIET

    wait_until(quiet, timeout_s=timeout_s, interval_s=interval_s)
    return last[0]


def request_unload(client: TritonClient, name: str) -> bool:
    """Ask Triton to unload NAME once its folder is gone; True if Triton accepted or the call is moot.

    Explicit mode (``--model-control-mode=explicit``) keeps serving a model — and its GPU memory — whose
    folder was removed, until asked: Triton 2.51 answers 200 at once and unloads in the background. POLL
    mode refuses the call with :data:`POLL_REFUSAL`, which is fine: there, removing the folder unloads."""
    try:
        reply = client.unload(name)
    except TritonUnavailable as exc:
        logger.warning("could not ask Triton to unload %s: %s", name, exc)
        return False
    if reply.status == 200:
        logger.info("asked Triton to unload %s", name)
        return True
    if POLL_REFUSAL in reply.error_text():
        return True  # POLL mode: the removed folder is the unload
    logger.warning(
        "Triton refused to unload %s (%d: %s) — it may keep serving it until it restarts",
        name,
        reply.status,
        reply.error_text(),
    )
    return False


@dataclass(frozen=True, kw_only=True)
class UnloadSettings:
    name: str
    layout: NodeLayout
    holder: Holder | None = None  # this pod; None: an operator, who removes only what no pod holds, or with force
    force: bool = False  # without a holder: remove the folder even while other pods' leases on it are fresh
    lease_ttl_s: float = DEFAULT_TTL_S
    triton_url: str = "http://127.0.0.1:8000"
    timeout_s: float = 60.0
    poll_interval_s: float = 0.25


@dataclass(frozen=True, kw_only=True)
class UnloadResult:
    removed: bool
    unloaded: bool  # Triton no longer reports the model ready (or could not be asked after the removal)
    kept: bool = False  # not this pod's to remove: another pod's lease is fresh, or this pod holds none
    left: Activity | None = None  # the folder stayed because Triton was LOADING it, or did not answer
    reason: str = ""  # why it is not done, in one line (empty when done)
    refused: bool = False  # without a pod identity or --force: other pods' fresh leases kept it

    @property
    def done(self) -> bool:
        return self.unloaded or self.kept

    @property
    def exit_code(self) -> ExitCode:
        if self.left is Activity.UNANSWERED:
            return ExitCode.TRITON_UNAVAILABLE
        if self.refused:
            return ExitCode.INSTALL_CONFLICT
        return ExitCode.OK if self.done else ExitCode.READINESS_TIMEOUT


def ended(result: UnloadResult, termination_log: Path | None) -> int:
    """The exit code of a command that ends with ``result`` (``tritonshare unload``, the proxy): when not 0,
    the reason is logged and written as the termination message, so the pod status shows it, as a failed
    load's is."""
    code = result.exit_code
    if code != ExitCode.OK:
        logger.error("exiting with %d: %s", code, result.reason)
        write_termination_message(result.reason, termination_log)
    return int(code)


def unload_model(settings: UnloadSettings, *, client: TritonClient | None = None) -> UnloadResult:
    client = client or TritonClient(settings.triton_url)
    name = settings.name
    leases = LeaseStore(settings.layout.leases, ttl_s=judging_ttl(settings.lease_ttl_s))  # as the loader
    seen = wait_quiet(client, name, timeout_s=settings.timeout_s, interval_s=settings.poll_interval_s)
    if seen is not Activity.QUIET:
        if settings.holder is not None:
            leases.forget(name, settings.holder)
        return _left(settings, seen)
    verdict, taken = _release(settings, leases, client)
    if taken.trash is not None:
        discard(taken.trash)  # outside NAME's lock: a loader of NAME need not wait behind a large delete
    if verdict is not Release.LAST:
        return _kept(settings, taken)
    if taken.left is not None:
        return _left(settings, taken.left)
    if taken.trash is None:
        logger.info("%s is not in %s; nothing to remove", name, settings.layout.repository)
    unloaded = _wait_unloaded(client, name, settings)
    reason = "" if unloaded else f"Triton still serves {name} {settings.timeout_s:.0f}s after its folder was removed"
    return UnloadResult(removed=taken.trash is not None, unloaded=unloaded, reason=reason)


def _kept(settings: UnloadSettings, taken: _Taken) -> UnloadResult:
    if taken.in_use_by is None:
        return UnloadResult(removed=False, unloaded=False, kept=True)
    reason = (
        f"{settings.name} stays in the repository: in use by {', '.join(taken.in_use_by)} (fresh leases) — delete "
        "those pods (their unload removes it), or pass --force to remove it from under them"
    )
    return UnloadResult(removed=False, unloaded=False, refused=True, reason=reason)


def _left(settings: UnloadSettings, seen: Activity) -> UnloadResult:
    """The folder stays, and this pod's lease is already dropped: gc removes the folder once Triton is quiet, if
    no one holds it."""
    if seen is Activity.LOADING:
        why = "Triton is still LOADING it, and removing it now would hang Triton's polling for every model"
    else:
        why = (
            f"Triton at {settings.triton_url} does not answer, and a Triton that is starting up loads every model "
            "of its repository before it answers, so removing the folder now could hang its start-up"
        )
    dropped = "; this pod's lease on it is dropped" if settings.holder is not None else ""
    reason = (
        f"{settings.layout.model_dir(settings.name)} stays in the repository: {why} "
        f"(waited {settings.timeout_s:.0f}s){dropped} — gc removes it once Triton answers and no pod holds a lease "
        "on it, or run unload again later"
    )
    return UnloadResult(removed=False, unloaded=False, left=seen, reason=reason)


@dataclass
class _Taken:
    """What :func:`_release` did under NAME's lock: where the folder went (deleted once the lock is released),
    or why it stayed although no other pod holds it."""

    trash: Path | None = None
    left: Activity | None = None
    in_use_by: list[str] | None = None  # without a pod identity: the pods whose fresh leases kept it


def _release(settings: UnloadSettings, leases: LeaseStore, client: TritonClient) -> tuple[Release, _Taken]:
    """Drop this pod's lease; take the folder out, and ask Triton to unload it, if it was the last fresh lease
    (or with no pod identity). Under NAME's lock, so a loader cannot publish NAME again in between; and Triton
    is asked again there, as a load may have begun since the wait."""
    name, holder, taken = settings.name, settings.holder, _Taken()

    def remove() -> None:
        seen = activity(client, name)
        if seen is not Activity.QUIET:
            taken.left = seen
            return
        taken.trash = move_out(settings.layout, name)
        request_unload(client, name)

    if holder is None:
        with leases.lock(name):
            users = [str(lease.holder) for lease in leases.fresh(name)]
            if users and not settings.force:
                taken.in_use_by = users
                return Release.SHARED, taken
            remove()
            if taken.left is None:
                leases.drop(name)
        return Release.LAST, taken
    verdict = leases.release(name, holder, remove=remove)
    if verdict is Release.SHARED:
        logger.info("%s stays in the repository: another pod's lease on it is fresh", name)
    elif verdict is Release.NOT_HELD:
        logger.warning("%s stays in the repository: %s holds no lease on it — not this pod's to remove", name, holder)
    return verdict, taken


def _wait_unloaded(client: TritonClient, name: str, settings: UnloadSettings) -> bool:
    def gone() -> bool:
        try:
            return not client.model_ready(name)
        except TritonUnavailable:
            return True  # the folder is gone: a Triton that comes back will not load it

    ok = wait_until(gone, timeout_s=settings.timeout_s, interval_s=settings.poll_interval_s)
    if ok:
        logger.info("Triton no longer serves %s", name)
    else:
        logger.warning("Triton still reports %s ready after %.0fs", name, settings.timeout_s)
    return ok
