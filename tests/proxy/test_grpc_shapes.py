"""gRPC infer requests whose declared tensor shapes are larger than their messages could carry, against a real Triton
of the test's own (the gRPC side of tests/proxy/test_rest_shapes.py): Triton checks an input's byte size as the
product of its shape and its datatype's size, in 64 bits, so a FP32 shape of [2**62] with no contents passes as
0 bytes and reaches the model — the Python backend's stub died on it and the model failed every request after,
still READY; a backend inside Triton's process would read out of bounds. Each test starts its own Triton.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.proxy.test_grpc import BIG, INFER, infer_request, raw_call
from tests.support.install import own_triton_serving
from tests.support.models import IDENTITY_CONFIG
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.proxy.policy import GRPC_SERVICE

pytestmark = pytest.mark.triton

MODEL = "own-grpc-shapes"
STREAM = f"/{GRPC_SERVICE}/ModelStreamInfer"
# [2**62] FP32 is 2**64 bytes: 0 in Triton's 64-bit byte-size check, which an empty message then passes.
KILLING_SHAPES = [[2**62], [10**12], [1000, 1000, 1000, 1000], [2**63 - 1]]


@pytest.fixture
def own_triton(tmp_path: Path) -> Iterator[TritonServer]:
    """A Triton of this test's own, serving the identity model MODEL (INPUT0 FP32 [-1] -> OUTPUT0)."""
    with own_triton_serving(tmp_path, MODEL) as server:
        yield server


@pytest.fixture
def proxy(own_triton: TritonServer, start_proxy: Callable[..., ProxyProcess]) -> ProxyProcess:
    return start_proxy(MODEL, "--no-unload", server=own_triton)


def _declaring(shape: list[int]) -> bytes:
    """An infer request of the own model declaring ``shape`` for its FP32 input and carrying empty raw contents."""
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=shape)
    request.raw_input_contents.append(b"")  # (present, empty: without it Triton finds no data for INPUT0)
    return request.SerializeToString()


def _infers(channel: grpc.Channel) -> None:
    """A normal infer through the proxy succeeds: Triton and the model are alive."""
    values = np.arange(4, dtype=np.float32)
    reply = pb.ModelInferResponse.FromString(raw_call(channel, INFER, infer_request(MODEL, values).SerializeToString()))
    assert np.array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), values)


def _refused(error: grpc.RpcError, shape: list[int]) -> None:
    call: grpc.Call = error  # type: ignore[assignment]
    details = call.details() or ""
    assert call.code() == grpc.StatusCode.INVALID_ARGUMENT, (shape, call.code(), details)
    assert "INPUT0" in details and "declares more elements" in details and str(shape[0]) in details, details


def test_a_unary_infer_declaring_more_than_it_carries_is_refused_and_triton_lives(
    own_triton: TritonServer, proxy: ProxyProcess
) -> None:
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        _infers(channel)
        for shape in KILLING_SHAPES:
            with pytest.raises(grpc.RpcError) as info:
                raw_call(channel, INFER, _declaring(shape))
            _refused(info.value, shape)
            assert own_triton.process is not None and own_triton.process.poll() is None, shape
        _infers(channel)


def test_a_streamed_infer_declaring_more_than_it_carries_is_refused_and_triton_lives(
    own_triton: TritonServer, proxy: ProxyProcess
) -> None:
    good = infer_request(MODEL, np.arange(4, dtype=np.float32)).SerializeToString()
    with grpc.insecure_channel(proxy.grpc_url) as channel:
        for shape in KILLING_SHAPES:
            replies = channel.stream_stream(STREAM)(iter([good, _declaring(shape)]), timeout=10)
            with pytest.raises(grpc.RpcError) as info:
                for reply in replies:  # the first message's answer may come before the refusal
                    assert not pb.ModelStreamInferResponse.FromString(reply).error_message, reply
            _refused(info.value, shape)
            assert own_triton.process is not None and own_triton.process.poll() is None, shape
        _infers(channel)


@pytest.mark.parametrize("typed", [False, True], ids=["raw-contents", "typed-contents"])
def test_a_large_shape_the_message_carries_passes(proxy: ProxyProcess, typed: bool) -> None:
    values = np.arange(1_200_000, dtype=np.float32)  # more than the 1 Mi elements allowed whatever the message
    request = pb.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[len(values)])
    if typed:
        tensor.contents.fp32_contents.extend(values.tolist())
    else:
        request.raw_input_contents.append(values.tobytes())
    with grpc.insecure_channel(proxy.grpc_url, options=BIG) as channel:
        reply = pb.ModelInferResponse.FromString(raw_call(channel, INFER, request.SerializeToString()))
    got = np.frombuffer(reply.raw_output_contents[0], np.float32)
    assert np.array_equal(got, values), json.dumps(list(reply.outputs[0].shape))


def test_negative_dims_are_refused_and_the_models_stub_lives(
    tmp_path: Path, start_proxy: Callable[..., ProxyProcess]
) -> None:
    # Two negative dims multiply to a positive count: [-2**31, -2**31] FP32 is 2**64 bytes, 0 in Triton's 64-bit
    # check, and a model with two variable dims took it with empty contents: its Python stub died (then every
    # request failed "Stub process is not healthy", the model still READY).
    config = IDENTITY_CONFIG.replace("dims: [ -1 ]", "dims: [ -1, -1 ]")
    with own_triton_serving(tmp_path, MODEL, config=config) as triton:
        proxy = start_proxy(MODEL, "--no-unload", server=triton)
        values = np.arange(4, dtype=np.float32).reshape(2, 2)
        with grpc.insecure_channel(proxy.grpc_url) as channel:
            for shape in [[-(2**31), -(2**31)], [-2, -(2**61)]]:
                with pytest.raises(grpc.RpcError) as info:
                    raw_call(channel, INFER, _declaring(shape))
                call: grpc.Call = info.value  # type: ignore[assignment]
                assert call.code() == grpc.StatusCode.INVALID_ARGUMENT, (shape, call.details())
                assert "negative dim" in (call.details() or "") and str(shape[0]) in (call.details() or "")
            request = infer_request(MODEL, values).SerializeToString()
            reply = pb.ModelInferResponse.FromString(raw_call(channel, INFER, request))
        assert np.array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), values.ravel())
