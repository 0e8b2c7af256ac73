"""Judging gRPC request messages as their bytes stream past: the gRPC framing around the protobuf messages
that :mod:`tritonshare.proxy.protobuf` walks.

A gRPC message is 1 byte compressed-flag + 4 bytes big-endian length + a protobuf message, and it may be split
across any number of HTTP/2 DATA frames. :class:`MessageInspector` follows that framing for one request stream: a
message that lies whole in one frame is walked in one go by its connection's
:class:`~tritonshare.proxy.protobuf.MessageWalker`; one split across frames, or compressed (grpc-encoding gzip or
deflate: inflated in bounded steps by an :class:`~tritonshare.proxy.inflation.Inflation`), by a
:class:`~tritonshare.proxy.protobuf.FieldWalker` fed piece by piece. Each message is judged as it completes: the
own model's name (field 1, the last one), and for infer requests no shared-memory parameter. A compressed message
is refused (RESOURCE_EXHAUSTED) as soon as it inflates too far
(:func:`~tritonshare.proxy.inflation.inflates_too_far`, the bound REST puts on a compressed body too): Triton's
gRPC server inflates a message whole into memory before it checks its size against its own limit (2 GiB - 1), so
1 GiB of zeros in 1 MB of gzip took Triton's RSS up 2.3 GB, 1.3 GB of it kept (as much through the proxy, which
walked it and passed it on, before this bound). Anything that cannot be followed — malformed protobuf, a compressed
message in an encoding the proxy cannot read — is refused: never "allow" on a message not understood.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonshare.proxy import held, http2
from tritonshare.proxy.inflation import INFLATES_TOO_FAR, CorruptStream, InflatesTooFar, Inflation
from tritonshare.proxy.policy import (
    CLASSIFICATION_REFUSAL,
    GRPC_INVALID_ARGUMENT,
    GRPC_NOT_FOUND,
    GRPC_PERMISSION_DENIED,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNIMPLEMENTED,
    GrpcRule,
    grpc_model_allowed,
    grpc_not_found,
)
from tritonshare.proxy.protobuf import (
    COMPRESSED_FIELDS,
    FIELDS_PER_COMPRESSED_BYTE,
    FieldWalker,
    MalformedMessage,
    MessageWalker,
    OverBudget,
    WalkResult,
    names_shm_parameter,
)

_U32 = http2.U32
_DECOMPRESSORS = {b"gzip": 31, b"deflate": 15}  # grpc-encoding → zlib wbits (gzip header / zlib header)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request message is not forwarded, as the gRPC status the client gets."""

    status: int
    message: str
    reason: str  # metrics label


