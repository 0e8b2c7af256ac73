"""Admission control: the concurrency cap, the FIFO queue and its timeout, the token bucket, metrics and the
refusal log. Pure logic on an injected clock (a fake loop), plus a run on real asyncio and uvloop loops."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import pytest
import uvloop
from prometheus_client import CollectorRegistry

from tritonshare.common.errors import UsageError
from tritonshare.proxy.admission import (
    LIMITED_ROUTES,
    METADATA_ROUTES,
    Admission,
    AdmissionLimits,
    Refusal,
    TokenBucket,
)
from tritonshare.proxy.policy import GRPC_RULES, REST_MODEL_ROUTES, REST_SERVER_ROUTES, Verdict
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState

MODEL = "m"


class FakeHandle:
    def __init__(self, callback: Callable[[], object], when: float = 0.0) -> None:
        self.callback = callback
        self.when = when
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """The three loop methods admission uses, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.ready: list[FakeHandle] = []
        self.timers: list[FakeHandle] = []

    def time(self) -> float:
        return self.now

    def call_soon(self, callback: Callable[[], object], /) -> FakeHandle:
        handle = FakeHandle(callback)
        self.ready.append(handle)
        return handle

    def call_later(self, delay: float, callback: Callable[[], object], /) -> FakeHandle:
        handle = FakeHandle(callback, self.now + delay)
        self.timers.append(handle)
        return handle

    def run_ready(self) -> None:
        while self.ready:
            handle = self.ready.pop(0)
            if not handle.cancelled:
                handle.callback()

    def advance(self, seconds: float) -> None:
        """Move the clock, running each timer at its time (and what it makes ready)."""
        target = self.now + seconds
        while True:
            self.run_ready()
            due = sorted((h for h in self.timers if not h.cancelled and h.when <= target), key=lambda h: h.when)
            if not due:
                break
            handle = due[0]
            self.timers.remove(handle)
            self.now = max(self.now, handle.when)
            handle.callback()
        self.now = target

    def pending_timers(self) -> int:
        return sum(1 for h in self.timers if not h.cancelled)


class Outcomes:
    """Records each ticket's answer under a label, in the order the answers arrive."""

    def __init__(self) -> None:
        self.answers: list[tuple[str, Refusal | None]] = []

    def callback(self, label: str) -> Callable[[Refusal | None], None]:
        return lambda refusal: self.answers.append((label, refusal))

    def admitted(self) -> list[str]:
        return [label for label, refusal in self.answers if refusal is None]

    def refused(self) -> list[tuple[str, str]]:
        return [(label, refusal.reason) for label, refusal in self.answers if refusal is not None]


def make(loop: FakeLoop, registry: CollectorRegistry | None = None, **limits: float) -> Admission:
    return Admission(AdmissionLimits(**limits), model=MODEL, loop=loop, registry=registry)  # type: ignore[arg-type]


def test_limited_routes_are_the_inference_routes_of_the_policy() -> None:
    """Probes, metadata and statistics are never queued; every inference route is."""
    rules: dict[str, tuple[Verdict, bool]] = {r.route: (r.verdict, r.inspect) for r in REST_MODEL_ROUTES.values()}
    rules.update({r.route: (r.verdict, r.inspect) for r in GRPC_RULES.values()})
    assert LIMITED_ROUTES <= rules.keys()
    assert {route for route, (_, inspect) in rules.items() if inspect} == LIMITED_ROUTES
    assert all(rules[route][0] is Verdict.OWN for route in LIMITED_ROUTES)


def test_every_route_that_reaches_triton_is_under_the_rate_limit() -> None:
    """A route forwarded to Triton (ALLOW, OWN) is inference (a slot, the inference bucket) or metadata (a bucket
    of its own); the rest (probes, refusals) never reach Triton per request."""
    rules = [*REST_SERVER_ROUTES.values(), *REST_MODEL_ROUTES.values(), *GRPC_RULES.values()]
    forwarded = {rule.route for rule in rules if rule.verdict in (Verdict.ALLOW, Verdict.OWN)}
    assert forwarded == LIMITED_ROUTES | METADATA_ROUTES
    assert not LIMITED_ROUTES & METADATA_ROUTES


def test_metadata_takes_tokens_of_a_bucket_of_its_own_and_never_a_slot() -> None:
    loop = FakeLoop()
    admission = make(loop, max_inflight=1, rate_limit_rps=10, rate_limit_burst=2)
    assert admission.rate_limited
    assert [admission.take_metadata_token() for _ in range(2)] == [None, None]
    refusal = admission.take_metadata_token()
    assert refusal is not None and refusal.reason == "rate_limited" and refusal.retry_after_s == 1
    assert admission.stats.throttled == 1 and admission.stats.inflight == 0  # counted as throttled; no slot
    assert admission.try_acquire() and admission.try_acquire() is False  # inference: its own token, one slot
    loop.advance(0.101)  # one token back
    assert admission.take_metadata_token() is None and admission.take_metadata_token() is not None


