"""Admission control for the pod's own model: a concurrency cap with a bounded FIFO queue, behind a token
bucket (issue 9, "fairness"). One :class:`Admission` per proxy process, shared by the REST and gRPC front
ends, so the limits hold for both protocols together.

What happens to an inference request (the routes in :data:`LIMITED_ROUTES`; probes are never limited, and
never reach Triton per request: the proxy answers them, :mod:`tritonshare.proxy.readiness`):

1. ``--rate-limit-rps R`` / ``--rate-limit-burst B``: each request takes a token from a bucket that holds
   at most B tokens and refills at R per second; no token → refused at once ("rate_limited").
2. ``--max-inflight N``: at most N requests hold a slot, i.e. are at Triton (a gRPC stream holds its slot
   while it is open). A request that finds every slot taken waits in a FIFO queue of at most
   ``--max-queue M`` (full → refused at once, "queue_full") for at most ``--queue-timeout-s T`` (then
   refused, "queue_timeout"). A freed slot is handed straight to the oldest waiter, so nobody overtakes.

Every other request that reaches Triton — server and model metadata, config, statistics, a model (version)'s
readiness: :data:`METADATA_ROUTES` — takes a token of a bucket of its own, with the same rate and burst
(:meth:`Admission.take_metadata_token`), or is refused at once; it takes no slot and never waits, so metadata
does not queue behind a busy model's inference. Without it a tenant capped at 5 inference requests a second sent
10k config requests a second to the shared Triton. A bucket of their own rather than the inference bucket: a
client that reads its model's metadata or config before its calls (PyTriton's ModelClient does) does not
spend its inference rate on it, nor can a metadata flood starve the tenant's own inference; what the tenant
can ask of Triton stays bounded, at twice the rate. ``--max-inflight`` alone leaves metadata unbounded: set a
rate too.

Refusals are HTTP 429 with ``Retry-After`` (REST) or gRPC status RESOURCE_EXHAUSTED (see
:data:`HTTP_STATUS`, :data:`GRPC_STATUS`).

The hot path has no task, no future and no lock: front ends call it from ``asyncio.Protocol`` callbacks::

    if admission.active and not admission.try_acquire():        # off: one attribute check
        self.ticket = admission.enqueue(self.on_admission)      # answer later, via loop.call_soon
        return                                                  # (pause reading meanwhile)
    self.holding = True                                         # ... forward; when the response or
                                                                # stream is over: admission.release()

``on_admission(refusal)`` runs exactly once unless the ticket is cancelled: with ``None`` the request now
holds a slot (forward it, later ``release()``); with a :class:`Refusal` it holds none (answer the refusal).
A client that goes away while waiting: ``ticket.cancel()`` (safe in any state; it gives back a slot that
was handed over but not yet delivered).

Counters are plain integers, exported by a Prometheus collector only when scraped, and refusals are
summarised in one log line per interval, never one per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from tritonshare.common.errors import UsageError

logger = logging.getLogger(__name__)

HTTP_STATUS = 429  # Too Many Requests, with Retry-After (RFC 6585 §4)
GRPC_STATUS = 8  # RESOURCE_EXHAUSTED; also send grpc-retry-pushback-ms (the gRPC retry policy honours it)

# Policy route labels (tritonshare.proxy.policy) that take a slot, by protocol: the requests that make Triton compute.
LIMITED_BY_PROTOCOL: dict[str, frozenset[str]] = {
    "rest": frozenset({"infer", "generate", "generate_stream"}),
    "grpc": frozenset({"ModelInfer", "ModelStreamInfer"}),
}
LIMITED_ROUTES = frozenset().union(*LIMITED_BY_PROTOCOL.values())
# Policy route labels of the other requests forwarded to Triton: they take a token of the metadata bucket.
METADATA_BY_PROTOCOL: dict[str, frozenset[str]] = {
    "rest": frozenset({"server_metadata", "model_metadata", "model_ready", "model_config", "model_stats"}),
    "grpc": frozenset({"ServerMetadata", "ModelMetadata", "ModelReady", "ModelConfig", "ModelStatistics"}),
}
METADATA_ROUTES = frozenset().union(*METADATA_BY_PROTOCOL.values())

LOG_INTERVAL_S = 10.0
_SLACK_S = 0.001  # timers may fire up to one clock tick early (asyncio's clock resolution)


@dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    """The limits of one model; 0 turns a limit off (the default: no admission control at all)."""

    max_inflight: int = 0  # requests at Triton at once
    max_queue: int = 128  # waiting for a slot; more are refused at once
    queue_timeout_s: float = 10.0  # longest wait for a slot
    rate_limit_rps: float = 0.0  # token refill rate
    rate_limit_burst: int = 0  # bucket size; 0 = one second's worth (ceil(rps), at least 1)

    def __post_init__(self) -> None:
        for name in ("max_inflight", "max_queue", "rate_limit_rps", "rate_limit_burst"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be 0 (off) or positive, not {getattr(self, name)}")
        if not self.queue_timeout_s > 0:
            raise UsageError(f"--queue-timeout-s must be positive, not {self.queue_timeout_s}")

    @property
    def active(self) -> bool:
        return self.max_inflight > 0 or self.rate_limit_rps > 0

    @property
    def burst(self) -> int:
        return self.rate_limit_burst or max(1, math.ceil(self.rate_limit_rps))


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused, in words for the caller, and when it may retry."""

    reason: str  # "rate_limited" | "queue_full" | "queue_timeout": the metrics/log label
    message: str
    retry_after_s: int  # whole seconds, for Retry-After (REST) and grpc-retry-pushback-ms (gRPC)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    """The part of the event loop admission uses (the loop itself in production; a fake clock in tests)."""

    def time(self) -> float: ...

    def call_soon(self, callback: Callable[[], object], /) -> Cancellable: ...

    def call_later(self, delay: float, callback: Callable[[], object], /) -> Cancellable: ...


