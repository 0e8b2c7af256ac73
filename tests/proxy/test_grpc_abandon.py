"""Cancelled gRPC calls are not cancelled at Triton (``--grpc-cancellations absorb``, the default): Triton before
24.12 can crash on a cancellation that races a call's end, and it is every tenant's Triton.

Frame by frame (no sockets, as in ``test_grpc_admission``): what Triton gets when a client resets a stream, lets
its deadline pass, or goes away; what the client gets of Triton's answer; what the abandoned call still holds.
Then through a real Triton, with what the proxy sends it recorded (``tests.proxy.wire``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.proxy.conftest import RecordingModel
from tests.proxy.test_grpc import identity_input, infer_request
from tests.proxy.test_grpc_admission import Relay, settle
from tests.proxy.test_grpc_relay import data, frames, message
from tests.proxy.test_grpc_wire import StartProxy, behind_pipe
from tests.proxy.wire import Stream as WireStream
from tests.proxy.wire import TcpPipe, client_streams
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.proxy import http2
from tritonshare.proxy.grpc_streams import RESET_BURST
from tritonshare.proxy.policy import GRPC_SERVICE

LABELS = {"model": "own", "protocol": "grpc", "route": "ModelInfer"}


def absorbing(**options: object) -> Relay:
    """A relayed connection without admission control (but where ``options`` say)."""
    return Relay(**{"max_inflight": 0, **options})


def requests(relay: Relay, code: str, route: str = "ModelInfer") -> float | None:
    labels = {**LABELS, "route": route, "code": code}
    return relay.state.metrics.registry.get_sample_value("tritonshare_proxy_requests_total", labels)


def to_client(relay: Relay, stream_id: int) -> list[int]:
    """The kinds of the frames of ``stream_id`` the client got."""
    return [kind for kind, _, sid, _ in frames(bytes(relay.to_client.out)) if sid == stream_id]


def triton_got(relay: Relay, kind: int, stream_id: int) -> list[bytes]:
    """The payloads of the frames of ``kind`` on ``stream_id`` that reached Triton (after the preface)."""
    sent = bytes(relay.to_triton.out)[len(http2.PREFACE) :]
    return [payload for k, _, sid, payload in frames(sent) if k == kind and sid == stream_id]


async def triton_answers(relay: Relay, stream_id: int, size: int) -> None:
    """Triton's answer on ``stream_id``: response headers, ``size`` bytes in 16 KiB DATA frames, trailers."""
    assert relay.upstream is not None
    head = relay.triton.encode([(":status", "200"), ("content-type", "application/grpc")])
    body = bytes(size)
    chunks = [data(stream_id, body[i : i + 16_384], end=False) for i in range(0, size, 16_384)]
    tail = relay.triton.encode([("grpc-status", "0")])
    relay.upstream.data_received(
        http2.frame(http2.HEADERS, http2.END_HEADERS, stream_id, head)
        + b"".join(chunks)
        + http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, stream_id, tail)
    )
    await settle()


@pytest.mark.asyncio
async def test_a_cancelled_call_runs_to_its_end_at_triton_and_its_answer_is_dropped() -> None:
    relay = await absorbing().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(http2.rst_stream(1, http2.CANCEL))
    at_triton = relay.at_triton()[1]
    assert at_triton.reset_code is None and at_triton.end_stream  # type: ignore[attr-defined]
    assert relay.state.inflight == 1  # Triton still runs it
    await triton_answers(relay, 1, 70_000)  # more than a stream's first window (64 KiB)
    # None of its DATA reaches the client, which has given it up; header blocks do only as they change its
    # HPACK table (a client decodes the blocks of streams it closed, to keep its table in step).
    assert http2.DATA not in to_client(relay, 1)
    # Every byte of it is credited back to Triton, on the connection and on the stream: no answer stalls.
    assert sum(http2.window_increment(p) for p in triton_got(relay, http2.WINDOW_UPDATE, 0)) == 70_000
    assert sum(http2.window_increment(p) for p in triton_got(relay, http2.WINDOW_UPDATE, 1)) == 70_000
    assert relay.state.inflight == 0
    assert requests(relay, "cancelled") == 1 and requests(relay, "ok") is None


