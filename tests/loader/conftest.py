"""Real storage servers for the loader's tests, each with the client environment set for the test.

Every fixture returns a server handle from :mod:`tests.support.storage` whose ``serve(folder)`` puts a
local folder (or, for ``http_server``, a file) in the store and returns the URI to load it from, and whose
``env()`` is the environment a ``tritonshare`` subprocess needs (already set in ``os.environ`` here).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest

from tests.support.storage import GcsEmulator, HttpFileServer, MotoS3, RcloneS3, SlowS3Lister
from tests.support.triton import TritonServer
from tritonshare.common.layout import NodeLayout
from tritonshare.common.triton import TritonClient
from tritonshare.loader.install import withdraw

with warnings.catch_warnings():
    # google-api-core asks for grpcio-status, which only gRPC transports need; under filterwarnings=error
    # its ImportWarning would fail whichever test imports google.cloud.storage first.
    warnings.simplefilter("ignore", ImportWarning)
    import google.api_core.exceptions  # noqa: F401

# Client settings from the machine must not leak into tests (a ~/.aws profile, real GCP credentials).
_FOREIGN_ENV = (
    "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_REGION",
    "AWS_ENDPOINT_URL_S3", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST",
    "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
)  # fmt: skip


def _isolate(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in _FOREIGN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no 1 s probe of a metadata endpoint
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def moto_session() -> Iterator[MotoS3]:
    server = MotoS3().start()
    yield server
    server.stop()


@pytest.fixture
def s3_server(moto_session: MotoS3, monkeypatch: pytest.MonkeyPatch) -> MotoS3:
    """moto S3, emptied for this test; AWS_ENDPOINT_URL and testing/testing credentials in the env."""
    moto_session.reset()
    _isolate(monkeypatch, moto_session.env())
    return moto_session


@pytest.fixture
def rclone_s3_server(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[RcloneS3]:
    """An S3 server that checks signatures (rclone), with its right credentials in the env; a test sets
    other AWS_* values to be refused."""
    server = RcloneS3(tmp_path_factory.mktemp("rclone-s3")).start()
    _isolate(monkeypatch, server.env())
    yield server
    server.stop()


@pytest.fixture
def gcs_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[GcsEmulator]:
    """The GCS emulator, empty; STORAGE_EMULATOR_HOST in the env."""
    server = GcsEmulator().start()
    _isolate(monkeypatch, server.env())
    yield server
    server.stop()


@pytest.fixture
def slow_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., SlowS3Lister]]:
    """Starts ``SlowS3Lister(**options)`` as the S3 endpoint (AWS_* in the env); stopped after the test."""
    started: list[SlowS3Lister] = []

    def start(**options: object) -> SlowS3Lister:
        server = SlowS3Lister(**options).start()  # type: ignore[arg-type]
        started.append(server)
        _isolate(monkeypatch, server.env())
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpFileServer]:
    """An HTTP file server over an empty folder; ``serve(path)`` returns a URL, ``fail(prefix, Fault(...))``
    makes it misbehave."""
    server = HttpFileServer(tmp_path_factory.mktemp("http-root")).start()
    yield server
    server.stop()


@pytest.fixture
def cleanup(layout: NodeLayout, triton: TritonServer) -> Iterator[list[str]]:
    """Names of models a test loads into the shared Triton: taken out after it (waiting out a load first)."""
    names: list[str] = []
    yield names
    for name in names:
        withdraw(layout, name, TritonClient(triton.url), timeout_s=60)
