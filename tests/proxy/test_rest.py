"""The REST front end against a real Triton holding two models (own and another): every allowed call works as
it does directly, every refused call of the table is refused with its status, odd spellings included; infer
bodies with shared-memory parameters are refused; large bodies stream in bounded memory; Triton down → 503
and recovery; draining; odd and malformed HTTP.

Most tests go through ``tritonshare proxy`` as a subprocess (the ``proxy`` fixture); drain tests run the front
end in this process (:class:`LocalRest`) to reach its state between two requests.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import logging
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import tritonclient.http as httpclient
import uvloop
from tritonclient.utils import InferenceServerException

from tests.proxy.conftest import ServedModels
from tests.support.install import install_model, wait_model_ready
from tests.support.models import write_model
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.errors import UsageError
from tritonshare.common.layout import NodeLayout
from tritonshare.proxy.rest import RestFrontend
from tritonshare.proxy.rest_requests import RequestPath
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState

pytestmark = pytest.mark.triton

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- helpers


def request(port: int, method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Raw:
    """A client socket for requests http.client will not send, reading responses one at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.file = self.sock.makefile("rb")

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()
        self.sock.close()

    def send(self, data: bytes) -> Raw:
        self.sock.sendall(data)
        return self

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status_line = self.file.readline()
        assert status_line, "the proxy closed the connection without a response"
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status < 200:
            return status, headers, b""
        if headers.get("transfer-encoding") == "chunked":
            return status, headers, self._chunked()
        return status, headers, self.file.read(int(headers.get("content-length", "0")))

    def _chunked(self) -> bytes:
        body = b""
        while size := int(self.file.readline().split(b";")[0], 16):
            body += self.file.read(size)
            self.file.readline()
        self.file.readline()
        return body

    def closed_by_peer(self) -> bool:
        try:
            return self.file.read(1) == b""
        except ConnectionResetError:
            return True


def infer_body(values: list[float], **extra: Any) -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "shape": [len(values)], "datatype": "FP32", "data": values}], **extra}
    return json.dumps(doc).encode()


def infer_head(own: str, length: int) -> bytes:
    return f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def error_of(body: bytes) -> str:
    return str(json.loads(body)["error"])


@pytest.fixture(scope="module")
def port(proxy: ProxyProcess) -> int:
    return proxy.http_port


@pytest.fixture(scope="module")
def own(served_models: ServedModels) -> str:
    return served_models.own


@pytest.fixture
def client(proxy: ProxyProcess) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(proxy.url, network_timeout=60)
    yield c
    c.close()


@pytest.fixture
def direct(triton: TritonServer) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(triton.url.removeprefix("http://"), network_timeout=60)
    yield c
    c.close()


# ---------------------------------------------------------------------------------------------- allowed


def test_server_and_model_metadata_are_the_same_as_direct(port: int, triton: TritonServer, own: str) -> None:
    for path in [
        "/v2",
        "/v2/health/live",
        f"/v2/models/{own}",
        f"/v2/models/{own}/versions/1",
        f"/v2/models/{own}/config",
        f"/v2/models/{own}/versions/1/config",
        f"/v2/models/{own}/ready",
        f"/v2/models/{own}/versions/1/ready",
        f"/v2/models/{own}/stats",
        f"/v2/models/{own}/versions/1/stats",
    ]:
        direct = request(triton.http_port, "GET", path)
        assert request(port, "GET", path) == direct, path
        assert direct[0] == 200, path


def test_tritonclient_calls_work_through_the_proxy(
    client: httpclient.InferenceServerClient, direct: httpclient.InferenceServerClient, own: str
) -> None:
    assert client.is_server_live() and client.is_server_ready()  # ready = the own model is ready
    assert client.is_model_ready(own) and client.is_model_ready(own, "1")
    assert client.get_server_metadata() == direct.get_server_metadata()
    assert client.get_model_metadata(own, "1") == direct.get_model_metadata(own, "1")
    assert client.get_model_config(own) == direct.get_model_config(own)
    stats = client.get_inference_statistics(own, "1")["model_stats"]
    assert [s["name"] for s in stats] == [own]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_infer_works_json_binary_and_compressed(
    client: httpclient.InferenceServerClient, own: str, binary: bool, compression: str | None
) -> None:
    data = np.arange(1000, dtype=np.float32) / 7
    inp = httpclient.InferInput("INPUT0", [data.size], "FP32")
    inp.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer(
        own,
        [inp],
        outputs=[out],
        request_compression_algorithm=compression,
        response_compression_algorithm=compression,
        request_id="shared_memory_region",
    )
    assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    assert result.get_response()["id"] == "shared_memory_region"  # the words as a value are fine