def test_without_a_rate_metadata_is_not_limited() -> None:
    admission = make(FakeLoop(), max_inflight=1)
    assert not admission.rate_limited
    assert all(admission.take_metadata_token() is None for _ in range(100))


def test_off_by_default_needs_no_loop_and_exports_nothing() -> None:
    registry = CollectorRegistry()
    admission = Admission(AdmissionLimits(), model=MODEL, registry=registry)  # no running loop here
    assert admission.active is False
    assert b"admission" not in _exposition(registry)


def test_cap_admits_n_then_queues_and_hands_each_freed_slot_to_the_oldest_waiter() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=2, max_queue=10)
    assert admission.try_acquire() and admission.try_acquire()
    assert not admission.try_acquire()
    tickets = [admission.enqueue(out.callback(f"w{i}")) for i in range(4)]
    loop.run_ready()
    assert out.answers == [] and admission.waiting == 4 and all(t.waiting for t in tickets)
    admission.release()
    assert out.answers == []  # the answer comes from the loop, never from inside release()
    loop.run_ready()
    assert out.admitted() == ["w0"] and admission.stats.inflight == 2
    for _ in range(3):
        admission.release()
    loop.run_ready()
    assert out.admitted() == ["w0", "w1", "w2", "w3"]
    assert admission.stats.inflight == 2 and admission.waiting == 0


def test_idle_only_when_no_slot_is_held_or_handed_over_and_nobody_waits() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=10)
    assert admission.idle
    assert admission.try_acquire()
    admission.enqueue(out.callback("w"))
    admission.release()  # handed over, not yet delivered: a drain must not stop here
    assert not admission.idle
    loop.run_ready()
    admission.release()
    assert admission.idle and out.admitted() == ["w"]


def test_newcomer_never_overtakes_a_waiter() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=10)
    assert admission.try_acquire()
    admission.enqueue(out.callback("first"))
    admission.release()  # the slot is handed to "first" (not yet delivered)
    assert not admission.try_acquire()  # a newcomer finds it taken
    admission.enqueue(out.callback("second"))
    loop.run_ready()
    assert out.admitted() == ["first"]
    admission.release()
    loop.run_ready()
    assert out.admitted() == ["first", "second"]


def test_random_workload_never_exceeds_the_cap_and_serves_in_arrival_order() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=3, max_queue=1000)
    rng = random.Random(7)
    holding = 0
    arrivals: list[str] = []
    for step in range(2000):
        if rng.random() < 0.55:
            label = f"r{step}"
            if admission.try_acquire():
                holding += 1
            else:
                arrivals.append(label)
                admission.enqueue(out.callback(label))
        elif holding:
            holding -= 1
            admission.release()
        before = len(out.admitted())
        loop.run_ready()
        holding += len(out.admitted()) - before
        assert holding <= 3 and holding == admission.stats.inflight
    assert out.admitted() == arrivals[: len(out.admitted())]
    assert len(out.admitted()) > 100


def test_full_queue_refuses_at_once_via_the_loop() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=2)
    assert admission.try_acquire()
    for label in ("a", "b", "c"):
        admission.enqueue(out.callback(label))
    assert out.answers == []
    loop.run_ready()
    assert out.refused() == [("c", "queue_full")]
    refusal = out.answers[0][1]
    assert refusal is not None and refusal.retry_after_s == 1 and "'m'" in refusal.message
    assert admission.waiting == 2


def test_max_queue_zero_refuses_the_excess_without_waiting() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=0)
    assert admission.try_acquire()
    admission.enqueue(out.callback("x"))
    loop.run_ready()
    assert out.refused() == [("x", "queue_full")]


def test_waiters_time_out_in_order_each_after_its_own_timeout() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=10, queue_timeout_s=1.0)
    assert admission.try_acquire()
    admission.enqueue(out.callback("early"))
    loop.advance(0.5)
    admission.enqueue(out.callback("late"))
    loop.advance(0.49)
    assert out.answers == []
    loop.advance(0.02)
    assert out.refused() == [("early", "queue_timeout")]
    loop.advance(0.48)
    assert out.refused() == [("early", "queue_timeout")]
    loop.advance(0.02)
    assert out.refused() == [("early", "queue_timeout"), ("late", "queue_timeout")]
    assert admission.waiting == 0 and admission.stats.inflight == 1
    assert admission.stats.refused["queue_timeout"] == 2
    assert admission.stats.waits == 2 and admission.stats.waited_s == pytest.approx(2.0, abs=0.01)
    loop.advance(20)  # past the refusal log's interval too
    assert loop.pending_timers() == 0  # no timer left running once the queue is empty