@pytest.mark.asyncio
async def test_a_cancelled_stream_is_ended_at_triton_as_if_its_client_had() -> None:
    """A ModelStreamInfer stream whose client had not ended its side: an empty DATA frame ends it, between
    messages; Triton answers what it has, then ends the stream."""
    relay = await absorbing().start()
    opening = relay.client.headers(1, "ModelStreamInfer")
    await relay.send(opening, data(1, message("own"), end=False), data(1, message("own"), end=False))
    await relay.send(http2.rst_stream(1, http2.CANCEL))
    at_triton = relay.at_triton()[1]
    assert bytes(at_triton.data) == 2 * message("own")  # type: ignore[attr-defined]
    assert at_triton.end_stream and at_triton.reset_code is None  # type: ignore[attr-defined]
    assert triton_got(relay, http2.DATA, 1)[-1] == b""
    await triton_answers(relay, 1, 100)
    assert requests(relay, "cancelled", "ModelStreamInfer") == 1 and relay.state.inflight == 0


@pytest.mark.asyncio
async def test_a_stream_cancelled_inside_a_message_is_reset_at_triton() -> None:
    """Ending the stream there would be Triton's error, not the call's end: Triton holds an incomplete message
    and has started nothing for it."""
    relay = await absorbing().start()
    big = message("own", bytes(range(256)) * 100)
    await relay.send(relay.client.headers(1, "ModelStreamInfer"), data(1, big[:10_000], end=False))
    await relay.send(http2.rst_stream(1, http2.CANCEL))
    assert relay.at_triton()[1].reset_code == http2.CANCEL  # type: ignore[attr-defined]
    assert relay.state.inflight == 0 and requests(relay, "cancelled", "ModelStreamInfer") == 1


@pytest.mark.asyncio
async def test_a_reset_crossing_tritons_answer_is_not_passed_on() -> None:
    """The client's deadline passes as Triton's answer is on its way: Triton has ended the call, and a reset
    arriving now is the very race that crashes it (server#7368)."""
    relay = await absorbing().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.triton_ends(1)
    await relay.send(http2.rst_stream(1, http2.CANCEL))
    assert triton_got(relay, http2.RST_STREAM, 1) == []
    assert requests(relay, "ok") == 1


@pytest.mark.asyncio
async def test_a_stream_triton_ended_first_is_ended_by_the_client_side_cleanly() -> None:
    """Triton ends a ModelStreamInfer stream while its client still sends: the client's reset then becomes the
    end of its side (an empty DATA frame), as does its connection's end; a stream the client ended itself
    gets nothing more."""
    relay = await absorbing().start()
    for stream_id in (1, 3, 5):
        opening = relay.client.headers(stream_id, "ModelStreamInfer")
        await relay.send(opening, data(stream_id, message("own"), end=False))
        await relay.triton_ends(stream_id)
    await relay.send(http2.rst_stream(1, http2.CANCEL), data(5, b"", end=True))
    relay.connection.connection_lost(None)
    ends = {sid: triton_got(relay, http2.DATA, sid)[1:] for sid in (1, 3, 5)}
    assert ends == {1: [b""], 3: [b""], 5: [b""]}  # each side ended once: by the proxy (1, 3), the client (5)
    assert all(triton_got(relay, http2.RST_STREAM, sid) == [] for sid in (1, 3, 5))
    assert relay.to_triton.closed  # nothing left running: Triton's connection goes at once


@pytest.mark.asyncio
async def test_streams_closed_at_triton_get_nothing_more() -> None:
    """A stream reset at Triton (the client cut it inside a message), one Triton reset, one abandoned that Triton
    then ended: no frame of theirs goes to Triton after, whatever the client does next (a frame on a closed stream
    can be a connection error there, which would cancel every call on the connection)."""
    relay = await absorbing().start()
    big = message("own", bytes(range(256)) * 100)
    await relay.send(relay.client.headers(1, "ModelStreamInfer"), data(1, big[:10_000], end=False))
    await relay.send(http2.rst_stream(1, http2.CANCEL))  # inside a message: reset at Triton
    for stream_id in (3, 5):
        await relay.send(
            relay.client.headers(stream_id, "ModelStreamInfer"), data(stream_id, message("own"), end=False)
        )
    assert relay.upstream is not None
    relay.upstream.data_received(http2.rst_stream(3, http2.INTERNAL_ERROR))  # Triton resets 3
    await relay.send(http2.rst_stream(5, http2.CANCEL))  # abandoned: its side ended
    await triton_answers(relay, 5, 100)  # then Triton ends it
    sent = len(relay.to_triton.out)
    await relay.send(http2.rst_stream(3, http2.CANCEL), http2.rst_stream(5, http2.CANCEL))
    relay.connection.connection_lost(None)
    assert len(relay.to_triton.out) == sent and relay.to_triton.closed
    assert triton_got(relay, http2.RST_STREAM, 1) == [http2.CANCEL.to_bytes(4, "big")]
    assert triton_got(relay, http2.DATA, 5)[-1] == b"" and len(triton_got(relay, http2.DATA, 5)) == 2


