"""What a tenant may reach through its proxy: the allow / own / rewrite / deny table (REFERENCE §3) as data.

Both front ends consult this one module, so one reading of this file tells a reviewer what a tenant
can reach. Default deny: an endpoint or RPC that is not in a table is refused.

Verdicts:

- ``ALLOW``  forward as is (server metadata).
- ``OWN``    forward only when the model named in the path (REST) or in field 1 of the request message
             (gRPC) is exactly the pod's own model; any other name is "not found", without asking Triton,
             so a tenant cannot learn whether another model exists.
- ``READY``  answer "is MY model ready" instead of Triton's server-wide readiness (strict readiness is
             false while any tenant's model is broken), from the proxy's kept answer
             (:mod:`tritonshare.proxy.readiness`): never one question to Triton per request.
- ``LIVE``   answer Triton's liveness, from the proxy's kept answer likewise.
- ``DENY``   refuse: repository (load can upload code), shared memory (register maps other memory,
             unregister-all drops everyone's regions), trace, logging, all-model statistics.

``inspect`` marks requests whose body is checked: an infer request must not carry shared-memory
parameters (they would let a tenant read or write regions registered by others).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    ALLOW = "allow"
    OWN = "own"
    READY = "ready"
    LIVE = "live"
    DENY = "deny"


# Parameter names that turn an input or output into a shared-memory reference (Triton's shm extension).
SHM_PARAMETERS = frozenset({"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"})
# Every one of them contains this; a body without it (and, for JSON, without any \u escape) cannot name one.
SHM_MARKER = b"shared_memory_"

# Triton 2.51 ranks a requested output's elements for its "classification" parameter after dividing the output's
# byte size by its datatype's size (classification.cc), which is 0 for BYTES: asked of a BYTES output, in any class
# count, through REST or gRPC, it killed the server here (SIGFPE), every tenant's model with it. An infer request
# does not say its outputs' datatypes, so the parameter is refused on any output.
CLASSIFICATION = "classification"
CLASSIFICATION_REFUSAL = (
    f"the output parameter {CLASSIFICATION!r} is not available through this proxy: Triton 2.51 divides by zero to "
    "classify a BYTES output, and dies (SIGFPE) with every tenant's model — rank the output in the client"
)


# ---------------------------------------------------------------------------------------------- REST


@dataclass(frozen=True)
class RestRule:
    route: str  # label for metrics and logs
    verdict: Verdict
    methods: frozenset[str]
    inspect: bool = False  # the body is an infer request to check for shared-memory parameters
    stream: bool = False  # the response is a stream (server-sent events): pass each chunk as it arrives


_GET = frozenset({"GET"})
_POST = frozenset({"POST"})
_ANY = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})

# Whole paths that are not about one model. Checked first: "/v2/models/stats" is all models, not a model
# named "stats".
REST_SERVER_ROUTES: dict[str, RestRule] = {
    "/v2": RestRule("server_metadata", Verdict.ALLOW, _GET),
    "/v2/health/live": RestRule("health_live", Verdict.LIVE, _GET),
    "/v2/health/ready": RestRule("health_ready", Verdict.READY, _GET),
    "/v2/models/stats": RestRule("all_models_stats", Verdict.DENY, _ANY),
    "/v2/trace/setting": RestRule("trace", Verdict.DENY, _ANY),
    "/v2/logging": RestRule("logging", Verdict.DENY, _ANY),
}
# Path prefixes denied whole (repository index/load/unload, both shared-memory APIs).
REST_DENIED_PREFIXES: dict[str, str] = {
    "/v2/repository/": "repository",
    "/v2/repository": "repository",
    "/v2/systemsharedmemory": "system_shared_memory",
    "/v2/cudasharedmemory": "cuda_shared_memory",
}
# The action after /v2/models/{m}[/versions/{v}]; "" is model metadata.
REST_MODEL_ROUTES: dict[str, RestRule] = {
    "": RestRule("model_metadata", Verdict.OWN, _GET),
    "ready": RestRule("model_ready", Verdict.OWN, _GET),
    "config": RestRule("model_config", Verdict.OWN, _GET),
    "stats": RestRule("model_stats", Verdict.OWN, _GET),
    "infer": RestRule("infer", Verdict.OWN, _POST, inspect=True),
    "generate": RestRule("generate", Verdict.OWN, _POST, inspect=True),
    "generate_stream": RestRule("generate_stream", Verdict.OWN, _POST, inspect=True, stream=True),
    "trace/setting": RestRule("model_trace", Verdict.DENY, _ANY),
}

_MODEL_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?:/(?P<action>.*))?")


@dataclass(frozen=True)
class RestDecision:
    status: int  # 0 = forward; otherwise the HTTP status to answer with
    route: str
    message: str = ""
    upstream_path: str = ""  # the canonical path to send to Triton (built here, never the raw target)
    rule: RestRule | None = None


def judge_rest(method: str, target: str, own: str) -> RestDecision:
    """Decide a REST request from its method and raw request target."""
    path, _, _query = target.partition("?")  # Triton's v2 routes take no query; it is not forwarded
    if not path.startswith("/") or "//" in path or "/./" in path or "/../" in path or path.endswith(("/.", "/..")):
        return RestDecision(400, "bad_path", f"malformed path {clip_path(path)!r}")
    rule = REST_SERVER_ROUTES.get(path)
    if rule is not None:
        return _decide(rule, method, path, f"/v2/models/{own}/ready" if rule.verdict is Verdict.READY else path)
    for prefix, route in REST_DENIED_PREFIXES.items():
        if path.startswith(prefix):
            return RestDecision(403, route, f"{route.replace('_', ' ')} API is not available to tenants")
    match = _MODEL_PATH.fullmatch(path)
    if match is None:
        return RestDecision(403, "unknown", f"endpoint {clip_path(path)!r} is not available to tenants")
    rule = REST_MODEL_ROUTES.get(match["action"] or "")
    if rule is None:
        return RestDecision(403, "unknown", f"endpoint {clip_path(path)!r} is not available to tenants")
    if rule.verdict is Verdict.DENY:
        return RestDecision(403, rule.route, f"{rule.route.replace('_', ' ')} API is not available to tenants")
    model = _own_segment(match["model"], own)
    if model is None:
        return RestDecision(404, rule.route, _not_found(match["model"]))
    upstream = f"/v2/models/{own}"
    if match["version"] is not None:
        version = urllib.parse.unquote(match["version"])
        if not version.isdigit() or not version.isascii():
            return RestDecision(400, rule.route, f"model version {clip_path(version)!r} is not a number")
        upstream += f"/versions/{version}"
    if match["action"]:
        upstream += f"/{match['action']}"
    return _decide(rule, method, path, upstream)


def _decide(rule: RestRule, method: str, path: str, upstream: str) -> RestDecision:
    if rule.verdict is Verdict.DENY:
        return RestDecision(403, rule.route, f"{rule.route.replace('_', ' ')} API is not available to tenants")
    if method not in rule.methods:
        return RestDecision(405, rule.route, f"method {method} is not allowed on {clip_path(path)}")
    return RestDecision(0, rule.route, upstream_path=upstream, rule=rule)


def _own_segment(raw: str, own: str) -> str | None:
    """The model segment names the own model: exact match after one URL-decoding, no encoded '/'."""
    try:
        decoded = urllib.parse.unquote(raw, errors="strict") if "%" in raw else raw
    except UnicodeDecodeError:
        return None
    if decoded != own or "/" in decoded:
        return None
    return decoded


def _not_found(raw: str) -> str:
    # Same words whether or not the model exists in Triton: the proxy never asks.
    return f"Request for unknown model: '{clip_path(urllib.parse.unquote(raw, errors='replace'))}' is not found"


def clip_path(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------- gRPC

GRPC_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"


@dataclass(frozen=True)
class GrpcRule:
    route: str  # the RPC's name, for metrics
    verdict: Verdict
    inspect: bool = False  # messages are infer requests: check for shared-memory parameters
    every_message: bool = False  # a client stream: judge every message, not only the first


GRPC_RULES: dict[str, GrpcRule] = {
    f"/{GRPC_SERVICE}/ServerLive": GrpcRule("ServerLive", Verdict.LIVE),
    f"/{GRPC_SERVICE}/ServerMetadata": GrpcRule("ServerMetadata", Verdict.ALLOW),
    f"/{GRPC_SERVICE}/ServerReady": GrpcRule("ServerReady", Verdict.READY),
    f"/{HEALTH_SERVICE}/Check": GrpcRule("HealthCheck", Verdict.READY),
    # Own model only; the model name is field 1 of each request message.
    f"/{GRPC_SERVICE}/ModelReady": GrpcRule("ModelReady", Verdict.OWN),
    f"/{GRPC_SERVICE}/ModelMetadata": GrpcRule("ModelMetadata", Verdict.OWN),
    f"/{GRPC_SERVICE}/ModelConfig": GrpcRule("ModelConfig", Verdict.OWN),
    f"/{GRPC_SERVICE}/ModelStatistics": GrpcRule("ModelStatistics", Verdict.OWN),
    f"/{GRPC_SERVICE}/ModelInfer": GrpcRule("ModelInfer", Verdict.OWN, inspect=True),
    f"/{GRPC_SERVICE}/ModelStreamInfer": GrpcRule("ModelStreamInfer", Verdict.OWN, inspect=True, every_message=True),
    # Denied: admin and shared state of every tenant.
    **{
        f"/{GRPC_SERVICE}/{rpc}": GrpcRule(rpc, Verdict.DENY)
        for rpc in (
            "RepositoryIndex",
            "RepositoryModelLoad",
            "RepositoryModelUnload",
            "SystemSharedMemoryStatus",
            "SystemSharedMemoryRegister",
            "SystemSharedMemoryUnregister",
            "CudaSharedMemoryStatus",
            "CudaSharedMemoryRegister",
            "CudaSharedMemoryUnregister",
            "TraceSetting",
            "LogSettings",
        )
    },
}

# gRPC status codes the proxy answers with.
GRPC_OK = 0
GRPC_NOT_FOUND = 5
GRPC_PERMISSION_DENIED = 7
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_INVALID_ARGUMENT = 3
GRPC_UNIMPLEMENTED = 12
GRPC_UNAVAILABLE = 14
GRPC_INTERNAL = 13
GRPC_UNAUTHENTICATED = 16


def judge_grpc_method(path: str) -> GrpcRule | None:
    """The rule for a ``:path``; None means an unknown method (answer UNIMPLEMENTED)."""
    return GRPC_RULES.get(path)


def grpc_model_allowed(rule: GrpcRule, model_name: bytes, own: bytes) -> bool:
    """Field 1 of an OWN RPC's request names exactly the own model. An empty name is refused: for
    ModelStatistics it means "all models"."""
    if rule.verdict is not Verdict.OWN:
        return True
    if not model_name:
        return False
    return model_name == own


def grpc_not_found(model_name: bytes) -> str:
    shown = model_name.decode("utf-8", errors="replace")
    return f"Request for unknown model: '{clip_path(shown)}' is not found"
