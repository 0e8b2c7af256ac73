"""bench/answers.py: one turn of the proxy yardstick judged by the proxy's and Triton's own counts of its answers
(h2load takes a gRPC reply with HTTP 200 for a success whatever its grpc-status)."""

from __future__ import annotations

from bench.answers import answers_line

TRITON = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="identity",version="1"}} {ok}
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{{model="identity",reason="BACKEND",version="1"}} {backend}
nv_inference_request_failure{{model="identity",reason="REJECTED",version="1"}} 0
"""

PROXY = """\
# HELP tritonshare_proxy_requests_total Requests answered, by protocol, route and status code.
# TYPE tritonshare_proxy_requests_total counter
tritonshare_proxy_requests_total{{code="200",model="identity",protocol="rest",route="infer"}} {rest}
tritonshare_proxy_requests_total{{code="200",model="identity",protocol="rest",route="live"}} 10.0
tritonshare_proxy_requests_total{{code="499",model="identity",protocol="rest",route="infer"}} {cut}
tritonshare_proxy_requests_total{{code="ok",model="identity",protocol="grpc",route="ModelInfer"}} {grpc}
tritonshare_proxy_requests_total{{code="unavailable",model="identity",protocol="grpc",route="ModelInfer"}} {refused}
"""


def triton(ok: int, backend: int) -> str:
    return TRITON.format(ok=ok, backend=backend)


def proxy(rest: int, grpc: int, cut: int = 0, refused: int = 0) -> str:
    return PROXY.format(rest=rest, grpc=grpc, cut=cut, refused=refused)


def test_a_turn_of_successes_counts_them_and_the_requests_cut_at_the_end() -> None:
    line = answers_line("ours", 34, (triton(100, 2), triton(3100, 2)), (proxy(0, 0), proxy(1000, 2000, cut=17)))
    assert line == "ours answers ok=3000 cut=17/34 other=0 triton_failed=0"


def test_a_proxy_refusing_is_shown_by_its_codes_even_with_http_200_to_h2load() -> None:
    turn = (proxy(5, 5, refused=1), proxy(1005, 5, refused=2001))  # every gRPC call: 200 + grpc-status 14
    line = answers_line("ours@.venv", 34, (triton(0, 0), triton(1000, 0)), turn)
    assert line == "ours@.venv answers ok=1000 cut=0/34 other=2000 triton_failed=0 (grpc unavailable: 2000)"


def test_triton_failures_are_counted_for_every_contestant() -> None:
    assert answers_line("nginx", 34, (triton(0, 4), triton(900, 104))) == "nginx answers triton_failed=100"
    assert answers_line("direct", 34, (triton(0, 0), triton(900, 0))) == "direct answers triton_failed=0"


def test_an_unreadable_page_is_no_success() -> None:
    assert answers_line("ours", 34, (triton(0, 0), ""), (proxy(0, 0), proxy(1, 1))) == (
        "ours answers unreadable (a metrics page was empty)"
    )
