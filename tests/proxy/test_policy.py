"""The allow / own / rewrite / deny table, as data (REFERENCE §3). Pure logic: no servers."""

from __future__ import annotations

import grpc
import pytest

from tritonshare.proxy import policy
from tritonshare.proxy.policy import (
    GRPC_RULES,
    GRPC_SERVICE,
    Verdict,
    grpc_model_allowed,
    judge_grpc_method,
    judge_rest,
)

OWN = "own"


@pytest.mark.parametrize(
    ("method", "target", "upstream"),
    [
        ("GET", "/v2", "/v2"),
        ("GET", "/v2/health/live", "/v2/health/live"),
        ("GET", "/v2/health/ready", "/v2/models/own/ready"),  # rewritten to the own model's readiness
        ("GET", "/v2/models/own", "/v2/models/own"),
        ("GET", "/v2/models/own/versions/1", "/v2/models/own/versions/1"),
        ("GET", "/v2/models/own/ready", "/v2/models/own/ready"),
        ("GET", "/v2/models/own/versions/3/ready", "/v2/models/own/versions/3/ready"),
        ("GET", "/v2/models/own/config", "/v2/models/own/config"),
        ("GET", "/v2/models/own/stats", "/v2/models/own/stats"),
        ("POST", "/v2/models/own/infer", "/v2/models/own/infer"),
        ("POST", "/v2/models/own/versions/1/infer", "/v2/models/own/versions/1/infer"),
        ("POST", "/v2/models/own/generate", "/v2/models/own/generate"),
        ("POST", "/v2/models/own/generate_stream", "/v2/models/own/generate_stream"),
        ("POST", "/v2/models/%6Fwn/infer", "/v2/models/own/infer"),  # one URL-decoding, then exact match
        ("POST", "/v2/models/own/infer?x=1", "/v2/models/own/infer"),  # query is not forwarded
        ("GET", "/v2/models/own/versions/%31/ready", "/v2/models/own/versions/1/ready"),  # version decoded once
    ],
)
def test_allowed_routes_forward_a_canonical_path(method: str, target: str, upstream: str) -> None:
    decision = judge_rest(method, target, OWN)
    assert decision.status == 0, decision
    assert decision.upstream_path == upstream


@pytest.mark.parametrize(
    ("method", "target", "status"),
    [
        # other tenants' models: 404, whatever the spelling, never asking Triton
        ("POST", "/v2/models/other/infer", 404),
        ("GET", "/v2/models/other", 404),
        ("GET", "/v2/models/other/versions/1/ready", 404),
        ("POST", "/v2/models/own%2F..%2Fother/infer", 404),
        ("POST", "/v2/models/own%2f/infer", 404),
        ("POST", "/v2/models/OWN/infer", 404),
        ("POST", "/v2/models/own%00/infer", 404),
        ("POST", "/v2/models/%25%36%46wn/infer", 404),  # decoded once only
        ("POST", "/v2/models/%ff/infer", 404),
        ("POST", "/v2/models/own /infer", 404),
        # admin and shared state: 403
        ("GET", "/v2/models/stats", 403),
        ("POST", "/v2/repository/index", 403),
        ("POST", "/v2/repository/models/own/load", 403),
        ("POST", "/v2/repository/models/other/unload", 403),
        ("GET", "/v2/systemsharedmemory/status", 403),
        ("POST", "/v2/systemsharedmemory/region/r/register", 403),
        ("POST", "/v2/systemsharedmemory/unregister", 403),
        ("GET", "/v2/cudasharedmemory/status", 403),
        ("POST", "/v2/cudasharedmemory/region/r/register", 403),
        ("POST", "/v2/cudasharedmemory/unregister", 403),
        ("GET", "/v2/trace/setting", 403),
        ("POST", "/v2/trace/setting", 403),
        ("GET", "/v2/models/own/trace/setting", 403),
        ("POST", "/v2/models/own/trace/setting", 403),
        ("GET", "/v2/logging", 403),
        ("POST", "/v2/logging", 403),
        ("GET", "/metrics", 403),
        ("GET", "/v2/models/own/unknown_action", 403),
        ("GET", "/", 403),
        # malformed paths: 400, never normalised into something allowed
        ("POST", "/v2/models/own/../other/infer", 400),
        ("POST", "/v2//models/own/infer", 400),
        ("POST", "/v2/models/./own/infer", 400),
        ("POST", "v2/models/own/infer", 400),
        ("GET", "/v2/models/own/versions/x1/ready", 400),
        ("GET", "/v2/models/own/versions/%31%2F2/ready", 400),
        ("GET", "/v2/models/own/versions/%D9%A1/ready", 400),  # a digit, but not ASCII: never sent to Triton
        ("GET", "/v2/models/own/versions/%C2%B2/ready", 400),
        ("GET", "/v2/models/own/..", 400),
        ("GET", "/v2/models/own/.", 400),
        # a denied API is denied whichever model it names, not "not found"
        ("GET", "/v2/models/other/trace/setting", 403),
        # wrong methods on own routes: 405
        ("DELETE", "/v2/models/own", 405),
        ("GET", "/v2/models/own/infer", 405),
        ("POST", "/v2/health/live", 405),
    ],
)
def test_refused_routes(method: str, target: str, status: int) -> None:
    decision = judge_rest(method, target, OWN)
    assert decision.status == status, decision
    assert decision.upstream_path == ""