def test_one_timer_serves_the_whole_queue() -> None:
    loop = FakeLoop()
    admission = make(loop, max_inflight=1, max_queue=100, queue_timeout_s=1.0)
    assert admission.try_acquire()
    for _ in range(50):
        admission.enqueue(lambda refusal: None)
        loop.now += 0.001
    assert loop.pending_timers() == 1


def test_admitted_before_the_timeout_is_not_refused_later() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=10, queue_timeout_s=1.0)
    assert admission.try_acquire()
    admission.enqueue(out.callback("w"))
    loop.advance(0.9)
    admission.release()
    loop.advance(2.0)
    assert out.answers == [("w", None)]
    assert admission.stats.waited_s == pytest.approx(0.9)


def test_cancelled_waiter_leaves_the_queue_and_is_never_called() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=10)
    assert admission.try_acquire()
    gone = admission.enqueue(out.callback("gone"))
    admission.enqueue(out.callback("stays"))
    gone.cancel()
    assert admission.waiting == 1
    admission.release()
    loop.advance(60)
    assert out.admitted() == ["stays"]


def test_cancel_after_the_slot_was_handed_over_passes_it_on() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=10)
    assert admission.try_acquire()
    gone = admission.enqueue(out.callback("gone"))
    admission.enqueue(out.callback("next"))
    admission.release()  # handed to "gone", delivery pending
    gone.cancel()  # its client left before the callback ran
    loop.run_ready()
    assert out.admitted() == ["next"] and admission.stats.inflight == 1
    gone.cancel()  # twice: harmless
    admission.release()
    assert admission.stats.inflight == 0


def test_double_release_is_logged_and_does_not_raise_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    loop = FakeLoop()
    admission = make(loop, max_inflight=1)
    assert admission.try_acquire()
    admission.release()
    with caplog.at_level(logging.ERROR, logger="tritonshare.proxy.admission"):
        admission.release()
    assert "released twice" in caplog.text
    assert admission.try_acquire() and not admission.try_acquire()


def test_rate_limit_allows_the_burst_then_the_refill_rate() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, rate_limit_rps=10, rate_limit_burst=3)
    assert [admission.try_acquire() for _ in range(4)] == [True, True, True, False]
    admission.enqueue(out.callback("over"))
    loop.run_ready()
    assert out.refused() == [("over", "rate_limited")]
    refusal = out.answers[0][1]
    assert refusal is not None and refusal.retry_after_s == 1 and "10 requests/s" in refusal.message
    loop.advance(0.101)  # one token back
    assert admission.try_acquire() and not admission.try_acquire()
    loop.advance(10)  # the bucket holds at most the burst
    assert sum(admission.try_acquire() for _ in range(10)) == 3
    assert admission.stats.throttled == 1


def test_rate_limit_burst_defaults_to_one_second_of_tokens() -> None:
    assert AdmissionLimits(rate_limit_rps=2.5).burst == 3
    assert AdmissionLimits(rate_limit_rps=0.2).burst == 1
    admission = make(FakeLoop(), rate_limit_rps=0.2)
    assert admission._refusals["rate_limited"].retry_after_s == 5  # one token every 5 s


def test_rate_limit_in_front_of_the_queue_takes_one_token_per_request() -> None:
    loop, out = FakeLoop(), Outcomes()
    admission = make(loop, max_inflight=1, max_queue=10, rate_limit_rps=1, rate_limit_burst=2)
    assert admission.try_acquire()  # token 1, slot
    assert not admission.try_acquire()  # no slot: no token taken yet
    admission.enqueue(out.callback("queued"))  # token 2
    admission.enqueue(out.callback("throttled"))  # no token: refused before the queue
    loop.run_ready()
    assert out.refused() == [("throttled", "rate_limited")] and admission.waiting == 1


def test_token_bucket_refills_continuously() -> None:
    now = [0.0]
    bucket = TokenBucket(4.0, 1, lambda: now[0])
    assert bucket.take() and not bucket.take()
    now[0] = 0.2
    assert not bucket.take()
    now[0] = 0.25
    assert bucket.take()


