"""``tritonshare advertise`` against a local HTTP server that speaks the two Kubernetes API calls it makes
(GET and JSON-patch of ``/api/v1/nodes/{node}/status``) and records every request it gets."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.support.ports import free_port
from tritonshare.common.errors import ExitCode, UsageError
from tritonshare.node.advertise import (
    Advertiser,
    AdvertiseSettings,
    check_resource,
    json_pointer,
    parse_quantity,
    run,
)
from tritonshare.node.commands import advertise
from tritonshare.node.kube import KubeApiError, KubeConfig, KubeForbidden, KubeNotFound, KubeUnavailable

NODE = "gpu-node-1"
TOKEN = "sa-token-0123"
RESOURCE = "tritonshare.io/gpu-memory"


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeApiServer:
    """Holds one node; applies JSON-patch ``add`` ops to its status; answers a forced status if set."""

    token: str = TOKEN
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    fail: dict[str, tuple[int, str]] = field(default_factory=dict)  # method -> (status, Status message)
    tls: ssl.SSLContext | None = None
    port: int = 0
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def patches(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "PATCH"]

    def start(self) -> FakeApiServer:
        server = ThreadingHTTPServer(("127.0.0.1", self.port or free_port()), _handler(self))
        if self.tls is not None:
            server.socket = self.tls.wrap_socket(server.socket, server_side=True)
        self._server = server
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def answer(self, method: str, path: str, auth: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if auth != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized")
        if method in self.fail:
            code, message = self.fail[method]
            return code, _status(code, message)
        parts = path.split("/")  # '', api, v1, nodes, NAME, status
        if parts[:4] != ["", "api", "v1", "nodes"] or len(parts) != 6 or parts[5] != "status":
            return 404, _status(404, "the server could not find the requested resource")
        node = self.nodes.get(parts[4])
        if node is None:
            return 404, _status(404, f'nodes "{parts[4]}" not found')
        if method == "PATCH":
            _apply(node, json.loads(body))
        return 200, node


def _status(code: int, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}


def _apply(doc: dict[str, Any], ops: list[dict[str, str]]) -> None:
    for op in ops:
        assert op["op"] == "add"
        *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        target = doc
        for token in parents:
            target = target[token]
        target[last] = op["value"]


def _handler(api: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            api.seen.append(Seen(self.command, self.path, dict(self.headers.items()), body))
            code, doc = api.answer(self.command, self.path, self.headers.get("Authorization", ""), body)
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def node(capacity: dict[str, str] | None = None, allocatable: dict[str, str] | None = None) -> dict[str, Any]:
    base = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": NODE},
        "status": {"capacity": {**base, **(capacity or {})}, "allocatable": {**base, **(allocatable or {})}},
    }


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer(nodes={NODE: node()}).start()
    yield server
    server.stop()


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # the kubelet's file may end with a newline; it is not part of the token
    return path


def settings_for(api: FakeApiServer, token: Path, **kw: Any) -> AdvertiseSettings:
    kube = KubeConfig(api_url=api.url, token_path=token, ca_path=kw.pop("ca_path", None), timeout_s=5)
    return AdvertiseSettings(node_name=kw.pop("node_name", NODE), kube=kube, **kw)


class FakeGpu:
    """A GpuMemoryReader standing in for NVML (no GPU on this machine); counts its readings."""

    def __init__(self, mib: int) -> None:
        self.mib = mib
        self.reads = 0

    def total_mib(self) -> int:
        self.reads += 1
        return self.mib


def test_patches_node_status_with_the_exact_kubernetes_request(api: FakeApiServer, token: Path) -> None:
    gpu = FakeGpu(81920)  # one 80 GiB GPU

    assert run(settings_for(api, token, reserve_mib=1024), reader=gpu) == ExitCode.OK

    assert gpu.reads == 1
    get, patch = api.seen
    assert (get.method, get.path) == ("GET", f"/api/v1/nodes/{NODE}/status")
    assert (patch.method, patch.path) == ("PATCH", f"/api/v1/nodes/{NODE}/status")
    assert patch.headers["Content-Type"] == "application/json-patch+json"
    assert patch.headers["Authorization"] == f"Bearer {TOKEN}"
    assert json.loads(patch.body) == [
        {"op": "add", "path": "/status/capacity/tritonshare.io~1gpu-memory", "value": "80896"},
        {"op": "add", "path": "/status/allocatable/tritonshare.io~1gpu-memory", "value": "80896"},
    ]
    status = api.nodes[NODE]["status"]
    assert status["capacity"][RESOURCE] == status["allocatable"][RESOURCE] == "80896"
    assert status["capacity"]["cpu"] == "8"  # nothing else touched


def test_second_run_reads_and_writes_nothing(api: FakeApiServer, token: Path) -> None:
    settings = settings_for(api, token)
    assert Advertiser(settings, reader=FakeGpu(40960)).once() is True

    assert Advertiser(settings, reader=FakeGpu(40960)).once() is False

    assert [s.method for s in api.seen] == ["GET", "PATCH", "GET"]
    assert api.nodes[NODE]["status"]["capacity"][RESOURCE] == "40960"


def test_value_the_api_server_canonicalised_counts_as_equal(api: FakeApiServer, token: Path) -> None:
    # The API server returns 16000 as "16k": comparing strings would patch on every run.
    api.nodes[NODE] = node({RESOURCE: "16k"}, {RESOURCE: "16k"})

    assert Advertiser(settings_for(api, token), reader=FakeGpu(16000)).once() is False
    assert api.patches() == []


def test_changed_memory_or_missing_allocatable_is_patched(api: FakeApiServer, token: Path) -> None:
    api.nodes[NODE] = node({RESOURCE: "24576"}, {})  # allocatable not yet copied by the kubelet

    assert Advertiser(settings_for(api, token), reader=FakeGpu(24576)).once() is True
    assert api.nodes[NODE]["status"]["allocatable"][RESOURCE] == "24576"

    assert Advertiser(settings_for(api, token), reader=FakeGpu(49152)).once() is True
    assert api.nodes[NODE]["status"]["capacity"][RESOURCE] == "49152"


def test_fixed_memory_for_mig_slices_needs_no_gpu(api: FakeApiServer, token: Path) -> None:
    run(settings_for(api, token, gpu_memory_mib=4864, reserve_mib=256))  # no reader: FixedMemory from settings

    assert api.nodes[NODE]["status"]["capacity"][RESOURCE] == "4608"


def test_custom_resource_name_is_escaped_in_the_pointer(api: FakeApiServer, token: Path) -> None:
    run(settings_for(api, token, resource="example.com/vram"), reader=FakeGpu(1000))

    assert json.loads(api.patches()[0].body)[0]["path"] == "/status/capacity/example.com~1vram"
    assert api.nodes[NODE]["status"]["capacity"]["example.com/vram"] == "1000"


def test_forbidden_names_the_rbac_needed(api: FakeApiServer, token: Path) -> None:
    api.fail["PATCH"] = (
        403,
        'nodes "gpu-node-1" is forbidden: User "system:serviceaccount:triton:default" cannot patch resource '
        '"nodes/status" in API group "" at the cluster scope',
    )

    with pytest.raises(KubeForbidden) as info:
        run(settings_for(api, token), reader=FakeGpu(1024))

    message = str(info.value)
    assert f"node {NODE}" in message
    assert "cannot patch resource" in message  # the API server's own words are kept
    assert "get and patch on nodes/status" in message
    assert "k8s/components/advertise" in message


def test_wrong_token_is_reported_as_a_permission_problem(api: FakeApiServer, tmp_path: Path) -> None:
    bad = tmp_path / "bad-token"
    bad.write_text("expired")

    with pytest.raises(KubeForbidden, match="HTTP 401"):
        run(settings_for(api, bad), reader=FakeGpu(1024))


def test_unknown_node_says_where_the_name_comes_from(api: FakeApiServer, token: Path) -> None:
    with pytest.raises(KubeNotFound, match=r"node gpu-node-9 not found .*spec\.nodeName"):
        run(settings_for(api, token, node_name="gpu-node-9"), reader=FakeGpu(1024))


def test_server_error_is_an_api_error_quoting_the_server(api: FakeApiServer, token: Path) -> None:
    api.fail["PATCH"] = (500, "etcdserver: request timed out")

    with pytest.raises(KubeApiError, match="HTTP 500: etcdserver: request timed out"):
        run(settings_for(api, token, retry_for_s=1), reader=FakeGpu(1024))
    assert len(api.patches()) >= 2  # retried before giving up


@pytest.mark.parametrize(("status", "message"), [(503, "etcdserver: leader changed"), (429, "too many requests")])
def test_a_busy_api_server_is_retried_until_it_answers(
    api: FakeApiServer, token: Path, status: int, message: str
) -> None:
    """As an init container with --best-effort, giving up at once left the node without the resource until
    Triton's pod restarted: every model pod requesting it unschedulable there."""
    api.fail["GET"] = (status, message)
    threading.Timer(1.0, api.fail.clear).start()

    assert run(settings_for(api, token), reader=FakeGpu(4096)) == ExitCode.OK
    assert api.nodes[NODE]["status"]["capacity"][RESOURCE] == "4096"
    assert len([s for s in api.seen if s.method == "GET"]) >= 2


