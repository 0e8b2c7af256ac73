"""The gRPC front end against real Triton: tritonclient and raw grpcio calls through ``tritonshare proxy``.

Every allowed RPC must behave exactly as it does directly; every refused one must get its status without
reaching Triton (checked with Triton's own statistics of the other model), and the client's connection
must stay usable after a refusal (HPACK tables in step).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from queue import Queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from tests.proxy.conftest import ServedModels
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.proxy.policy import GRPC_RULES, GRPC_SERVICE, Verdict

pytestmark = pytest.mark.triton

BIG = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
INFER = f"/{GRPC_SERVICE}/ModelInfer"


@pytest.fixture
def client(proxy: ProxyProcess) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(proxy.grpc_url)
    yield c
    c.close()


@pytest.fixture
def direct(triton: TritonServer) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(triton.grpc_url)
    yield c
    c.close()


@pytest.fixture
def channel(proxy: ProxyProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(proxy.grpc_url) as ch:
        yield ch


def raw_call(ch: grpc.Channel, path: str, request: bytes = b"") -> bytes:
    """A unary call by path with the request's serialized bytes (no stubs: any method, any bytes)."""
    return bytes(ch.unary_unary(path)(request, timeout=10))


def raw_status(ch: grpc.Channel, path: str, request: bytes = b"") -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        raw_call(ch, path, request)
    error: grpc.Call = info.value  # type: ignore[assignment]
    return error.code(), error.details() or ""