class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate`` per second of ``clock``; starts full."""

    __slots__ = ("_burst", "_clock", "_last", "_rate", "_tokens")

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def take(self) -> bool:
        now = self._clock()
        tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if tokens >= 1.0:
            self._tokens = tokens - 1.0
            return True
        self._tokens = tokens
        return False


OnAdmission = Callable[[Refusal | None], None]

_WAITING, _GRANTED, _REFUSED, _DONE, _CANCELLED = range(5)


class Ticket:
    """A request that could not take a slot at once. Its callback runs once, later, unless cancelled."""

    __slots__ = ("_admission", "_callback", "_refusal", "_state", "deadline", "enqueued_at")

    def __init__(self, admission: Admission, callback: OnAdmission, now: float) -> None:
        self._admission = admission
        self._callback = callback
        self._refusal: Refusal | None = None
        self._state = _WAITING
        self.enqueued_at = now
        self.deadline = now

    @property
    def waiting(self) -> bool:
        return self._state == _WAITING

    def cancel(self) -> None:
        """The caller gave up (client gone). Safe in any state; a slot handed over but not yet
        delivered goes to the next waiter."""
        state, self._state = self._state, _CANCELLED
        if state == _WAITING:
            self._admission._forget(self)
        elif state == _GRANTED:
            self._admission.release()

    def _fire(self) -> None:
        if self._state == _CANCELLED:
            return
        self._state = _DONE
        self._callback(self._refusal)


class Admission:
    """Admission control for one model (see the module docstring for the protocol)."""

    def __init__(
        self,
        limits: AdmissionLimits,
        *,
        model: str,
        registry: CollectorRegistry | None = None,
        loop: Scheduler | None = None,
        log_interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self.limits = limits
        self.active = limits.active  # the fast path's one check
        self.model = model
        self._loop: Scheduler = loop or _running_loop(limits)
        self._max_inflight = limits.max_inflight or sys.maxsize
        self.rate_limited = limits.rate_limit_rps > 0  # the metadata routes' one check
        self._bucket: TokenBucket | None = None  # inference
        self._metadata_bucket: TokenBucket | None = None
        if self.rate_limited:
            self._bucket = TokenBucket(limits.rate_limit_rps, limits.burst, self._loop.time)
            self._metadata_bucket = TokenBucket(limits.rate_limit_rps, limits.burst, self._loop.time)
        self._queue: deque[Ticket] = deque()
        self._timer: Cancellable | None = None
        self.held_bytes = 0  # gRPC DATA held back from Triton for streams waiting for a slot (grpc_admission)
        self.stats = AdmissionStats()
        self._refusals = _refusals(model, limits)
        self._log = _RefusalLog(self, log_interval_s)
        if registry is not None and self.active:
            registry.register(AdmissionCollector(self))

    # ------------------------------------------------------------------ the front ends' calls

    def try_acquire(self) -> bool:
        """Take a slot now if one is free, nobody waits and the bucket has a token. False: call
        :meth:`enqueue` (which decides between waiting and refusing)."""
        if self.stats.inflight >= self._max_inflight or self._queue:
            return False
        if self._bucket is not None and not self._bucket.take():
            return False
        self.stats.inflight += 1
        return True

    def enqueue(self, callback: OnAdmission) -> Ticket:
        """Wait for a slot, or be refused; ``callback`` gets the answer via the loop, never from here."""
        ticket = Ticket(self, callback, self._loop.time())
        if self._bucket is not None and not self._bucket.take():
            self._refuse(ticket, self._refusals["rate_limited"])
        elif self.stats.inflight < self._max_inflight and not self._queue:
            self.stats.inflight += 1
            self._grant(ticket)
        elif len(self._queue) >= self.limits.max_queue:
            self._refuse(ticket, self._refusals["queue_full"])
        else:
            self._wait(ticket)
        return ticket

    def take_metadata_token(self) -> Refusal | None:
        """A request of :data:`METADATA_ROUTES` takes a token of their bucket now (None), or is refused at once;
        it takes no slot. Call only when :attr:`rate_limited`."""
        if self._metadata_bucket is None or self._metadata_bucket.take():
            return None
        self.stats.throttled += 1
        self._log.note()
        return self._refusals["rate_limited"]

    def try_metadata_token(self) -> bool:
        """Take a token of the metadata bucket now if it has one (True); False counts nothing: then call
        :meth:`take_metadata_token`, which refuses and counts. Call only when :attr:`rate_limited`."""
        return self._metadata_bucket is None or self._metadata_bucket.take()

    def release(self) -> None:
        """A request holding a slot is over (response complete, stream closed, or failed)."""
        if self._queue:
            ticket = self._queue.popleft()
            self.stats.left_queue(self._loop.time() - ticket.enqueued_at)
            self._grant(ticket)  # the slot passes straight on: the count does not change
        elif self.stats.inflight > 0:
            self.stats.inflight -= 1
        else:
            logger.error("model %s: admission slot released twice; ignored (a front-end bug)", self.model)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        """No slot held and nobody waiting (with a slot handed over but not yet delivered, not idle):
        what a drain on SIGTERM waits for, besides the requests in flight."""
        return self.stats.inflight == 0 and not self._queue

    def close(self) -> None:
        """Stop the timers (at shutdown) and log the last refusal summary."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._log.flush()

    # ------------------------------------------------------------------ internals

    def _grant(self, ticket: Ticket) -> None:
        ticket._state = _GRANTED
        self._loop.call_soon(ticket._fire)

    def _refuse(self, ticket: Ticket, refusal: Refusal) -> None:
        ticket._state = _REFUSED
        ticket._refusal = refusal
        if refusal.reason == "rate_limited":
            self.stats.throttled += 1
        else:
            self.stats.refused[refusal.reason] += 1
        self._log.note()
        self._loop.call_soon(ticket._fire)

    def _wait(self, ticket: Ticket) -> None:
        ticket.deadline = ticket.enqueued_at + self.limits.queue_timeout_s
        self._queue.append(ticket)
        self.stats.queued += 1
        if self._timer is None:
            self._timer = self._loop.call_later(self.limits.queue_timeout_s, self._expire)

    def _forget(self, ticket: Ticket) -> None:
        self._queue.remove(ticket)  # O(M) with M = --max-queue; only when a waiting client goes away
        self.stats.left_queue(self._loop.time() - ticket.enqueued_at)

    def _expire(self) -> None:
        """Refuse the waiters whose deadline passed (the oldest first: deadlines are in queue order)."""
        self._timer = None
        now = self._loop.time()
        queue = self._queue
        while queue and queue[0].deadline <= now + _SLACK_S:
            ticket = queue.popleft()
            self.stats.left_queue(now - ticket.enqueued_at)
            self._refuse(ticket, self._refusals["queue_timeout"])
        if queue:
            self._timer = self._loop.call_later(max(queue[0].deadline - now, _SLACK_S), self._expire)


