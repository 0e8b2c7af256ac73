"""The proxy's /metrics: its own request accounting plus Triton's series for the own model only."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.proxy.conftest import ServedModels
from tests.proxy.test_grpc_access import codes, infer_all
from tests.proxy.test_rest import Raw, infer_body, request
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
    errors = "tritonshare_proxy_upstream_errors"
    assert value(errors, errors + "_total", protocol="grpc") == 1
    assert value(errors, errors + "_total", protocol="rest") == 0  # there from the start: increase() sees a first one


def test_upstream_errors_are_exported_at_zero_before_the_first() -> None:
    """A counter series that appears at 1 has no increase for rate()/increase() to see: an alert on Triton being
    unreachable would miss the first outage of a proxy's life."""
    from tritonshare.proxy.metrics import ProxyMetrics

    text = ProxyMetrics("m").exposition().decode()
    samples = {
        (s.name, s.labels.get("protocol")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if family.name == "tritonshare_proxy_upstream_errors"
    }
    name = "tritonshare_proxy_upstream_errors_total"
    assert samples == {(name, "rest"): 0, (name, "grpc"): 0}


def _refusals(proxy: ProxyProcess) -> dict[tuple[str, str, str], float]:
    return {
        (labels["protocol"], labels["route"], labels["reason"]): value
        for name, labels, value in _samples(proxy)
        if name == "tritonshare_proxy_refusals_total"
    }


def test_refusals_operators_alert_on_are_exported_at_zero_from_the_start(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels, tmp_path: Path
) -> None:
    """``increase(tritonshare_proxy_refusals_total{reason="unauthenticated"}[5m]) > 0`` must fire on a proxy's
    first refusal: a series that appears at 1 has no increase, so every one an alert reads is there at 0."""
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    limits = ["--rate-limit-rps", "5", "--max-inflight", "2", "--auth-token-file", str(tokens)]
    guarded = _refusals(start_proxy(served_models.own, "--no-unload", *limits))
    inference = [("rest", "infer"), ("rest", "generate"), ("rest", "generate_stream"), ("grpc", "ModelInfer")]
    for protocol, route in [*inference, ("grpc", "ModelStreamInfer")]:
        for reason in ("unauthenticated", "rate_limited", "queue_full", "queue_timeout", "held_budget"):
            assert guarded.get((protocol, route, reason)) == 0, (protocol, route, reason)
    for protocol, route in (("rest", "model_config"), ("grpc", "ModelMetadata")):  # metadata: their own bucket
        assert guarded[protocol, route, "rate_limited"] == 0
    for protocol in ("rest", "grpc", "metrics"):
        assert guarded[protocol, "connection", "too_many_connections"] == 0
    assert guarded["rest", "infer", "draining"] == 0 and guarded["grpc", "ModelStreamInfer", "draining"] == 0
    assert set(guarded.values()) == {0}

    # Without the options, none of their reasons: a series at 0 forever would say the check is on.
    plain = _refusals(start_proxy(served_models.own, "--no-unload"))
    assert {reason for _, _, reason in plain} == {"too_many_connections", "held_budget", "draining"}
    assert plain["grpc", "ModelInfer", "held_budget"] == 0 and plain["rest", "connection", "too_many_connections"] == 0


def test_refusals_are_counted_but_not_timed() -> None:
    from tritonshare.proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics("m")
    metrics.observe("rest", "infer", "200", 0.2)
    for _ in range(9):
        metrics.refused_answer("rest", "infer", "429", "rate_limited")
    metrics.refused_answer("rest", "repository", "403", "denied")
    samples = [
        (s.name, s.labels, s.value)
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
    ]

    def values(name: str, **labels: str) -> list[float]:
        return [v for n, lab, v in samples if n == name and labels.items() <= lab.items()]

    assert values("tritonshare_proxy_requests_total", route="infer", code="429") == [9]
    assert values("tritonshare_proxy_refusals_total", route="infer", reason="rate_limited") == [9]
    # The one request served is the histogram's whole: its median is 0.2 s, not the refusals' 0.
    hist = "tritonshare_proxy_request_duration_seconds"
    assert values(hist + "_count", route="infer") == [1] and values(hist + "_bucket", le="0.1") == [0]
    assert values(hist + "_count", route="repository") == []  # only ever refused: no latency to show
    assert values("tritonshare_proxy_requests_total", route="repository") == [1]


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


# ---------------------------------------------------------------------------------------------- the whole page

# One sample line of the text format (0.0.4): name, optional {labels}, value, optional timestamp.
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: -?\d+)?")
# One label pair: a value may escape only a backslash, a double quote and a newline.
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
# The samples of a family, by its type (a counter's TYPE line names it with its _total already).
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def strict_families(text: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    """The page read as Prometheus' own parser reads it, stricter than prometheus_client's (which accepts a family
    whose lines are split up, a second TYPE line, samples of no family): {family: (type, [(sample, labels, value)])}."""
    families: dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]] = {}
    helped: set[str] = set()
    current = ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helped, f"line {number}: a second HELP for {name}"
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in families, f"line {number}: a second TYPE for {name}"
            families[name], current = (kind, []), name
        elif line and not line.startswith("#"):
            match = _SAMPLE.fullmatch(line)
            assert match, f"line {number} is not a sample: {line!r}"
            sample, raw, value = match.groups()
            kind, samples = families.get(current, ("untyped", []))
            assert sample in {current + s for s in _SUFFIXES.get(kind, ("",))}, (
                f"line {number}: {sample} is not a sample of the {kind} {current} above it"
            )
            labels: dict[str, str] = {}
            rest = raw or ""
            while rest:
                pair = _LABEL.match(rest)
                assert pair, f'line {number}: labels {raw!r} are not name="escaped value" pairs'
                assert pair[1] not in labels, f"line {number}: label {pair[1]} twice"
                labels[pair[1]] = pair[2]
                rest = rest[pair.end() :]
            samples.append((sample, labels, float(value)))
    return families


