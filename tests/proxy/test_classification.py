"""The ``classification`` output parameter, against a real Triton of the test's own serving a BYTES model: Triton 2.51
ranks a classified output after dividing its byte size by its datatype's size (``classification.cc``), which is 0
for BYTES, so one request asking to classify a BYTES output killed the shared Triton here with SIGFPE — REST, gRPC
unary and streamed alike, any class count — every tenant's server. The proxy cannot tell an output's datatype from
the request, so it refuses the parameter on every output. Each test starts its own Triton: before the proxy refused
the parameter, the first such request killed it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.proxy.test_grpc import INFER, raw_call, refusals
from tests.proxy.test_rest import error_of, request
from tests.support.install import own_triton_serving
from tests.support.models import BYTES_IDENTITY_CONFIG
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.proxy.policy import GRPC_SERVICE

pytestmark = pytest.mark.triton

MODEL = "own-strings"
STREAM = f"/{GRPC_SERVICE}/ModelStreamInfer"
WORDS = [b"a", b"bc"]


@pytest.fixture
def own_triton(tmp_path: Path) -> Iterator[TritonServer]:
    """A Triton of this test's own, serving the identity model MODEL over strings (INPUT0 BYTES [-1] -> OUTPUT0)."""
    with own_triton_serving(tmp_path, MODEL, config=BYTES_IDENTITY_CONFIG) as server:
        yield server


@pytest.fixture
def proxy(own_triton: TritonServer, start_proxy: Callable[..., ProxyProcess]) -> ProxyProcess:
    return start_proxy(MODEL, "--no-unload", server=own_triton)


def _alive(triton: TritonServer) -> bool:
    return triton.process is not None and triton.process.poll() is None and triton.live()


def _rest_body(key: str = '"classification"', output: str = "OUTPUT0") -> bytes:
    tensor = {"name": "INPUT0", "datatype": "BYTES", "shape": [len(WORDS)], "data": [w.decode() for w in WORDS]}
    inputs = json.dumps({"inputs": [tensor]})[:-1]  # (the output's parameter key written as given: escapes kept)
    return f'{inputs}, "outputs": [{{"name": "{output}", "parameters": {{{key}: 1}}}}]}}'.encode()


def _grpc_request(*, classify: bool, output: str = "OUTPUT0") -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[len(WORDS)])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(w)) + w for w in WORDS))
    wanted = request.outputs.add(name=output)
    if classify:
        wanted.parameters["classification"].int64_param = 1
    return request.SerializeToString()


def test_a_rest_request_classifying_an_output_is_refused_and_triton_lives(
    own_triton: TritonServer, proxy: ProxyProcess
) -> None:
    path = f"/v2/models/{MODEL}/infer"
    for key in ['"classification"', r'"cl\u0061ssification"']:
        status, body = request(proxy.http_port, "POST", path, _rest_body(key))
        assert status == 400 and "'classification'" in error_of(body), (key, status, body)
        assert _alive(own_triton), key
    assert refusals(proxy, "infer", "classification") == 2
    # What only looks like it passes: the word inside a string, not a parameter's key.
    lookalike = _rest_body('"note"', output='OUTPUT0\\", \\"classification')
    status, body = request(proxy.http_port, "POST", path, lookalike)
    assert status == 400 and "unexpected inference output" in error_of(body), body  # Triton's answer: it got there
    status, body = request(proxy.http_port, "POST", path, _rest_body('"binary_data"').replace(b": 1}", b": false}"))
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == ["a", "bc"], body


def test_a_grpc_request_classifying_an_output_is_refused_unary_or_streamed_and_triton_lives(
    own_triton: TritonServer, proxy: ProxyProcess
) -> None:
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as info:
            raw_call(channel, INFER, _grpc_request(classify=True))
        call: grpc.Call = info.value  # type: ignore[assignment]
        assert call.code() == grpc.StatusCode.INVALID_ARGUMENT and "'classification'" in (call.details() or "")
        assert _alive(own_triton)
        good = _grpc_request(classify=False)
        replies = channel.stream_stream(STREAM)(iter([good, _grpc_request(classify=True)]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            for reply in replies:  # the first message's answer may come before the refusal
                assert not pb.ModelStreamInferResponse.FromString(reply).error_message, reply
        call = info.value  # type: ignore[assignment]
        assert call.code() == grpc.StatusCode.INVALID_ARGUMENT and "'classification'" in (call.details() or "")
        assert _alive(own_triton)
        assert refusals(proxy, "ModelInfer", "classification") == 1
        assert refusals(proxy, "ModelStreamInfer", "classification") == 1
        reply = pb.ModelInferResponse.FromString(raw_call(channel, INFER, good))
    contents = b"".join(struct.pack("<I", len(w)) + w for w in WORDS)
    assert reply.raw_output_contents[0] == contents, reply
