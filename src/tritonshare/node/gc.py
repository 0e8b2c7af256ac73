"""``tritonshare gc``: removes what dead pods left behind, on every Triton node (k8s/base/gc).

A pod killed with SIGKILL, OOM or a lost node never runs its unload, and a loader killed mid-download
leaves its staging folder. Every ``interval_s`` one pass removes, and logs with its reason:

1. models in the repository whose every lease (:mod:`tritonshare.common.lease`) is older than
   ``lease_ttl_s``, or that have no lease and were installed longer ago than that — renamed out of the
   repository into staging, and deleted once every rename of the pass is done. Each is judged again under
   its lease lock right before its rename, Triton's index included: never while it says LOADING for the
   model, as removing a folder mid-load hangs that load and, with it, POLL for every tenant (REFERENCE §2);
   such a model waits for a later pass. If Triton cannot be asked, no more models are removed in that pass;
2. staging entries tritonshare made (``NAME.PURPOSE.ID``: a loader's workspace, a retired model) that
   nothing has written to for longer than the TTL (a loader killed mid-download, a delete cut short) —
   except a workspace of a model someone holds a fresh lease on (its loader is alive, maybe stalled).
   Anything else in staging is not tritonshare's and is left alone (logged once);
3. lease folders of models that are not installed and whose leases all expired.

Only NAMEs matching one of ``manage`` (fnmatch patterns) are touched, so models an operator put on the node
by other means can be kept out of reach.

Heartbeats are file mtimes, judged against the wall clock. When that clock steps forward (an NTP step, a VM
resumed from suspend or paused for a live migration) every lease looks older by the step, and live pods'
models would go: gc watches the wall clock against the monotonic one (:class:`StepWatch`) and, after a step
forward larger than a heartbeat interval (a tenth of the TTL), removes nothing for one TTL of monotonic time,
in which every live pod beats again.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tritonshare.common.errors import ExitCode, TritonshareError, TritonUnavailable
from tritonshare.common.layout import NodeLayout, is_model_name
from tritonshare.common.lease import DEFAULT_TTL_S, Clock, LeaseStore
from tritonshare.common.repository import discard, move_out, read_record
from tritonshare.common.triton import TritonClient
from tritonshare.common.unload import request_unload

logger = logging.getLogger(__name__)

# Staging entries tritonshare makes are NAME.PURPOSE.ID (repository.new_staging_dir, repository.retire);
# gc never touches any other name there.
_STAGING_ENTRY = re.compile(r"(?P<name>.+)\.(?P<purpose>[a-z]+)\.[0-9a-f]{12}")
_RETIRED = "retired"  # the PURPOSE of a model renamed out of the repository: garbage, nobody writes to it


@dataclass(frozen=True, kw_only=True)
class GcSettings:
    layout: NodeLayout = field(default_factory=NodeLayout)
    triton_url: str = "http://127.0.0.1:8000"
    triton_timeout_s: float = 5.0
    lease_ttl_s: float = DEFAULT_TTL_S  # a lease not refreshed for this long belongs to a dead pod
    interval_s: float = 30.0
    once: bool = False  # one pass, then exit
    manage: tuple[str, ...] = ("*",)  # fnmatch patterns of the model NAMEs gc may remove


@dataclass(frozen=True, kw_only=True)
class Removal:
    kind: Literal["model", "staging", "leases", "lease"]
    name: str
    path: Path
    reason: str


class StepWatch:
    """Tells whether the wall clock has run steadily beside the monotonic one for at least ``hold_s``: a step
    forward of more than ``tolerance_s`` between two looks starts a hold of ``hold_s`` (monotonic) seconds.
    CLOCK_MONOTONIC is never set, and stands still while a VM is suspended, so a step forward of the wall
    clock against it is what makes a fresh heartbeat look old. A step back only makes leases look fresher."""

    def __init__(self, wall: Clock, monotonic: Clock, *, tolerance_s: float, hold_s: float) -> None:
        self.wall, self.monotonic = wall, monotonic
        self.tolerance_s, self.hold_s = tolerance_s, hold_s
        self._offset = wall() - monotonic()
        self._hold_until = float("-inf")

    def steady(self) -> bool:
        now = self.monotonic()
        offset = self.wall() - now
        step, self._offset = offset - self._offset, offset
        if step > self.tolerance_s:
            self._hold_until = now + self.hold_s
            logger.warning(
                "the wall clock stepped %.0fs ahead (an NTP step, or a VM resumed from suspend?), so every lease "
                "looks %.0fs older than it is: gc removes nothing for the next %.0fs, while live pods beat again",
                step,
                step,
                self.hold_s,
            )
        return now >= self._hold_until


class Collector:
    """One node's garbage collector; :meth:`sweep` is one pass. ``clock`` is wall time (file times are);
    ``monotonic`` tells its steps (:class:`StepWatch`)."""

    def __init__(
        self,
        settings: GcSettings,
        *,
        client: TritonClient | None = None,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.settings = settings
        self.client = client or TritonClient(settings.triton_url, timeout_s=settings.triton_timeout_s)
        self.clock = clock
        self.store = LeaseStore(settings.layout.leases, ttl_s=settings.lease_ttl_s, clock=clock)
        ttl = settings.lease_ttl_s
        self.steps = StepWatch(clock, monotonic, tolerance_s=ttl / 10, hold_s=ttl)
        self._foreign: set[str] = set()  # staging entries not tritonshare's, already logged

    def sweep(self) -> list[Removal]:
        """One pass: staging leftovers first (they free the disk the other steps may need), then models, then
        leases (of models not installed, and of dead pods beside a live one); one step's failure does not stop
        the others (it is raised once all have run). Nothing while the wall clock is not steady."""
        if not self.steps.steady():
            logger.info("gc removes nothing this pass: the wall clock stepped ahead less than a TTL ago")
            return []
        removals: list[Removal] = []
        failed: list[Exception] = []
        for step in (self._staging, self._models, self._orphan_leases, self._dead_holders):
            try:
                removals += step()
            except (OSError, TritonshareError) as exc:
                failed.append(exc)
        for r in removals:
            logger.info("gc removed %s %s (%s): %s", r.kind, r.name, r.path, r.reason)
        if failed:
            raise failed[0]
        return removals

    def managed(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.settings.manage)

    # -- models in the repository

    def _models(self) -> list[Removal]:
        moved: list[tuple[Removal, Path]] = []
        try:
            for name in self._candidates():
                try:
                    outcome = self._move_out(name)
                except TritonUnavailable:
                    raise
                except (OSError, TritonshareError) as exc:  # this one stays; the others are judged on
                    logger.error("gc cannot remove %s: %s — the next pass tries again", name, exc)
                    continue
                if outcome is not None:
                    moved.append(outcome)
        except TritonUnavailable as exc:
            logger.warning("gc removes no more models this pass: %s", exc)
        finally:
            for _removal, trash in moved:  # after every rename: a slow delete must not delay the next check
                discard(trash)
        return [removal for removal, _trash in moved]

    def _candidates(self) -> list[str]:
        repository = self.settings.layout.repository
        # a link in the repository is the operator's (linked models): never renamed, nor what it leads to
        folders = [p for p in sorted(repository.iterdir()) if p.is_dir() and not p.is_symlink()]
        names = [p.name for p in folders if self.managed(p.name)]
        return [name for name in names if _keyable(name) and self._model_reason(name) is not None]

    def _model_reason(self, name: str) -> str | None:
        """Why NAME should go, or None while it is held (or too new to judge)."""
        now, ttl = self.clock(), self.settings.lease_ttl_s
        leases = self.store.leases(name)
        if leases:
            last = max(leases, key=lambda lease: lease.renewed_at)
            idle = last.idle_s(now)
            if idle <= ttl:
                return None
            if last.given_up:
                return f"every lease expired: {last.holder} gave the model up (its load failed or was stopped)"
            return f"every lease expired: the last heartbeat came {idle:.0f}s ago from {last.holder} (ttl {ttl:.0f}s)"
        installed = _installed_at(self.settings.layout.model_dir(name))
        if installed is None or now - installed <= ttl:
            return None
        return f"no lease, and installed {now - installed:.0f}s ago (ttl {ttl:.0f}s)"

    def _move_out(self, name: str) -> tuple[Removal, Path] | None:
        """Rename NAME out of the repository into staging; returns what was done and where the folder went.
        Judged again under NAME's lock (a loader may have taken a lease since the first look), and Triton
        asked right then (a load may have begun since the pass began)."""
        with self.store.lock(name):
            reason = self._model_reason(name)
            if reason is None or self._loading(name):
                return None
            trash = move_out(self.settings.layout, name)
            if trash is None:
                return None
            self.store.drop(name)
            request_unload(self.client, name)  # explicit mode keeps serving a removed folder until asked
        return Removal(kind="model", name=name, path=self.settings.layout.model_dir(name), reason=reason), trash

    def _loading(self, name: str) -> bool:
        """Whether Triton's index says LOADING for NAME now; raises TritonUnavailable if it cannot tell."""
        loading = any(state.state == "LOADING" for state in self.client.model_states(name))
        if loading:
            logger.info(
                "gc keeps %s this pass: Triton is LOADING it, and removing a folder mid-load would hang polling "
                "for every model",
                name,
            )
        return loading

    # -- staging leftovers and orphan leases

    def _staging(self) -> list[Removal]:
        now, ttl = self.clock(), self.settings.lease_ttl_s
        removals = []
        paths = sorted(self.settings.layout.staging.iterdir())
        entries = [(path, entry) for path in paths if (entry := self._entry(path)) is not None]
        changes = {path: _last_change(path) for path, _entry in entries}
        newest = _newest_workspaces(entries, changes)
        for path, entry in entries:
            changed = changes[path]
            if not self.managed(entry["name"]) or changed is None or now - changed <= ttl:
                continue
            if newest.get(entry["name"]) == path and self._in_use(path, entry):
                continue
            _delete(path)
            reason = f"staging leftover untouched for {now - changed:.0f}s (ttl {ttl:.0f}s)"
            removals.append(Removal(kind="staging", name=path.name, path=path, reason=reason))
        return removals

    def _entry(self, path: Path) -> re.Match[str] | None:
        """PATH's NAME and PURPOSE if tritonshare made it, else None (logged once)."""
        match = _STAGING_ENTRY.fullmatch(path.name)
        if match is None or not is_model_name(match["name"]):
            if path.name not in self._foreign:
                self._foreign.add(path.name)
                logger.info(
                    "gc leaves %s alone: tritonshare did not make it (its staging entries are NAME.PURPOSE.ID) — "
                    "remove it by hand if nothing needs it",
                    path,
                )
            return None
        return match

    def _in_use(self, path: Path, entry: re.Match[str]) -> bool:
        """Whether PATH, its model's newest workspace, is that of a loader still downloading: a fresh lease on
        its model, which is not installed yet — alive even if its download has not written for a TTL (a stalled
        source). Older workspaces of the model are a crash-looping loader's earlier attempts, never kept. Once
        the model is installed, a workspace beside it is a killed loader's leftover (the loader that installed
        it removed its own), whoever holds the model now. Retired models are nobody's."""
        if entry["purpose"] == _RETIRED or self.settings.layout.model_dir(entry["name"]).exists():
            return False
        holders = [str(lease.holder) for lease in self.store.fresh(entry["name"])]
        if holders:
            logger.info("gc keeps %s: %s holds a fresh lease on %s", path, ", ".join(holders), entry["name"])
        return bool(holders)

    def _orphan_leases(self) -> list[Removal]:
        removals = []
        for name in self.store.names():
            if not self.managed(name) or self.settings.layout.model_dir(name).exists() or self.store.fresh(name):
                continue
            with self.store.lock(name):
                if self.settings.layout.model_dir(name).exists() or self.store.fresh(name):
                    continue
                self.store.drop(name)
            reason = "model not installed and every lease expired"
            removals.append(Removal(kind="leases", name=name, path=self.store.root / name, reason=reason))
        return removals

    def _dead_holders(self) -> list[Removal]:
        """The expired leases of a model other pods still hold: pods SIGKILLed in a rollout leave them, and
        nothing else removes them while the model stays in use (50 of them beside one live lease were kept)."""
        removals = []
        for name in self.store.names():
            if not self.managed(name) or not self._expired_beside_fresh(name):
                continue
            with self.store.lock(name):
                if not self._expired_beside_fresh(name):
                    continue
                for lease in self.store.expired(name):
                    if self.store.forget(name, lease.holder):
                        reason = f"expired {lease.idle_s(self.clock()):.0f}s ago while another pod holds the model"
                        path = self.store.path(name, lease.holder)
                        removals.append(Removal(kind="lease", name=f"{name} {lease.holder}", path=path, reason=reason))
        return removals

    def _expired_beside_fresh(self, name: str) -> bool:
        return bool(self.store.expired(name)) and bool(self.store.fresh(name))


