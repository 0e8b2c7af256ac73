"""The proxy's /metrics: its own request accounting plus Triton's series for the own model only."""

from __future__ import annotations

import urllib.request

import numpy as np
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.proxy.conftest import ServedModels
from tests.support.proxy import ProxyProcess
from tests.support.triton import TritonServer


def _infer(url: str, model: str) -> None:
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("INPUT0", [4], "FP32")
    inp.set_data_from_numpy(np.ones(4, dtype=np.float32))
    client.infer(model, [inp])
    client.close()


def _samples(proxy: ProxyProcess) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def test_metrics_count_requests_and_refusals_and_reexport_only_the_own_model(
    proxy: ProxyProcess, served_models: ServedModels, triton: TritonServer
) -> None:
    for _ in range(3):
        _infer(proxy.url, served_models.own)
        _infer(triton.url.removeprefix("http://"), served_models.other)  # the neighbour's traffic, direct
    urllib.request.urlopen(f"http://{proxy.url}/v2/health/live").close()
    try:
        urllib.request.urlopen(urllib.request.Request(f"http://{proxy.url}/v2/repository/index", method="POST"))
    except urllib.error.HTTPError as exc:
        assert exc.code == 403

    samples = _samples(proxy)
    infer_ok = [
        v
        for n, lab, v in samples
        if n == "tritonshare_proxy_requests_total" and lab["route"] == "infer" and lab["code"] == "200"
    ]
    assert infer_ok and infer_ok[0] >= 3
    assert any(n == "tritonshare_proxy_refusals_total" and lab["route"] == "repository" for n, lab, _ in samples)
    assert any(n.startswith("tritonshare_proxy_request_duration_seconds") for n, _, _ in samples)

    triton_models = {lab.get("model") for n, lab, _ in samples if n.startswith("nv_")}
    assert triton_models == {served_models.own}
    # (the parser names counter samples <name>_total; Triton's page says nv_inference_request_success)
    success = [v for n, lab, v in samples if n == "nv_inference_request_success_total"]
    assert success and success[0] >= 3


def test_plain_counters_export_as_prometheus_families() -> None:
    from tritonshare.proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics("m")
    metrics.inflight_gauge("rest").inc()
    for seconds in (0.0001, 0.002, 0.002, 50.0):
        metrics.observe("rest", "infer", "200", seconds)
    metrics.refused("grpc", "ModelInfer", "not_found")
    metrics.upstream_error("grpc")
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}

    def value(family: str, sample: str, **labels: str) -> float:
        return next(
            s.value for s in families[family].samples if s.name == sample and labels.items() <= s.labels.items()
        )

    assert value("tritonshare_proxy_requests", "tritonshare_proxy_requests_total", route="infer", code="200") == 4
    hist = "tritonshare_proxy_request_duration_seconds"
    assert value(hist, hist + "_bucket", le="0.00025") == 1
    assert value(hist, hist + "_bucket", le="0.0025") == 3  # cumulative
    assert value(hist, hist + "_bucket", le="30.0") == 3
    assert value(hist, hist + "_bucket", le="+Inf") == 4
    assert value(hist, hist + "_count") == 4
    assert abs(value(hist, hist + "_sum") - 50.0041) < 1e-9
    assert value("tritonshare_proxy_refusals", "tritonshare_proxy_refusals_total", reason="not_found") == 1
    assert value("tritonshare_proxy_inflight_requests", "tritonshare_proxy_inflight_requests", protocol="rest") == 1
    assert value("tritonshare_proxy_upstream_errors", "tritonshare_proxy_upstream_errors_total") == 1


def test_route_meters_share_the_protocol_gauge_and_tell_a_drain_when_the_last_request_ends() -> None:
    from tritonshare.proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics("m")
    infer, ready = metrics.meter("rest", "infer"), metrics.meter("rest", "model_ready")
    assert metrics.meter("rest", "infer") is infer  # one meter per (protocol, route)
    idle: list[int] = []
    metrics.flight.on_idle = lambda: idle.append(metrics.flight.value)

    started = [infer.begin(), infer.begin(), metrics.meter("grpc", "ModelInfer").begin()]
    assert metrics.inflight_gauge("rest").value == 2 and metrics.flight.value == 3
    infer.end("200", started[0])
    ready.end("499", started[1])  # the same protocol's gauge, whichever route names the end
    assert metrics.inflight_gauge("rest").value == 0 and idle == []  # gRPC still has one in flight
    metrics.meter("grpc", "ModelInfer").end("OK", started[2])
    assert idle == [0] and metrics.inflight_gauge("grpc").value == 0

    text = metrics.exposition().decode()
    requests = {
        (s.labels["route"], s.labels["code"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "tritonshare_proxy_requests_total"
    }
    assert requests == {("infer", "200"): 1, ("model_ready", "499"): 1, ("ModelInfer", "OK"): 1}
    hist = "tritonshare_proxy_request_duration_seconds_count"
    counts = {
        s.labels["route"]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == hist
    }
    assert counts == {"infer": 1, "model_ready": 1, "ModelInfer": 1}