def test_an_api_server_that_comes_up_late_is_waited_for(token: Path) -> None:
    late = FakeApiServer(nodes={NODE: node()}, port=free_port())  # nothing listens there yet
    threading.Timer(1.0, late.start).start()
    try:
        assert run(settings_for(late, token), reader=FakeGpu(4096)) == ExitCode.OK
        assert late.nodes[NODE]["status"]["allocatable"][RESOURCE] == "4096"
    finally:
        late.stop()


def test_permissions_are_not_retried(api: FakeApiServer, token: Path) -> None:
    api.fail["GET"] = (403, "forbidden")

    with pytest.raises(KubeForbidden):
        run(settings_for(api, token), reader=FakeGpu(1024))
    assert len(api.seen) == 1


def test_unreachable_api_names_the_url(token: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    kube = KubeConfig(api_url=url, token_path=token, timeout_s=2)
    settings = AdvertiseSettings(node_name=NODE, kube=kube, retry_for_s=0)

    with pytest.raises(KubeUnavailable, match=rf"Kubernetes API at {url} did not answer GET .*KUBERNETES_SERVICE_HOST"):
        run(settings, reader=FakeGpu(1024))


def test_missing_token_file_says_how_to_mount_it(api: FakeApiServer, tmp_path: Path) -> None:
    with pytest.raises(KubeUnavailable, match="no service-account token at .*automountServiceAccountToken"):
        run(settings_for(api, tmp_path / "absent"), reader=FakeGpu(1024))
    assert api.seen == []


def test_reserve_larger_than_the_gpu_is_a_usage_error(api: FakeApiServer, token: Path) -> None:
    with pytest.raises(UsageError, match="--reserve-mib 2048 leaves nothing of the node's 2048 MiB"):
        run(settings_for(api, token, reserve_mib=2048), reader=FakeGpu(2048))
    assert api.seen == []


@pytest.mark.parametrize("name", ["gpu-memory", "kubernetes.io/gpu-memory", "nvidia.kubernetes.io/x", "a/b/c"])
def test_resource_names_outside_the_extended_form_are_refused(name: str) -> None:
    with pytest.raises(UsageError, match="not an extended resource name"):
        check_resource(name)


def test_json_pointer_escapes_tilde_before_slash() -> None:
    assert json_pointer("status", "capacity", "a~b/c") == "/status/capacity/a~0b~1c"


@pytest.mark.parametrize(
    ("text", "value"),
    [("16384", 16384), ("16k", 16000), ("16Ki", 16384), ("1e3", 1000), ("1E", 10**18), ("1.5Gi", 1610612736)],
)
def test_quantities_are_compared_as_numbers(text: str, value: int) -> None:
    assert parse_quantity(text) == Decimal(value)


def test_not_a_quantity() -> None:
    assert parse_quantity("lots") is None


def test_sidecar_readvertises_after_the_resource_is_lost(api: FakeApiServer, token: Path) -> None:
    stop = threading.Event()
    settings = settings_for(api, token, interval_s=0.05)
    worker = threading.Thread(target=run, args=(settings,), kwargs={"reader": FakeGpu(8192), "stop": stop})
    worker.start()
    try:
        _wait(lambda: len(api.patches()) == 1)
        api.fail["GET"] = (503, "the server is currently unable to handle the request")  # a blip: keep going
        _wait(lambda: len(api.seen) >= 5)
        del api.fail["GET"]
        api.nodes[NODE] = node()  # re-registered node: extended resources gone
        _wait(lambda: len(api.patches()) == 2)
    finally:
        stop.set()
        worker.join(5)
    assert not worker.is_alive()
    assert api.nodes[NODE]["status"]["capacity"][RESOURCE] == "8192"


def test_cli_reads_options_from_the_environment_and_writes_the_termination_log(
    api: FakeApiServer, token: Path, tmp_path: Path
) -> None:
    env = {
        "TRITONSHARE_NODE_NAME": NODE,
        "TRITONSHARE_GPU_MEMORY_MIB": "20096",
        "TRITONSHARE_KUBE_API_URL": api.url,
        "TRITONSHARE_KUBE_TOKEN_PATH": str(token),
        "TRITONSHARE_TERMINATION_LOG": str(tmp_path / "termination-log"),
    }
    result = CliRunner().invoke(advertise, ["--reserve-mib", "96"], env=env)
    assert result.exit_code == 0, result.output
    assert api.nodes[NODE]["status"]["capacity"][RESOURCE] == "20000"

    api.fail["GET"] = (403, "forbidden")
    result = CliRunner().invoke(advertise, [], env=env)
    assert result.exit_code == ExitCode.UNEXPECTED
    assert "nodes/status" in (tmp_path / "termination-log").read_text()


def test_cli_best_effort_reports_the_failure_but_lets_the_pod_start(
    api: FakeApiServer, token: Path, tmp_path: Path
) -> None:
    api.fail["PATCH"] = (403, "forbidden")
    log = tmp_path / "termination-log"
    args = ["--node-name", NODE, "--gpu-memory-mib", "1024", "--kube-api-url", api.url]
    args += ["--kube-token-path", str(token), "--termination-log", str(log), "--best-effort"]

    result = CliRunner().invoke(advertise, args)

    assert result.exit_code == 0
    assert log.read_text().startswith(f"not advertised: node {NODE}: PATCH")
    assert "get and patch on nodes/status" in log.read_text()


class HtmlAnswers(BaseHTTPRequestHandler):
    """What answers when --kube-api-url points at a web proxy or a login page: 200, HTML."""

    def _serve(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"<html><body>Sign in</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PATCH = _serve

    def log_message(self, *args: object) -> None:
        pass


def test_an_answer_that_is_no_kubernetes_object_is_an_api_error_and_best_effort_lets_the_pod_start(
    token: Path, tmp_path: Path
) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), HtmlAnswers)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        settings = AdvertiseSettings(node_name=NODE, kube=KubeConfig(api_url=url, token_path=token, timeout_s=2))
        with pytest.raises(KubeApiError, match=r"the answer is no Kubernetes object \(<html>.*check --kube-api-url"):
            run(settings, reader=FakeGpu(1024))
        log = tmp_path / "termination-log"
        args = ["--node-name", NODE, "--gpu-memory-mib", "1024", "--kube-api-url", url, "--kube-token-path", str(token)]
        result = CliRunner().invoke(advertise, [*args, "--termination-log", str(log), "--best-effort"])
        assert result.exit_code == 0, result.output  # it was exit 1 ('a bug in tritonshare'): Triton never started
        assert "no Kubernetes object" in log.read_text()
    finally:
        server.shutdown()
        server.server_close()


