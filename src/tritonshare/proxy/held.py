"""The process-wide budget of request bytes the proxy holds to check them (``--max-held-bytes``), REST and gRPC.

A REST infer body's JSON part is held until it is complete and checked (:mod:`tritonshare.proxy.inspect`), each
up to ``--max-json-bytes``; nothing else bounded their sum, so a few clients sending large JSON bodies at once
could hold more than the container's memory limit and have the proxy OOM-killed — with every other client of the
pod. So what is held is counted for the whole process. A request reserves what it will hold before holding it past
the event-loop turn its bytes came in (bytes handled within one turn are not held: a whole request in one read never
reserves, nor does a compressed body that came whole with its head): its declared JSON length in full when the head
tells it (the Content-Length of a plain JSON body, or Inference-Header-Content-Length), at the head if none of its
body came with it, else once the bytes that did have been read; else as its bytes are held (chunked, or
gzip/deflate, whose inflated size is unknown). What it reserved goes back when its JSON part has been checked and
handed on, or it is refused, or its connection ends (:meth:`~tritonshare.proxy.rest_requests.RequestPath._unhold`).
A reservation that does not fit is refused: 503 with ``Retry-After: 1``, counted as refusal reason :data:`REASON`.

gRPC holds the parameter fields of infer messages (``parameters``, ``inputs`` — whose contents can carry tensor
data — and ``outputs``) to check them, each message's up to ``--max-json-bytes``
(:class:`~tritonshare.proxy.protobuf.FieldWalker`); the message's frames are forwarded as they pass. What is kept
is reserved as it is kept (also when its field ends within the same read), at what it keeps alive (a view of a
read buffer reserves the whole buffer; a small part of one is copied), and goes back when its field ends (or its
message is judged, for a field that names shared memory), or its stream ends, whichever way
(:meth:`~tritonshare.proxy.grpc_messages.MessageInspector.close`). A message lying whole in one DATA frame keeps
nothing. A stream that does not fit is refused RESOURCE_EXHAUSTED (reason :data:`REASON`) and reset at Triton.

The budget counts JSON bytes (a compressed body: the larger of its compressed bytes held and its JSON inflated so
far). Each is held once (:class:`~tritonshare.proxy.request_body.InferBodyCheck`), so the proxy's memory grows by about
the budget, plus, while one request's JSON is checked (one at a time: the check runs on the event loop), a copy of
that JSON (at most ``--max-json-bytes``).
"""

from __future__ import annotations

from tritonshare.proxy.inspect import BodyRefused

REASON = "held_budget"  # the refusals' metrics label
STATUS = 503
RETRY_AFTER = b"Retry-After: 1\r\n"


class HeldBudget:
    """Bytes held by every request at once, at most ``limit`` (0: counted, not bounded)."""

    __slots__ = ("limit", "held")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def reserve(self, size: int) -> bool:
        """Take ``size`` more bytes if they fit (True); else take nothing (False)."""
        if self.limit and self.held + size > self.limit:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        """Give back bytes taken by :meth:`reserve`."""
        self.held -= size

    def refusal(self, size: int, own: int) -> BodyRefused:
        """The answer to a request that could not reserve ``size`` more bytes, having ``own`` reserved already."""
        return BodyRefused(
            STATUS,
            f"the request's JSON ({own + size} bytes to hold) does not fit for now: the proxy is holding "
            f"{self.held - own} bytes of other requests' JSON to check them (--max-held-bytes {self.limit}); "
            "retry later; tensors sent as binary data (Inference-Header-Content-Length) leave less JSON to hold",
            REASON,
        )

    def grpc_refusal(self, size: int, own: int) -> str:
        """The message of a gRPC request that could not keep ``size`` more bytes, having ``own`` reserved already
        (RESOURCE_EXHAUSTED, refusal reason :data:`REASON`)."""
        return (
            f"the request message's parameter fields ({own + size} bytes to keep) do not fit for now: the proxy is "
            f"holding {self.held - own} bytes of other requests to check them (--max-held-bytes {self.limit}); "
            "retry later; tensor data sent in raw_input_contents rather than in the inputs' contents is never held"
        )
