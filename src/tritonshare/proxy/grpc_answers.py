"""The answers a relayed gRPC connection gives its client itself: refusals and the probes.

A new stream refused here (denied, unknown method, no token, Triton unreachable) never reaches Triton; a
forwarded stream whose message is refused ends for the client here (the relay resets it at Triton). The probes
— readiness (ServerReady, Health/Check: the own model's) and liveness (ServerLive: Triton's) — are answered from
the proxy's kept answers (:mod:`tritonshare.proxy.readiness`), never one question to Triton per call; an answer
that must wait for a question to Triton does not block the connection: it is a task. The DATA bytes of those
answers count against the client's connection window although Triton never sent them:
:attr:`LocalAnswers.window_debt` keeps them, and the relay takes them off the client's next connection
WINDOW_UPDATEs to Triton (see :mod:`tritonshare.proxy.grpc`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tritonshare.proxy import grpc_replies
from tritonshare.proxy.grpc_messages import Refusal
from tritonshare.proxy.grpc_streams import PROTOCOL, StreamTable
from tritonshare.proxy.policy import GrpcRule, Verdict
from tritonshare.proxy.readiness import TritonProbe
from tritonshare.proxy.state import ProxyState


class LocalAnswers:
    """What one client connection is answered by the proxy itself."""

    def __init__(
        self,
        state: ProxyState,
        streams: StreamTable,
        to_client: Callable[[bytes], None],
        settled: Callable[[], None],
    ) -> None:
        """``to_client``: writes the proxy's frames between Triton's; ``settled``: told when a stream or an
        answer in progress is over (a draining connection may close then)."""
        self._state = state
        self._streams = streams
        self._to_client = to_client
        self._settled = settled
        self.tasks: set[asyncio.Task[None]] = set()  # probe answers waiting for Triton's
        self.window_debt = 0  # DATA bytes sent to the client here, not yet taken off its WINDOW_UPDATEs

    def refuse_new(
        self, stream_id: int, route: str, status: int, message: str, reason: str, pushback_ms: int | None = None
    ) -> None:
        """A new stream is refused with ``status``; Triton never sees it."""
        self._streams.answer_locally(stream_id)
        self._to_client(grpc_replies.refusal(stream_id, status, message, pushback_ms=pushback_ms))
        self._state.refuse(PROTOCOL, route, grpc_replies.STATUS_NAMES[status], reason)

    def refuse_forwarded(self, stream_id: int, refusal: Refusal, pushback_ms: int | None = None) -> None:
        """A forwarded stream's message is refused: it ends for the client (the caller resets it at Triton)."""
        stream = self._streams.refuse(stream_id, refusal)
        frames = grpc_replies.refusal(
            stream_id, refusal.status, refusal.message, headers_sent=stream.headers_sent, pushback_ms=pushback_ms
        )
        self._to_client(frames)
        self._settled()

    def answer_probe(self, stream_id: int, rule: GrpcRule) -> None:
        """A probe (verdict READY or LIVE): answered from what the proxy keeps of Triton's answer (readiness:
        not ready while draining)."""
        self._streams.answer_locally(stream_id)
        started = time.perf_counter()
        if rule.verdict is Verdict.READY and self._state.draining:
            self._send_probe(stream_id, rule, False, started)
            return
        probe = self._state.probes[rule.verdict]
        status = probe.fresh()
        if status is not None:
            self._send_probe(stream_id, rule, status == 200, started)
            return
        task = asyncio.get_running_loop().create_task(self._ask(stream_id, rule, probe, started))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def cancel(self) -> None:
        """The connection is gone: answers in progress are dropped."""
        for task in self.tasks:
            task.cancel()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._settled()

    async def _ask(self, stream_id: int, rule: GrpcRule, probe: TritonProbe, started: float) -> None:
        yes = await probe.ok()
        self._send_probe(stream_id, rule, yes and not (rule.verdict is Verdict.READY and self._state.draining), started)

    def _send_probe(self, stream_id: int, rule: GrpcRule, yes: bool, started: float) -> None:
        frames, data_bytes = grpc_replies.unary_response(stream_id, grpc_replies.PROBE_MESSAGES[rule.route][yes])
        self.window_debt += data_bytes
        self._to_client(frames)
        self._state.answered(PROTOCOL, rule.route, "ok", started)