def test_cli_outside_a_pod_asks_for_the_api_url() -> None:
    result = CliRunner().invoke(
        advertise, ["--node-name", NODE, "--gpu-memory-mib", "1"], env={"KUBERNETES_SERVICE_HOST": None}
    )
    assert result.exit_code == ExitCode.USAGE
    assert "pass --kube-api-url" in result.output


# --- TLS: the cluster CA file is what the client trusts ---


@dataclass
class Pki:
    ca: Path
    server: ssl.SSLContext


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-cluster-ca")])

    def build(subject: x509.Name, public: Any, extensions: list[tuple[Any, bool]]) -> x509.Certificate:
        b = x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public)
        b = b.serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        b = b.not_valid_after(now + datetime.timedelta(hours=1))
        for ext, critical in extensions:
            b = b.add_extension(ext, critical=critical)
        return b.sign(ca_key, hashes.SHA256())

    ca = build(ca_name, ca_key.public_key(), [(x509.BasicConstraints(ca=True, path_length=None), True)])
    leaf = build(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        key.public_key(),
        [(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)],
    )
    pem = serialization.Encoding.PEM
    (folder / "ca.crt").write_bytes(ca.public_bytes(pem))
    (folder / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (folder / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    return Pki(ca=folder / "ca.crt", server=context)


@pytest.fixture
def tls_api(pki: Pki) -> Iterator[FakeApiServer]:
    server = FakeApiServer(nodes={NODE: node()}, tls=pki.server).start()
    yield server
    server.stop()


def test_https_with_the_cluster_ca(tls_api: FakeApiServer, token: Path, pki: Pki) -> None:
    run(settings_for(tls_api, token, ca_path=pki.ca), reader=FakeGpu(1024))

    assert tls_api.nodes[NODE]["status"]["capacity"][RESOURCE] == "1024"


def test_https_refuses_a_server_the_ca_did_not_sign(tls_api: FakeApiServer, token: Path) -> None:
    with pytest.raises(KubeUnavailable, match="not signed by the CA in the system trust store .*--kube-ca-path"):
        run(settings_for(tls_api, token), reader=FakeGpu(1024))  # system trust store only; not retried
    assert tls_api.patches() == []


def test_unreadable_ca_file_is_named(tls_api: FakeApiServer, token: Path, tmp_path: Path) -> None:
    with pytest.raises(KubeUnavailable, match="cannot load the cluster CA from .*missing.crt"):
        run(settings_for(tls_api, token, ca_path=tmp_path / "missing.crt"), reader=FakeGpu(1024))


def _wait(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)
