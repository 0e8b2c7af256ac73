"""Fairness and access control at the REST port (issue 9), against the real Triton: ``--max-inflight`` holds
exactly (a model that records when each request ran shows how many ran at once), waiting requests run in
arrival order, a full queue, a wait past ``--queue-timeout-s`` and the rate limit are 429 with Retry-After,
and a slot always comes back (refused body, client gone while waiting, client gone while Triton computes);
bearer tokens (tritonclient and curl; probes open; a changed token file counts without a restart); TLS
(tritonclient and curl with a CA, ALPN, a rotated certificate seen by new connections without a restart).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.proxy.conftest import ServedModels
from tests.proxy.test_metrics import _samples
from tests.support.certs import CertificateAuthority, serial_of, write_atomically
from tests.support.install import install_model
from tests.support.models import SLOW_CONFIG
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.proxy.rest import RestFrontend
from tritonshare.proxy.settings import ProxySettings
from tritonshare.proxy.state import ProxyState
from tritonshare.proxy.tls import HANDSHAKE_TIMEOUT_S

pytestmark = pytest.mark.triton

# Identity, 4 instances, ``DELAY_S`` per request; appends "start end value" for each request to ``LOG``.
RECORDING_MODEL = """\
import time

import triton_python_backend_utils as pb_utils

LOG = {log!r}
DELAY_S = {delay_s!r}


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            started = time.time()
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            time.sleep(DELAY_S)
            with open(LOG, "a") as fh:
                fh.write(f"{{started!r}} {{time.time()!r}} {{float(x[0])!r}}\\n")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""


@dataclass(frozen=True)
class Run:
    start: float
    end: float
    value: float


@dataclass(frozen=True)
class RecordingModel:
    name: str
    log: Path

    def runs(self) -> list[Run]:
        """The requests Triton executed, in the order they finished."""
        if not self.log.exists():
            return []
        return [Run(*map(float, line.split())) for line in self.log.read_text().splitlines()]

    def reset(self) -> None:
        self.log.unlink(missing_ok=True)


@pytest.fixture
def recording_model(
    triton: TritonServer, layout: NodeLayout, tmp_path: Path, model_name: str
) -> Callable[[float], RecordingModel]:
    def install(delay_s: float) -> RecordingModel:
        model = RecordingModel(model_name, tmp_path / "runs.log")
        install_model(
            layout,
            triton,
            model_name,
            config=SLOW_CONFIG,
            model_py=RECORDING_MODEL.format(log=str(model.log), delay_s=delay_s),
        )
        return model

    return install


def most_at_once(runs: list[Run]) -> int:
    """The largest number of requests executing at the same moment."""
    events = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs])  # an end sorts before a start
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def infer_body(value: float) -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [value]}]}
    return json.dumps(doc).encode()