def check_histograms(families: dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]) -> None:
    for name, (kind, samples) in families.items():
        if kind != "histogram":
            continue
        series: dict[tuple[tuple[str, str], ...], dict[str, list[tuple[str, float]]]] = {}
        for sample, labels, value in samples:
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            series.setdefault(key, {}).setdefault(sample.removeprefix(name), []).append((labels.get("le", ""), value))
        for key, parts in series.items():
            buckets = parts["_bucket"]
            bounds = [float(le) for le, _ in buckets]
            assert bounds == sorted(bounds) and buckets[-1][0] == "+Inf", f"{name}{key}: buckets {bounds}"
            counts = [v for _, v in buckets]
            assert counts == sorted(counts), f"{name}{key}: buckets not cumulative: {counts}"
            assert parts["_count"] == [("", counts[-1])] and len(parts["_sum"]) == 1, f"{name}{key}: {parts}"


def check_own_names(families: dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]) -> None:
    """Prometheus' naming rules for the proxy's own families: counters end in _total, a gauge does not, units are
    the base ones (seconds, bytes), spelled last."""
    for name, (kind, _) in families.items():
        if not name.startswith("tritonshare_"):
            continue
        assert name.endswith("_total") == (kind == "counter"), f"{name} is a {kind}"
        words = name.removesuffix("_total").split("_")
        units = {"ms", "us", "milliseconds", "microseconds", "kib", "mib", "kb", "mb", "secs", "s"}
        assert not units & set(words), f"{name}: not a base unit"
        for unit in ("seconds", "bytes"):
            assert unit not in words or words[-1] == unit, f"{name}: the unit goes last"


