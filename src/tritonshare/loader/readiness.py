"""Waiting for Triton to serve a published model, and telling why it does not.

``poll`` mode (Triton's ``--model-control-mode=poll``): the folder is already in the repository; Triton
loads it at its next poll. Every ``interval_s`` the waiter asks ``GET /v2/models/NAME/ready`` and reads
``POST /v2/repository/index`` so a failed load is reported at once with Triton's reason (triton#6534,
#6710) instead of at the deadline.

``explicit`` mode: ``POST /v2/repository/models/NAME/load`` returns when the load has finished or failed.

Two facts about Triton 2.51's index shape the poll waiter (both seen here):

- a folder Triton has not looked at yet is listed by name only (state ""); a config.pbtxt Triton cannot
  parse keeps it that way for good (Triton only logs "Poll failed for model directory");
- a name Triton loaded or failed before keeps its last state while its folder is gone, and shows it again
  when a folder of that name reappears, until the next poll. So an UNAVAILABLE entry counts as this
  load's failure only once Triton shows it picked the new folder up (name-only, LOADING or READY seen, or
  a different reason), or after ``stale_grace_s``. Reason "unloaded" is never a load failure.
"""

from __future__ import annotations

import http.client
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tritonshare.common.errors import ReadinessTimeout, TritonLoadFailed, TritonUnavailable, UsageError, clip
from tritonshare.common.triton import ModelState, TritonClient
from tritonshare.common.unload import POLL_REFUSAL

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], None]

UNLOADED = "unloaded"  # Triton's reason for a model it unloaded on purpose
STALE_GRACE_S = 30.0  # twice Triton's default --repository-poll-secs (15)
# How often a waiter looks. Measured against Triton 2.51 (POLL 1 s, 10 loads each): the loader noticed a ready
# model 115 ms (median) after Triton first answered ready when looking every 0.25 s, 67 ms every 0.1 s. A look
# is one GET of NAME's readiness, plus one read of the repository index while NAME is not ready.
POLL_INTERVAL_S = 0.1
SAY_EVERY_S = 30.0  # how often a wait logs what Triton says
# what to do about a load Triton refused (exit 12): the model is at fault, not the node or the loader
FIX_THE_MODEL = " — fix the model at its source (config.pbtxt or files; Triton's log on the node has the whole reason)"


@dataclass(frozen=True)
class Look:
    """One look at Triton: is NAME ready, what does the index say, or why Triton did not answer."""

    ready: bool = False
    states: tuple[ModelState, ...] = ()
    error: str = ""
    others_loading: tuple[str, ...] = ()  # other models Triton is LOADING: a poll waits for every load it started

    @property
    def held_up(self) -> str:
        """While Triton has not started on NAME, the other loads its polling waits for ("" if none)."""
        if self.error or any(s.state for s in self.states) or not self.others_loading:
            return ""
        names = ", ".join(self.others_loading[:3])
        if len(self.others_loading) > 3:
            names += f" and {len(self.others_loading) - 3} more"
        return f"Triton's polling waits for the load of {names} (LOADING), as each poll waits for every load it started"

    @property
    def loading(self) -> bool:
        return any(s.state == "LOADING" for s in self.states)

    def failure(self) -> str:
        """Triton's reason when a version of NAME failed to load; "" otherwise."""
        return next((s.reason for s in self.states if s.state == "UNAVAILABLE" and s.reason != UNLOADED), "")

    def fresh(self) -> bool:
        """True when the index can only describe a folder Triton has looked at since it was published."""
        return any(s.state in ("", "LOADING", "READY") for s in self.states)


def look(client: TritonClient, name: str) -> Look:
    try:
        if client.model_ready(name):
            return Look(ready=True)
        index = client.repository_index()
        others = sorted({s.name for s in index if s.name != name and s.state == "LOADING"})
        return Look(states=tuple(s for s in index if s.name == name), others_loading=tuple(others))
    except TritonUnavailable as exc:
        return Look(error=str(exc))


