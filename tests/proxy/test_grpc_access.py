"""Fairness and access control on the gRPC front end (issue 9), through ``tritonshare proxy`` against real
Triton: admission control measured at Triton's side (a model that records when it ran what), bearer-token
authentication with tritonclient's ``headers``, and TLS with tritonclient's ``ssl=True``, certificate
rotation included."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from tests.proxy.conftest import RecordingModel, ServedModels
from tests.proxy.wire import RawClient
from tests.support.certs import CertificateAuthority, serial_of, write_atomically
from tests.support.proxy import TRITONSHARE, ProxyProcess
from tritonshare.proxy import http2

pytestmark = pytest.mark.triton

StartProxy = Callable[..., ProxyProcess]
INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True)
class Outcome:
    value: float
    code: str  # "OK" or the gRPC status name, e.g. "RESOURCE_EXHAUSTED"
    message: str
    done_at: float  # time.monotonic() when the answer came


def tensor(value: float, size: int = 4) -> grpcclient.InferInput:
    data = np.full(size, value, dtype=np.float32)
    inp = grpcclient.InferInput("INPUT0", [size], "FP32")
    inp.set_data_from_numpy(data)
    return inp


def infer_all(
    client: grpcclient.InferenceServerClient,
    model: str,
    values: list[float],
    *,
    spacing_s: float = 0.0,
    size: int = 4,
    headers: dict[str, str] | None = None,
) -> list[Outcome]:
    """Send one async infer per value (``spacing_s`` apart) on the client's connection; their outcomes, in
    the order of ``values``. An OK answer must echo its input (the identity models)."""
    outcomes: dict[float, Outcome] = {}
    done = threading.Event()

    def callback(value: float) -> Callable[[grpcclient.InferResult | None, InferenceServerException | None], None]:
        def answered(result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
            if error is not None:
                code, message = str(error.status()).removeprefix("StatusCode."), error.message() or ""
            else:
                assert result is not None
                output = result.as_numpy("OUTPUT0")
                code, message = ("OK", "") if output.shape == (size,) and (output == value).all() else ("WRONG", "")
            outcomes[value] = Outcome(value, code, message, time.monotonic())
            if len(outcomes) == len(values):
                done.set()

        return answered

    for value in values:
        client.async_infer(model, [tensor(value, size)], callback(value), headers=headers, client_timeout=90)
        if spacing_s:
            time.sleep(spacing_s)
    assert done.wait(100), f"only {len(outcomes)} of {len(values)} calls were answered"
    return [outcomes[v] for v in values]


@pytest.fixture
def client_of() -> Iterator[Callable[..., grpcclient.InferenceServerClient]]:
    """tritonclient gRPC clients (one connection each), closed at teardown."""
    clients: list[grpcclient.InferenceServerClient] = []

    def make(url: str, **kwargs: object) -> grpcclient.InferenceServerClient:
        clients.append(grpcclient.InferenceServerClient(url, **kwargs))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


def scrape(proxy: ProxyProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    wanted = set(labels.items())
    found = [value for (n, have), value in samples.items() if n == name and wanted <= have]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def codes(outcomes: list[Outcome]) -> list[str]:
    return [o.code for o in outcomes]


# ---------------------------------------------------------------------------------------------- admission


def test_max_inflight_holds_exactly_at_triton(
    start_proxy: StartProxy,
    recording_model: Callable[[float], RecordingModel],
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    """12 calls from 3 connections at once: Triton never runs more than --max-inflight of them, and every
    call is served. The same load without the cap runs more at once (so the measure can tell)."""
    model = recording_model(0.3)

    def load(url: str) -> list[Outcome]:
        results: list[Outcome] = []
        threads = [
            threading.Thread(
                target=lambda c=c: results.extend(infer_all(client_of(url), model.name, [c * 10 + i for i in range(4)]))
            )
            for c in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    capped = start_proxy(model.name, "--no-unload", "--max-inflight", "2", "--queue-timeout-s", "60")
    assert codes(load(capped.grpc_url)) == ["OK"] * 12
    assert len(model.executions()) == 12
    assert model.max_concurrency() == 2
    samples = scrape(capped)
    # All but the first two wait when the 12 calls arrive together; on a busy node a call may come after a slot
    # was freed and not wait. Never more than 10 (two were admitted at once), and the cap held at Triton above.
    assert 1 <= metric(samples, "tritonshare_proxy_admission_queued_total") <= 10
    assert metric(samples, "tritonshare_proxy_admission_inflight") == 0
    assert metric(samples, "tritonshare_proxy_admission_waiting") == 0
    assert metric(samples, "tritonshare_proxy_admission_max_inflight_requests") == 2
    assert metric(samples, "tritonshare_proxy_admission_queue_timeout_seconds") == 60
    assert metric(samples, "tritonshare_proxy_admission_rate_limit_requests_per_second") == 0  # off

    model.log.unlink()
    uncapped = start_proxy(model.name, "--no-unload")
    assert codes(load(uncapped.grpc_url)) == ["OK"] * 12
    assert model.max_concurrency() >= 3


def test_the_cap_holds_for_rest_and_grpc_together(
    start_proxy: StartProxy,
    recording_model: Callable[[float], RecordingModel],
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    """One admission per proxy: 6 gRPC calls and 6 REST requests at once share --max-inflight 2."""
    model = recording_model(0.3)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "2", "--queue-timeout-s", "60")
    rest_codes: list[str] = []

    def rest(value: float) -> None:
        with httpclient.InferenceServerClient(proxy.url, network_timeout=60) as client:
            inp = httpclient.InferInput("INPUT0", [4], "FP32")
            inp.set_data_from_numpy(np.full(4, value, dtype=np.float32))
            rest_codes.append("OK" if (client.infer(model.name, [inp]).as_numpy("OUTPUT0") == value).all() else "WRONG")

    grpc_outcomes: list[Outcome] = []
    threads = [threading.Thread(target=rest, args=(100.0 + v,)) for v in range(6)]
    threads.append(
        threading.Thread(
            target=lambda: grpc_outcomes.extend(infer_all(client_of(proxy.grpc_url), model.name, list(range(6))))
        )
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rest_codes == ["OK"] * 6 and codes(grpc_outcomes) == ["OK"] * 6
    assert len(model.executions()) == 12
    assert model.max_concurrency() == 2


def test_waiting_calls_run_in_arrival_order_across_connections(
    start_proxy: StartProxy,
    recording_model: Callable[[float], RecordingModel],
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    model = recording_model(0.3)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--queue-timeout-s", "60")
    first, second = client_of(proxy.grpc_url), client_of(proxy.grpc_url)
    outcomes: list[Outcome] = []
    threads = []
    for value in range(6):  # 0.1 s apart, alternating connections: all but the first wait
        client = first if value % 2 == 0 else second
        threads.append(
            threading.Thread(target=lambda c=client, v=value: outcomes.extend(infer_all(c, model.name, [v])))
        )
        threads[-1].start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert sorted(codes(outcomes)) == ["OK"] * 6
    assert [run.values for run in model.executions()] == [(float(v),) for v in range(6)]
    assert [o.value for o in sorted(outcomes, key=lambda o: o.done_at)] == list(range(6))
    assert model.max_concurrency() == 1


def test_refusals_are_resource_exhausted_and_never_reach_triton(
    start_proxy: StartProxy,
    recording_model: Callable[[float], RecordingModel],
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    """One slot, one place in the queue: the 2nd call times out waiting, the 3rd and 4th find the queue
    full. Only the 1st reaches Triton, and the connection still serves calls afterwards."""
    model = recording_model(1.0)
    proxy = start_proxy(
        model.name, "--no-unload", "--max-inflight", "1", "--max-queue", "1", "--queue-timeout-s", "0.5"
    )
    client = client_of(proxy.grpc_url)
    started = time.monotonic()
    outcomes = infer_all(client, model.name, [0, 1, 2, 3], spacing_s=0.1)
    assert codes(outcomes) == ["OK"] + ["RESOURCE_EXHAUSTED"] * 3
    assert f"model '{model.name}': no slot free within 0.5 s" in outcomes[1].message
    assert 0.5 <= outcomes[1].done_at - started < 1.0  # ~0.1 s (sent) + 0.5 s (waited)
    for full in outcomes[2:]:
        assert "1 requests in flight and 1 waiting (the most allowed); retry later" in full.message
        assert full.done_at < outcomes[1].done_at  # refused at once
    assert [run.values for run in model.executions()] == [(0.0,)]

    assert codes(infer_all(client, model.name, [4])) == ["OK"]  # same connection: HPACK tables in step
    samples = scrape(proxy)
    assert metric(samples, "tritonshare_proxy_admission_refused_total", reason="queue_full") == 2
    assert metric(samples, "tritonshare_proxy_admission_refused_total", reason="queue_timeout") == 1
    assert metric(samples, "tritonshare_proxy_requests_total", route="ModelInfer", code="resource_exhausted") == 3
    assert metric(samples, "tritonshare_proxy_refusals_total", route="ModelInfer", reason="queue_full") == 2


def test_rate_limit_refuses_over_rate_and_leaves_other_rpcs_alone(
    start_proxy: StartProxy,
    served_models: ServedModels,
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    proxy = start_proxy(served_models.own, "--no-unload", "--rate-limit-rps", "1", "--rate-limit-burst", "2")
    client = client_of(proxy.grpc_url)
    outcomes = infer_all(client, served_models.own, [0, 1, 2, 3, 4, 5])
    assert sorted(codes(outcomes)) == ["OK"] * 2 + ["RESOURCE_EXHAUSTED"] * 4
    refused = next(o for o in outcomes if o.code != "OK")
    assert f"model '{served_models.own}': rate limit of 1 requests/s (burst 2) exceeded" in refused.message
    assert client.get_model_metadata(served_models.own).name == served_models.own  # metadata: a bucket of its own
    assert client.is_model_ready(served_models.own)
    for _ in range(5):  # probes: answered by the proxy, never limited
        assert client.is_server_live() and client.is_server_ready()
    with grpc.insecure_channel(proxy.grpc_url) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(INFER)(infer_request(served_models.own), timeout=10)
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("grpc-retry-pushback-ms", "1000") in [(m.key, m.value) for m in error.trailing_metadata() or ()]
    time.sleep(1.1)  # one token back
    assert codes([*infer_all(client, served_models.own, [6]), *infer_all(client, served_models.own, [7])]) == [
        "OK",
        "RESOURCE_EXHAUSTED",
    ]
    assert metric(scrape(proxy), "tritonshare_proxy_admission_throttled_total") == 6


def status_of(call: Callable[[], object]) -> str:
    try:
        call()
    except InferenceServerException as error:
        return str(error.status()).removeprefix("StatusCode.")
    return "OK"


def test_rate_limit_holds_metadata_calls_in_a_bucket_of_their_own(
    start_proxy: StartProxy,
    served_models: ServedModels,
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    """A ModelConfig flood at 10k/s went to Triton whatever --rate-limit-rps said: metadata, config, statistics
    and a model's readiness now take a token of their own bucket (same rate and burst), never waiting for one."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--rate-limit-rps", "0.2", "--rate-limit-burst", "2")  # 1 token / 5 s
    client = client_of(proxy.grpc_url)
    assert [status_of(lambda: client.get_model_config(own)) for _ in range(6)] == ["OK"] * 2 + [
        "RESOURCE_EXHAUSTED"
    ] * 4
    others = [
        lambda: client.get_model_metadata(own),
        lambda: client.get_inference_statistics(own),
        lambda: client.is_model_ready(own),
        client.get_server_metadata,
    ]
    assert [status_of(call) for call in others] == ["RESOURCE_EXHAUSTED"] * 4  # one bucket for every metadata RPC
    with grpc.insecure_channel(proxy.grpc_url) as channel, pytest.raises(grpc.RpcError) as info:
        request = pb.ModelConfigRequest(name=own).SerializeToString()
        channel.unary_unary("/inference.GRPCInferenceService/ModelConfig")(request, timeout=10)
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit of 0.2 requests/s" in error.details()
    assert ("grpc-retry-pushback-ms", "5000") in [(m.key, m.value) for m in error.trailing_metadata() or ()]
    assert codes(infer_all(client, own, [1])) == ["OK"]  # inference has its own tokens
    assert client.is_server_live() and client.is_server_ready()  # probes: never limited
    samples = scrape(proxy)
    assert metric(samples, "tritonshare_proxy_admission_throttled_total") == 4 + 4 + 1
    refused = {"route": "ModelConfig", "reason": "rate_limited"}
    assert metric(samples, "tritonshare_proxy_refusals_total", **refused) == 5