class MessageJudge:
    """What judging the request messages of one route on one relayed connection takes: the route's rule, the own
    model's name, the bound on parameter bytes kept for a full parse, and the connection's walker of whole
    messages. Messages that lie whole in their DATA frames are judged by :meth:`whole`, with no state per
    stream; a stream gets a :class:`MessageInspector` once one does not (or from its start, when the relay
    needs to count its messages)."""

    __slots__ = ("rule", "own", "accept", "limit", "budget", "walker")

    def __init__(
        self,
        rule: GrpcRule,
        own: bytes,
        *,
        limit: int,
        budget: held.HeldBudget | None = None,
        walker: MessageWalker | None = None,
    ) -> None:
        """``budget``: the process's held-bytes budget (:mod:`tritonshare.proxy.held`), where parameter bytes kept
        across reads are reserved; ``walker``: the connection's, for messages of ``rule`` (one is made if not
        given)."""
        self.rule = rule
        self.own = own
        self.accept = own or None  # a name accepted without asking the policy (never an empty one)
        self.limit = limit
        self.budget = budget
        self.walker = walker or MessageWalker(inspect=rule.inspect, limit=limit)

    def whole(self, buf: bytes, pos: int, end: int) -> int | Refusal:
        """Judge the uncompressed messages that lie whole at the start of ``buf[pos:end]``: the refusal of the
        first one refused, or where the first one that does not lie whole starts (``end`` if none)."""
        try:
            while end - pos >= 5 and not buf[pos]:
                stop = pos + 5 + _U32.unpack_from(buf, pos + 1)[0]
                if stop > end:
                    break
                name, details = self.walker.walk(buf, pos + 5, stop)
                if details is not None or name != self.accept:
                    refusal = self.verdict(name, details)
                    if refusal is not None:
                        return refusal
                pos = stop
        except MalformedMessage as exc:
            return _malformed(exc)
        return pos

    def repeatable(self, buf: bytes, pos: int, end: int) -> int:
        """Where the bytes that decide the judgment of ``buf[pos:end]`` end, when it is exactly one uncompressed
        message, passed, of the shape the walker remembers: any message that starts with ``buf[pos:]`` up to
        there and is as long is passed too, whatever its last field's value. -1 otherwise."""
        accept = self.accept
        if accept is None or end - pos < 5 or buf[pos] or pos + 5 + _U32.unpack_from(buf, pos + 1)[0] != end:
            return -1
        length = self.walker.shape(buf, pos + 5, end, accept)
        return pos + 5 + length if length >= 0 else -1

    def verdict(self, name: bytes, result: WalkResult | None) -> Refusal | None:
        """The refusal of a message naming ``name`` with the rest of its walk (None: nothing but the name to
        judge), if it is refused."""
        complete = result is None or result.name_complete
        if not complete or not grpc_model_allowed(self.rule, name, self.own):
            return Refusal(GRPC_NOT_FOUND, grpc_not_found(name), "other_model")
        if result is None:
            return None
        if result.overdeclared:
            return Refusal(GRPC_INVALID_ARGUMENT, result.overdeclared, "shape")
        if result.classified:
            return Refusal(GRPC_INVALID_ARGUMENT, CLASSIFICATION_REFUSAL, "classification")
        if result.oversized:
            return Refusal(
                GRPC_RESOURCE_EXHAUSTED,
                f"request parameters mention shared memory and are larger than the {self.limit} bytes the proxy checks",
                "too_large",
            )
        for number, data in result.suspects:
            if names_shm_parameter(number, data):
                return Refusal(
                    GRPC_PERMISSION_DENIED, "shared-memory parameters are not available to tenants", "shared_memory"
                )
        return None


def _malformed(exc: Exception) -> Refusal:
    return Refusal(GRPC_INVALID_ARGUMENT, f"request message is not valid protobuf: {exc}", "malformed")