def run(
    settings: GcSettings,
    *,
    stop: threading.Event | None = None,
    clock: Clock = time.time,
    monotonic: Clock = time.monotonic,
) -> int:
    """Sweep every ``interval_s`` until SIGTERM/SIGINT (or ``stop``); with ``once``, sweep once."""
    settings.layout.check()
    collector = Collector(settings, clock=clock, monotonic=monotonic)
    if stop is None:
        stop = threading.Event()
        if not settings.once:
            _stop_on_signals(stop)
    logger.info(
        "gc of %s, %s and %s: lease ttl %.0fs, %s, models matching %s",
        settings.layout.repository,
        settings.layout.staging,
        settings.layout.leases,
        settings.lease_ttl_s,
        "one pass" if settings.once else f"every {settings.interval_s:.0f}s",
        " ".join(settings.manage),
    )
    while True:
        ok = _sweep(collector)
        if settings.once:
            return ExitCode.OK if ok else ExitCode.UNEXPECTED
        if stop.wait(settings.interval_s):
            return ExitCode.OK


def _sweep(collector: Collector) -> bool:
    try:
        collector.sweep()
    except (OSError, TritonshareError) as exc:
        logger.error("gc pass failed: %s — the next pass tries again", exc)
        return False
    except Exception:  # a bug, or a tree no one foresaw: logged, and the sidecar lives on to try again
        logger.exception("gc pass failed unexpectedly — the next pass tries again")
        return False
    return True


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, _frame: object) -> None:
        logger.info("received %s: stopping after this pass", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _keyable(name: str) -> bool:
    if is_model_name(name):
        return True
    logger.warning("gc leaves %s alone: its folder name is not a valid model NAME, so no lease can name it", name)
    return False


def _newest_workspaces(entries: list[tuple[Path, re.Match[str]]], changes: dict[Path, float | None]) -> dict[str, Path]:
    """Per NAME, its most recently changed workspace (not retired): the only one a live loader can be using."""
    newest: dict[str, Path] = {}
    for path, entry in entries:
        name, changed = entry["name"], changes[path] or 0.0
        if entry["purpose"] != _RETIRED and (name not in newest or changed >= (changes[newest[name]] or 0.0)):
            newest[name] = path
    return newest


def _installed_at(model_dir: Path) -> float | None:
    """When NAME was installed: its install record, else the folder's own times (rename sets its ctime)."""
    record = read_record(model_dir)
    if record is not None and record.installed_at:
        return record.installed_at
    try:
        st = model_dir.stat()
    except FileNotFoundError:
        return None
    return max(st.st_mtime, st.st_ctime)


def _last_change(path: Path) -> float | None:
    """Newest max(mtime, ctime) in a tree; None if it vanished. ctime counts because unpacked archives keep
    old mtimes, while ctime is when the file was made here — a download in progress always looks new.
    Walked with a stack, not recursion: a tree 1,200 levels deep ended the sidecar with RecursionError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    newest = max(st.st_mtime, st.st_ctime)
    pending = [path] if stat.S_ISDIR(st.st_mode) else []
    while pending:
        for child in _children(pending.pop()):
            try:
                st = os.lstat(child)
            except FileNotFoundError:
                continue
            newest = max(newest, st.st_mtime, st.st_ctime)
            if stat.S_ISDIR(st.st_mode):
                pending.append(child)
    return newest


def _children(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        discard(path)
    else:
        path.unlink(missing_ok=True)