def test_not_found_message_does_not_depend_on_existence() -> None:
    a = judge_rest("POST", "/v2/models/exists/infer", OWN)
    b = judge_rest("POST", "/v2/models/absent/infer", OWN)
    assert a.message.replace("exists", "X") == b.message.replace("absent", "X")


def test_infer_routes_are_inspected_and_stream_route_streams() -> None:
    assert judge_rest("POST", "/v2/models/own/infer", OWN).rule.inspect  # type: ignore[union-attr]
    stream = judge_rest("POST", "/v2/models/own/generate_stream", OWN).rule
    assert stream is not None and stream.stream


def test_grpc_table_covers_all_twenty_rpcs_and_health() -> None:
    rpcs = {path.rsplit("/", 1)[1] for path in GRPC_RULES if path.startswith(f"/{GRPC_SERVICE}/")}
    assert len(rpcs) == 20
    verdicts = {rule.route: rule.verdict for rule in GRPC_RULES.values()}
    assert verdicts["ServerLive"] is Verdict.LIVE and verdicts["ServerMetadata"] is Verdict.ALLOW
    assert verdicts["ServerReady"] is Verdict.READY and verdicts["HealthCheck"] is Verdict.READY
    assert {r for r, v in verdicts.items() if v is Verdict.OWN} == {
        "ModelReady",
        "ModelMetadata",
        "ModelConfig",
        "ModelStatistics",
        "ModelInfer",
        "ModelStreamInfer",
    }
    assert sum(v is Verdict.DENY for v in verdicts.values()) == 11
    assert GRPC_RULES[f"/{GRPC_SERVICE}/ModelStreamInfer"].every_message


def test_grpc_unknown_methods_have_no_rule() -> None:
    assert judge_grpc_method(f"/{GRPC_SERVICE}/NoSuchRpc") is None
    assert judge_grpc_method("/grpc.health.v1.Health/Watch") is None
    assert judge_grpc_method(f"/{GRPC_SERVICE}/modelinfer") is None


def test_grpc_model_names_match_exactly() -> None:
    rule = GRPC_RULES[f"/{GRPC_SERVICE}/ModelInfer"]
    assert grpc_model_allowed(rule, b"own", b"own")
    for name in (b"", b"other", b"own ", b"OWN", b"own\x00"):
        assert not grpc_model_allowed(rule, name, b"own"), name
    assert grpc_model_allowed(GRPC_RULES[f"/{GRPC_SERVICE}/ServerLive"], b"", b"own")


@pytest.mark.parametrize(
    ("target", "route"),
    [
        ("/v2/repository", "repository"),
        ("/v2/repository/index", "repository"),
        ("/v2/repository/models/own/load", "repository"),
        ("/v2/systemsharedmemory/status", "system_shared_memory"),
        ("/v2/cudasharedmemory/region/r/register", "cuda_shared_memory"),
        ("/v2/models/other/trace/setting", "model_trace"),
    ],
)
def test_denied_apis_are_named_in_metrics_by_their_route(target: str, route: str) -> None:
    decision = judge_rest("POST", target, OWN)
    assert (decision.status, decision.route) == (403, route)


def test_a_wrong_method_is_named_in_the_answer() -> None:
    decision = judge_rest("DELETE", "/v2/models/own", OWN)
    assert decision.status == 405
    assert "DELETE" in decision.message and "/v2/models/own" in decision.message


@pytest.mark.parametrize("action", ["infer", "generate", "generate_stream"])
def test_every_rest_infer_route_is_inspected_for_shared_memory(action: str) -> None:
    rule = judge_rest("POST", f"/v2/models/own/{action}", OWN).rule
    assert rule is not None and rule.inspect


@pytest.mark.parametrize("rpc", ["ModelInfer", "ModelStreamInfer"])
def test_every_grpc_infer_rpc_is_inspected_for_shared_memory(rpc: str) -> None:
    rule = judge_grpc_method(f"/inference.GRPCInferenceService/{rpc}")
    assert rule is not None and rule.inspect


def test_grpc_paths_are_the_ones_triton_clients_send() -> None:
    # Spelled out, not built from GRPC_SERVICE: a typo in the constant would refuse every client.
    assert judge_grpc_method("/inference.GRPCInferenceService/ModelInfer") is not None
    assert judge_grpc_method("/grpc.health.v1.Health/Check") is not None


@pytest.mark.parametrize(
    "name",
    [
        "OK",
        "NOT_FOUND",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "INVALID_ARGUMENT",
        "UNIMPLEMENTED",
        "UNAVAILABLE",
        "INTERNAL",
        "UNAUTHENTICATED",
    ],
)
def test_grpc_status_codes_are_the_standard_ones(name: str) -> None:
    assert getattr(policy, f"GRPC_{name}") == getattr(grpc.StatusCode, name).value[0]


def test_long_names_in_messages_are_clipped_to_the_limit() -> None:
    whole = judge_rest("GET", "/v2/models/" + "m" * 120, OWN).message
    assert "m" * 120 in whole and "…" not in whole
    clipped = judge_rest("GET", "/v2/models/" + "m" * 121, OWN).message
    assert "m" * 119 + "…'" in clipped and "m" * 120 not in clipped