class MessageInspector:
    """Follows the gRPC messages of one request stream and judges each one as it completes."""

    __slots__ = (
        "_judge",
        "_encoding",
        "_prefix",
        "_left",
        "_walker",
        "_inflation",
        "_refusal",
        "messages",
        "first_end",
    )

    def __init__(self, judge: MessageJudge, *, encoding: bytes | None) -> None:
        """``encoding``: the stream's grpc-encoding (compressed messages are decompressed to be walked)."""
        self._judge = judge
        self._encoding = encoding
        self._prefix = b""  # the 5-byte prefix of a message, while it arrives in pieces
        self._left = 0  # body bytes of the current message still to come
        self._walker: FieldWalker | None = None
        self._inflation: Inflation | None = None  # the current message's, if it is compressed
        self._refusal: Refusal | None = None
        self.messages = 0  # messages judged and accepted so far
        # Where the first accepted message ended, in the buffer of the feed() call that completed it (the
        # relay holds a stream waiting for admission from that message's last byte on).
        self.first_end = -1

    def feed(self, buf: bytes, pos: int, end: int) -> Refusal | None:
        """Feed DATA bytes ``buf[pos:end]``; the refusal of the first message completed in them that
        must not reach Triton, if any. Once a refusal is returned, the stream is over."""
        try:
            while pos < end:
                if self._walker is None and not self._prefix and end - pos >= 5 and not buf[pos]:
                    stop = pos + 5 + _U32.unpack_from(buf, pos + 1)[0]
                    if stop <= end:  # a whole uncompressed message: walk it in one go
                        judge = self._judge
                        name, details = judge.walker.walk(buf, pos + 5, stop)
                        if details is not None or name != judge.accept:
                            refusal = self._judge_message(name, details, stop)
                            if refusal is not None:
                                return refusal
                        elif self.messages:  # the own model, nothing more to look at (as _judge, inline)
                            self.messages += 1
                        else:
                            self.messages, self.first_end = 1, stop
                        pos = stop
                        continue
                pos = self._feed_piece(buf, pos, end)
                if pos < 0:
                    return self._refusal
        except (MalformedMessage, CorruptStream) as exc:
            return _malformed(exc)
        except OverBudget as over:  # (not `exc` again: compiled code types a name once, by its first use)
            assert self._judge.budget is not None  # (only a walker given a budget raises it)
            return Refusal(GRPC_RESOURCE_EXHAUSTED, self._judge.budget.grpc_refusal(over.size, over.own), held.REASON)
        return None

    def between_messages(self) -> bool:
        """Every message fed so far is whole: the stream is at a message boundary."""
        return self._walker is None and not self._prefix

    def close(self) -> None:
        """The stream is over, whichever way: what the message in progress kept is given back."""
        if self._walker is not None:
            self._walker.release()

    def _feed_piece(self, buf: bytes, pos: int, end: int) -> int:
        """Follow a message that is not whole in ``buf[pos:end]``: its 5-byte prefix, or bytes of its body.
        Returns where reading goes on, -1 if a message was refused (:attr:`_refusal`)."""
        if self._walker is None:
            take = min(5 - len(self._prefix), end - pos)
            self._prefix += buf[pos : pos + take]
            pos += take
            if len(self._prefix) == 5:
                self._refusal = self._start_message(pos)
                if self._refusal is not None:
                    return -1
            return pos
        take = min(self._left, end - pos)
        self._refusal = self._feed_body(buf, pos, pos + take)
        if self._refusal is not None:
            return -1
        pos += take
        self._left -= take
        if not self._left:
            self._refusal = self._end_message(pos)
            if self._refusal is not None:
                return -1
        return pos

    def _start_message(self, pos: int) -> Refusal | None:
        flag, length = self._prefix[0], int.from_bytes(self._prefix[1:5], "big")
        self._prefix = b""
        if flag > 1:
            raise MalformedMessage(f"gRPC message flag {flag} is neither 0 nor 1")
        self._inflation = None
        if flag == 1:
            wbits = _DECOMPRESSORS.get(self._encoding or b"")
            if wbits is None:
                shown = (self._encoding or b"(none)").decode("latin-1")
                return Refusal(
                    GRPC_UNIMPLEMENTED,
                    f"the proxy cannot inspect messages compressed with "
                    f"grpc-encoding {shown!r}; use gzip, deflate or none",
                    "compression",
                )
            self._inflation = Inflation(wbits)
        fields = COMPRESSED_FIELDS if self._inflation is not None else -1  # see protobuf.COMPRESSED_FIELDS
        judge = self._judge
        self._walker = FieldWalker(inspect=judge.rule.inspect, limit=judge.limit, fields=fields, budget=judge.budget)
        self._left = length
        return self._end_message(pos) if length == 0 else None

    def _feed_body(self, buf: bytes, start: int, end: int) -> Refusal | None:
        """Walk bytes of a message's body (inflated first if compressed); the refusal of one that inflates too far."""
        walker, inflation = self._walker, self._inflation
        assert walker is not None
        if inflation is None:
            walker.feed(buf, start, end)
            return None
        chunk = buf[start:end]
        walker.fields_left += FIELDS_PER_COMPRESSED_BYTE * len(chunk)
        try:
            for out in inflation.steps(chunk):
                walker.feed(out, 0, len(out))
        except InflatesTooFar:
            return Refusal(GRPC_RESOURCE_EXHAUSTED, f"the compressed message {INFLATES_TOO_FAR}", "too_large")
        return None

    def _end_message(self, pos: int) -> Refusal | None:
        walker = self._walker
        assert walker is not None
        try:
            inflation = self._inflation
            if inflation is not None:  # (all its input was inflated as it came: no output is pending)
                if not inflation.eof:
                    raise MalformedMessage(f"compressed message ends before its {self._encoding!r} stream does")
                if inflation.trailing:  # what a reader other than zlib might take for more of the message
                    raise MalformedMessage(
                        f"compressed message has {inflation.trailing} bytes after its {self._encoding!r} stream ends"
                    )
            result = walker.finish()
            return self._judge_message(result.model_name, result, end=pos)
        finally:
            self._walker = None
            walker.release()  # judged, or refused: what it kept goes

    def _judge_message(self, name: bytes, result: WalkResult | None, end: int) -> Refusal | None:
        """The verdict on a message that ended at ``end`` in the buffer being fed (see MessageJudge.verdict)."""
        refusal = self._judge.verdict(name, result)
        if refusal is not None:
            return refusal
        self.messages += 1
        if self.messages == 1:
            self.first_end = end
        return None