@pytest.mark.asyncio
async def test_with_cancellations_forwarded_a_reset_crossing_tritons_answer_goes_on() -> None:
    relay = await absorbing(grpc_cancellations="forward").start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.triton_ends(1)
    await relay.send(http2.rst_stream(1, http2.CANCEL))
    assert triton_got(relay, http2.RST_STREAM, 1) == [http2.CANCEL.to_bytes(4, "big")]


@pytest.mark.asyncio
async def test_frames_a_client_sends_on_a_stream_it_cancelled_do_not_reach_triton() -> None:
    relay = await absorbing().start()
    await relay.send(relay.client.headers(1, "ModelStreamInfer"), data(1, message("own"), end=False))
    await relay.send(http2.rst_stream(1, http2.CANCEL))
    sent = len(relay.to_triton.out)
    await relay.send(data(1, message("other"), end=False), http2.window_update(1, 1000), http2.rst_stream(1, 8))
    assert len(relay.to_triton.out) == sent
    assert relay.credits() == len(message("other"))  # the dropped DATA, credited back to the client


@pytest.mark.asyncio
async def test_an_abandoned_call_keeps_its_admission_slot_until_triton_ends_it() -> None:
    relay = await Relay().start()  # one slot
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(http2.rst_stream(1, http2.CANCEL))
    await relay.send(relay.client.headers(3, "ModelInfer"), data(3, message("own")))
    assert relay.state.admission.waiting == 1  # Triton still runs the cancelled call: the next one waits
    await relay.triton_ends(1)
    assert relay.state.admission.waiting == 0 and relay.at_triton()[3].end_stream  # type: ignore[attr-defined]
    await relay.triton_ends(3)
    assert relay.state.admission.idle and relay.state.inflight == 0


@pytest.mark.asyncio
async def test_an_abandoned_call_keeps_its_place_under_the_cap_on_streams() -> None:
    relay = await absorbing(grpc_max_streams=2).start()
    for stream_id in (1, 3):
        await relay.send(relay.client.headers(stream_id, "ModelInfer"), data(stream_id, message("own")))
    await relay.send(http2.rst_stream(1, http2.CANCEL), relay.client.headers(5, "ModelInfer"))
    assert sorted(relay.at_triton()) == [1, 3]
    assert triton_got(relay, http2.RST_STREAM, 1) == []
    refused = [p for kind, _, sid, p in frames(bytes(relay.to_client.out)) if kind == http2.RST_STREAM and sid == 5]
    assert refused == [http2.REFUSED_STREAM.to_bytes(4, "big")]  # clients retry it
    await relay.triton_ends(1)
    await relay.send(relay.client.headers(7, "ModelInfer"), data(7, message("own")))
    assert sorted(relay.at_triton()) == [1, 3, 7]


@pytest.mark.asyncio
async def test_cancelling_and_calling_again_puts_no_more_calls_on_triton_than_the_cap() -> None:
    """What "rapid reset" (CVE-2023-44487) does to a server that drops cancelled work: here the calls go on at
    Triton and keep their places, so a client resetting thousands of calls a second has at most the cap's
    worth running; the rest are refused (REFUSED_STREAM) without reaching Triton."""
    relay = await absorbing().start()
    body = message("own")
    talk = [
        relay.client.headers(2 * i + 1, "ModelInfer") + data(2 * i + 1, body) + http2.rst_stream(2 * i + 1, 8)
        for i in range(3 * RESET_BURST)
    ]
    for chunk in talk:
        relay.connection.data_received(chunk)
    await settle()
    streams = relay.at_triton()
    assert len(streams) == relay.state.settings.grpc_max_streams
    assert all(s.reset_code is None for s in streams.values())  # type: ignore[attr-defined]
    # A client whose deadlines are short cancels many calls: not a flood the reset budget ends the connection for.
    assert http2.GOAWAY not in [kind for kind, _, _, _ in frames(bytes(relay.to_client.out))]


