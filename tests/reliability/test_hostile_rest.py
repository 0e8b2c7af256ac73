"""Hostile REST input, judged where it matters: at "Triton". The proxy runs in front of a recording stand-in
(:class:`~tests.reliability.conftest.RestRecorder`); after every generated request, everything that reached the
stand-in must be in the allow table of REFERENCE §3 for the own model (written out here independently of
``proxy/policy.py``), no forwarded infer body may name a shared-memory parameter as Triton would decode it,
and the proxy must still be alive and answering.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import RESTRICTED_KEY, Hostile, Seen

SHM_KEYS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
OWN = "tenant-own"
OTHER = "tenant-other"
EXAMPLES = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ---------------------------------------------------------------------------------------------- the oracle


def allowed(seen: Seen, own: str) -> bool:
    """Is this request one a tenant may send to Triton (REFERENCE §3)?"""
    if (seen.method, seen.path) in {("GET", "/v2"), ("GET", "/v2/health/live")}:
        return True
    actions = "ready|config|stats|infer|generate|generate_stream"
    match = re.fullmatch(rf"/v2/models/{re.escape(own)}(?:/versions/[0-9]+)?(?:/({actions}))?", seen.path)
    if match is None:
        return False
    posted = match[1] in ("infer", "generate", "generate_stream")
    return seen.method == ("POST" if posted else "GET")


def shm_keys_forwarded(seen: Seen) -> list[str]:
    """Shared-memory keys Triton would find in this request's JSON (decoded as ``http_server.cc`` does)."""
    body = seen.body
    encoding = seen.headers.get("content-encoding", "").lower()
    if encoding in ("gzip", "deflate"):
        try:
            body = zlib.decompressobj(47).decompress(body)
        except zlib.error:
            return []  # Triton cannot read it either
    length = seen.headers.get("inference-header-content-length")
    if length is not None and length.isdigit() and seen.path.endswith("/infer"):
        body = body[: int(length)]
    found: list[str] = []

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found.extend(key for key, _ in pairs if key in SHM_KEYS)
        return dict(pairs)

    try:
        json.loads(body, object_pairs_hook=hook)
    except (ValueError, RecursionError):
        return []  # not JSON: Triton refuses it
    return found


# Headers that must never reach Triton from a tenant: hop-by-hop ones (an Upgrade would switch the connection to a
# protocol the proxy does not judge), and the key of Triton's restricted APIs.
NEVER_FORWARDED = frozenset({"upgrade", "keep-alive", "proxy-connection", "te", "trailer", "proxy-authorization",
                             "expect", RESTRICTED_KEY})  # fmt: skip


def assert_nothing_unlawful_reached_triton(hostile: Hostile, since: int) -> None:
    reached = hostile.rest.seen[since:]
    unlawful = [f"{s.method} {s.path}" for s in reached if not allowed(s, hostile.own)]
    assert not unlawful, f"reached Triton: {unlawful}"
    headers = [
        (s.path, sorted(NEVER_FORWARDED & s.headers.keys())) for s in reached if NEVER_FORWARDED & s.headers.keys()
    ]
    assert not headers, f"headers that must not reach Triton did: {headers}"
    smuggled = [(s.path, keys) for s in reached if (keys := shm_keys_forwarded(s))]
    assert not smuggled, f"shared-memory parameters reached Triton: {smuggled}"
    assert hostile.alive(), hostile.proxy.log_text()[-3000:]


