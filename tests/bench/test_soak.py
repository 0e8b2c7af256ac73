"""bench/faults/soak.py: the proxy's own count of its answers, read from its metrics page."""

from __future__ import annotations

from bench.faults.soak import codes_of

PAGE = """\
# HELP tritonshare_proxy_requests_total Requests answered, by protocol, route and status code.
# TYPE tritonshare_proxy_requests_total counter
tritonshare_proxy_requests_total{code="200",model="identity",protocol="rest",route="infer"} 500000.0
tritonshare_proxy_requests_total{code="200",model="identity",protocol="rest",route="live"} 3.0
tritonshare_proxy_requests_total{code="503",model="identity",protocol="rest",route="infer"} 7.0
tritonshare_proxy_requests_total{code="ok",model="identity",protocol="grpc",route="ModelInfer"} 499990.0
tritonshare_proxy_requests_total{code="ok",model="identity",protocol="grpc",route="ModelReady"} 2.0
tritonshare_proxy_requests_total{code="closed",model="identity",protocol="grpc",route="ModelInfer"} 32.0
# HELP tritonshare_proxy_refusals_total Requests refused by the proxy itself (policy, limits, drain).
# TYPE tritonshare_proxy_refusals_total counter
tritonshare_proxy_refusals_total{model="identity",protocol="rest",reason="draining",route="infer"} 7.0
"""


def test_each_code_is_the_sum_over_every_route_it_was_answered_on() -> None:
    assert codes_of(PAGE) == {"rest 200": 500003, "rest 503": 7, "grpc ok": 499992, "grpc closed": 32}