def test_keep_alive_connection_serves_many_requests_and_pipelining_keeps_order(port: int, own: str) -> None:
    one = f"GET /v2/models/{own}/ready HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    body = infer_body([1.5, 2.5])
    two = f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    three = b"GET /v2/models/other/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    with Raw(port) as raw:
        raw.send(one + two + b"\r\n" + three + one)  # four requests in one write (and a stray CRLF)
        statuses = [raw.response() for _ in range(4)]
        assert [s for s, _, _ in statuses] == [200, 200, 404, 200]
        assert json.loads(statuses[1][2])["outputs"][0]["data"] == [1.5, 2.5]
        for _ in range(50):
            raw.send(one)
            assert raw.response()[0] == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("probe", ["/v2/health/ready", "/v2/health/live"])
def test_a_probe_body_is_read_and_dropped_never_taken_for_a_request(
    port: int, own: str, probe: str, chunked: bool
) -> None:
    """The proxy answers probes itself; a body sent with one is still its body, so a request in it is not run."""
    inner = f"GET /v2/models/{own} HTTP/1.1\r\nHost: x\r\n\r\n".encode()  # 200 with a JSON body, if run
    if chunked:
        framing, body = "Transfer-Encoding: chunked", b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
    else:
        framing, body = f"Content-Length: {len(inner)}", inner
    with Raw(port) as raw:
        raw.send(f"GET {probe} HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode() + body)
        raw.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert [raw.response()[::2] for _ in range(2)] == [(200, b""), (200, b"")]


def test_chunked_request_body_and_expect_continue(port: int, own: str) -> None:
    body = infer_body([3.0, 4.0])
    head = f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    chunked = b"".join(b"%x;note=x\r\n%s\r\n" % (len(p), p) for p in (body[:7], body[7:])) + b"0\r\nX-T: 1\r\n\r\n"
    with Raw(port) as raw:
        status, _, answer = raw.send(head + chunked).response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [3.0, 4.0]
        expect = (
            f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        assert raw.send(expect).response()[0] == 100  # answered by the proxy before the body is sent
        status, _, answer = raw.send(body).response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [3.0, 4.0]


@pytest.mark.timeout(30)  # a connection left open waits for a body that may never come: fail in seconds
@pytest.mark.parametrize("path", ["/v2/models/OTHER/infer", "/v2/repository/models/OTHER/unload"])
def test_a_refused_request_that_expected_100_continue_is_answered_and_closed(
    port: int, served_models: ServedModels, path: str
) -> None:
    """Refused before its body: the client may or may not send it now, so only a close says where the next
    request would begin (the bytes it sends next are never read as a request)."""
    head = (
        f"POST {path.replace('OTHER', served_models.other)} HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        "Content-Length: 38\r\n\r\n"
    ).encode()
    with Raw(port) as raw:
        status, headers, body = raw.send(head).response()
        assert status in (403, 404) and headers["connection"] == "close" and error_of(body)
        assert raw.closed_by_peer()


def test_http10_client_gets_its_answer_and_a_close(port: int, own: str) -> None:
    with Raw(port) as raw:
        status, headers, body = raw.send(f"GET /v2/models/{own}/ready HTTP/1.0\r\n\r\n".encode()).response()
        assert status == 200 and headers["connection"] == "close"
        assert raw.closed_by_peer()


@pytest.mark.timeout(30)  # a connection left open would be read here until the socket times out
@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1\r\nConnection: close"])
def test_a_refused_request_that_asked_for_a_close_is_answered_and_closed(
    port: int, served_models: ServedModels, version: str
) -> None:
    """A client reading its answer to the end of the connection (HTTP/1.0) waits for that close."""
    with Raw(port) as raw:
        status, headers, _ = raw.send(f"GET /v2/models/{served_models.other} {version}\r\n\r\n".encode()).response()
        assert status == 404 and headers["connection"] == "close"
        assert raw.closed_by_peer()


SLOW_STREAM_CONFIG = """\
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
SLOW_STREAM_MODEL = """\
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            for v in pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy():
                time.sleep(0.4)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.array([v], np.float32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_generate_stream_events_arrive_as_they_are_produced(
    triton: TritonServer, layout: NodeLayout, start_proxy: Callable[..., ProxyProcess], model_name: str
) -> None:
    install_model(layout, triton, model_name, config=SLOW_STREAM_CONFIG, model_py=SLOW_STREAM_MODEL)
    proxy = start_proxy(model_name, "--no-unload")
    body = b'{"INPUT0": [1, 2, 3, 4]}'
    with Raw(proxy.http_port) as raw:
        raw.send(
            f"POST /v2/models/{model_name}/generate_stream HTTP/1.1\r\nHost: x\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        started = time.monotonic()
        assert raw.file.readline().startswith(b"HTTP/1.1 200")
        while raw.file.readline() != b"\r\n":
            pass
        arrivals, events = [], []
        while size := int(raw.file.readline(), 16):
            events.append(raw.file.read(size))
            arrivals.append(time.monotonic() - started)
            raw.file.readline()
    outputs = [json.loads(e.decode().removeprefix("data: "))["OUTPUT0"] for e in events]
    assert outputs == [1.0, 2.0, 3.0, 4.0]
    assert arrivals[0] < arrivals[-1] - 0.8, f"events were held back, not streamed: arrivals {arrivals}"


# ---------------------------------------------------------------------------------------------- refused


def _refusal_cases(own: str, other: str) -> list[tuple[str, str, int]]:
    o = other
    return [
        ("GET", f"/v2/models/{o}", 404),
        ("GET", f"/v2/models/{o}/ready", 404),
        ("GET", f"/v2/models/{o}/versions/1/config", 404),
        ("GET", f"/v2/models/{o}/stats", 404),
        ("POST", f"/v2/models/{o}/infer", 404),
        ("POST", f"/v2/models/{o}/generate_stream", 404),
        ("POST", f"/v2/models/{o.replace('o', '%6F', 1)}/infer", 404),
        ("POST", f"/v2/models/{own}%2F..%2F{o}/infer", 404),
        ("POST", f"/v2/models/{own}/../{o}/infer", 400),
        ("POST", f"/v2/models/{own}/%2e%2e/{o}/infer", 403),
        ("POST", f"/v2/models//{o}/infer", 400),
        ("POST", f"//v2/models/{o}/infer", 400),
        ("POST", f"/v2/models/{o}/infer/", 403),
        ("POST", f"/v2/models/{o}/infer?model={own}", 404),
        ("POST", f"/v2/models/{own.upper()}/infer", 404),
        ("GET", "/v2/models/stats", 403),
        ("GET", "/v2/models/stats?model=x", 403),
        ("POST", "/v2/repository/index", 403),
        ("POST", f"/v2/repository/models/{own}/load", 403),
        ("POST", f"/v2/repository/models/{own}/unload", 403),
        ("GET", "/v2/systemsharedmemory/status", 403),
        ("POST", "/v2/systemsharedmemory/region/r/register", 403),
        ("POST", "/v2/systemsharedmemory/unregister", 403),
        ("GET", "/v2/cudasharedmemory/status", 403),
        ("POST", "/v2/cudasharedmemory/region/r/register", 403),
        ("POST", "/v2/cudasharedmemory/unregister", 403),
        ("GET", "/v2/trace/setting", 403),
        ("POST", "/v2/trace/setting", 403),
        ("GET", f"/v2/models/{own}/trace/setting", 403),
        ("POST", f"/v2/models/{own}/trace/setting", 403),
        ("GET", "/v2/logging", 403),
        ("POST", "/v2/logging", 403),
        ("GET", "/metrics", 403),
        ("GET", "/", 403),
        ("DELETE", f"/v2/models/{own}", 405),
        ("GET", f"/v2/models/{own}/infer", 405),
        ("POST", f"/v2/models/{own}/versions/one/infer", 400),
    ]


def test_every_refused_call_is_refused_with_its_status(port: int, served_models: ServedModels) -> None:
    for method, path, status in _refusal_cases(served_models.own, served_models.other):
        got, body = request(port, method, path, b"{}" if method == "POST" else None)
        assert (got, method, path) == (status, method, path)
        assert error_of(body)


def test_mixed_case_encoding_of_the_own_name_is_allowed(port: int, own: str) -> None:
    encoded = "".join(f"%{ord(c):02x}" if i % 2 else c for i, c in enumerate(own))
    status, body = request(port, "POST", f"/v2/models/{encoded}/infer", infer_body([1.0]))
    assert status == 200 and json.loads(body)["model_name"] == own


def test_other_models_look_the_same_whether_they_exist_or_not(port: int, served_models: ServedModels) -> None:
    existing = request(port, "GET", f"/v2/models/{served_models.other}/ready")
    missing = request(port, "GET", "/v2/models/no-such-model-anywhere/ready")
    assert existing[0] == missing[0] == 404
    assert error_of(existing[1]).replace(served_models.other, "X") == error_of(missing[1]).replace(
        "no-such-model-anywhere", "X"
    )


def test_refusals_are_counted_in_metrics(proxy: ProxyProcess, port: int) -> None:
    request(port, "POST", "/v2/repository/index", b"{}")
    status, text = request(proxy.metrics_port, "GET", "/metrics")
    lines = [line for line in text.decode().splitlines() if line.startswith("tritonshare_proxy_refusals_total")]
    assert status == 200 and any('route="repository"' in line and 'protocol="rest"' in line for line in lines)


# ---------------------------------------------------------------------------------------------- shared memory


def test_json_nested_deep_enough_to_crash_triton_is_refused(port: int, own: str, triton: TritonServer) -> None:
    # 50,000 levels crashed Triton 2.51's recursive JSON parser here (every tenant's server, one request).
    deep = b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":' + b"[" * 50_000 + b"]" * 50_000
    for path in (f"/v2/models/{own}/infer", f"/v2/models/{own}/generate"):
        status, body = request(port, "POST", path, deep + b"}]}")
        assert status == 400 and "nests deeper than 128 levels" in error_of(body), body
    assert (
        request(port, "POST", f"/v2/models/{own}/infer", gzip.compress(deep + b"}]}"), Content_Encoding="gzip")[0]
        == 400
    )
    assert triton.process is not None and triton.process.poll() is None  # Triton never saw it
    status, body = request(port, "POST", f"/v2/models/{own}/infer", infer_body([1.0, 2.0]))
    assert status == 200, body


def test_deep_json_is_refused_however_often_it_is_sent(port: int, own: str, triton: TritonServer) -> None:
    # A whole request in one read whose head the proxy has judged before takes its fast path: that path must
    # bound the nesting too (a review found it did not: the second copy went to Triton).
    body = b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"FP32","data":' + b"[" * 1000 + b"]" * 1000 + b"}]}"
    head = f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    for _ in range(2):  # each on a new connection: the memo of judged heads is the proxy's, not the connection's
        with Raw(port) as raw:
            for _ in range(3):  # and again on the same connection
                status, _headers, answer = raw.send(head + body).response()
                assert status == 400 and "nests deeper than 128 levels" in error_of(answer), answer
    assert triton.process is not None and triton.process.poll() is None
    shallow = b'{"inputs":[{"name":"INPUT0","shape":[2],"datatype":"FP32","data":[[1.0,2.0]]}]}'
    with Raw(port) as raw:  # a clean request with the same kind of head still goes through
        for _ in range(2):
            status, _headers, answer = raw.send(
                head.replace(str(len(body)).encode(), str(len(shallow)).encode()) + shallow
            ).response()
            assert status == 200, answer


def _shm_json(own: str, where: str, key: str = "shared_memory_region") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(infer_body([1.0, 2.0]))
    doc["outputs"] = [{"name": "OUTPUT0", "parameters": {}}]
    target = {"request": doc, "input": doc["inputs"][0], "output": doc["outputs"][0]}[where]
    target.setdefault("parameters", {})[key] = "region0"
    return doc


def _assert_shm_refused(status: int, body: bytes) -> None:
    assert status == 400, body
    assert "shared-memory parameter" in error_of(body) and "not allowed through this proxy" in error_of(body)


@pytest.mark.parametrize("where", ["request", "input", "output"])
def test_shared_memory_parameters_are_refused(port: int, own: str, where: str) -> None:
    for key in ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"):
        _assert_shm_refused(
            *request(port, "POST", f"/v2/models/{own}/infer", json.dumps(_shm_json(own, where, key)).encode())
        )


def test_shared_memory_parameters_are_refused_however_they_are_sent(port: int, own: str) -> None:
    path = f"/v2/models/{own}/infer"
    plain = json.dumps(_shm_json(own, "input")).encode()
    escaped = plain.replace(b"shared_memory_region", b"shared\\u005fmemory\\u005Fregion")
    _assert_shm_refused(*request(port, "POST", path, escaped))
    _assert_shm_refused(*request(port, "POST", path, gzip.compress(plain), Content_Encoding="gzip"))
    _assert_shm_refused(*request(port, "POST", path, zlib.compress(plain), Content_Encoding="deflate"))
    binary = plain + np.arange(2, dtype=np.float32).tobytes()
    _assert_shm_refused(*request(port, "POST", path, binary, Inference_Header_Content_Length=str(len(plain))))
    generate = request(
        port, "POST", f"/v2/models/{own}/generate", b'{"INPUT0": [1], "parameters": {"shared_memory_region": "r"}}'
    )
    _assert_shm_refused(*generate)
    with Raw(port) as raw:  # chunked, split inside the key
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        cut = plain.index(b"memory")
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (plain[:cut], plain[cut:])) + b"0\r\n\r\n"
        status, _, body = raw.send(head + chunks).response()
        _assert_shm_refused(status, body)
        assert raw.send(f"GET /v2/models/{own}/ready HTTP/1.1\r\nHost: x\r\n\r\n".encode()).response()[0] == 200


def test_a_registered_region_that_works_directly_is_refused_through_the_proxy(
    port: int, own: str, direct: httpclient.InferenceServerClient
) -> None:
    import tritonclient.utils.shared_memory as shm

    key, region = f"/ts-{uuid.uuid4().hex[:8]}", f"region-{uuid.uuid4().hex[:8]}"
    data = np.arange(4, dtype=np.float32)
    handle = shm.create_shared_memory_region(region, key, data.nbytes)
    try:
        shm.set_shared_memory_region(handle, [data])
        direct.register_system_shared_memory(region, key, data.nbytes)
        inp = httpclient.InferInput("INPUT0", [4], "FP32")
        inp.set_shared_memory(region, data.nbytes)
        assert np.array_equal(direct.infer(own, [inp]).as_numpy("OUTPUT0"), data)  # Triton would read it
        with pytest.raises(InferenceServerException) as caught:
            httpclient.InferenceServerClient(f"127.0.0.1:{port}").infer(own, [inp])
        assert "not allowed through this proxy" in str(caught.value)
    finally:
        direct.unregister_system_shared_memory(region)
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("json_header", [True, False], ids=["binary-extension", "raw-binary"])
def test_a_gzip_bomb_is_refused_before_triton_inflates_it(
    port: int, own: str, triton: TritonServer, json_header: bool
) -> None:
    # Triton inflates a compressed body whole into memory before reading it: 2 MB of gzip took its RSS up 2 GB
    # (kept), so a few dozen such requests, one tenant's, would have the node kill every tenant's server.
    header = (
        json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32"}]}).encode() if json_header else b""
    )
    stream = zlib.compressobj(9, zlib.DEFLATED, 31)
    body = stream.compress(header) + stream.compress(bytes(4))
    body += b"".join(stream.compress(bytes(1 << 20)) for _ in range(256)) + stream.flush()  # 256 MiB in ~256 KiB
    head = (
        f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = triton.rss_mib()
    with Raw(port) as raw:
        status, headers, answer = raw.send(head + body).response()
        assert status == 413 and "inflates to more than 100 times its size" in error_of(answer), answer
        assert headers["connection"] == "close" and raw.closed_by_peer()
    assert triton.rss_mib() - before < 64  # Triton dropped the part it had, never inflated the rest
    assert request(port, "POST", f"/v2/models/{own}/infer", infer_body([1.0]))[0] == 200


# ---------------------------------------------------------------------------------------------- malformed


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /v2 HTTP/1.1 x\r\n\r\n", 400),
        (b"GET /v2 HTTP/2.0\r\n\r\n", 400),
        (b"GET /v2\nHost: x\r\n\r\n", 400),
        (b"GET /v2 HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"GET /v2 HTTP/1.1\r\nBad Header: x\r\n\r\n", 400),
        (b"POST /v2/models/OWN/infer HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}", 400),
        (b"POST /v2/models/OWN/infer HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
        (b"POST /v2/models/OWN/infer HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n{}", 400),
        (b"POST /v2/models/OWN/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
        (b"GET /v2 HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        # Triton counts a tab before the value (not a space): 8192 bytes so counted close its connection
        (b"GET /v2 HTTP/1.1\r\nX-Big: \t" + b"a" * 8191 + b"\r\n\r\n", 431),
    ],
)
def test_malformed_requests_get_an_error_and_a_close(port: int, own: str, raw: bytes, status: int) -> None:
    with Raw(port) as conn:
        got, headers, body = conn.send(raw.replace(b"OWN", own.encode())).response()
        assert got == status and headers["connection"] == "close" and error_of(body)
        assert conn.closed_by_peer()


# ---------------------------------------------------------------------------------------------- large bodies


def test_a_64_mib_binary_infer_streams_through_in_bounded_memory(
    proxy: ProxyProcess, client: httpclient.InferenceServerClient, own: str
) -> None:
    data = np.random.default_rng(1).random((64 << 20) // 4 + 1024, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [data.size], "FP32")
    inp.set_data_from_numpy(data, binary_data=True)
    before = proxy.rss_kib("VmHWM")
    result = client.infer(own, [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
    assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    grown_mib = (proxy.rss_kib("VmHWM") - before) / 1024
    assert grown_mib < 16, f"the proxy's peak RSS grew by {grown_mib:.1f} MiB for a 64 MiB request and response"


def test_json_part_larger_than_the_limit_is_413(start_proxy: Callable[..., ProxyProcess], own: str) -> None:
    proxy = start_proxy(own, "--no-unload", "--max-json-bytes", "2000")
    status, body = request(proxy.http_port, "POST", f"/v2/models/{own}/infer", infer_body([1.0] * 1000))
    assert status == 413 and "max_json_bytes" in error_of(body)
    assert request(proxy.http_port, "POST", f"/v2/models/{own}/infer", infer_body([1.0]))[0] == 200


# ---------------------------------------------------------------------------------------------- Triton down


def test_triton_down_gives_503_fast_and_the_proxy_recovers(
    tmp_path: Path, start_proxy: Callable[..., ProxyProcess], model_name: str
) -> None:
    repo = tmp_path / "models"
    write_model(repo / model_name, config=SLOW_STREAM_CONFIG, model_py=SLOW_STREAM_MODEL)
    server = TritonServer(repository=repo, log_path=tmp_path / "triton.log").start()
    path, body = f"/v2/models/{model_name}/generate_stream", b'{"INPUT0": [1, 2, 3, 4, 5, 6]}'
    stream = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    try:
        wait_model_ready(server, model_name)
        proxy = start_proxy(model_name, "--no-unload", server=server)
        with Raw(proxy.http_port) as raw:
            assert raw.send(stream).file.readline().startswith(b"HTTP/1.1 200")
            while raw.file.readline() != b"\r\n":
                pass
            assert b"OUTPUT0" in raw.file.read(int(raw.file.readline(), 16))  # the first event arrived
            server.kill()  # Triton dies mid-response
            started = time.monotonic()
            rest = raw.file.read()  # whatever was in flight, then the proxy closes the connection
            assert b"0\r\n\r\n" not in rest and time.monotonic() - started < 2.0
        started = time.monotonic()
        status, answer = request(proxy.http_port, "POST", path, body)
        assert status == 503 and "unavailable" in error_of(answer)
        assert time.monotonic() - started < 1.0
        server = TritonServer(
            repository=repo,
            log_path=tmp_path / "triton2.log",
            http_port=server.http_port,
            grpc_port=server.grpc_port,
            metrics_port=server.metrics_port,
        ).start()
        wait_model_ready(server, model_name)
        status, answer = request(proxy.http_port, "POST", path, b'{"INPUT0": [7]}')
        assert status == 200 and b'"OUTPUT0":7.0' in answer
    finally:
        server.kill()  # a graceful stop takes seconds, and this one is our own


# ---------------------------------------------------------------------------------------------- draining


class LocalRest:
    """The REST front end alone, in this process, on a uvloop loop in a thread, to reach its state."""

    def __init__(self, settings: ProxySettings, **frontend: float) -> None:
        self.settings = settings
        self.frontend_options = frontend
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        """Run the loop, and close it in its own thread once stopped."""
        self.loop.run_forever()
        self.loop.close()

    def __enter__(self) -> LocalRest:
        self.thread.start()
        self.state, self.frontend = self.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if self.thread.is_alive():
            # Seen about once in 15 runs, after the drain-grace test: uvloop's close, waiting in libuv's run for a
            # handle (not found which; the proxy's own exit is tested with real processes in test_shutdown.py).
            # The thread is a daemon: the run goes on rather than hang here, out of the per-test timeout's reach.
            logging.getLogger(__name__).warning("the front end's event loop did not stop and close within 10 s")

    async def _start(self) -> tuple[ProxyState, RestFrontend]:
        state = ProxyState(self.settings)
        frontend = RestFrontend(state, **self.frontend_options)
        await frontend.start()
        return state, frontend

    async def _stop(self) -> None:
        self.frontend.stop_accepting()
        self.frontend.abort()
        await asyncio.sleep(0.1)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())

    @property
    def port(self) -> int:
        return self.frontend.port


@pytest.fixture
def local(triton: TritonServer, served_models: ServedModels) -> Iterator[LocalRest]:
    settings = ProxySettings(name=served_models.own, triton_url=triton.url, host="127.0.0.1", http_port=0)
    with LocalRest(settings) as local:
        yield local


def test_drain_closes_idle_connections_and_busy_ones_after_their_response(local: LocalRest, own: str) -> None:
    ready = f"GET /v2/models/{own}/ready HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    body = infer_body([5.0])
    head = f"POST /v2/models/{own}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with Raw(local.port) as idle, Raw(local.port) as busy:
        assert idle.send(ready).response()[0] == 200
        busy.send(head + body[:5])  # a request in progress when draining begins
        time.sleep(0.2)

        def drain() -> None:
            local.state.draining = True
            local.frontend.stop_accepting()
            local.frontend.begin_drain()

        local.call(drain)
        assert idle.closed_by_peer()
        status, headers, answer = busy.send(body[5:]).response()
        assert status == 200 and headers["connection"] == "close"
        assert json.loads(answer)["outputs"][0]["data"] == [5.0]
        assert busy.closed_by_peer()
        assert local.call(lambda: local.state.inflight) == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", local.port), timeout=2)


def test_new_request_while_draining_gets_503_and_close(local: LocalRest, own: str) -> None:
    with Raw(local.port) as conn:
        assert conn.send(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n").response()[0] == 200
        local.call(lambda: setattr(local.state, "draining", True))
        status, headers, body = conn.send(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n").response()
        assert status == 503 and headers["connection"] == "close" and "shutting down" in error_of(body)
        assert conn.closed_by_peer()


def test_readiness_asked_in_a_drain_grace_is_503_where_another_request_is_served(local: LocalRest, own: str) -> None:
    """A request whose head was arriving when draining began may complete (the grace), but never the readiness
    probe: the pod must leave the Service from the moment it drains."""
    probe = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    own_ready = f"GET /v2/models/{own}/ready HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    def drain() -> None:
        local.state.draining = True
        local.frontend.begin_drain()

    with Raw(local.port) as graced, Raw(local.port) as prober, Raw(local.port) as pipelined:
        assert prober.send(probe).response()[0] == 200  # ready before the drain
        graced.send(own_ready[:10])
        prober.send(probe[:10])
        pipelined.send(own_ready[:10])
        time.sleep(0.2)
        local.call(drain)
        status, headers, _ = graced.send(own_ready[10:]).response()
        assert status == 200 and headers["connection"] == "close"  # the grace: served, then closed
        status, headers, body = prober.send(probe[10:]).response()
        assert status == 503 and headers["connection"] == "close" and "shutting down" in error_of(body)
        assert prober.closed_by_peer()
        # A probe pipelined behind a graced request is not served: the connection closes after the first answer.
        status, headers, _ = pipelined.send(own_ready[10:] + probe).response()
        assert status == 200 and headers["connection"] == "close"
        assert pipelined.closed_by_peer()


def test_a_head_not_complete_in_time_gets_408_and_an_idle_connection_is_closed(
    triton: TritonServer, served_models: ServedModels
) -> None:
    settings = ProxySettings(name=served_models.own, triton_url=triton.url, host="127.0.0.1", http_port=0)
    with LocalRest(settings, header_timeout_s=1.0, idle_timeout_s=2.0) as local:
        with Raw(local.port) as slow, Raw(local.port) as idle, Raw(local.port) as busy:
            started = time.monotonic()
            slow.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            assert idle.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n").response()[0] == 200
            for _ in range(8):  # a connection in use is neither
                time.sleep(0.4)
                assert busy.send(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n").response()[0] == 200
            status, headers, body = slow.response()
            assert status == 408 and headers["connection"] == "close" and "not complete within 1 s" in error_of(body)
            assert slow.closed_by_peer() and idle.closed_by_peer()
            assert time.monotonic() - started < 6


def test_a_connection_must_send_its_first_head_in_time_where_a_served_one_may_idle(
    triton: TritonServer, served_models: ServedModels
) -> None:
    """A connection that never sends a byte held its place under --max-connections for the whole keep-alive
    idle time (300 s): 1,024 of them, no token needed, locked every client out, probes included. Its first head
    is due ``header_timeout_s`` after the accept, as gRPC closes silent connections; idle keep-alive after a
    request is another, longer, matter."""
    settings = ProxySettings(name=served_models.own, triton_url=triton.url, host="127.0.0.1", http_port=0)
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with LocalRest(settings, header_timeout_s=1.0, idle_timeout_s=30.0) as local:
        with Raw(local.port) as silent, Raw(local.port) as trickling, Raw(local.port) as served:
            accepted = time.monotonic()
            assert served.send(live).response()[0] == 200
            for byte in live[:12]:  # a byte every 0.2 s: each one comes in time, the head does not
                trickling.send(bytes([byte]))
                time.sleep(0.2)
            status, _, body = trickling.response()
            assert status == 408 and "not complete within 1 s" in error_of(body)
            assert silent.closed_by_peer()
            assert time.monotonic() - accepted < 4  # the sweep runs once a second
            assert served.send(live).response()[0] == 200  # the served one idles on


def _written_apart(sock: Raw, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request as http.client, requests and httpx send it: the head, then the body in a write of its own
    (after a pause, so the proxy reads them apart)."""
    sock.send(head)
    time.sleep(0.05)
    return sock.send(body).response()


@pytest.mark.interpreted
def test_a_body_written_apart_from_its_head_takes_the_short_path(
    triton: TritonServer, served_models: ServedModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head judged before that comes alone is held for its body, and the two go to Triton as one request
    taken whole (no head parsed again, no body read the general way); what the short path checks, it checks:
    a shared-memory parameter or a huge shape in such a body is refused as ever."""
    own = served_models.own
    settings = ProxySettings(name=own, triton_url=triton.url, host="127.0.0.1", http_port=0)
    heads_parsed = []
    read_head = RequestPath._read_head

    def counting(self: RequestPath, data: bytes) -> bytes:
        heads_parsed.append(data[:40])
        return read_head(self, data)

    monkeypatch.setattr(RequestPath, "_read_head", counting)
    with LocalRest(settings) as local, Raw(local.port) as client:
        for value in range(1, 6):  # one digit: bodies of one length, so one head
            body = infer_body([float(value)])
            status, _, answer = _written_apart(client, infer_head(own, len(body)), body)
            assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [float(value)], answer
        assert len(heads_parsed) == 1, heads_parsed  # the first, which judged the head; none after
        shm = json.dumps(_shm_json(own, "input")).encode()
        _assert_shm_refused(*_written_apart(client, infer_head(own, len(shm)), shm)[::2])
    with LocalRest(settings) as local, Raw(local.port) as client:
        body = infer_body([1.0])
        huge = body.replace(b"[1]", b"[1000000, 1000000]", 1).ljust(len(body) + 20)
        clean = body.ljust(len(huge))  # (trailing blanks are valid JSON: one head for both)
        assert _written_apart(client, infer_head(own, len(clean)), clean)[0] == 200
        status, _, answer = _written_apart(client, infer_head(own, len(huge)), huge)
        assert status == 400 and "declares more elements" in error_of(answer), answer


def test_a_held_head_whose_body_is_late_is_served_and_one_whose_body_never_comes_gets_408(
    triton: TritonServer, served_models: ServedModels
) -> None:
    """A head held for its body becomes a request in progress at the next sweep, so a late body is read the
    general way and a missing one is timed out as any stalled body is (not as an incomplete head)."""
    own = served_models.own
    settings = ProxySettings(name=own, triton_url=triton.url, host="127.0.0.1", http_port=0)
    body = infer_body([7.0])
    head = infer_head(own, len(body))
    with LocalRest(settings, header_timeout_s=3.0) as local, Raw(local.port) as client:
        assert client.send(head + body).response()[0] == 200  # the head judged
        client.send(head)
        time.sleep(1.5)  # a sweep or more
        status, _, answer = client.send(body).response()
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [7.0], answer
    with LocalRest(settings, header_timeout_s=1.0) as local, Raw(local.port) as client:
        assert client.send(head + body).response()[0] == 200
        started = time.monotonic()
        status, headers, answer = client.send(head).response()
        assert status == 408 and headers["connection"] == "close", answer
        assert "the request body stopped: no byte of it for 1 s" in error_of(answer)
        # a sweep to start it, one to see it stall, the timeout, and the sweep granularity: ~3-5 s, not 30
        assert time.monotonic() - started < 8


def test_a_port_in_use_is_a_usage_error(proxy: ProxyProcess, own: str) -> None:
    settings = ProxySettings(name=own, host="127.0.0.1", http_port=proxy.http_port)

    async def start() -> None:
        await RestFrontend(ProxyState(settings)).start()

    with pytest.raises(UsageError, match=f"cannot listen on 127.0.0.1:{proxy.http_port}.*--http-port"):
        asyncio.run(start())