class AdmissionStats:
    """Plain counters, read at scrape time (no metric object is touched per request)."""

    __slots__ = ("inflight", "queued", "refused", "throttled", "waits", "waited_s")

    def __init__(self) -> None:
        self.inflight = 0  # holding a slot now
        self.queued = 0  # had to wait (total)
        self.waits = 0  # left the queue: admitted, timed out or gone
        self.waited_s = 0.0  # their total time in the queue
        self.throttled = 0  # refused by the rate limit
        self.refused = {"queue_full": 0, "queue_timeout": 0}  # refused by the concurrency cap

    def left_queue(self, seconds: float) -> None:
        self.waits += 1
        self.waited_s += seconds


def _running_loop(limits: AdmissionLimits) -> Scheduler:
    """The running loop; admission that is off needs none (so it can be built anywhere)."""
    return asyncio.get_running_loop() if limits.active else _NoLoop()


class _NoLoop:
    """The scheduler of admission that is off: its front ends never call it, so nothing is scheduled."""

    def time(self) -> float:
        return 0.0

    def call_soon(self, callback: Callable[[], object], /) -> Cancellable:
        raise RuntimeError("admission control is off: check Admission.active before calling it")

    def call_later(self, delay: float, callback: Callable[[], object], /) -> Cancellable:
        raise RuntimeError("admission control is off: check Admission.active before calling it")


