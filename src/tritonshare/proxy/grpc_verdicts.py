"""A new gRPC stream judged by its header block, and the verdicts the proxy answers itself acted on.

The policy table (:mod:`tritonshare.proxy.policy`) judges the stream's ``:path``; before its verdict is acted
on, in order: a block that is malformed; a stream after the drain's GOAWAY; a connection turned away as a whole
when it opened (plain text on the TLS port, past ``--max-connections``: UNAVAILABLE saying why, before any check
of the call, as REST answers such a connection before reading a request); ``authorization`` more than once
(INVALID_ARGUMENT, as REST answers 400: the token checked must be the only one, whichever a later reader takes);
a caller without a valid bearer token (when tokens are on; the probes stay open); an unreachable Triton (after
the token checks, as REST answers 401 before it tries Triton); an unknown method.
READY and LIVE are answered with the own model's readiness and Triton's liveness as the proxy keeps them, and
DENY refused, here; what is left goes to Triton (the relay forwards it), unless the client already has
``grpc_max_streams`` streams open there (REFUSED_STREAM, which clients retry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tritonshare.proxy import http2
from tritonshare.proxy.admission import METADATA_ROUTES
from tritonshare.proxy.auth import MESSAGE as AUTH_MESSAGE
from tritonshare.proxy.auth import OPEN_GRPC_ROUTES
from tritonshare.proxy.grpc_answers import LocalAnswers
from tritonshare.proxy.grpc_streams import PROTOCOL, StreamTable
from tritonshare.proxy.hpack_codec import HeaderBlock
from tritonshare.proxy.policy import (
    GRPC_INVALID_ARGUMENT,
    GRPC_PERMISSION_DENIED,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNAUTHENTICATED,
    GRPC_UNAVAILABLE,
    GRPC_UNIMPLEMENTED,
    GrpcRule,
    Verdict,
    clip_path,
    judge_grpc_method,
)
from tritonshare.proxy.state import ProxyState

# Acts on a verdict for a new stream (its id and rule): the rule again if the stream goes to Triton.
Action = Callable[[int, GrpcRule], GrpcRule | None]


class Unavailable(NamedTuple):
    """Why a connection answers every new stream UNAVAILABLE itself: the message clients see, the /metrics reason;
    ``turned_away``: decided when the connection opened, so no check of a call comes before it (Triton found down
    afterwards is not: the token checks still come first)."""

    message: str
    reason: str
    turned_away: bool = False


REPEATED_AUTHORIZATION = "authorization metadata given more than once; send one bearer token"
TRITON_DOWN = Unavailable("Triton is not reachable from the proxy; retry later", "unavailable")
# A call's refusal by the token checks: (gRPC status, message, /metrics reason).
_BAD_REQUEST = (GRPC_INVALID_ARGUMENT, REPEATED_AUTHORIZATION, "bad_request")
_UNAUTHENTICATED = (GRPC_UNAUTHENTICATED, AUTH_MESSAGE, "unauthenticated")


class NewStreams:
    """Judges the new streams of one client connection."""

    def __init__(
        self, state: ProxyState, streams: StreamTable, answers: LocalAnswers, to_client: Callable[[bytes], None]
    ) -> None:
        self._state = state
        self._streams = streams
        self._answers = answers
        self._to_client = to_client
        self._auth = state.auth
        self._max_streams = state.settings.grpc_max_streams
        self._metered = METADATA_ROUTES if state.admission.rate_limited else frozenset()  # take a token each
        self._actions: dict[Verdict, Action] = {
            Verdict.ALLOW: self._forwarded,
            Verdict.OWN: self._forwarded,
            Verdict.READY: self._answer_probe,
            Verdict.LIVE: self._answer_probe,
            Verdict.DENY: self._deny,
        }
        # The last block judged and its rule: a client repeats the same block for every call of a method (the
        # same object while the decoder's table is unchanged).
        self._judged: tuple[HeaderBlock, GrpcRule | None] | None = None

    def judge(
        self, stream_id: int, block: HeaderBlock, *, unavailable: Unavailable | None, goaway_last: int | None
    ) -> GrpcRule | None:
        """The rule of a new stream to forward to Triton; None once it is answered here. ``unavailable``: why no
        stream goes to Triton; ``goaway_last``: the last stream id of the connection's GOAWAY, if one was sent."""
        judged = self._judged
        if judged is None or judged[0] is not block:
            judged = self._judged = (block, judge_grpc_method((block.path or b"").decode("latin-1")))
        rule = judged[1]
        route = rule.route if rule else "unknown"
        if block.ambiguous:
            # Malformed (RFC 7540 §8.1.2.3), and Triton might act on another :path than the one judged here.
            self._streams.answer_locally(stream_id)
            self._to_client(http2.rst_stream(stream_id, http2.PROTOCOL_ERROR))
            self._state.refuse(PROTOCOL, "unknown", "protocol_error", "malformed")
        elif goaway_last is not None and stream_id > goaway_last:
            # After the drain's GOAWAY: refused before any other check (REFUSED_STREAM: not processed, so the
            # client may retry it on another replica, as grpcio does by itself), and counted as REST counts it.
            self._streams.answer_locally(stream_id)
            self._to_client(http2.rst_stream(stream_id, http2.REFUSED_STREAM))
            self._state.refuse(PROTOCOL, route, "unavailable", "draining")
        elif unavailable is not None:  # no stream goes to Triton
            refusal = None if unavailable.turned_away else self._token_refusal(rule, block)
            if refusal is None:
                refusal = (GRPC_UNAVAILABLE, unavailable.message, unavailable.reason)
            self._answers.refuse_new(stream_id, route, *refusal)
        # (the guard spares a forwarded call the method call when neither token check applies)
        elif (block.repeated_authorization or self._auth is not None) and (refusal := self._token_refusal(rule, block)):
            self._answers.refuse_new(stream_id, route, *refusal)
        elif rule is None:
            shown = clip_path((block.path or b"").decode("utf-8", errors="replace"))
            self._answers.refuse_new(
                stream_id, route, GRPC_UNIMPLEMENTED, f"method {shown} is not available", "unknown"
            )
        else:
            return self._actions[rule.verdict](stream_id, rule)
        return None

    def _token_refusal(self, rule: GrpcRule | None, block: HeaderBlock) -> tuple[int, str, str] | None:
        """Why the call is refused by the token checks, if it is: ``authorization`` more than once (the token
        checked here and the one a later reader takes might differ); with tokens on, no valid bearer token —
        probes are open, and it is checked before the verdict is acted on, so a caller without one learns
        nothing about methods."""
        if block.repeated_authorization:
            return _BAD_REQUEST
        auth = self._auth
        if auth is None or (rule is not None and rule.route in OPEN_GRPC_ROUTES):
            return None
        return None if auth.check_grpc(block.authorization) else _UNAUTHENTICATED

    def _forwarded(self, stream_id: int, rule: GrpcRule) -> GrpcRule | None:
        """A stream for Triton, unless the client already has as many open there as the proxy advertises
        (SETTINGS_MAX_CONCURRENT_STREAMS): refused then, which clients retry; or, with a rate limit, a metadata
        call finds its bucket empty: RESOURCE_EXHAUSTED, as for inference (``Admission.take_metadata_token``)."""
        if self._streams.open_count() >= self._max_streams:
            self._streams.answer_locally(stream_id)
            self._to_client(http2.rst_stream(stream_id, http2.REFUSED_STREAM))
            self._state.refuse(PROTOCOL, rule.route, "unavailable", "too_many_streams")  # as clients report it
            return None
        if rule.route in self._metered and (refusal := self._state.admission.take_metadata_token()) is not None:
            pushback_ms = refusal.retry_after_s * 1000
            self._answers.refuse_new(
                stream_id, rule.route, GRPC_RESOURCE_EXHAUSTED, refusal.message, refusal.reason, pushback_ms
            )
            return None
        return rule

    def _answer_probe(self, stream_id: int, rule: GrpcRule) -> None:
        self._answers.answer_probe(stream_id, rule)

    def _deny(self, stream_id: int, rule: GrpcRule) -> None:
        message = f"{rule.route} is not available to tenants"
        self._answers.refuse_new(stream_id, rule.route, GRPC_PERMISSION_DENIED, message, "denied")