@dataclass
class PollWaiter:
    """State of one wait in poll mode: when it started, the looks so far."""

    client: TritonClient
    name: str
    timeout_s: float
    interval_s: float = POLL_INTERVAL_S
    stale_grace_s: float = STALE_GRACE_S
    clock: Clock = time.monotonic
    sleep: Sleep = time.sleep
    reused: bool = False  # NAME was installed already: this load waits on it, it did not publish it
    started: float = field(init=False, default=0.0)
    picked_up: bool = field(init=False, default=False)
    first_reason: str | None = field(init=False, default=None)

    def wait(self) -> None:
        """Return when NAME is ready; raise TritonLoadFailed or ReadinessTimeout. Says it waits, and every
        ``SAY_EVERY_S`` what Triton's index says: a large model takes minutes, which must not look like a hang."""
        self.started = self.clock()
        said: float | None = None
        while True:
            seen = look(self.client, self.name)
            if seen.ready:
                return
            self._judge(seen)
            now = self.clock()
            if now - self.started >= self.timeout_s:
                raise ReadinessTimeout(self._timeout_message(seen))
            if said is None or now - said >= SAY_EVERY_S:
                logger.info("waiting for Triton to load %s (%.0f s of %.0f s): %s", self.name, now - self.started,
                            self.timeout_s, _state(seen))  # fmt: skip
                said = now
            self.sleep(self.interval_s)

    def _judge(self, seen: Look) -> None:
        reason = seen.failure()
        if seen.fresh() or (self.first_reason is not None and reason and reason != self.first_reason):
            self.picked_up = True
        if self.first_reason is None and seen.states:
            self.first_reason = reason
        trusted = self.picked_up or self.clock() - self.started >= self.stale_grace_s
        if reason and trusted:
            raise TritonLoadFailed(f"Triton failed to load {self.name}: {clip(reason, 600)}{FIX_THE_MODEL}")

    def _timeout_message(self, seen: Look) -> str:
        since = "finding it already installed (reused)" if self.reused else "publishing"
        head = f"{self.name} is not ready {self.clock() - self.started:.1f} s after {since}"
        if seen.error:
            return f"{head}: {seen.error}"
        if seen.loading:
            return f"{head}: Triton is still LOADING it — raise --timeout-s for a model this large or slow"
        if not seen.states:
            return f"{head}: Triton's index does not list it — is Triton's --model-repository this repository?"
        if seen.failure():
            return f"{head}: Triton still reports it UNAVAILABLE ({clip(seen.failure())}), maybe from an earlier load"
        if seen.held_up:
            return (
                f"{head}: Triton has not started loading it — {seen.held_up}; raise --timeout-s to wait for it, "
                "or ask the node's platform team about that model"
            )
        return (
            f"{head}: Triton has not started loading it — its polling may be held up by another model's load, or "
            "config.pbtxt does not match Triton's ModelConfig schema (Triton's log then says 'Poll failed')"
        )


def _state(seen: Look) -> str:
    if seen.error:
        return seen.error
    if seen.held_up:
        return seen.held_up
    return ", ".join(f"version {s.version or '-'} {s.state or 'not yet polled'}" for s in seen.states) or "not listed"


def wait_polled(
    client: TritonClient,
    name: str,
    *,
    timeout_s: float,
    interval_s: float = POLL_INTERVAL_S,
    reused: bool = False,
    sleep: Sleep = time.sleep,
) -> None:
    PollWaiter(client, name, timeout_s, interval_s, reused=reused, sleep=sleep).wait()


def load_explicitly(
    client: TritonClient,
    name: str,
    *,
    timeout_s: float,
    interval_s: float = POLL_INTERVAL_S,
    reused: bool = False,
    sleep: Sleep = time.sleep,
) -> None:
    """Ask Triton to load NAME and report its answer; the call lasts as long as the load, so there is
    nothing to poll (``interval_s`` and ``sleep`` are unused), and the messages read the same for a reused
    install."""
    loader = TritonClient(client.url, timeout_s=max(timeout_s, 0.1))
    try:
        reply = loader.load(name)
    except TritonUnavailable as exc:
        if isinstance(exc.__cause__, TimeoutError):
            raise ReadinessTimeout(f"Triton did not finish loading {name} within {timeout_s:g} s") from exc
        raise ReadinessTimeout(f"{name} could not be loaded: {exc}") from exc
    if POLL_REFUSAL in reply.error_text():  # the model was never tried: "fix the model" (exit 12) would mislead
        raise UsageError(
            f"Triton at {client.url} runs in POLL mode and refuses to load {name} when asked — use --mode poll"
        )
    if reply.status != 200:
        raise TritonLoadFailed(f"Triton failed to load {name}: {clip(reply.error_text(), 600)}{FIX_THE_MODEL}")
    if not client.model_ready(name):
        raise TritonLoadFailed(f"Triton accepted the load of {name} but does not report it ready")