def _refusals(model: str, limits: AdmissionLimits) -> dict[str, Refusal]:
    """The three refusals of this model, built once (a refusal allocates nothing)."""
    rps = limits.rate_limit_rps
    return {
        "rate_limited": Refusal(
            "rate_limited",
            f"model '{model}': rate limit of {rps:g} requests/s (burst {limits.burst}) exceeded; slow down",
            max(1, math.ceil(1 / rps)) if rps else 1,
        ),
        "queue_full": Refusal(
            "queue_full",
            f"model '{model}': {limits.max_inflight} requests in flight and {limits.max_queue} waiting "
            "(the most allowed); retry later",
            1,
        ),
        "queue_timeout": Refusal(
            "queue_timeout",
            f"model '{model}': no slot free within {limits.queue_timeout_s:g} s "
            f"({limits.max_inflight} requests in flight at most); retry later",
            1,
        ),
    }


class _RefusalLog:
    """One warning per interval that saw refusals, summarising them (never one line per request)."""

    def __init__(self, admission: Admission, interval_s: float) -> None:
        self._admission = admission
        self._interval_s = interval_s
        self._timer: Cancellable | None = None
        self._seen = self._counts()

    def note(self) -> None:
        """A refusal happened: make sure a summary follows within one interval."""
        if self._timer is None:
            self._timer = self._admission._loop.call_later(self._interval_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        counts = self._counts()
        throttled, full, timed_out, queued = (now - before for now, before in zip(counts, self._seen, strict=True))
        self._seen = counts
        if throttled or full or timed_out:
            logger.warning(
                "model %s: refused %d requests in the last %gs (rate_limited=%d queue_full=%d queue_timeout=%d); "
                "%d had to wait; now %d in flight, %d waiting",
                self._admission.model,
                throttled + full + timed_out,
                self._interval_s,
                throttled,
                full,
                timed_out,
                queued,
                self._admission.stats.inflight,
                self._admission.waiting,
            )

    def _counts(self) -> tuple[int, int, int, int]:
        stats = self._admission.stats
        return stats.throttled, stats.refused["queue_full"], stats.refused["queue_timeout"], stats.queued


class AdmissionCollector(Collector):
    """Exports one admission's counters on the proxy's registry, read at scrape time."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        adm, stats = self._admission, self._admission.stats
        yield _family(GaugeMetricFamily, "inflight", "Requests holding a slot (at Triton).", adm, stats.inflight)
        yield _family(GaugeMetricFamily, "waiting", "Requests waiting for a slot now.", adm, adm.waiting)
        yield _family(CounterMetricFamily, "queued", "Requests that had to wait for a slot.", adm, stats.queued)
        yield _family(CounterMetricFamily, "throttled", "Requests refused by the rate limit.", adm, stats.throttled)
        refused = CounterMetricFamily(
            "tritonshare_proxy_admission_refused",
            "Requests refused by the concurrency cap: queue_full (refused at once), queue_timeout (waited too long).",
            labels=["model", "reason"],
        )
        for reason, count in stats.refused.items():
            refused.add_metric([adm.model, reason], count)
        yield refused
        wait = SummaryMetricFamily(
            "tritonshare_proxy_admission_wait_seconds",
            "Time spent waiting for a slot, by requests that left the queue.",
            labels=["model"],
        )
        wait.add_metric([adm.model], count_value=stats.waits, sum_value=stats.waited_s)
        yield wait
        yield from _limits(adm)


def _family(
    kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, adm: Admission, value: float
) -> Metric:
    family = kind(f"tritonshare_proxy_admission_{name}", doc, labels=["model"])
    family.add_metric([adm.model], value)
    return family


def _limits(adm: Admission) -> Iterator[Metric]:
    """The configured limits, one gauge each, named with its unit (0 = off; a queue setting is 0 without a cap,
    a burst 0 without a rate)."""
    lim = adm.limits
    capped, rated = bool(lim.max_inflight), bool(lim.rate_limit_rps)
    for name, doc, value in (
        ("max_inflight_requests", "Requests at Triton at once (--max-inflight; 0 = no cap).", lim.max_inflight),
        ("max_queue_requests", "Requests waiting for a slot at most (--max-queue).", lim.max_queue if capped else 0),
        (
            "queue_timeout_seconds",
            "Longest wait for a slot (--queue-timeout-s).",
            lim.queue_timeout_s if capped else 0,
        ),
        (
            "rate_limit_requests_per_second",
            "Requests admitted per second, inference and metadata each (--rate-limit-rps; 0 = no rate limit).",
            lim.rate_limit_rps,
        ),
        (
            "rate_limit_burst_requests",
            "Requests the rate limit admits at once (--rate-limit-burst).",
            lim.burst if rated else 0,
        ),
    ):
        yield _family(GaugeMetricFamily, name, doc, adm, value)