@pytest.mark.asyncio
async def test_an_abandoned_call_is_not_forgotten_among_many_streams_ended_early() -> None:
    """The proxy remembers a bounded number of streams it reset, to drop Triton's late frames of them; one still
    running at Triton stays among them, its answer credited back to Triton (else it could stall Triton's stream,
    and its place and slot, for the connection's life)."""
    relay = await absorbing(grpc_max_streams=400).start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")), http2.rst_stream(1, 8))
    for stream_id in range(3, 700, 2):  # refused by the proxy: another tenant's model
        await relay.send(relay.client.headers(stream_id, "ModelInfer"), data(stream_id, message("other")))
    await triton_answers(relay, 1, 70_000)
    assert sum(http2.window_increment(p) for p in triton_got(relay, http2.WINDOW_UPDATE, 1)) == 70_000
    assert http2.DATA not in to_client(relay, 1) and relay.state.inflight == 0


@pytest.mark.asyncio
async def test_a_deadline_does_not_reach_triton() -> None:
    """At its deadline Triton's gRPC server would cancel the call itself. The block that carries one is
    re-encoded without it, and so is every block after it (``client_streams`` decodes Triton's side with one
    HPACK decoder in order: the blocks stay decodable)."""
    relay = await absorbing().start()
    timed = relay.client.headers(1, "ModelInfer", ("grpc-timeout", "5S"), ("x-tag", "a"))
    await relay.send(timed, data(1, message("own")))
    await relay.send(relay.client.headers(3, "ModelInfer", ("x-tag", "b")), data(3, message("own")))
    await relay.send(relay.client.headers(5, "ModelInfer", ("grpc-timeout", "3m")), data(5, message("own")))
    streams = relay.at_triton()
    assert [streams[sid].headers.get("grpc-timeout") for sid in (1, 3, 5)] == [None] * 3  # type: ignore[attr-defined]
    assert [streams[sid].headers.get("x-tag") for sid in (1, 3)] == ["a", "b"]  # type: ignore[attr-defined]
    assert all(streams[sid].headers[":path"].endswith("/ModelInfer") for sid in (1, 3, 5))  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_with_cancellations_forwarded_triton_gets_resets_and_deadlines() -> None:
    relay = await absorbing(grpc_cancellations="forward").start()
    timed = relay.client.headers(1, "ModelInfer", ("grpc-timeout", "5S"))
    await relay.send(timed, data(1, message("own")), http2.rst_stream(1, http2.CANCEL))
    at_triton = relay.at_triton()[1]
    assert at_triton.headers["grpc-timeout"] == "5S" and at_triton.reset_code == http2.CANCEL  # type: ignore[attr-defined]
    assert relay.state.inflight == 0 and requests(relay, "cancelled") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["closed", "refused"])
async def test_a_client_that_goes_leaves_its_calls_running_at_triton(how: str) -> None:
    """The client's connection closes (or the proxy ends it: a protocol error) with calls in flight: Triton's
    connection stays, the proxy answers what Triton asks of the client (SETTINGS, PING), and closes it once
    Triton has ended them."""
    relay = await absorbing().start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    await relay.send(relay.client.headers(3, "ModelStreamInfer"), data(3, message("own"), end=False))
    if how == "closed":
        relay.connection.connection_lost(None)
    else:
        await relay.send(http2.frame(http2.PUSH_PROMISE, 0, 1, bytes(4)))  # only servers send it: the end
    assert not relay.to_triton.closed and relay.connection in relay.frontend.connections
    streams = relay.at_triton()
    assert streams[1].end_stream and streams[3].end_stream  # type: ignore[attr-defined]
    assert all(s.reset_code is None for s in streams.values())  # type: ignore[attr-defined]
    assert relay.upstream is not None
    relay.upstream.data_received(http2.settings({4: 1 << 20}) + http2.frame(http2.PING, 0, 0, b"12345678"))
    answered = [(k, f, p) for k, f, sid, p in frames(bytes(relay.to_triton.out)[len(http2.PREFACE) :]) if k in (4, 6)]
    assert (http2.SETTINGS, http2.ACK, b"") in answered and (http2.PING, http2.ACK, b"12345678") in answered
    await relay.triton_ends(1)
    assert not relay.to_triton.closed
    await relay.triton_ends(3)
    assert relay.to_triton.closed and relay.connection not in relay.frontend.connections
    assert requests(relay, "cancelled") == 1 and requests(relay, "cancelled", "ModelStreamInfer") == 1


@pytest.mark.asyncio
async def test_calls_a_gone_client_left_running_are_cut_after_the_drain_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    relay = await absorbing(drain_timeout_s=0.2).start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    relay.connection.connection_lost(None)
    await asyncio.sleep(0.05)
    assert not relay.to_triton.closed
    with caplog.at_level(logging.WARNING):
        await asyncio.sleep(0.3)
    assert relay.to_triton.closed and relay.connection not in relay.frontend.connections
    assert "1 gRPC calls abandoned by a client that left did not end at Triton within 0.2 s" in caplog.text
    assert relay.state.inflight == 0