def _page(proxy: ProxyProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _traffic(proxy: ProxyProcess, own: str, other: str, tag: str) -> None:
    """A bit of everything a tenant sends: answered REST and gRPC calls, refusals of each kind, unauthenticated
    and throttled calls, paths and model names of its own choosing, a malformed request."""
    good = {"authorization": "Bearer secret"}
    for _ in range(2):
        assert request(proxy.http_port, "POST", f"/v2/models/{own}/infer", infer_body([1.0]), **good)[0] == 200
    grpc_client = grpcclient.InferenceServerClient(proxy.grpc_url)
    try:
        assert codes(infer_all(grpc_client, own, [1.0, 2.0], headers=good)) == ["OK", "OK"]
        assert codes(infer_all(grpc_client, own, [3.0], headers={"authorization": "Bearer wrong"})) == [
            "UNAUTHENTICATED"
        ]
        assert codes(infer_all(grpc_client, f"{other}-{tag}", [4.0], headers=good))[0] in ("NOT_FOUND", "UNAVAILABLE")
    finally:
        grpc_client.close()
    assert request(proxy.http_port, "GET", f"/v2/models/{own}")[0] == 401  # no token
    assert request(proxy.http_port, "GET", f"/v2/models/{own}", authorization="Bearer nope")[0] == 401
    assert request(proxy.http_port, "GET", "/v2/health/ready")[0] == 200  # probes need none
    statuses: list[int] = []
    for _ in range(8):  # (in a second or two, only a token or two comes back)
        statuses.append(request(proxy.http_port, "POST", f"/v2/models/{own}/infer", infer_body([1.0]), **good)[0])
    assert 429 in statuses  # the rate limit's burst of 4 was spent above
    for n in range(20):  # tenant-chosen paths and names: never a label value
        assert request(proxy.http_port, "GET", f"/v2/{tag}-{n}?q=%22x%22", **good)[0] == 403
        assert request(proxy.http_port, "GET", f"/v2/models/{tag}-{n}%22/ready", **good)[0] in (404, 429)
    assert request(proxy.http_port, "POST", "/v2/repository/index", b"", **good)[0] == 403
    with Raw(proxy.http_port) as raw:
        assert raw.send(b"NOT HTTP AT ALL\r\n\r\n").response()[0] == 400


def test_the_whole_page_is_valid_prometheus_text_after_every_kind_of_traffic(
    start_proxy: Callable[..., ProxyProcess], served_models: ServedModels, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    limits = ["--rate-limit-rps", "1", "--rate-limit-burst", "4", "--max-inflight", "2"]
    proxy = start_proxy(served_models.own, "--no-unload", "--auth-token-file", str(tokens), *limits)
    _traffic(proxy, served_models.own, served_models.other, "first")
    first = strict_families(_page(proxy))
    time.sleep(4.5)  # tokens for the second round
    _traffic(proxy, served_models.own, served_models.other, "second")
    text = _page(proxy)
    second = strict_families(text)
    list(text_string_to_metric_families(text))  # and prometheus_client's own parser takes it

    check_histograms(second)
    check_own_names(second)
    own = {name: family for name, family in second.items() if name.startswith("tritonshare_")}
    assert own.keys() == {n for n in first if n.startswith("tritonshare_")}
    for name, (kind, samples) in own.items():
        before = {(s, tuple(sorted(labels.items()))): v for s, labels, v in first[name][1]}
        after = {(s, tuple(sorted(labels.items()))): v for s, labels, v in samples}
        assert before.keys() <= after.keys(), f"{name}: series gone"
        for key, value in after.items():
            assert not any(word in v for _, v in key[1] for word in ("first-", "second-", '"', "/")), (name, key)
            if kind in ("counter", "histogram", "summary") and key in before:
                assert value >= before[key], f"{name}{key} went down: {before[key]} → {value}"
    # Tenant-chosen paths, names and errors are no label value (checked above): the series stay few.
    assert sum(len(samples) for _, samples in own.values()) < 300
    # The refusals of the first round were counted, each kind under its own reason.
    refusals = own["tritonshare_proxy_refusals_total"][1]
    reasons = {labels["reason"] for _, labels, _ in refusals}
    assert {"unauthenticated", "rate_limited", "other_model", "denied", "bad_request"} <= reasons, reasons
    # The same refusal has the same reason on both protocols: one query sums a tenant's calls to other models.
    for reason in ("unauthenticated", "other_model"):
        assert {labels["protocol"] for _, labels, _ in refusals if labels["reason"] == reason} == {"rest", "grpc"}
    # Refusals are counted, not timed: infer's latency is that of the infers served (not of the 429s beside them).
    requests = own["tritonshare_proxy_requests_total"][1]
    assert any(labels["code"] == "429" for _, labels, _ in requests)
    served = sum(v for _, labels, v in requests if labels["route"] == "infer" and labels["code"] == "200")
    hist = own["tritonshare_proxy_request_duration_seconds"][1]
    assert [v for s, labels, v in hist if s.endswith("_count") and labels["route"] == "infer"] == [served]
    assert not [labels for _, labels, _ in hist if labels["route"] in ("unknown", "repository", "malformed")]
    # At rest, nothing in flight, waiting or held.
    for gauge in ("tritonshare_proxy_inflight_requests", "tritonshare_proxy_admission_inflight"):
        assert all(v == 0 for _, _, v in own[gauge][1]), own[gauge]
    assert [v for _, _, v in own["tritonshare_proxy_held_bytes"][1]] == [0]
