"""Installing a model under NAME: decide before downloading whether it is already there, publish it with
one rename, and take it back out when Triton cannot load it — only what this loader published, only when
no other pod's lease on NAME is fresh, and only once Triton answers that it is not loading it.

What is installed is identified by the source URI and a digest of the source's *listing* (every object's
path, size, checksum and version), known before a byte is downloaded: a restarted init container finds
its own install and reuses it without downloading (kserve#1741/#280), and a NAME holding anything else is
a conflict, never overwritten.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tritonshare.common.errors import InstallConflict
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import DEFAULT_TTL_S, Holder, Lease, LeaseStore, judging_ttl
from tritonshare.common.repository import InstallRecord, discard, move_out, publish, read_record, write_record
from tritonshare.common.triton import TritonClient
from tritonshare.common.unload import Activity, activity, request_unload, wait_quiet
from tritonshare.loader.sources.base import RemoteObject

logger = logging.getLogger(__name__)


def listing_digest(objects: Iterable[RemoteObject], query: str = "") -> str:
    """sha256 over the sorted (relpath, size, checksum, version) of every listed object — and the source URL's
    :func:`~tritonshare.loader.sources.base.query_identity`, when it has one (the recorded source masks it)."""
    h = hashlib.sha256()
    if query:
        h.update(f"query\0{query}\n".encode())
    for obj in sorted(objects, key=lambda o: o.relpath):
        checksum = f"{obj.checksum.algorithm}:{obj.checksum.value}" if obj.checksum else "-"
        h.update(f"{obj.relpath}\0{obj.size}\0{checksum}\0{obj.version}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Installed:
    path: Path
    reused: bool  # True when NAME already held this install and nothing was published


def existing(layout: NodeLayout, wanted: InstallRecord, *, users: Sequence[str] = ()) -> InstallRecord | None:
    """The record of ``repository/NAME`` when it holds this very install; None when NAME is free.
    Raises InstallConflict when it holds anything else, naming ``users`` (the pods that hold it) if given."""
    target = layout.model_dir(wanted.name)
    if not os.path.lexists(target):  # a link to nothing holds NAME too: an operator's, whose volume is gone
        return None
    found = read_record(target)
    if found is not None and found.same_content(wanted):
        return found
    raise InstallConflict(_conflict(target, wanted, found, users))


def users(layout: NodeLayout, name: str, holder: Holder | None, lease_ttl_s: float = DEFAULT_TTL_S) -> list[str]:
    """The pods other than ``holder`` whose leases on NAME are fresh (judged as :func:`withdraw` judges)."""
    leases = LeaseStore(layout.leases, ttl_s=judging_ttl(lease_ttl_s))
    return [str(lease.holder) for lease in _fresh_others(leases, name, holder)]


def _conflict(target: Path, wanted: InstallRecord, found: InstallRecord | None, users: Sequence[str]) -> str:
    name = wanted.name
    advice = f"unload it first (tritonshare unload --name {name}) or choose another --name"
    if users:  # following the advice above would take their model from under them
        advice = (
            f"it is in use by {', '.join(users)}: choose another --name, or delete those pods first (their unload "
            "removes it)"
        )
    if found is None:
        return f"{target} exists but was not installed by tritonshare (no readable record) — {advice}"
    if found.source != wanted.source:
        return f"{target} holds {name!r} installed from {found.source}, not {wanted.source} — {advice}"
    return (
        f"{target} holds {name!r} from {wanted.source} as it was before: the source changed since "
        f"(listing digest {found.digest[:12]} → {wanted.digest[:12]}) — {advice}"
    )


def install(layout: NodeLayout, root: Path, record: InstallRecord, *, files_flushed: bool = False) -> Installed:
    """Record what ``root`` is, then publish it as ``repository/NAME`` with one rename (``files_flushed``: the
    caller flushed the files of ``root`` already, :func:`~tritonshare.common.repository.flush_tree`). If another
    loader of the same source published first, its copy is reused and ``root`` is left to the caller to discard."""
    stamped = InstallRecord(name=record.name, source=record.source, digest=record.digest, installed_at=time.time())
    write_record(root, stamped)  # a full disk raises InsufficientSpace there; the record is flushed
    try:
        return Installed(publish(layout, root, record.name, files_flushed=files_flushed), reused=False)
    except InstallConflict:
        if existing(layout, record) is None:  # it vanished again: let the caller fail rather than loop
            raise
        logger.info("%s was installed from the same source meanwhile; using that copy", record.name)
        return Installed(layout.model_dir(record.name), reused=True)


class Withdrawal(enum.Enum):
    """What :func:`withdraw` did with repository/NAME. For a folder that stays, the value says why and what
    removes it later (``{name}``: the model's NAME)."""

    REMOVED = "taken out of the repository"
    REUSED = (
        "this load reused it (it was installed before), and other pods may be using it — gc removes it once no "
        "pod holds a lease on it"
    )
    SHARED = "another pod's lease on it is fresh: that pod uses this install"
    LOADING = (
        "Triton is LOADING it, and removing it now would hang Triton's polling for every model — "
        "`tritonshare unload --name {name}` removes it once the load ends"
    )
    UNANSWERED = (
        "Triton does not answer, and a Triton that is starting up loads every model of its repository before it "
        "answers, so removing it now could hang that start-up — gc removes it once Triton answers and no pod "
        "holds a lease on it"
    )

    def why(self, name: str) -> str:
        return self.value.format(name=name)


def withdraw(
    layout: NodeLayout,
    name: str,
    client: TritonClient,
    *,
    timeout_s: float,
    interval_s: float = 0.25,
    holder: Holder | None = None,
    lease_ttl_s: float = DEFAULT_TTL_S,
    reused: bool = False,
) -> Withdrawal:
    """Take ``repository/NAME`` back out after a failed load: rename it into staging, delete it, and ask
    Triton to unload it (explicit mode keeps serving a model whose folder is gone).

    Only a folder this loader published (not ``reused``), and, like :meth:`LeaseStore.release`, only under
    NAME's lease lock while no lease but ``holder``'s (this pod's) is fresh: two pods of one model share one
    install. Never while Triton is LOADING it or does not answer (REFERENCE §2: removing a folder mid-load
    hangs that load and, with it, POLL for every tenant; Triton loads its whole repository before it
    answers): wait up to ``timeout_s`` for Triton to say it is not loading NAME, else leave the folder.
    Triton re-tries a failed model at every poll, so call this as soon as a failure is seen, while the next
    poll is furthest away.
    """
    if reused:
        return _kept(name, Withdrawal.REUSED)
    leases = LeaseStore(layout.leases, ttl_s=judging_ttl(lease_ttl_s))
    if _held_by_others(leases, name, holder):
        return _kept(name, Withdrawal.SHARED)
    seen = wait_quiet(client, name, timeout_s=timeout_s, interval_s=interval_s)
    if seen is not Activity.QUIET:
        return _kept(name, _UNQUIET[seen])
    with leases.lock(name):
        outcome, trash = _take_out(layout, leases, name, client, holder)
    if trash is not None:
        discard(trash)  # outside NAME's lock: a loader of NAME need not wait behind a large delete
        logger.info("took %s back out of the repository", name)
    return outcome if outcome is Withdrawal.REMOVED else _kept(name, outcome)


_UNQUIET = {Activity.LOADING: Withdrawal.LOADING, Activity.UNANSWERED: Withdrawal.UNANSWERED}


def _take_out(
    layout: NodeLayout, leases: LeaseStore, name: str, client: TritonClient, holder: Holder | None
) -> tuple[Withdrawal, Path | None]:
    """Under NAME's lock: judge again (a pod may have taken a lease, or a load begun, since the first look),
    then rename the folder out, ask Triton to unload it, and forget the expired leases of the pods that held
    what is gone. The delete is the caller's, once the lock is released."""
    if _held_by_others(leases, name, holder):
        return Withdrawal.SHARED, None
    seen = activity(client, name)
    if seen is not Activity.QUIET:
        return _UNQUIET[seen], None
    trash = move_out(layout, name)
    if trash is not None:
        request_unload(client, name)
    own = holder.uid if holder is not None else None
    for lease in leases.expired(name):  # none fresh but this pod's (checked above)
        if lease.holder.uid != own:
            leases.forget(name, lease.holder)
    return Withdrawal.REMOVED, trash


def take_over(
    layout: NodeLayout,
    wanted: InstallRecord,
    client: TritonClient,
    *,
    holder: Holder | None,
    lease_ttl_s: float = DEFAULT_TTL_S,
    clock: Callable[[], float] = time.time,
) -> bool:
    """Retire ``repository/NAME`` when it holds another tritonshare install (another source, or the source as
    it was) that no pod uses any more, so that ``wanted`` can be installed now rather than after gc's next
    pass: a rollout to a new model version must not wait for the TTL behind a pod killed without SIGTERM, or
    an unload Triton did not answer. Abandoned means what gc counts: every other pod's lease expired — or no
    lease at all and installed more than a TTL ago (a load run by hand takes no lease). Never a folder
    without tritonshare's record, never one in use, never while Triton is LOADING it or does not answer
    (:func:`withdraw`'s rules). Returns True when NAME is free now."""
    name = wanted.name
    found = read_record(layout.model_dir(name))
    if found is None:
        return False  # not installed by tritonshare: an operator's folder is never touched
    leases = LeaseStore(layout.leases, ttl_s=judging_ttl(lease_ttl_s))
    others = [lease for lease in leases.leases(name) if holder is None or lease.holder.uid != holder.uid]
    if not others and clock() - found.installed_at <= judging_ttl(lease_ttl_s):
        return False  # unleased and recent: maybe a load by hand, gc's rule too
    if withdraw(layout, name, client, timeout_s=0, holder=holder, lease_ttl_s=lease_ttl_s) is not Withdrawal.REMOVED:
        return False
    logger.warning(
        "took over %s: it held %s (listing digest %s), which no pod uses any more; installing %s",
        name,
        found.source,
        found.digest[:12],
        wanted.source,
    )
    return True


def _held_by_others(leases: LeaseStore, name: str, holder: Holder | None) -> bool:
    return bool(_fresh_others(leases, name, holder))


def _fresh_others(leases: LeaseStore, name: str, holder: Holder | None) -> list[Lease]:
    own = holder.uid if holder is not None else None
    return [lease for lease in leases.fresh(name) if lease.holder.uid != own]


def _kept(name: str, outcome: Withdrawal) -> Withdrawal:
    logger.warning("%s stays in the repository: %s", name, outcome.why(name))
    return outcome