@pytest.mark.asyncio
async def test_with_cancellations_forwarded_a_client_that_goes_closes_tritons_connection() -> None:
    relay = await absorbing(grpc_cancellations="forward").start()
    await relay.send(relay.client.headers(1, "ModelInfer"), data(1, message("own")))
    relay.connection.connection_lost(None)
    assert relay.to_triton.closed and relay.state.inflight == 0


# ----------------------------------------------------------------------------------------- through a real Triton


@pytest.fixture
def recorded_proxy(
    start_proxy: StartProxy,
    triton: TritonServer,
    recording_model: Callable[[float], RecordingModel],
    tmp_path: Path,
) -> Iterator[tuple[ProxyProcess, TcpPipe, RecordingModel]]:
    """A proxy for a model that takes 0.8 s a request, what it sends Triton recorded."""
    model = recording_model(0.8)
    proxy, _, pipe = behind_pipe(start_proxy, triton, model.name, tmp_path, record=True)
    assert pipe is not None
    yield proxy, pipe, model
    pipe.close()


def what_triton_got(pipe: TcpPipe) -> list[WireStream]:
    time.sleep(0.2)  # the pipe's threads record the last bytes
    return [s for sent in pipe.sent for s in client_streams(bytes(sent)).values() if s.headers]


def ran(model: RecordingModel) -> list[float]:
    """INPUT0[0] of every request Triton ran to its end."""
    return [value for run in model.executions() for value in run.values]


@pytest.mark.triton
def test_a_call_whose_deadline_passes_runs_to_its_end_at_triton(
    recorded_proxy: tuple[ProxyProcess, TcpPipe, RecordingModel],
) -> None:
    proxy, pipe, model = recorded_proxy
    with grpcclient.InferenceServerClient(proxy.grpc_url) as client:
        with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
            client.infer(model.name, [identity_input(np.array([7.0], dtype=np.float32))], client_timeout=0.2)
        deadline = time.monotonic() + 10
        while 7.0 not in ran(model) and time.monotonic() < deadline:
            time.sleep(0.1)
        again = client.infer(model.name, [identity_input(np.array([8.0], dtype=np.float32))], client_timeout=30)
    assert again.as_numpy("OUTPUT0").tolist() == [8.0]  # the same proxy, the same connection to Triton
    assert ran(model) == [7.0, 8.0]  # Triton ran the abandoned call to its end
    streams = what_triton_got(pipe)
    assert [s.headers[":path"] for s in streams] == [f"/{GRPC_SERVICE}/ModelInfer"] * 2
    assert [(s.end_stream, s.reset_code, "grpc-timeout" in s.headers) for s in streams] == [(True, None, False)] * 2
    assert proxy_requests(proxy, "cancelled") == 1 and proxy_requests(proxy, "ok") == 1


@pytest.mark.triton
def test_a_client_that_goes_mid_call_leaves_tritons_connection_open_until_the_call_ends(
    recorded_proxy: tuple[ProxyProcess, TcpPipe, RecordingModel],
) -> None:
    proxy, pipe, model = recorded_proxy
    request = infer_request(model.name, np.array([5.0], dtype=np.float32)).SerializeToString()
    channel = grpc.insecure_channel(proxy.grpc_url)
    call = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer").future(request, timeout=30)
    time.sleep(0.3)  # the call is at Triton
    channel.close()  # the client goes (grpcio cancels its calls, then closes the connection)
    assert call.cancelled() or call.code() == grpc.StatusCode.CANCELLED
    time.sleep(0.2)
    still_open = pipe.open
    deadline = time.monotonic() + 10
    while pipe.open and time.monotonic() < deadline:
        time.sleep(0.05)
    closed_at = time.time()
    assert still_open == 1 and pipe.open == 0  # kept while Triton ran the call, closed after it
    (run,) = model.executions()
    assert run.values == (5.0,) and run.end <= closed_at
    (stream,) = what_triton_got(pipe)
    assert stream.end_stream and stream.reset_code is None
    assert proxy_requests(proxy, "cancelled") == 1


def proxy_requests(proxy: ProxyProcess, code: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as response:
        page = response.read().decode()
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "tritonshare_proxy_requests_total" and sample.labels.get("code") == code:
                if sample.labels.get("protocol") == "grpc":
                    return sample.value
    return 0.0