def exchange(port: int, raw: bytes, *, timeout_s: float = 10.0) -> bytes:
    """Send ``raw`` on a fresh connection, half-close, return every byte the proxy answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the proxy may close first (a refused head with a body still coming)
        chunks = []
        try:
            while data := sock.recv(65536):
                chunks.append(data)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    return int(match[1]) if match else 0


def still_serves(hostile: Hostile) -> None:
    since = len(hostile.rest.seen)
    answer = exchange(hostile.proxy.http_port, b"GET /v2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(answer) == 200 and len(hostile.rest.seen) == since + 1  # (probes are answered from a cache)


# ---------------------------------------------------------------------------------------------- strategies

SEGMENTS = [
    "v2", "models", OWN, OTHER, "versions", "1", "007", "-1", "1e3", "infer", "ready", "config", "stats",
    "generate", "generate_stream", "trace", "setting", "repository", "index", "load", "unload",
    "systemsharedmemory", "cudasharedmemory", "region", "status", "register", "unregister", "health", "live",
    "logging", "metrics", "..", ".", "", "%2F", "%2f", "%2e", "%2e%2e", "%2E%2E", quote(OWN, safe=""),
    "tenant%2Down", OWN.upper(), OWN + "%00", OWN + "%2F..%2F" + OTHER, OWN + ";x", "%25", "%", "%zz", "~",
]  # fmt: skip
random_segment = st.text(max_size=8).map(lambda text: quote(text, safe="-._~!$&'()*+,;=:@"))
segment = st.one_of(st.sampled_from(SEGMENTS), random_segment)
# Near the lawful ones: a model spelled in many ways, a version or not, an action or not.
MODEL_SPELLINGS = [OWN, OTHER, quote(OWN, safe=""), "tenant%2down", "%74enant-own", OWN.upper(), OWN + ".", "stats"]
VERSIONS = ["", "/versions/1", "/versions/12", "/versions/%31", "/versions/x", "/versions/", "/versions/-1"]
ACTIONS = ["", "/ready", "/config", "/stats", "/infer", "/generate", "/generate_stream", "/trace/setting", "/infer/"]
near_lawful = st.builds(
    lambda model, version, action: f"/v2/models/{model}{version}{action}",
    st.sampled_from(MODEL_SPELLINGS),
    st.sampled_from(VERSIONS),
    st.sampled_from(ACTIONS),
)
paths = st.one_of(
    near_lawful,
    st.lists(segment, max_size=7).map(lambda parts: "/" + "/".join(parts)),
    st.lists(segment, max_size=4).map(lambda parts: f"/v2/models/{OWN}/" + "/".join(parts)),
    st.lists(segment, max_size=3).map(lambda parts: "/v2/" + "/".join(parts)),
)
queries = st.one_of(st.just(""), st.text(max_size=12).map(lambda q: "?" + quote(q, safe="=&/")))
methods = st.one_of(
    st.sampled_from(["GET", "POST"]),
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "CONNECT", "TRACE", "get"]),
    st.from_regex(r"[A-Z]{1,10}", fullmatch=True),
)
HEADER_NAMES = [
    "Content-Encoding", "Inference-Header-Content-Length", "Expect", "Connection", "Content-Type", "Upgrade",
    "TE", "Trailer", "Keep-Alive", "Proxy-Authorization", "Transfer-Encoding", "X-Forwarded-For", "Triton-Key",
    "TRITON-KEY", "Proxy-Connection",
]  # fmt: skip
HEADER_VALUES = ["gzip", "deflate", "identity", "br", "chunked", "close", "keep-alive", "100-continue", "0", "10",
                 "upgrade", "h2c", "Upgrade, Triton-Key", "trailers"]  # fmt: skip
headers = st.lists(
    st.tuples(
        st.one_of(st.sampled_from(HEADER_NAMES), st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True)),
        st.one_of(st.sampled_from(HEADER_VALUES), st.from_regex(r"[ -~]{0,20}", fullmatch=True).map(str.strip)),
    ),
    max_size=5,
)
bodies = st.one_of(st.just(b""), st.binary(max_size=256), st.just(b'{"inputs":[]}'))


def request_bytes(method: str, target: str, fields: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: proxy"]
    lines += [f"{name}: {value}" for name, value in fields if name.lower() not in ("content-length", "host")]
    if body and not any(name.lower() == "transfer-encoding" for name, _ in fields):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body


# ---------------------------------------------------------------------------------------------- properties


@EXAMPLES
@given(method=methods, path=paths, query=queries, fields=headers, body=bodies)
def test_no_request_outside_the_allow_table_reaches_triton(
    hostile: Hostile, method: str, path: str, query: str, fields: list[tuple[str, str]], body: bytes
) -> None:
    since = len(hostile.rest.seen)
    answer = exchange(hostile.proxy.http_port, request_bytes(method, path + query, fields, body))
    assert_nothing_unlawful_reached_triton(hostile, since)
    status = status_of(answer)
    event(f"answered {status}")
    if status == 200:
        assert len(hostile.rest.seen) > since  # only "Triton" says 200
    framed = not any(name.lower() in ("transfer-encoding", "expect") for name, _ in fields)
    if framed:
        assert status, f"no HTTP answer to a complete request: {answer[:200]!r}"


@EXAMPLES
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(lambda t: t.encode("utf-8"))))
def test_arbitrary_bytes_never_reach_triton_and_the_proxy_keeps_serving(hostile: Hostile, raw: bytes) -> None:
    since = len(hostile.rest.seen)
    exchange(hostile.proxy.http_port, raw + b"\r\n\r\n")
    assert_nothing_unlawful_reached_triton(hostile, since)
    assert len(hostile.rest.seen) == since or raw.startswith((b"GET /v2", b"POST /v2"))


# Infer bodies: a shared-memory parameter hidden anywhere, spelled plainly or with \u escapes, compressed or not.
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=6))
shm_key = st.sampled_from(SHM_KEYS)
spelled = st.one_of(
    shm_key.map(json.dumps),
    shm_key.map(lambda key: '"' + key.replace("_", "\\u005f", 1) + '"'),
    shm_key.map(lambda key: '"' + "".join(f"\\u{ord(c):04x}" for c in key) + '"'),
)
plain_key = st.sampled_from(["inputs", "outputs", "parameters", "name", "data", "shape", "x"]).map(json.dumps)


def json_text(depth: int = 3) -> st.SearchStrategy[str]:
    if depth == 0:
        return json_leaf.map(json.dumps)
    inner = json_text(depth - 1)
    objects = st.lists(st.tuples(st.one_of(plain_key, spelled), inner), max_size=3).map(
        lambda pairs: "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"
    )
    arrays = st.lists(inner, max_size=3).map(lambda items: "[" + ",".join(items) + "]")
    return st.one_of(json_leaf.map(json.dumps), objects, arrays)


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "": lambda data: data,
    "gzip": lambda data: gzip.compress(data, compresslevel=1),
    "deflate": lambda data: zlib.compress(data, 1),
}


@EXAMPLES
@given(
    doc=json_text(),
    action=st.sampled_from(["infer", "generate", "generate_stream"]),
    encoding=st.sampled_from(sorted(ENCODERS)),
    binary_tail=st.one_of(st.none(), st.binary(min_size=0, max_size=64)),
    chunked=st.booleans(),
)
def test_no_shared_memory_parameter_reaches_triton_in_any_infer_body(
    hostile: Hostile, doc: str, action: str, encoding: str, binary_tail: bytes | None, chunked: bool
) -> None:
    plain = doc.encode()
    fields = [("Content-Type", "application/json")]
    if binary_tail is not None:  # the binary tensor extension: the JSON is only the first N bytes
        fields.append(("Inference-Header-Content-Length", str(len(plain))))
        plain += binary_tail
    body = ENCODERS[encoding](plain)
    if encoding:
        fields.append(("Content-Encoding", encoding))
    if chunked:
        fields.append(("Transfer-Encoding", "chunked"))
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:7], body[7:]) if p) + b"0\r\n\r\n"
    since = len(hostile.rest.seen)
    answer = exchange(hostile.proxy.http_port, request_bytes("POST", f"/v2/models/{OWN}/{action}", fields, body))
    assert_nothing_unlawful_reached_triton(hostile, since)
    event(f"answered {status_of(answer)}")
    assert status_of(answer) in (200, 400), answer[:300]
