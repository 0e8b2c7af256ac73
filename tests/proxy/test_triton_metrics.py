"""The proxy's re-export of Triton's metrics: the own model's series from a REAL Triton serving two models
with real traffic, and none of the other tenant's; plus the text handling on pages Triton could serve."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import tracemalloc
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.install import install_model
from tests.support.metrics_pages import MetricsPort
from tests.support.ports import free_port
from tests.support.triton import REPO_ROOT, TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.common.unload import UnloadSettings, unload_model
from tritonshare.proxy.triton_metrics import (
    TritonModelMetrics,
    default_url,
    own_model_lines,
    own_model_series,
    up_gauge,
)


@dataclass(frozen=True)
class Tenants:
    own: str
    other: str


@pytest.fixture(scope="module")
def tenants(triton: TritonServer, layout: NodeLayout) -> Iterator[Tenants]:
    """Two fresh identity models, so their request counts are this module's alone."""
    tag = uuid.uuid4().hex[:8]
    models = Tenants(own=f"metrics-own-{tag}", other=f"metrics-other-{tag}")
    install_model(layout, triton, models.own)
    install_model(layout, triton, models.other)
    yield models
    for name in (models.own, models.other):
        unload_model(UnloadSettings(name=name, layout=layout, triton_url=triton.url, timeout_s=30))