def test_metrics_are_exported_on_the_proxy_registry() -> None:
    loop, registry = FakeLoop(), CollectorRegistry()
    admission = make(loop, registry, max_inflight=1, max_queue=1, queue_timeout_s=2, rate_limit_rps=100)
    assert admission.try_acquire()
    admission.enqueue(lambda refusal: None)  # waits
    admission.enqueue(lambda refusal: None)  # queue full
    loop.advance(3)  # the waiter times out
    for _ in range(200):
        admission.try_acquire() or admission.enqueue(lambda refusal: None)
    loop.run_ready()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"tritonshare_proxy_admission_{name}", {"model": MODEL, **labels})

    assert value("inflight") == 1 and value("waiting") == 1  # one of the 200 found room in the queue
    assert value("queued_total") == 2
    assert value("refused_total", reason="queue_full") >= 1  # type: ignore[operator]
    assert value("refused_total", reason="queue_timeout") == 1
    assert value("throttled_total") >= 1  # type: ignore[operator]
    assert value("wait_seconds_count") == 1 and value("wait_seconds_sum") == pytest.approx(2.0, abs=0.01)
    # One gauge per setting, named with its unit (a family mixing counts, seconds and rates had no unit to name)
    assert value("max_inflight_requests") == 1 and value("max_queue_requests") == 1
    assert value("queue_timeout_seconds") == 2
    assert value("rate_limit_requests_per_second") == 100 and value("rate_limit_burst_requests") == 100
    assert value("limit", limit="max_inflight") is None


def test_refusals_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    loop = FakeLoop()
    admission = Admission(
        AdmissionLimits(max_inflight=1, max_queue=0),
        model=MODEL,
        loop=loop,
        log_interval_s=10,
    )
    assert admission.try_acquire()
    with caplog.at_level(logging.WARNING, logger="tritonshare.proxy.admission"):
        for _ in range(500):
            admission.enqueue(lambda refusal: None)
        loop.advance(9.9)
        assert caplog.records == []
        loop.advance(0.2)
        assert len(caplog.records) == 1
        assert "refused 500 requests in the last 10s" in caplog.text and "queue_full=500" in caplog.text
        loop.advance(60)  # a quiet interval logs nothing
        assert len(caplog.records) == 1
        admission.enqueue(lambda refusal: None)
        admission.close()  # shutdown flushes the summary at once
    assert len(caplog.records) == 2 and "refused 1 requests" in caplog.records[1].getMessage()
    assert loop.pending_timers() == 0


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_inflight", -1, "--max-inflight must be 0 (off) or positive"),
        ("rate_limit_rps", -0.5, "--rate-limit-rps must be 0 (off) or positive"),
        ("queue_timeout_s", 0, "--queue-timeout-s must be positive"),
    ],
)
def test_bad_limits_are_usage_errors(field: str, value: float, words: str) -> None:
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        AdmissionLimits(**{field: value})  # type: ignore[arg-type]


def test_refusals_and_hand_over_on_a_real_uvloop_loop() -> None:
    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(_real_loop_scenario()) == [("w1", None), ("w2", "queue_timeout")]
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_refusals_and_hand_over_on_the_asyncio_loop() -> None:
    assert await _real_loop_scenario() == [("w1", None), ("w2", "queue_timeout")]


async def _real_loop_scenario() -> list[tuple[str, str | None]]:
    """One slot; w1 gets it when the holder releases after 20 ms; w2 waits past its 100 ms timeout."""
    loop = asyncio.get_running_loop()
    admission = Admission(AdmissionLimits(max_inflight=1, max_queue=4, queue_timeout_s=0.1), model=MODEL)
    answers: list[tuple[str, str | None]] = []
    done = asyncio.Event()

    def record(label: str) -> Callable[[Refusal | None], None]:
        def answer(refusal: Refusal | None) -> None:
            answers.append((label, None if refusal is None else refusal.reason))
            if len(answers) == 2:
                done.set()

        return answer

    assert admission.try_acquire()
    admission.enqueue(record("w1"))
    admission.enqueue(record("w2"))
    started = loop.time()
    loop.call_later(0.02, admission.release)
    await asyncio.wait_for(done.wait(), 5)
    assert 0.09 <= loop.time() - started < 1.0
    admission.close()
    return answers


def _exposition(registry: CollectorRegistry) -> bytes:
    from prometheus_client.exposition import generate_latest

    return generate_latest(registry)


@pytest.mark.asyncio
async def test_a_drain_waits_for_requests_holding_or_waiting_for_a_slot() -> None:
    """A REST request waiting for a slot is not in flight yet: the drain must wait for the queue too."""
    state = ProxyState(ProxySettings(name=MODEL, max_inflight=1))
    loop = asyncio.get_running_loop()
    assert state.admission.try_acquire()  # a request holds the slot, one waits
    answers: list[Refusal | None] = []
    state.admission.enqueue(answers.append)
    assert not await state.wait_idle(0.05)  # nothing "in flight" for ProxyState, yet not idle
    loop.call_later(0.05, state.admission.release)  # the slot passes to the waiter...
    loop.call_later(0.15, state.admission.release)  # ...which finishes later
    started = loop.time()
    assert await state.wait_idle(5)
    assert 0.14 <= loop.time() - started < 1.0 and answers == [None]
    state.admission.close()