def infer_request(model: str) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
    request.raw_input_contents.append(np.ones(2, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


def test_calls_waiting_on_a_connection_leave_its_window_to_the_admitted_stream(
    start_proxy: StartProxy,
    recording_model: Callable[[float], RecordingModel],
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    """One connection: an open stream holds the only slot; six 1 MiB calls wait behind it. Their bytes
    count against the connection's flow-control window at Triton (4 MiB) until Triton gets them, so a proxy
    keeping whole waiting messages would leave the stream no window for its next message — and the stream
    would never end to free the slot. Waiting calls keep back only their last byte."""
    model = recording_model(0.1)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--queue-timeout-s", "20")
    client = client_of(proxy.grpc_url)
    answers: list[float] = []

    def on_response(result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
        assert error is None and result is not None, error
        answers.extend(result.as_numpy("OUTPUT0").tolist()[:1])

    client.start_stream(on_response)
    client.async_stream_infer(model.name, [tensor(100.0)])
    wait_for(lambda: answers == [100.0])
    outcomes: list[Outcome] = []
    waiting = threading.Thread(
        target=lambda: outcomes.extend(infer_all(client, model.name, [float(v) for v in range(6)], size=256 * 1024))
    )
    waiting.start()
    time.sleep(1.0)  # the six calls have sent what the window lets them
    client.async_stream_infer(model.name, [tensor(101.0)])
    wait_for(lambda: answers == [100.0, 101.0], timeout_s=5)
    assert outcomes == []  # still waiting for the stream's slot
    client.stop_stream()
    waiting.join()
    assert codes(outcomes) == ["OK"] * 6
    assert model.max_concurrency() == 1


def test_an_open_stream_holds_its_slot_until_it_ends(
    start_proxy: StartProxy, served_models: ServedModels, client_of: Callable[..., grpcclient.InferenceServerClient]
) -> None:
    proxy = start_proxy(served_models.stream, "--no-unload", "--max-inflight", "1", "--queue-timeout-s", "60")
    answers: dict[str, list[float]] = {"a": [], "b": []}

    def collector(key: str) -> Callable[[grpcclient.InferResult | None, InferenceServerException | None], None]:
        def on_response(result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
            assert error is None, error
            assert result is not None
            answers[key].extend(result.as_numpy("OUTPUT0").tolist())

        return on_response

    a, b = client_of(proxy.grpc_url), client_of(proxy.grpc_url)
    a.start_stream(collector("a"))
    a.async_stream_infer(served_models.stream, [stream_tensor([1.0, 2.0])])
    wait_for(lambda: answers["a"] == [1.0, 2.0])
    b.start_stream(collector("b"))
    b.async_stream_infer(served_models.stream, [stream_tensor([5.0])])
    time.sleep(1.0)
    assert answers["b"] == []  # a's stream is open: b waits
    a.async_stream_infer(served_models.stream, [stream_tensor([3.0])])  # a's slot still serves a
    wait_for(lambda: answers["a"] == [1.0, 2.0, 3.0])
    a.stop_stream()
    wait_for(lambda: answers["b"] == [5.0])
    b.stop_stream()


def stream_tensor(values: list[float]) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("INPUT0", [len(values)], "FP32")
    inp.set_data_from_numpy(np.array(values, dtype=np.float32))
    return inp


def wait_for(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def waiting_after_all_sent(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> bool:
    queued = metric(samples, "tritonshare_proxy_admission_queued_total")
    return queued == 3 and metric(samples, "tritonshare_proxy_admission_waiting") >= 1


def test_sigterm_lets_waiting_calls_finish(
    start_proxy: StartProxy,
    recording_model: Callable[[float], RecordingModel],
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    model = recording_model(0.3)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--drain-timeout-s", "20")
    client = client_of(proxy.grpc_url)
    outcomes: list[Outcome] = []
    sender = threading.Thread(
        target=lambda: outcomes.extend(infer_all(client, model.name, [0, 1, 2, 3], spacing_s=0.05))
    )
    sender.start()
    deadline = time.monotonic() + 30  # every call sent, one at Triton, the others waiting (polled: a busy node
    while not waiting_after_all_sent(scrape(proxy)):  # may be slow to send them)
        assert time.monotonic() < deadline and sender.is_alive(), outcomes
        time.sleep(0.02)
    proxy.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    sender.join()
    assert codes(outcomes) == ["OK"] * 4
    assert proxy.process.wait(timeout=30) == 0  # type: ignore[union-attr]
    assert len(model.executions()) == 4


# ---------------------------------------------------------------------------------------------- auth


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# tenant A's callers\ntoken-one\ntoken-two\n")
    return path


def test_bearer_token_right_passes_wrong_or_missing_is_unauthenticated(
    start_proxy: StartProxy,
    served_models: ServedModels,
    tokens: Path,
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    proxy = start_proxy(served_models.own, "--no-unload", "--auth-token-file", str(tokens))
    client = client_of(proxy.grpc_url)
    own = served_models.own
    good = {"authorization": "Bearer token-two"}
    for headers in (None, {"authorization": "Bearer token-three"}, {"authorization": "token-one"}):
        assert codes(infer_all(client, own, [1], headers=headers)) == ["UNAUTHENTICATED"]
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata(own, headers=headers)
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        assert info.value.message() == "missing or invalid bearer token"
    assert codes(infer_all(client, own, [1, 2], headers=good)) == ["OK", "OK"]  # same connection, after refusals
    assert client.get_model_metadata(own, headers=good).name == own
    # Probes need no token.
    assert client.is_server_live() and client.is_server_ready()
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        assert channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10) == b"\x08\x01"
        # Without a token, denied and unknown methods say nothing more than "unauthenticated".
        for path in ("/inference.GRPCInferenceService/RepositoryIndex", "/no.Such/Method"):
            with pytest.raises(grpc.RpcError) as rpc:
                channel.unary_unary(path)(b"", timeout=10)
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as rpc:
            channel.unary_unary("/inference.GRPCInferenceService/RepositoryIndex")(
                b"", timeout=10, metadata=[("authorization", "Bearer token-one")]
            )
        assert rpc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    samples = scrape(proxy)
    assert metric(samples, "tritonshare_proxy_auth_tokens", model=own) == 2
    # missing: no header and a token without "Bearer" (infer + metadata each), the two raw calls
    assert metric(samples, "tritonshare_proxy_auth_refused_total", model=own, reason="missing") == 6
    assert metric(samples, "tritonshare_proxy_auth_refused_total", model=own, reason="invalid") == 2
    print("\n".join(line for line in proxy.log_text().splitlines() if "DBG" in line))


def test_authorization_given_twice_is_invalid_argument_and_counted_as_bad_request(
    start_proxy: StartProxy, served_models: ServedModels, tokens: Path
) -> None:
    """Whichever of two tokens the proxy checked, Triton or a later reader might take the other: a call with
    ``authorization`` more than once is refused, as REST refuses a repeated Authorization header (400)."""
    proxy = start_proxy(served_models.own, "--no-unload", "--auth-token-file", str(tokens))
    own = served_models.own
    good, bad = ("authorization", "Bearer token-one"), ("authorization", "Bearer token-three")
    request = pb.ModelMetadataRequest(name=own).SerializeToString()
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata")
        for metadata in ([good, bad], [bad, good], [good, good]):
            with pytest.raises(grpc.RpcError) as rpc:
                call(request, timeout=10, metadata=metadata)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, metadata
            assert "more than once" in (rpc.value.details() or "")
        assert pb.ModelMetadataResponse.FromString(call(request, timeout=10, metadata=[good])).name == own
    head = f"GET /v2/models/{own} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer token-one\r\n"
    with socket.create_connection(("127.0.0.1", proxy.http_port), timeout=10) as sock:
        sock.sendall(f"{head}Authorization: Bearer token-three\r\n\r\n".encode())
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 400 ")
    samples = scrape(proxy)
    assert metric(samples, "tritonshare_proxy_refusals_total", protocol="grpc", reason="bad_request") == 3
    assert metric(samples, "tritonshare_proxy_refusals_total", protocol="rest", reason="bad_request") == 1
    assert metric(samples, "tritonshare_proxy_requests_total", route="ModelMetadata", code="invalid_argument") == 3
    assert metric(samples, "tritonshare_proxy_auth_refused_total", reason="invalid") == 0  # not a token check


def test_token_file_change_is_picked_up_without_restart(
    start_proxy: StartProxy,
    served_models: ServedModels,
    tokens: Path,
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    proxy = start_proxy(served_models.own, "--no-unload", "--auth-token-file", str(tokens))
    client = client_of(proxy.grpc_url)
    old, new = {"authorization": "Bearer token-one"}, {"authorization": "Bearer token-rotated"}
    assert codes(infer_all(client, served_models.own, [1], headers=old)) == ["OK"]
    write_atomically(tokens, b"token-rotated\n")  # as a Secret update: a new file in one rename
    deadline = time.monotonic() + 5
    while codes(infer_all(client, served_models.own, [2], headers=new)) != ["OK"]:
        assert time.monotonic() < deadline, "the new token was not accepted within 5 s"
        time.sleep(0.2)
    assert codes(infer_all(client, served_models.own, [3], headers=old)) == ["UNAUTHENTICATED"]
    assert "auth tokens reloaded from" in proxy.log_text()


def _metadata_status(client: RawClient, decoder: hpack.Decoder, stream_id: int, own: str, token: str) -> str:
    """The grpc-status of one ModelMetadata call on ``stream_id`` carrying ``token``; ``decoder`` reads every
    header block of the connection in order (its table follows the proxy's)."""
    message = pb.ModelMetadataRequest(name=own).SerializeToString()
    data = http2.frame(http2.DATA, http2.END_STREAM, stream_id, b"\x00" + len(message).to_bytes(4, "big") + message)
    path = "/inference.GRPCInferenceService/ModelMetadata"
    client.sock.sendall(client.request(stream_id, path, extra=(("authorization", f"Bearer {token}"),)) + data)

    def ended(got: list[tuple[int, int, int, bytes]]) -> bool:
        return any(k == http2.HEADERS and f & http2.END_STREAM and s == stream_id for k, f, s, _ in got)

    blocks = [
        (sid, dict(decoder.decode(payload))) for kind, _, sid, payload in client.frames(ended) if kind == http2.HEADERS
    ]
    statuses = [headers.get("grpc-status") for sid, headers in blocks if sid == stream_id]
    assert statuses and statuses[-1] is not None, f"stream {stream_id} did not end"
    return str(statuses[-1])


def test_a_token_revoked_by_a_reload_is_refused_on_the_next_call_of_a_repeated_header_block(
    start_proxy: StartProxy, served_models: ServedModels, tokens: Path
) -> None:
    """A connection repeating its header block (the same bytes from the second call on: every field indexed)
    opens each next stream as the last one without judging it again, token included, but only while the token
    file is unchanged: the first call after the reload that drops the token is UNAUTHENTICATED, and so is the
    one after it (a refusal is never kept as a pass)."""
    proxy = start_proxy(served_models.own, "--no-unload", "--auth-token-file", str(tokens))
    own, decoder = served_models.own, hpack.Decoder()
    client = RawClient(proxy.grpc_port)
    try:
        assert [_metadata_status(client, decoder, sid, own, "token-one") for sid in (1, 3, 5, 7)] == ["0"] * 4
        write_atomically(tokens, b"token-rotated\n")
        time.sleep(1.3)  # the file is looked at once a second: the next call looks
        assert [_metadata_status(client, decoder, sid, own, "token-one") for sid in (9, 11)] == ["16", "16"]
        assert [_metadata_status(client, decoder, sid, own, "token-rotated") for sid in (13, 15, 17)] == ["0"] * 3
    finally:
        client.close()
    samples = scrape(proxy)
    assert metric(samples, "tritonshare_proxy_auth_refused_total", model=own, reason="invalid") == 2


# ---------------------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority()


@pytest.fixture
def tls_proxy(
    start_proxy: StartProxy, served_models: ServedModels, ca: CertificateAuthority, tmp_path: Path
) -> tuple[ProxyProcess, Path, Path]:
    """A proxy with TLS on (certificate serial 1); returns it, the CA file and the certificates' folder."""
    folder = tmp_path / "tls"
    folder.mkdir()
    cert, key = ca.write_pair(folder, serial=1)
    proxy = start_proxy(served_models.own, "--no-unload", "--tls-cert", str(cert), "--tls-key", str(key))
    return proxy, ca.write_ca(tmp_path / "ca.crt"), folder


def test_tls_with_tritonclient_ssl(
    tls_proxy: tuple[ProxyProcess, Path, Path],
    served_models: ServedModels,
    client_of: Callable[..., grpcclient.InferenceServerClient],
    tmp_path: Path,
) -> None:
    proxy, ca_file, _ = tls_proxy
    for host in ("localhost", "127.0.0.1"):
        client = client_of(f"{host}:{proxy.grpc_port}", ssl=True, root_certificates=str(ca_file))
        assert client.is_server_live()
        assert codes(infer_all(client, served_models.own, [1, 2], size=300_000)) == ["OK", "OK"]
    plain = client_of(proxy.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        plain.is_server_live()
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    stranger_ca = CertificateAuthority("another CA").write_ca(tmp_path / "other-ca.crt")
    stranger = client_of(f"localhost:{proxy.grpc_port}", ssl=True, root_certificates=str(stranger_ca))
    with pytest.raises(InferenceServerException) as info:
        stranger.is_server_live()
    assert info.value.status() == "StatusCode.UNAVAILABLE"


def served_serial(port: int, ca_file: Path) -> int:
    """The serial of the certificate the proxy shows a new connection (ALPN h2, as gRPC clients)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        assert tls.selected_alpn_protocol() == "h2"
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return serial_of(der)


def test_certificate_rotation_reaches_new_connections_without_restart(
    tls_proxy: tuple[ProxyProcess, Path, Path],
    served_models: ServedModels,
    ca: CertificateAuthority,
    client_of: Callable[..., grpcclient.InferenceServerClient],
) -> None:
    proxy, ca_file, folder = tls_proxy
    before = client_of(f"localhost:{proxy.grpc_port}", ssl=True, root_certificates=str(ca_file))
    assert codes(infer_all(before, served_models.own, [1])) == ["OK"]
    assert served_serial(proxy.grpc_port, ca_file) == 1
    ca.write_pair(folder, serial=2)
    deadline = time.monotonic() + 5
    while served_serial(proxy.grpc_port, ca_file) != 2:
        assert time.monotonic() < deadline, "the rotated certificate was not served within 5 s"
        time.sleep(0.2)
    after = client_of(f"localhost:{proxy.grpc_port}", ssl=True, root_certificates=str(ca_file))
    assert codes(infer_all(after, served_models.own, [2])) == ["OK"]
    assert codes(infer_all(before, served_models.own, [3])) == ["OK"]  # the open connection goes on
    assert proxy.process is not None and proxy.process.poll() is None
    assert "TLS certificate reloaded" in proxy.log_text()
    samples, own = scrape(proxy), served_models.own  # the metrics port is plain HTTP
    assert metric(samples, "tritonshare_proxy_tls_reloads_total", model=own) >= 1
    assert metric(samples, "tritonshare_proxy_tls_certificate_not_after_timestamp_seconds", model=own) > time.time()


# ---------------------------------------------------------------------------------------------- start-up


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--tls-cert", "/nonexistent/tls.crt"], {}, "--tls-cert needs --tls-key too"),
        (["--tls-cert", "/nonexistent/tls.crt", "--tls-key", "/nonexistent/tls.key"], {}, "cannot read"),
        (["--auth-token-file", "/nonexistent/tokens"], {}, "cannot read it"),
        ([], {"TRITONSHARE_AUTH_TOKEN_FILE": "/nonexistent/tokens"}, "--auth-token-file /nonexistent/tokens"),
        ([], {"TRITONSHARE_MAX_INFLIGHT": "-1"}, "Invalid value for '--max-inflight'"),
        (["--queue-timeout-s", "0"], {}, "Invalid value for '--queue-timeout-s'"),
    ],
)
def test_bad_access_options_stop_the_proxy_before_it_listens(
    args: list[str], env: dict[str, str], words: str, tmp_path: Path
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
    result = subprocess.run(
        [TRITONSHARE, "proxy", "--name", "m", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
        + ["--repository", str(tmp_path), "--staging", str(tmp_path), "--no-unload", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert words in result.stderr