def infer(port: int, model: str, value: float, **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=infer_body(value), headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def get(port: int, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def at_once(count: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(i)`` for i in range(count), all released at the same moment from their own threads."""
    barrier = threading.Barrier(count)

    def run(i: int) -> Any:
        barrier.wait()
        return call(i)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


def staggered(count: int, gap_s: float, call: Callable[[int], Any]) -> list[Any]:
    """``call(i)`` for i in range(count), each started ``gap_s`` after the previous one, in its own thread."""
    with ThreadPoolExecutor(count) as pool:
        futures = []
        for i in range(count):
            futures.append(pool.submit(call, i))
            time.sleep(gap_s)
        return [f.result() for f in futures]


def metric(proxy: ProxyProcess, prefix: str) -> float:
    """The value of the one exported series starting with ``prefix`` (name and labels)."""
    _, _, text = get(proxy.metrics_port, "/metrics")
    values = [float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines() if line.startswith(prefix)]
    assert len(values) == 1, f"{prefix}: {values}"
    return values[0]


# ---------------------------------------------------------------------------------------------- admission


def test_max_inflight_holds_exactly_at_triton(
    triton: TritonServer, start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    model = recording_model(0.4)
    direct = at_once(8, lambda i: infer(triton.http_port, model.name, i)[0])
    assert direct == [200] * 8
    assert most_at_once(model.runs()) > 2, "the model must be able to run more than the cap at once"
    model.reset()
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "2")
    statuses = at_once(12, lambda i: infer(proxy.http_port, model.name, i)[0])
    assert statuses == [200] * 12
    runs = model.runs()
    assert len(runs) == 12 and most_at_once(runs) == 2
    assert metric(proxy, "tritonshare_proxy_admission_inflight{") == 0.0
    assert metric(proxy, "tritonshare_proxy_admission_queued_total{") >= 10  # 12 at once, 2 slots


def test_waiting_requests_run_in_arrival_order(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    model = recording_model(0.3)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1")
    statuses = staggered(6, 0.1, lambda i: infer(proxy.http_port, model.name, i)[0])
    assert statuses == [200] * 6
    runs = model.runs()
    assert [r.value for r in runs] == [0, 1, 2, 3, 4, 5]
    assert most_at_once(runs) == 1


def test_a_full_queue_is_429_at_once_with_retry_after(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    model = recording_model(1.0)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--max-queue", "1")
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(infer, proxy.http_port, model.name, 1)
        time.sleep(0.2)
        waiting = pool.submit(infer, proxy.http_port, model.name, 2)
        time.sleep(0.2)
        started = time.monotonic()
        status, headers, body = infer(proxy.http_port, model.name, 3)
        took = time.monotonic() - started
        assert status == 429 and headers["retry-after"] == "1", body
        assert "1 waiting" in json.loads(body)["error"] and took < 0.5
        assert running.result()[0] == waiting.result()[0] == 200
    assert [r.value for r in model.runs()] == [1, 2]
    assert metric(proxy, f'tritonshare_proxy_admission_refused_total{{model="{model.name}",reason="queue_full"}}') == 1


def test_a_wait_past_the_queue_timeout_is_429(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    model = recording_model(1.0)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--queue-timeout-s", "0.3")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(infer, proxy.http_port, model.name, 1)
        time.sleep(0.1)
        started = time.monotonic()
        status, headers, body = infer(proxy.http_port, model.name, 2)
        took = time.monotonic() - started
        assert status == 429 and headers["retry-after"] == "1"
        assert "no slot free within 0.3 s" in json.loads(body)["error"] and 0.25 < took < 0.9
        assert running.result()[0] == 200
    assert [r.value for r in model.runs()] == [1]


def test_the_rate_limit_refuses_with_429_and_leaves_probes_alone(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--rate-limit-rps", "2", "--rate-limit-burst", "2")
    answers = [infer(proxy.http_port, own, i) for i in range(5)]
    assert [status for status, _, _ in answers] == [200, 200, 429, 429, 429]
    assert answers[2][1]["retry-after"] == "1" and "rate limit" in json.loads(answers[2][2])["error"]
    assert get(proxy.http_port, f"/v2/models/{own}/ready")[0] == 200  # metadata: a bucket of its own
    time.sleep(0.6)  # one token back
    assert infer(proxy.http_port, own, 9)[0] == 200
    assert metric(proxy, f'tritonshare_proxy_admission_throttled_total{{model="{own}"}}') == 3


def test_the_rate_limit_holds_metadata_in_a_bucket_of_its_own_and_leaves_probes_alone(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """A config flood at 10k/s went to Triton whatever --rate-limit-rps said: metadata, config, statistics and a
    model's readiness now take a token of their own bucket (same rate and burst), never waiting for one."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--rate-limit-rps", "0.2", "--rate-limit-burst", "2")  # 1 token / 5 s
    answers = [get(proxy.http_port, f"/v2/models/{own}/config") for _ in range(8)]
    statuses = [status for status, _, _ in answers]
    assert statuses == [200, 200] + [429] * 6
    status, headers, body = answers[-1]
    assert headers["retry-after"] == "5" and "rate limit of 0.2 requests/s" in json.loads(body)["error"]
    for path in ("/v2", f"/v2/models/{own}", f"/v2/models/{own}/stats", f"/v2/models/{own}/versions/1/ready"):
        assert get(proxy.http_port, path)[0] == 429, path  # one bucket for every metadata route
    assert infer(proxy.http_port, own, 1)[0] == 200  # inference has its own tokens
    for path in ("/v2/health/ready", "/v2/health/live"):
        assert get(proxy.http_port, path)[0] == 200  # probes: answered by the proxy, never limited
    throttled = statuses.count(429) + 4
    assert metric(proxy, f'tritonshare_proxy_admission_throttled_total{{model="{own}"}}') == throttled
    refused = [
        v for n, lab, v in _samples(proxy) if n == "tritonshare_proxy_refusals_total" and lab["route"] == "model_config"
    ]
    assert refused == [statuses.count(429)]


def _request_then_leave(port: int, model: str, value: float, after_s: float) -> None:
    body = infer_body(value)
    head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(after_s)


def test_a_slot_comes_back_whatever_ends_the_request(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    model = recording_model(0.5)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--queue-timeout-s", "3")
    port, name = proxy.http_port, model.name
    shm = json.loads(infer_body(1))
    shm["inputs"][0]["parameters"] = {"shared_memory_region": "r"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", f"/v2/models/{name}/infer", body=json.dumps(shm).encode())
    assert conn.getresponse().status == 400  # refused after it took the slot
    conn.close()
    with ThreadPoolExecutor(1) as pool:  # a client leaves while it waits for the slot
        running = pool.submit(infer, port, name, 2)
        time.sleep(0.1)
        _request_then_leave(port, name, 3, after_s=0.1)
        assert running.result()[0] == 200
    _request_then_leave(port, name, 4, after_s=0.1)  # a client leaves while Triton computes its request
    assert infer(port, name, 5)[0] == 200
    runs = model.runs()
    assert [r.value for r in runs] == [2, 4, 5]  # 3 never reached Triton; 5 waited for 4 to finish
    assert most_at_once(runs) == 1
    assert metric(proxy, "tritonshare_proxy_admission_inflight{") == 0.0


def _infer_bytes(model: str, value: float, *headers: str) -> bytes:
    """One whole infer request, head and body, in the bytes a keep-alive client repeats (values of one digit
    give bodies of one length, so heads of the same bytes: the memoised head, the short path)."""
    body = infer_body(value)
    extra = "".join(f"{header}\r\n" for header in headers)
    head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _status_of(sock: socket.socket, request: bytes) -> int:
    """Send ``request`` (in one write) and read its whole response (Content-Length framed); its status."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"the proxy closed the connection: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail("the proxy closed the connection mid-body")
    return int(head.split(b" ", 2)[1])


def test_a_slot_taken_on_the_short_path_comes_back_when_its_client_leaves_while_triton_computes(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    """A repeated head with a free slot takes it on the short path; the client leaving mid-exchange gives it back
    once Triton has answered (the next request waits for that), and only once (nothing in flight after)."""
    model = recording_model(0.5)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--queue-timeout-s", "3")
    with socket.create_connection(("127.0.0.1", proxy.http_port), timeout=30) as sock:
        assert _status_of(sock, _infer_bytes(model.name, 1)) == 200  # its head judged and memoised
        sock.sendall(_infer_bytes(model.name, 2))  # the same head bytes: the short path
        time.sleep(0.1)
    assert infer(proxy.http_port, model.name, 3)[0] == 200
    runs = model.runs()
    assert [r.value for r in runs] == [1, 2, 3] and most_at_once(runs) == 1  # 3 waited for the orphaned 2
    assert metric(proxy, "tritonshare_proxy_admission_inflight{") == 0.0
    assert metric(proxy, "tritonshare_proxy_admission_queued_total{") == 1  # 3, behind 2's slot


def test_a_memoised_head_finding_every_slot_taken_waits_in_the_queue(
    start_proxy: Callable[..., ProxyProcess], recording_model: Callable[[float], RecordingModel]
) -> None:
    """The short path takes a slot only when one is free now: a repeated head that finds none queues as any
    request does (in arrival order, the cap held), and the one after it takes the short path again."""
    model = recording_model(0.4)
    proxy = start_proxy(model.name, "--no-unload", "--max-inflight", "1", "--queue-timeout-s", "5")
    port = proxy.http_port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as first:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as second:
            assert _status_of(first, _infer_bytes(model.name, 1)) == 200  # memoised
            with ThreadPoolExecutor(1) as pool:
                running = pool.submit(_status_of, first, _infer_bytes(model.name, 2))
                time.sleep(0.15)
                assert _status_of(second, _infer_bytes(model.name, 3)) == 200  # waited for 2's slot
                assert running.result() == 200
            assert _status_of(second, _infer_bytes(model.name, 4)) == 200
    runs = model.runs()
    assert [r.value for r in runs] == [1, 2, 3, 4] and most_at_once(runs) == 1
    assert runs[2].start >= runs[1].end
    assert metric(proxy, "tritonshare_proxy_admission_queued_total{") == 1
    assert metric(proxy, "tritonshare_proxy_admission_inflight{") == 0.0


def test_a_rate_limit_token_taken_on_the_short_path_counts_and_refuses_as_before(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels
) -> None:
    """Repeated heads on one keep-alive connection (the short path) spend the bucket as others do: 2 of burst 2
    pass, the rest are 429 and counted once each, inference and metadata alike; the connection stays usable."""
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--rate-limit-rps", "0.2", "--rate-limit-burst", "2")
    config = f"GET /v2/models/{own}/config HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", proxy.http_port), timeout=30) as sock:
        inference = [_status_of(sock, _infer_bytes(own, i)) for i in range(5)]
        metadata = [_status_of(sock, config) for _ in range(5)]
    assert inference == metadata == [200, 200, 429, 429, 429]
    assert metric(proxy, f'tritonshare_proxy_admission_throttled_total{{model="{own}"}}') == 6


# ---------------------------------------------------------------------------------------------- bearer tokens


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# tenant callers\nalpha-token\n\nbeta-token\n")
    return path


def test_the_right_token_passes_and_a_wrong_or_missing_one_is_401(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels, token_file: Path
) -> None:
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--auth-token-file", str(token_file))
    client = httpclient.InferenceServerClient(proxy.url)
    try:
        assert client.is_server_live() and client.is_server_ready()  # probes need no token
        data = np.array([1.5, 2.5], dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [2], "FP32")
        inp.set_data_from_numpy(data)
        result = client.infer(own, [inp], headers={"Authorization": "Bearer alpha-token"})
        assert np.array_equal(result.as_numpy("OUTPUT0"), data)
        for headers in ({"Authorization": "Bearer gamma-token"}, {}):
            with pytest.raises(InferenceServerException, match="missing or invalid bearer token"):
                client.infer(own, [inp], headers=headers)
    finally:
        client.close()
    status, headers, _ = get(proxy.http_port, f"/v2/models/{own}")
    assert status == 401 and headers["www-authenticate"] == 'Bearer realm="tritonshare"'
    assert get(proxy.http_port, "/v2/repository/index", Authorization="Bearer nope")[0] == 401  # learns nothing
    url = f"http://{proxy.url}/v2/models/{own}"
    assert _curl(url, "-H", "Authorization: Bearer beta-token") == "200"
    assert _curl(url) == "401"
    assert _curl(f"{url}/infer", "-H", "Authorization: bearer beta-token", "-d", infer_body(7).decode()) == "200"


def _curl(url: str, *args: str) -> str:
    done = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", *args, url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.stdout


def test_a_changed_token_file_counts_without_a_restart(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels, tmp_path: Path
) -> None:
    own = served_models.own
    path = tmp_path / "tokens"
    path.write_text("old-token\n")
    proxy = start_proxy(own, "--no-unload", "--auth-token-file", str(path))
    conn = http.client.HTTPConnection("127.0.0.1", proxy.http_port, timeout=30)  # one connection, same heads

    def status(token: str) -> int:
        conn.request("GET", f"/v2/models/{own}/ready", headers={"Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        response.read()
        return response.status

    try:
        assert (status("old-token"), status("new-token")) == (200, 401)
        write_atomically(path, b"new-token\n")  # what a Secret update amounts to
        deadline = time.monotonic() + 5
        while status("new-token") != 200:
            assert time.monotonic() < deadline, "the new token was not accepted within 5 s"
            time.sleep(0.2)
        assert status("old-token") == 401  # the same head bytes as before: the verdict is not memoised
    finally:
        conn.close()


def test_a_token_revoked_by_a_reload_is_refused_on_the_next_request_of_a_memoised_head(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels, tmp_path: Path
) -> None:
    """The head (its Authorization included) is memoised and its verdict kept for the short path, but only while
    the token file is unchanged: the first request after the reload that drops the token is 401, on the same
    keep-alive connection with the same bytes, and the token now in the file passes at once."""
    own = served_models.own
    path = tmp_path / "tokens"
    path.write_text("alpha-token\n")
    proxy = start_proxy(own, "--no-unload", "--auth-token-file", str(path))
    alpha = _infer_bytes(own, 1, "Authorization: Bearer alpha-token")
    with socket.create_connection(("127.0.0.1", proxy.http_port), timeout=30) as sock:
        assert [_status_of(sock, alpha) for _ in range(3)] == [200, 200, 200]  # the last two: the short path
        write_atomically(path, b"beta-token\n")
        time.sleep(1.3)  # the file is looked at once a second: the next request looks
        assert _status_of(sock, alpha) == 401
        assert _status_of(sock, alpha) == 401  # a refusal is never kept as a pass either
        beta = _infer_bytes(own, 1, "Authorization: Bearer beta-token")
        assert [_status_of(sock, beta) for _ in range(2)] == [200, 200]
    assert metric(proxy, f'tritonshare_proxy_auth_refused_total{{model="{own}",reason="invalid"}}') == 2


def test_the_token_is_not_forwarded_to_triton(served_models: ServedModels, token_file: Path) -> None:
    settings = ProxySettings(name=served_models.own, auth_token_file=token_file)

    async def judged_upstream_head() -> bytes:
        frontend = RestFrontend(ProxyState(settings))
        raw = f"GET /v2/models/{served_models.own} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alpha-token"
        return frontend.judge(raw.encode()).upstream

    head = asyncio.run(judged_upstream_head())
    assert head.startswith(b"GET /v2/models/") and b"alpha-token" not in head and b"uthorization" not in head


# ---------------------------------------------------------------------------------------------- TLS


@pytest.fixture
def tls_files(tmp_path: Path) -> Iterator[tuple[CertificateAuthority, Path, Path, Path]]:
    """(CA, CA file, certificate, key) in a folder of their own."""
    ca = CertificateAuthority()
    folder = tmp_path / "tls"
    folder.mkdir()
    cert, key = ca.write_pair(folder, serial=7001)
    yield ca, ca.write_ca(tmp_path / "ca.crt"), cert, key


def _handshake(port: int, ca_file: Path) -> tuple[int, str | None]:
    """(serial of the proxy's certificate, ALPN protocol) seen by a new connection offering h2 and http/1.1."""
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            return serial_of(der), tls.selected_alpn_protocol()


def test_tls_serves_tritonclient_and_curl_with_a_ca(
    start_proxy: Callable[..., ProxyProcess],
    served_models: ServedModels,
    tls_files: tuple[CertificateAuthority, Path, Path, Path],
) -> None:
    _, ca_file, cert, key = tls_files
    own = served_models.own
    proxy = start_proxy(own, "--no-unload", "--tls-cert", str(cert), "--tls-key", str(key))
    assert _handshake(proxy.http_port, ca_file) == (7001, "http/1.1")
    client = httpclient.InferenceServerClient(proxy.url, ssl=True, ssl_options={"ca_certs": str(ca_file)})
    try:
        assert client.is_server_ready() and client.is_model_ready(own)
        data = np.arange(8, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [8], "FP32")
        inp.set_data_from_numpy(data, binary_data=True)
        assert np.array_equal(client.infer(own, [inp]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()
    url = f"https://{proxy.url}/v2/models/{own}"
    assert _curl(f"{url}/ready", "--cacert", str(ca_file)) == "200"
    assert _curl(f"{url}/infer", "--cacert", str(ca_file), "-d", infer_body(3).decode()) == "200"
    assert _curl(f"{url}/ready") == "000"  # no trust in the proxy's CA: curl refuses the certificate


def test_tls_connection_close_ends_at_once(
    start_proxy: Callable[..., ProxyProcess],
    served_models: ServedModels,
    tls_files: tuple[CertificateAuthority, Path, Path, Path],
) -> None:
    _, ca_file, cert, key = tls_files
    proxy = start_proxy(served_models.own, "--no-unload", "--tls-cert", str(cert), "--tls-key", str(key))
    context = ssl.create_default_context(cafile=ca_file)
    with socket.create_connection(("127.0.0.1", proxy.http_port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
            started, answer = time.monotonic(), b""
            while chunk := tls.recv(65536):  # an HTTP/1.0 client reads until the connection ends
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and time.monotonic() - started < 1.0


def test_a_tls_handshake_that_never_comes_ends_the_connection_on_both_ports(
    start_proxy: Callable[..., ProxyProcess],
    served_models: ServedModels,
    tls_files: tuple[CertificateAuthority, Path, Path, Path],
) -> None:
    """It holds an open file and a place under --max-connections: bounded by HANDSHAKE_TIMEOUT_S, not 60 s."""
    _, _, cert, key = tls_files
    proxy = start_proxy(served_models.own, "--no-unload", "--tls-cert", str(cert), "--tls-key", str(key))
    silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for port in (proxy.http_port, proxy.grpc_port)]
    started = time.monotonic()
    for sock in silent:
        with sock:
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
    assert HANDSHAKE_TIMEOUT_S - 0.5 < time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 5


def test_tls_handshakes_under_way_hold_places_and_one_past_the_cap_is_closed_before_any_handshake(
    start_proxy: Callable[..., ProxyProcess],
    served_models: ServedModels,
    tls_files: tuple[CertificateAuthority, Path, Path, Path],
) -> None:
    """Silent connections (handshakes under way) fill ``--max-connections``; the next is closed before its
    handshake, on both ports, and counted; once a silent one goes, a handshake succeeds again."""
    _, ca_file, cert, key = tls_files
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    proxy = start_proxy(served_models.own, "--no-unload", *tls, "--max-connections", "2")

    def handshakes(port: int) -> bool:
        try:
            return _handshake(port, ca_file)[0] == 7001
        except (ssl.SSLError, OSError):
            return False

    for port in (proxy.http_port, proxy.grpc_port):
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            with pytest.raises((ssl.SSLError, OSError)):
                _handshake(port, ca_file)
            silent.pop().close()
            deadline = time.monotonic() + 5
            while not handshakes(port):
                assert time.monotonic() < deadline, "no place came free after a silent connection closed"
                time.sleep(0.05)
        finally:
            for sock in silent:
                sock.close()
    refused: dict[str, float] = {}
    for name, labels, value in _samples(proxy):
        if name == "tritonshare_proxy_refusals_total" and labels.get("reason") == "too_many_connections":
            refused[labels["protocol"]] = refused.get(labels["protocol"], 0.0) + value
    assert refused["rest"] >= 1 and refused["grpc"] >= 1, refused
    assert refused["metrics"] == 0, refused  # its own cap, not reached (shown at 0 from the start)


def test_a_rotated_certificate_reaches_new_connections_without_a_restart(
    start_proxy: Callable[..., ProxyProcess],
    served_models: ServedModels,
    tls_files: tuple[CertificateAuthority, Path, Path, Path],
) -> None:
    ca, ca_file, cert, key = tls_files
    proxy = start_proxy(served_models.own, "--no-unload", "--tls-cert", str(cert), "--tls-key", str(key))
    assert _handshake(proxy.http_port, ca_file)[0] == 7001
    ca.write_pair(cert.parent, serial=7002)
    deadline = time.monotonic() + 5
    while _handshake(proxy.http_port, ca_file)[0] != 7002:
        assert time.monotonic() < deadline, "new connections still get the old certificate after 5 s"
        time.sleep(0.2)
    assert proxy.process is not None and proxy.process.poll() is None  # the same process all along
    url = f"https://{proxy.url}/v2/models/{served_models.own}/ready"
    assert _curl(url, "--cacert", str(ca_file)) == "200"