def identity_input(values: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    return tensor


def infer_request(model: str, values: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(values.shape))
    request.raw_input_contents.append(values.tobytes())
    return request


def inference_count(triton: TritonServer, model: str) -> int:
    with grpcclient.InferenceServerClient(triton.grpc_url) as c:
        stats = c.get_inference_statistics(model, as_json=True)
    return sum(int(s.get("inference_count", 0)) for s in stats.get("model_stats", []))


def status_of(call: object) -> str:
    """The gRPC status name an InferenceServerException carries, e.g. 'StatusCode.NOT_FOUND'."""
    assert isinstance(call, InferenceServerException)
    return str(call.status())


# ---------------------------------------------------------------------------------------------- allowed


def test_server_live_and_metadata_as_directly(
    client: grpcclient.InferenceServerClient, direct: grpcclient.InferenceServerClient
) -> None:
    assert client.is_server_live()
    assert client.get_server_metadata(as_json=True) == direct.get_server_metadata(as_json=True)


def test_server_ready_and_health_check_answer_for_the_own_model(
    client: grpcclient.InferenceServerClient, channel: grpc.Channel
) -> None:
    assert client.is_server_ready()
    # grpc.health.v1.HealthCheckResponse{status: SERVING (1)}
    assert raw_call(channel, "/grpc.health.v1.Health/Check") == b"\x08\x01"


def test_readiness_is_false_when_the_own_model_is_not_served(
    start_proxy: object, direct: grpcclient.InferenceServerClient
) -> None:
    # Triton itself is live (its strict readiness depends on every tenant of the shared test server, so it
    # is not asserted), but this pod's model is not served:
    assert direct.is_server_live()
    proxy = start_proxy("not-installed-model", "--no-unload")  # type: ignore[operator]
    with grpcclient.InferenceServerClient(proxy.grpc_url) as c:
        assert not c.is_server_ready()
    with grpc.insecure_channel(proxy.grpc_url) as ch:
        assert raw_call(ch, "/grpc.health.v1.Health/Check") == b"\x08\x02"  # NOT_SERVING


@pytest.mark.parametrize("version", ["", "1"])
def test_model_rpcs_of_the_own_model_as_directly(
    client: grpcclient.InferenceServerClient,
    direct: grpcclient.InferenceServerClient,
    served_models: ServedModels,
    version: str,
) -> None:
    own = served_models.own
    assert client.is_model_ready(own, version)
    assert client.get_model_metadata(own, version, as_json=True) == direct.get_model_metadata(
        own, version, as_json=True
    )
    assert client.get_model_config(own, version, as_json=True) == direct.get_model_config(own, version, as_json=True)
    stats = client.get_inference_statistics(own, version, as_json=True)
    assert [s["name"] for s in stats["model_stats"]] == [own]


def test_model_infer_returns_what_triton_returns(
    client: grpcclient.InferenceServerClient, served_models: ServedModels
) -> None:
    data = np.arange(16, dtype=np.float32)
    for _ in range(3):  # several calls on one connection: HPACK indexed references from the 2nd on
        result = client.infer(served_models.own, [identity_input(data)], request_id="r-1")
        assert np.array_equal(result.as_numpy("OUTPUT0"), data)
        assert result.get_response().id == "r-1"


def test_repeated_infer_calls_are_judged_every_time(
    client: grpcclient.InferenceServerClient, served_models: ServedModels, triton: TritonServer
) -> None:
    """A grpc client repeats a call's bytes but for its stream id and tensor: the proxy's short paths for a repeated
    call and its repeated reply (tests/proxy/test_grpc_relay.py) must still refuse another model's name — one as long
    as the own one, whose bytes differ from a passed call's in the name only — and an admin RPC, answer each call as
    Triton does, and count each by its status."""
    as_long = "x" * len(served_models.own)
    before = inference_count(triton, served_models.own)
    for other in (as_long, served_models.other, as_long):
        for i in range(4):
            data = np.full(16, i, dtype=np.float32)
            assert np.array_equal(client.infer(served_models.own, [identity_input(data)]).as_numpy("OUTPUT0"), data)
        with pytest.raises(InferenceServerException) as info:
            client.infer(other, [identity_input(np.full(16, 9, dtype=np.float32))])
        assert status_of(info.value) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_repository_index()
    assert status_of(info.value) == "StatusCode.PERMISSION_DENIED"
    data = np.arange(16, dtype=np.float32)
    for _ in range(3):  # header blocks re-encoded from here on (the dropped block changed the table)
        assert np.array_equal(client.infer(served_models.own, [identity_input(data)]).as_numpy("OUTPUT0"), data)
    assert inference_count(triton, served_models.own) == before + 15


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_infer_is_inspected_and_forwarded(
    client: grpcclient.InferenceServerClient, served_models: ServedModels, triton: TritonServer, algorithm: str
) -> None:
    data = np.linspace(0, 1, 1000, dtype=np.float32)
    result = client.infer(served_models.own, [identity_input(data)], compression_algorithm=algorithm)
    assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    before = inference_count(triton, served_models.other)
    with pytest.raises(InferenceServerException) as info:
        client.infer(served_models.other, [identity_input(data)], compression_algorithm=algorithm)
    assert status_of(info.value) == "StatusCode.NOT_FOUND"
    assert inference_count(triton, served_models.other) == before


def test_a_compressed_message_that_inflates_too_far_is_refused_before_triton_inflates_it(
    channel: grpc.Channel, proxy: ProxyProcess, served_models: ServedModels, triton: TritonServer
) -> None:
    # Triton's gRPC server inflates a message whole into memory before checking its size (2 GiB - 1): 1 GiB of
    # zeros in 1 MB of gzip took its RSS up 2.3 GB, 1.3 GB of it kept after Triton refused the request.
    request = infer_request(served_models.own, np.zeros(1, dtype=np.float32))
    request.raw_input_contents[0] = bytes(256 << 20)  # gzip (grpcio's) takes it to ~256 KiB
    before = triton.rss_mib()
    code, details = raw_status_compressed(channel, request.SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "inflates to more than 100 times its size" in details and "send it uncompressed" in details
    assert triton.rss_mib() - before < 64  # Triton dropped the part it had, never inflated the rest
    assert refusals(proxy, "ModelInfer", "too_large") >= 1
    data = np.arange(4, dtype=np.float32)  # the connection and Triton go on serving
    assert raw_call(channel, INFER, infer_request(served_models.own, data).SerializeToString())


def test_a_compressed_server_metadata_request_that_inflates_too_far_is_refused_too(
    channel: grpc.Channel, proxy: ProxyProcess, triton: TritonServer
) -> None:
    # ServerMetadata is forwarded as it is (nothing in it to judge), but Triton's gRPC server inflates any
    # compressed message whole before its method sees it: the bound holds for every forwarded RPC.
    size = 256 << 20
    unknown_field = bytes([0x12, *(size >> shift & 0x7F | (0x80 if shift < 28 else 0) for shift in (0, 7, 14, 21, 28))])
    before = triton.rss_mib()  # valid protobuf (field 2, unknown: skipped), 256 MiB in ~256 KiB of gzip
    code, details = raw_status_compressed(channel, unknown_field + bytes(size), path=f"/{GRPC_SERVICE}/ServerMetadata")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "inflates to more than 100 times its size" in details
    assert triton.rss_mib() - before < 64
    assert refusals(proxy, "ServerMetadata", "too_large") >= 1
    reply = pb.ServerMetadataResponse.FromString(
        channel.unary_unary(f"/{GRPC_SERVICE}/ServerMetadata")(b"", timeout=10, compression=grpc.Compression.Gzip)
    )
    assert reply.name == "triton"  # a compressed request that is not a bomb still passes


def raw_status_compressed(ch: grpc.Channel, request: bytes, path: str = INFER) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        ch.unary_unary(path)(request, timeout=60, compression=grpc.Compression.Gzip)
    error: grpc.Call = info.value  # type: ignore[assignment]
    return error.code(), error.details() or ""


def refusals(proxy: ProxyProcess, route: str, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as response:
        families = text_string_to_metric_families(response.read().decode())
    return sum(
        s.value
        for family in families
        for s in family.samples
        if s.name == "tritonshare_proxy_refusals_total" and (s.labels["route"], s.labels["reason"]) == (route, reason)
    )


def test_tritons_own_errors_pass_through_and_are_counted_by_status(
    client: grpcclient.InferenceServerClient,
    direct: grpcclient.InferenceServerClient,
    proxy: ProxyProcess,
    served_models: ServedModels,
) -> None:
    wrong = grpcclient.InferInput("NO_SUCH_INPUT", [4], "FP32")
    wrong.set_data_from_numpy(np.ones(4, dtype=np.float32))
    errors = []
    for c in (client, direct):
        with pytest.raises(InferenceServerException) as info:
            c.infer(served_models.own, [wrong])
        errors.append((status_of(info.value), str(info.value.message())))
    assert errors[0] == errors[1]  # Triton's status and message, unchanged
    assert errors[0][0] == "StatusCode.INVALID_ARGUMENT"
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as response:
        families = text_string_to_metric_families(response.read().decode())
    counted = {
        (s.labels["protocol"], s.labels["route"], s.labels["code"])
        for family in families
        for s in family.samples
        if s.name == "tritonshare_proxy_requests_total"
    }
    assert ("grpc", "ModelInfer", "invalid_argument") in counted


@pytest.mark.slow
def test_infer_of_64_mib_and_more_passes(proxy: ProxyProcess, served_models: ServedModels) -> None:
    data = np.random.default_rng(7).random((64 << 20) // 4 + 1000, dtype=np.float32)
    with grpcclient.InferenceServerClient(proxy.grpc_url, channel_args=BIG) as c:
        result = c.infer(served_models.own, [identity_input(data)], client_timeout=60)
    assert np.array_equal(result.as_numpy("OUTPUT0"), data)


def stream_infer(url: str, model: str, batches: list[tuple[str, np.ndarray]]) -> tuple[list[np.ndarray], str]:
    """Send each (model, values) message on one ModelStreamInfer stream; outputs and the first error."""
    results: Queue[object] = Queue()
    outputs: list[np.ndarray] = []
    error = ""
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(callback=lambda result, error: results.put(error if error is not None else result))
        expected = 0
        for name, values in batches:
            c.async_stream_infer(name, [identity_input(values)])
            expected += len(values) if name == model else 0
        deadline = time.monotonic() + 20
        while len(outputs) < expected and not error and time.monotonic() < deadline:
            item = results.get(timeout=20)
            if isinstance(item, InferenceServerException):
                error = status_of(item) + " " + str(item.message())
            else:
                outputs.append(item.as_numpy("OUTPUT0"))  # type: ignore[attr-defined]
        c.stop_stream()
        while not error and not results.empty():
            item = results.get()
            if isinstance(item, InferenceServerException):
                error = status_of(item) + " " + str(item.message())
    return outputs, error


def test_stream_infer_with_a_decoupled_model_passes_every_response(
    stream_proxy: ProxyProcess, served_models: ServedModels
) -> None:
    first, second = np.array([1, 2, 3], dtype=np.float32), np.array([4, 5], dtype=np.float32)
    outputs, error = stream_infer(
        stream_proxy.grpc_url, served_models.stream, [(served_models.stream, first), (served_models.stream, second)]
    )
    assert error == ""
    assert [float(o[0]) for o in outputs] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------------------------- refused


def test_other_model_is_not_found_in_every_own_rpc(
    client: grpcclient.InferenceServerClient, served_models: ServedModels, triton: TritonServer
) -> None:
    other = served_models.other
    before = inference_count(triton, other)
    calls = [
        lambda: client.is_model_ready(other),
        lambda: client.get_model_metadata(other),
        lambda: client.get_model_config(other, "1"),
        lambda: client.get_inference_statistics(other),
        lambda: client.infer(other, [identity_input(np.ones(4, dtype=np.float32))]),
    ]
    for call in calls:
        with pytest.raises(InferenceServerException) as info:
            call()
        assert status_of(info.value) == "StatusCode.NOT_FOUND"
        assert f"'{other}' is not found" in str(info.value.message())
    assert inference_count(triton, other) == before
    assert client.is_model_ready(served_models.own)  # the same connection still works


def test_statistics_of_all_models_is_not_found(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("")  # an empty name means every model
    assert status_of(info.value) == "StatusCode.NOT_FOUND"


DENIED = sorted(path for path, rule in GRPC_RULES.items() if rule.verdict is Verdict.DENY)


def test_every_denied_rpc_is_permission_denied(channel: grpc.Channel) -> None:
    assert len(DENIED) == 11
    for path in DENIED:
        code, details = raw_status(channel, path, pb.RepositoryIndexRequest().SerializeToString())
        assert (path, code) == (path, grpc.StatusCode.PERMISSION_DENIED)
        assert "not available to tenants" in details


def test_denied_rpcs_through_tritonclient(
    client: grpcclient.InferenceServerClient, served_models: ServedModels
) -> None:
    for call in (
        client.get_model_repository_index,
        lambda: client.unload_model(served_models.other),
        lambda: client.load_model(served_models.other),
        client.get_system_shared_memory_status,
        client.unregister_system_shared_memory,
        lambda: client.register_system_shared_memory("r", "/k", 16),
        client.get_log_settings,
        client.get_trace_settings,
    ):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert status_of(info.value) == "StatusCode.PERMISSION_DENIED"
    assert client.is_model_ready(served_models.own)


@pytest.mark.parametrize("path", [f"/{GRPC_SERVICE}/NoSuchMethod", "/other.Service/Call", "/"])
def test_unknown_methods_are_unimplemented(channel: grpc.Channel, path: str) -> None:
    assert raw_status(channel, path)[0] == grpc.StatusCode.UNIMPLEMENTED


def test_a_stream_whose_second_message_names_another_model_is_refused(
    stream_proxy: ProxyProcess, served_models: ServedModels, triton: TritonServer
) -> None:
    before = inference_count(triton, served_models.other)
    outputs, error = stream_infer(
        stream_proxy.grpc_url,
        served_models.stream,
        [(served_models.stream, np.array([1, 2], dtype=np.float32)), (served_models.other, np.ones(2, np.float32))],
    )
    assert error.startswith("StatusCode.NOT_FOUND")
    assert served_models.other in error
    assert inference_count(triton, served_models.other) == before


def test_a_repeated_model_name_is_judged_by_its_last_occurrence(
    channel: grpc.Channel, served_models: ServedModels, triton: TritonServer
) -> None:
    path = f"/{GRPC_SERVICE}/ModelInfer"
    data = np.arange(4, dtype=np.float32)
    own_then_other = infer_request(served_models.own, data).SerializeToString() + _name_field(served_models.other)
    assert pb.ModelInferRequest.FromString(own_then_other).model_name == served_models.other
    before = inference_count(triton, served_models.other)
    assert raw_status(channel, path, own_then_other)[0] == grpc.StatusCode.NOT_FOUND
    assert inference_count(triton, served_models.other) == before
    # The name after the raw contents (any field order is valid protobuf): judged, and served.
    request = infer_request(served_models.own, data)
    request.ClearField("model_name")
    late = request.SerializeToString() + _name_field(served_models.own)
    response = pb.ModelInferResponse.FromString(raw_call(channel, path, late))
    assert response.model_name == served_models.own
    assert np.frombuffer(response.raw_output_contents[0], dtype=np.float32).tolist() == data.tolist()


def test_a_model_name_behind_a_tag_wider_than_32_bits_is_refused(
    channel: grpc.Channel, served_models: ServedModels, triton: TritonServer
) -> None:
    # Triton's C++ parser keeps a tag's low 32 bits: 10 + 2**32 is field 1 to it, the other model's name.
    wide = bytes([0x8A, 0x80, 0x80, 0x80, 0x10]) + _name_field(served_models.other)[1:]
    request = infer_request(served_models.own, np.arange(4, dtype=np.float32)).SerializeToString() + wide
    before = inference_count(triton, served_models.other)
    assert raw_status(channel, f"/{GRPC_SERVICE}/ModelInfer", request)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert raw_status(channel, f"/{GRPC_SERVICE}/ModelConfig", _name_field(served_models.own) + wide)[0] == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert inference_count(triton, served_models.other) == before


def _name_field(name: str) -> bytes:
    return b"\x0a" + bytes([len(name)]) + name.encode()


@pytest.mark.parametrize("where", ["input", "output", "request"])
def test_shared_memory_parameters_are_permission_denied(
    client: grpcclient.InferenceServerClient, channel: grpc.Channel, served_models: ServedModels, where: str
) -> None:
    data = np.ones(4, dtype=np.float32)
    if where == "input":
        tensor = grpcclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_shared_memory("tenant-region", 16)
        with pytest.raises(InferenceServerException) as info:
            client.infer(served_models.own, [tensor])
        assert status_of(info.value) == "StatusCode.PERMISSION_DENIED"
        return
    request = infer_request(served_models.own, data)
    params = request.outputs.add(name="OUTPUT0").parameters if where == "output" else request.parameters
    params["shared_memory_region"].string_param = "tenant-region"
    code, _ = raw_status(channel, f"/{GRPC_SERVICE}/ModelInfer", request.SerializeToString())
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_the_connection_stays_usable_after_every_kind_of_refusal(
    client: grpcclient.InferenceServerClient, served_models: ServedModels
) -> None:
    # tritonclient's HPACK encoder indexes each new :path; dropping such a header block must not put
    # Triton's table out of step with the client's (the proxy re-encodes from then on).
    data = np.arange(8, dtype=np.float32)
    refusals = [
        client.get_model_repository_index,  # DENY: header block dropped
        lambda: client.get_inference_statistics(served_models.other),  # OWN: reset after forwarding
        client.get_log_settings,
        lambda: client.infer(served_models.other, [identity_input(data)]),
    ]
    for refuse in refusals * 2:
        with pytest.raises(InferenceServerException):
            refuse()
        assert np.array_equal(client.infer(served_models.own, [identity_input(data)]).as_numpy("OUTPUT0"), data)
        assert client.is_server_ready()
        assert client.get_model_metadata(served_models.own, as_json=True)["name"] == served_models.own