def wait_unserved(
    client: TritonClient,
    name: str,
    folder: Path,
    *,
    timeout_s: float,
    interval_s: float = POLL_INTERVAL_S,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> None:
    """Before publishing NAME in poll mode: return once Triton no longer serves an earlier NAME whose folder
    left the repository (taken over, or unloaded by the pod this one replaces). Triton serves it until its
    next poll, and a folder published before then is never loaded as new: Triton reloads it in place, and
    until then answers "ready" for the old model — a load that exits 0 at once for a model Triton never
    loaded (a broken one stays unloaded, Triton serving the old one). Returns as soon as ``folder`` exists:
    another loader of NAME published, which install() resolves (reuse or conflict)."""
    started = clock()
    while not folder.exists() and _serves(client, name):
        if clock() - started >= timeout_s:
            raise ReadinessTimeout(
                f"Triton still serves an earlier {name} {clock() - started:.1f} s after its folder left the "
                "repository: its polling may be held up by another model's load — raise --timeout-s, or check "
                "Triton's log"
            )
        sleep(interval_s)


def _serves(client: TritonClient, name: str) -> bool:
    try:
        return client.model_ready(name)
    except TritonUnavailable:
        return False  # a Triton that comes back loads what the repository holds, not what it served


def nothing_to_wait_for(
    client: TritonClient, name: str, folder: Path, *, timeout_s: float, sleep: Sleep = time.sleep
) -> None:
    """Before publishing in explicit mode: the load call after it loads the new folder, whatever was served."""


class BeforePublish(Protocol):
    def __call__(
        self, client: TritonClient, name: str, folder: Path, *, timeout_s: float, sleep: Sleep = ...
    ) -> None: ...


# --mode → what must hold before a folder is published as NAME
BEFORE_PUBLISH: dict[str, BeforePublish] = {"poll": wait_unserved, "explicit": nothing_to_wait_for}


class Readiness(Protocol):
    def __call__(
        self,
        client: TritonClient,
        name: str,
        *,
        timeout_s: float,
        interval_s: float = ...,
        reused: bool = ...,
        sleep: Sleep = ...,
    ) -> None: ...


# --mode → how the published model becomes ready
MODES: dict[str, Readiness] = {"poll": wait_polled, "explicit": load_explicitly}


def wait_live(
    client: TritonClient,
    *,
    timeout_s: float,
    interval_s: float = POLL_INTERVAL_S,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> None:
    """Wait until Triton answers, before anything is downloaded.

    Triton down is a readiness timeout (exit 13), not a load failure (12): Triton never tried the model,
    and the cure is on the node (Triton restarting, a wrong --triton-url), not in the model. Waiting up to
    the readiness deadline rides out a Triton that starts together with the pod, as on a node's boot. An
    answer that cannot be Triton's HTTP endpoint (its gRPC port's HTTP/2, its metrics port's answer to
    anything) is a usage error at once: no wait makes a wrong --triton-url right.
    """
    started, said = clock(), False
    while True:
        try:
            if client.server_live():
                check_is_triton(client)
                return
            error = f"Triton at {client.url} answers, but not that it is live"
        except TritonUnavailable as exc:
            if isinstance(exc.__cause__, http.client.BadStatusLine):  # not HTTP/1.x: the gRPC port?
                raise UsageError(f"{client.url} does not answer in HTTP/1.1 (Triton's gRPC port?) — {_PORTS}") from exc
            error = str(exc)
        if clock() - started >= timeout_s:
            raise ReadinessTimeout(f"Triton is not reachable after {clock() - started:.1f} s: {error}")
        if not said:
            logger.info("waiting up to %.0f s for Triton at %s to answer: %s", timeout_s, client.url, error)
            said = True
        sleep(interval_s)


_PORTS = "--triton-url must name Triton's HTTP port (8000 by default; its gRPC port is 8001, metrics 8002)"


def check_is_triton(client: TritonClient) -> None:
    """UsageError unless ``GET /v2`` answers as a KServe v2 server does (a JSON object naming its version)."""
    reply = client.request("GET", "/v2")
    try:
        doc = reply.json()
    except ValueError:
        doc = None
    if reply.status != 200 or not isinstance(doc, dict) or "version" not in doc:
        raise UsageError(
            f"{client.url} answers, but not as Triton's HTTP endpoint (GET /v2: {reply.status} "
            f"{clip(reply.body.decode(errors='replace'), 80)!r}) — {_PORTS}"
        )