def infer_http(triton: TritonServer, model: str, times: int) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{triton.http_port}")
    try:
        for _ in range(times):
            data = np.arange(4, dtype=np.float32)
            inp = httpclient.InferInput("INPUT0", [4], "FP32")
            inp.set_data_from_numpy(data)
            assert np.array_equal(client.infer(model, [inp]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def infer_grpc(triton: TritonServer, model: str, times: int) -> None:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        for _ in range(times):
            inp = grpcclient.InferInput("INPUT0", [2], "FP32")
            inp.set_data_from_numpy(np.ones(2, dtype=np.float32))
            client.infer(model, [inp])
    finally:
        client.close()


def metrics_url(triton: TritonServer) -> str:
    return f"http://127.0.0.1:{triton.metrics_port}/metrics"


def families(page: bytes) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    """name -> (type, [(sample name, labels, value)]), parsed the way Prometheus would read the page."""
    return {
        f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(page.decode())
    }


def value(page: bytes, sample: str, model: str) -> float:
    for fam in text_string_to_metric_families(page.decode()):
        for s in fam.samples:
            if s.name == sample and s.labels.get("model") == model:
                return float(s.value)
    raise AssertionError(f"no {sample}{{model={model!r}}} in:\n{page.decode()}")


@pytest.mark.triton
def test_own_model_series_with_real_counts_and_nothing_of_the_other_tenant(
    triton: TritonServer, tenants: Tenants
) -> None:
    infer_http(triton, tenants.own, 3)
    infer_grpc(triton, tenants.own, 2)
    infer_http(triton, tenants.other, 7)

    page = TritonModelMetrics(metrics_url(triton), tenants.own, ttl_s=0).exposition()

    assert value(page, "nv_inference_request_success_total", tenants.own) == 5
    assert value(page, "nv_inference_count_total", tenants.own) == 5
    assert value(page, "nv_inference_request_failure_total", tenants.own) == 0
    assert value(page, "nv_inference_queue_duration_us_total", tenants.own) > 0
    assert tenants.other not in page.decode()
    everything = families(page)
    for name, (_kind, samples) in everything.items():
        if name != "tritonshare_proxy_triton_metrics_up":
            assert all(labels.get("model") == tenants.own for _n, labels, _v in samples), name
    assert everything["tritonshare_proxy_triton_metrics_up"][1][0][2] == 1.0


@pytest.mark.triton
def test_series_keep_triton_s_names_and_types(triton: TritonServer, tenants: Tenants) -> None:
    infer_http(triton, tenants.own, 1)
    direct = urlopen_text(metrics_url(triton))

    page = TritonModelMetrics(metrics_url(triton), tenants.own, ttl_s=0).exposition().decode()

    # Triton writes counters without the _total suffix; so does the re-export (dashboards rely on the names).
    assert "# TYPE nv_inference_request_success counter" in direct
    assert "# TYPE nv_inference_request_success counter" in page
    assert "# TYPE nv_inference_queue_duration_us counter" in page

    def own_series(text: str) -> list[str]:
        return sorted(line.split(" ")[0] for line in text.splitlines() if line.startswith("nv_") and own in line)

    own = f'model="{tenants.own}"'
    assert own_series(page) == own_series(direct)


@pytest.mark.triton
def test_server_wide_series_are_dropped(triton: TritonServer, tenants: Tenants) -> None:
    direct = urlopen_text(metrics_url(triton))
    server_wide = {
        line.split("{")[0].split(" ")[0]
        for line in direct.splitlines()
        if line and not line.startswith("#") and 'model="' not in line
    }
    assert server_wide, "Triton always has series without a model label (e.g. pinned memory pool)"

    page = TritonModelMetrics(metrics_url(triton), tenants.own, ttl_s=0).exposition().decode()

    assert not any(line.startswith(name) for name in server_wide for line in page.splitlines())


# Another tenant's Python model writing into Triton's metrics (the custom metrics API of the Python backend):
# it may name any family and give its series any labels, the own model's name included.
FORGER_MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(  # kept: the family leaves Triton's page with its object
            name="tritonshare_proxy_triton_metrics_up", description="forged", kind=pb_utils.MetricFamily.GAUGE
        )
        self.forged = self.family.Metric(labels={"model": "VICTIM"})
        self.forged.set(1)

    def execute(self, requests):
        return []
"""


@pytest.mark.triton
def test_a_tenant_s_custom_metric_cannot_pose_as_one_of_the_proxy_s_own(
    triton: TritonServer, layout: NodeLayout, tenants: Tenants
) -> None:
    forger = f"forger-{uuid.uuid4().hex[:8]}"
    install_model(layout, triton, forger, model_py=FORGER_MODEL.replace("VICTIM", tenants.own))
    try:
        direct = urlopen_text(metrics_url(triton))
        page = TritonModelMetrics(metrics_url(triton), tenants.own, ttl_s=0, timeout_s=5).exposition().decode()
    finally:
        unload_model(UnloadSettings(name=forger, layout=layout, triton_url=triton.url, timeout_s=30))

    assert f'tritonshare_proxy_triton_metrics_up{{model="{tenants.own}"}} 1' in direct  # Triton took it
    assert page.count("# TYPE tritonshare_proxy_triton_metrics_up") == 1
    assert [line for line in page.splitlines() if line.startswith("tritonshare_")] == [
        f'tritonshare_proxy_triton_metrics_up{{model="{tenants.own}"}} 1.0'
    ]
    assert "forged" not in page


@pytest.mark.triton
def test_cache_answers_scrapes_within_ttl_then_reads_again(triton: TritonServer, tenants: Tenants) -> None:
    now = [100.0]
    metrics = TritonModelMetrics(metrics_url(triton), tenants.own, ttl_s=5.0, clock=lambda: now[0])
    before = value(metrics.exposition(), "nv_inference_request_success_total", tenants.own)

    infer_http(triton, tenants.own, 2)
    now[0] += 4.9
    assert value(metrics.exposition(), "nv_inference_request_success_total", tenants.own) == before
    now[0] += 0.2
    assert value(metrics.exposition(), "nv_inference_request_success_total", tenants.own) == before + 2


def test_unreachable_triton_gives_up_zero_and_no_series(caplog: pytest.LogCaptureFixture) -> None:
    metrics = TritonModelMetrics(f"http://127.0.0.1:{free_port()}/metrics", "m", ttl_s=0, timeout_s=0.5)

    page = metrics.exposition().decode()
    page_again = metrics.exposition().decode()

    assert page == page_again
    assert page.splitlines()[-1] == 'tritonshare_proxy_triton_metrics_up{model="m"} 0.0'
    assert "nv_" not in page
    warnings = [r for r in caplog.records if "check --triton-metrics-url" in r.getMessage()]
    assert len(warnings) == 1  # said once, not at every scrape


def test_a_slow_metrics_port_is_given_up_at_the_deadline_and_its_answer_kept() -> None:
    slow = MetricsPort.dripping()  # a byte every 0.5 s: each read is in time, the page never is
    try:
        metrics = TritonModelMetrics(slow.url, "m", timeout_s=1.0, ttl_s=0.5)
        started = time.monotonic()
        page = metrics.exposition().decode()
        took = time.monotonic() - started
        again = metrics.exposition().decode()  # within ttl_s of the answer, though not of the question

        assert took < 3.0, f"the scrape took {took:.1f}s"
        assert page.splitlines()[-1] == 'tritonshare_proxy_triton_metrics_up{model="m"} 0.0'
        assert (again, slow.accepted) == (page, 1)
    finally:
        slow.close()


def test_a_page_cut_short_of_its_content_length_counts_as_down() -> None:
    """A Triton that dies (or a connection reset) mid-page: what came looks like a page, its last value cut
    (12345 read as 12); it is not re-exported as if whole (nor, in the loader, read as the GPUs' memory)."""
    page = b'# TYPE nv_inference_count counter\nnv_inference_count{model="m",version="1"} 12345\n'
    port = MetricsPort(page, cut_after=len(page) - 5)
    try:
        answer = TritonModelMetrics(port.url, "m", timeout_s=5, ttl_s=0).exposition().decode()
    finally:
        port.close()

    assert "nv_inference_count" not in answer
    assert answer.splitlines()[-1] == 'tritonshare_proxy_triton_metrics_up{model="m"} 0.0'


def crowded_page(tenants: int) -> str:
    """A page of ``tenants`` other models, and model ``m`` in a few families, with every trap of the text format:
    a name that is a prefix of others (m1, m10…), another model's series whose other label is ``"m"``, a HELP
    text quoting "m" for a family with none of its series, escapes in label values and help."""
    families = [f"nv_inference_family_{i}" for i in range(20)]
    out = []
    for i, family in enumerate(families):
        ours = i % 5 == 0
        said = "" if ours else '; a tenant wrote "m" and model=\\"m\\" here'
        out.append(f"# HELP {family} about {family}{said}\n")
        out.append(f"# TYPE {family} counter\n")
        out.append("# a comment of no family\n")
        out.extend(f'{family}{{model="m{t}",version="1"}} {t}\n' for t in range(tenants))
        out.append(f'{family}{{model="other",note="m"}} 1\n')
        if ours:
            out.append(f'{family}{{model="m",version="{i}",note="say \\"hi\\"\\n"}} {i}\n')
    return "".join(out)


def test_a_large_page_is_filtered_as_it_is_read_with_the_same_result() -> None:
    """Other tenants' series are dropped line by line as the page comes: what the proxy holds and parses is
    its own model's part, however large the page (any tenant's Python model can grow it with custom metrics)."""
    page = crowded_page(8000)  # about 8 MiB
    port = MetricsPort(page.encode())
    try:
        metrics = TritonModelMetrics(port.url, "m", timeout_s=20, ttl_s=0)
        tracemalloc.start()
        try:
            answer = metrics.exposition().decode()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        port.close()

    assert len(page) > 8_000_000
    assert answer == own_model_series(page, "m") + up_gauge("m", True)
    assert answer.count('model="m"') == 4 + 1  # and the up gauge's
    assert "m0" not in answer and "other" not in answer and "tenant wrote" not in answer
    assert peak < 4 * 1024 * 1024, f"held {peak / 2**20:.0f} MiB to read an {len(page) / 2**20:.0f} MiB page"


def test_a_family_s_help_line_never_heads_the_next_family_s_samples() -> None:
    """A family with HELP and TYPE but no sample, then one with a TYPE and no HELP: the sifted page must not pair the
    first's HELP with the second's TYPE (each header line goes with the family it names)."""
    page = (
        "# HELP nv_a_total First family, no samples\n# TYPE nv_a_total counter\n"
        '# TYPE nv_b gauge\nnv_b{model="m",version="1"} 3\n'
        '# HELP nv_c Third\n# TYPE nv_c gauge\nnv_c{model="x"} 1\n# HELP nv_d Fourth\nnv_d{model="m"} 4\n'
    )
    kept = b"".join(own_model_lines([line.encode() + b"\n" for line in page.splitlines()], "m")).decode()

    assert kept == '# TYPE nv_b gauge\nnv_b{model="m",version="1"} 3\n# HELP nv_d Fourth\nnv_d{model="m"} 4\n'
    assert own_model_series(kept, "m") == own_model_series(page, "m")


@pytest.mark.triton
def test_not_a_metrics_page_counts_as_down(triton: TritonServer, tenants: Tenants) -> None:
    # Triton's HTTP port answers /metrics with 400/404: a misconfigured URL must not raise from a scrape.
    page = TritonModelMetrics(f"{triton.url}/metrics", tenants.own, ttl_s=0).exposition().decode()

    assert 'tritonshare_proxy_triton_metrics_up{model="' + tenants.own + '"} 0.0' in page


PAGE = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="a",version="1"} 3
nv_inference_request_success{model="ab",version="1"} 4
nv_inference_request_success{model="b",version="1"} 5
# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes
# TYPE nv_gpu_memory_used_bytes gauge
nv_gpu_memory_used_bytes{gpu_uuid="GPU-0"} 1.2e+09
# HELP requests_total A counter declared with its suffix \\\\ and a backslash
# TYPE requests_total counter
requests_total{model="a",note="say \\"hi\\"\\nbye"} 1
# HELP nv_inference_first_response_histogram_ms Duration from request to first response
# TYPE nv_inference_first_response_histogram_ms histogram
nv_inference_first_response_histogram_ms_bucket{model="a",version="1",le="10"} 2
nv_inference_first_response_histogram_ms_bucket{model="a",version="1",le="+Inf"} 3
nv_inference_first_response_histogram_ms_sum{model="a",version="1"} 42
nv_inference_first_response_histogram_ms_count{model="a",version="1"} 3
nv_inference_first_response_histogram_ms_bucket{model="b",version="1",le="+Inf"} 9
# TYPE misc untyped
misc{model="a"} 7
misc{model="a",k="inf"} +Inf
misc{model="a",k="nan"} NaN
misc{model="a",k="big"} 1.5e+16
"""


def test_page_is_filtered_by_exact_model_label_and_rendered_faithfully() -> None:
    text = own_model_series(PAGE, "a")

    assert text == (
        "# HELP nv_inference_request_success Number of successful inference requests, all batch sizes\n"
        "# TYPE nv_inference_request_success counter\n"
        'nv_inference_request_success{model="a",version="1"} 3.0\n'
        "# HELP requests_total A counter declared with its suffix \\\\ and a backslash\n"
        "# TYPE requests_total counter\n"
        'requests_total{model="a",note="say \\"hi\\"\\nbye"} 1.0\n'
        "# HELP nv_inference_first_response_histogram_ms Duration from request to first response\n"
        "# TYPE nv_inference_first_response_histogram_ms histogram\n"
        'nv_inference_first_response_histogram_ms_bucket{model="a",version="1",le="10"} 2.0\n'
        'nv_inference_first_response_histogram_ms_bucket{model="a",version="1",le="+Inf"} 3.0\n'
        'nv_inference_first_response_histogram_ms_sum{model="a",version="1"} 42.0\n'
        'nv_inference_first_response_histogram_ms_count{model="a",version="1"} 3.0\n'
        "# HELP misc \n"
        "# TYPE misc untyped\n"
        'misc{model="a"} 7.0\n'
        'misc{model="a",k="inf"} +Inf\n'
        'misc{model="a",k="nan"} NaN\n'
        'misc{model="a",k="big"} 1.5e+16\n'
    )
    reparsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert reparsed["requests"].samples[0].labels["note"] == 'say "hi"\nbye'


@pytest.mark.parametrize(
    ("triton_url", "metrics"),
    [
        ("http://tritonshare-triton.tritonshare.svc:8000", "http://tritonshare-triton.tritonshare.svc:8002/metrics"),
        ("127.0.0.1:8000", "http://127.0.0.1:8002/metrics"),
        ("http://[fd00::1]:8000", "http://[fd00::1]:8002/metrics"),
    ],
)
def test_default_metrics_url_is_triton_s_host_on_its_metrics_port(triton_url: str, metrics: str) -> None:
    assert default_url(triton_url) == metrics


def urlopen_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


# --- what prometheus-adapter makes of the re-exported series (k8s/components/monitoring) ------------------

MONITORING = REPO_ROOT / "k8s" / "components" / "monitoring"


def adapter_rule() -> dict[str, Any]:
    config_map = yaml.safe_load((MONITORING / "prometheus-adapter-rules.yaml").read_text())
    rules: list[dict[str, Any]] = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert len(rules) == 1
    return rules[0]


def adapter_query(namespace: str, pods: list[str]) -> str:
    """The metricsQuery as prometheus-adapter fills it in for an HPA asking about ``pods``."""
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    query: str = adapter_rule()["metricsQuery"]
    return query.replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod")


def test_hpa_scales_on_the_metric_the_adapter_rule_defines() -> None:
    hpa = yaml.safe_load((MONITORING / "autoscaling" / "horizontalpodautoscaler.yaml").read_text())
    rule = adapter_rule()

    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == rule["name"]["as"]
    assert re.fullmatch(rule["name"]["matches"], "nv_inference_queue_duration_us")
    assert rule["seriesQuery"].startswith("nv_inference_queue_duration_us{")


def test_adapter_rule_gives_the_average_queue_time_per_request_of_each_model_pod(tmp_path: Path) -> None:
    """promtool evaluates the adapter's query on series shaped like the proxies' re-export: per pod, the
    queue time of the last 30 s divided by the requests of the last 30 s, across a Triton restart."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found — scripts/setup.sh installs it (Debian package prometheus)")

    def series(pod: str, metric: str, values: str, *, version: str = "1", namespace: str = "team-a") -> Any:
        labels = f'namespace="{namespace}",pod="{pod}",model="m",version="{version}"'
        return {"series": f"{metric}{{{labels}}}", "values": values}

    queue, success = "nv_inference_queue_duration_us", "nv_inference_request_success"
    suite = {
        "rule_files": [],
        "evaluation_interval": "10s",
        "tests": [
            {
                "interval": "10s",
                "input_series": [
                    # 10 requests per scrape, 3000 µs of queueing: 300 µs per request.
                    series("m-1", queue, "0 3000 6000 9000 12000"),
                    series("m-1", success, "0 10 20 30 40"),
                    # Two versions served by one pod count together: (3000 + 15000) / (30 + 15) = 400.
                    series("m-2", queue, "0 1000 2000 3000 4000"),
                    series("m-2", success, "0 10 20 30 40"),
                    series("m-2", queue, "0 5000 10000 15000 20000", version="2"),
                    series("m-2", success, "0 5 10 15 20", version="2"),
                    # Triton restarted between 20 s and 30 s: the counters start again from zero (a
                    # difference of first and last sample would be negative here).
                    series("m-3", queue, "0 3000 6000 300 600"),
                    series("m-3", success, "0 10 20 1 2"),
                    # No traffic: 0, not a division by zero.
                    series("idle", queue, "0 0 0 0 0"),
                    series("idle", success, "0 0 0 0 0"),
                    # Same pod name in another namespace: not this HPA's pod.
                    series("m-1", queue, "0 900000 1800000 2700000 3600000", namespace="team-b"),
                    series("m-1", success, "0 1 2 3 4", namespace="team-b"),
                ],
                "promql_expr_test": [
                    {
                        "expr": adapter_query("team-a", ["m-1", "m-2", "m-3", "idle"]),
                        "eval_time": "40s",
                        "exp_samples": [
                            {"labels": '{pod="m-1"}', "value": 300},
                            {"labels": '{pod="m-2"}', "value": 400},
                            {"labels": '{pod="m-3"}', "value": 300},
                            {"labels": '{pod="idle"}', "value": 0},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "adapter-test.yaml").write_text(yaml.safe_dump(suite))

    result = subprocess.run(
        [promtool, "test", "rules", "adapter-test.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stdout + result.stderr
