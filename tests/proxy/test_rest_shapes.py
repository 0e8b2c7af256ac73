"""Infer requests whose declared tensor shapes are larger than their bodies could carry, against a real Triton of
the test's own: Triton's REST front end sizes a JSON-data input's buffer from its shape before it reads the data
(``http_server.cc``: ``serialized.resize(element_cnt * dtype size)``), so one small request can make the shared
Triton allocate terabytes (``std::bad_alloc``) or a wrapped-around size (``std::length_error``) and abort — every
tenant's server, from one request (seen here with Triton 2.51). Each test starts its own Triton: before the proxy
refused these, the first such request killed it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.proxy.test_rest import Raw, error_of, infer_body, request
from tests.support.install import own_triton_serving
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer

pytestmark = pytest.mark.triton

MODEL = "own-shapes"


@pytest.fixture
def own_triton(tmp_path: Path) -> Iterator[TritonServer]:
    """A Triton of this test's own, serving the identity model MODEL (INPUT0 FP32 [-1] -> OUTPUT0)."""
    with own_triton_serving(tmp_path, MODEL) as server:
        yield server


def _declaring(shape: list[int], **input_fields: object) -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape, "data": [], **input_fields}]}
    return json.dumps(doc).encode()


# Each aborted Triton 2.51 here when sent to it directly: 2**63-1 and 2**64-1 elements of 4 bytes wrap to a size
# past vector::max_size (std::length_error); 10**12 elements are 4 TB (std::bad_alloc).
KILLING_SHAPES = [[2**63 - 1], [2**64 - 1], [10**6, 10**6]]


def test_a_shape_far_larger_than_its_body_is_refused_and_triton_lives(
    own_triton: TritonServer, start_proxy: Callable[..., ProxyProcess]
) -> None:
    proxy = start_proxy(MODEL, "--no-unload", server=own_triton)
    path = f"/v2/models/{MODEL}/infer"
    for shape in KILLING_SHAPES:
        status, body = request(proxy.http_port, "POST", path, _declaring(shape))
        assert status == 400 and "declares more elements" in error_of(body), (shape, status, body)
        assert own_triton.process is not None and own_triton.process.poll() is None, shape
    status, body = request(proxy.http_port, "POST", path, infer_body([1.0, 2.0]))
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1.0, 2.0], body


def test_the_shape_bound_holds_on_the_short_path_of_a_repeated_head(
    own_triton: TritonServer, start_proxy: Callable[..., ProxyProcess]
) -> None:
    # A clean request first, then one of the same length (so the same head) declaring a huge shape: the short
    # path of a memoised head must bound shapes as the long way does.
    proxy = start_proxy(MODEL, "--no-unload", server=own_triton)
    huge = _declaring([10**6, 10**6])
    clean = infer_body([1.0, 2.0]).ljust(len(huge))  # trailing blanks are valid JSON
    head = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(huge)}\r\n\r\n".encode()
    with Raw(proxy.http_port) as raw:
        status, _headers, answer = raw.send(head + clean).response()
        assert status == 200, answer
        status, _headers, answer = raw.send(head + huge).response()
        assert status == 400 and "declares more elements" in error_of(answer), answer
    assert own_triton.process is not None and own_triton.process.poll() is None


@pytest.mark.parametrize("binary", [False, True], ids=["json-data", "binary-data"])
def test_shapes_the_body_can_carry_pass(
    own_triton: TritonServer, start_proxy: Callable[..., ProxyProcess], binary: bool
) -> None:
    proxy = start_proxy(MODEL, "--no-unload", server=own_triton)
    values = [float(i) for i in range(50_000)]
    if binary:
        data = b"".join(int(v).to_bytes(4, "little") for v in values)  # any bytes: an identity model
        tensor = {
            "name": "INPUT0",
            "datatype": "FP32",
            "shape": [50_000],
            "parameters": {"binary_data_size": len(data)},
        }
        header = json.dumps({"inputs": [tensor]}).encode()
        status, body = request(
            proxy.http_port,
            "POST",
            f"/v2/models/{MODEL}/infer",
            header + data,
            Inference_Header_Content_Length=str(len(header)),
        )
    else:
        status, body = request(proxy.http_port, "POST", f"/v2/models/{MODEL}/infer", infer_body(values))
    assert status == 200, body[:300]


def _chunked(port: int, header: bytes, tail: bytes) -> tuple[int, bytes]:
    """A binary-extension infer request sent chunked (its length unknown to the proxy until it ends)."""
    body = header + tail
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 65536]), body[i : i + 65536]) for i in range(0, len(body), 65536)
    )
    head = (
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n\r\n"
    ).encode()
    with Raw(port) as raw:
        status, _headers, answer = raw.send(head + chunks + b"0\r\n\r\n").response()
    return status, answer


def test_a_chunked_body_passes_a_binary_tensor_larger_than_its_json_but_not_inline_data_declared_so(
    own_triton: TritonServer, start_proxy: Callable[..., ProxyProcess]
) -> None:
    proxy = start_proxy(MODEL, "--no-unload", server=own_triton)
    count = 2_000_000  # more than the floor of 1 Mi elements and than the JSON header's bytes
    tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [count], "parameters": {"binary_data_size": 4 * count}}
    status, answer = _chunked(proxy.http_port, json.dumps({"inputs": [tensor]}).encode(), bytes(4 * count))
    assert status == 200, answer[:300]
    # The same shape with inline data, within --max-body-bytes (1 GiB) but not within the JSON: refused.
    inline = {"name": "INPUT0", "datatype": "FP32", "shape": [200_000_000], "data": [], "parameters": {}}
    status, answer = _chunked(proxy.http_port, json.dumps({"inputs": [inline]}).encode(), b"")
    assert status == 400 and "declares more elements" in error_of(answer), answer
    assert own_triton.process is not None and own_triton.process.poll() is None
