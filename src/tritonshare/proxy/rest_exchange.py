"""One request on a REST client connection (:mod:`tritonshare.proxy.rest_connection`), from its head to the
end of its response: what has happened to it so far."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonshare.proxy import admission
    from tritonshare.proxy.request_body import RequestBody
    from tritonshare.proxy.rest import Judged


class Exchange:
    """One request on a client connection, from its head to the end of its response. A connection carries
    one request at a time, so it keeps one Exchange and restarts it per request (:meth:`start`): resetting
    the fields costs a third of what building a new object does, on the path every request takes."""

    __slots__ = (
        "judged", "body", "forwarded", "started", "request_done", "response_done", "holding", "ticket", "held",
        "reserved",
    )  # fmt: skip

    judged: Judged
    body: RequestBody | None  # a body still to read
    forwarded: bool  # sent to Triton (counted in flight from then on)
    started: float
    request_done: bool
    response_done: bool
    holding: bool  # holds an admission slot
    ticket: admission.Ticket | None  # waiting for an admission slot
    held: bool  # its body is held for the check, not forwarded yet: counted in ``ProxyState.held``
    reserved: int  # while held: its bytes of the held-bytes budget (``ProxyState.held_budget``)

    def start(self, judged: Judged) -> Exchange:
        self.judged = judged
        self.body = self.ticket = None
        self.forwarded = self.request_done = self.response_done = self.holding = self.held = False
        self.started = 0.0
        return self

    @classmethod
    def sent_whole(cls) -> Exchange:
        """The short path's exchange, made once per connection: a request forwarded whole in one write. Nothing
        changes those fields while it is in progress (a body or a ticket is set only before a request is
        forwarded whole), so per request only ``judged``, ``started`` and ``response_done`` are set, and
        ``holding`` when the request took an admission slot (every end of an exchange holding one gives it back
        and sets it False again: :meth:`~tritonshare.proxy.rest_requests.RequestPath._settle`)."""
        ex = cls()
        ex.body = ex.ticket = None
        ex.forwarded = ex.request_done = True
        ex.response_done = ex.holding = ex.held = False
        return ex
