"""``run(settings)`` against stores that misbehave in ways no single request shows, with the real Triton: a store
(or a proxy in front of it) that ignores Range, whose big objects must come whole, verified; and a store that
lists slowly — each page just in time, or without end — which ``--download-timeout-s`` must bound, leaving
nothing in staging or the repository."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.loader.test_run import expect_failure, settings
from tests.loader.test_sources_http import Nginx
from tests.support.models import write_model
from tests.support.storage import GcsEmulator, RangeDropper, SlowS3Lister, make_zip, tree_bytes
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode, TransientSourceError
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import RECORD_FILE
from tritonshare.common.triton import TritonClient
from tritonshare.loader.run import run

pytestmark = [pytest.mark.triton, pytest.mark.storage]

WEIGHTS_BYTES = 18 << 20  # over two of the engine's 8 MiB parts: fetched in parts when the store serves ranges


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = write_model(tmp_path / "model")
    (folder / "1" / "weights.bin").write_bytes(os.urandom(WEIGHTS_BYTES))
    return folder


def gcs_ignoring_range(model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The model in the GCS emulator, reached through a forwarder that drops Range."""
    emulator: GcsEmulator = request.getfixturevalue("gcs_server")
    uri = emulator.serve(model)
    dropper = RangeDropper(emulator.port).start()
    request.getfixturevalue("monkeypatch").setenv("STORAGE_EMULATOR_HOST", dropper.endpoint)
    yield uri
    dropper.stop()


def http_ignoring_range(model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The model as a zip (downloaded, then unpacked: not streamed) from nginx, which states its SHA-256, reached
    through a forwarder that drops Range."""
    (tmp_path / "www").mkdir()
    archive = make_zip(model, tmp_path / "www" / "model.zip", arcname="model")
    digest = base64.b64encode(hashlib.sha256(archive.read_bytes()).digest()).decode()
    nginx = Nginx(tmp_path / "www", headers={"Repr-Digest": f"sha-256=:{digest}:"}).start()
    dropper = RangeDropper(nginx.port).start()
    yield f"{dropper.endpoint}/model.zip"
    dropper.stop()
    nginx.stop()


STORES: dict[str, Callable[[Path, Path, pytest.FixtureRequest], Iterator[str]]] = {
    "gcs": gcs_ignoring_range,
    "http": http_ignoring_range,
}


@pytest.fixture(params=sorted(STORES))
def ignoring_range(model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    yield from STORES[request.param](model, tmp_path, request)


def test_a_model_from_a_store_that_ignores_range_is_installed_whole(
    layout: NodeLayout,
    triton: TritonServer,
    model: Path,
    ignoring_range: str,
    model_name: str,
    cleanup: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a part's 200 was a transient error, retried until the loader gave up (exit 11)
    cleanup.append(model_name)
    with caplog.at_level(logging.WARNING, logger="tritonshare"):
        assert run(settings(layout, triton, ignoring_range, model_name, retries=1)) == ExitCode.OK
    assert tree_bytes(layout.model_dir(model_name))["1/weights.bin"] == (model / "1" / "weights.bin").read_bytes()
    assert RECORD_FILE in os.listdir(layout.model_dir(model_name))
    assert TritonClient(triton.url).model_ready(model_name)
    warned = [r.getMessage() for r in caplog.records if "ignores the Range header" in r.getMessage()]
    assert len(warned) == 1 and "fetching big objects whole, one stream each" in warned[0]
    assert not [r for r in caplog.records if "retry" in r.getMessage()]  # no attempt was lost to it


@pytest.mark.parametrize(
    "slowness",
    [{"page_delay_s": 0.3}, {"page_delay_s": 0.0, "pages": 1, "trickle": True}],
    ids=["slow pages without end", "one page trickling in"],
)
def test_a_listing_that_does_not_end_stops_at_the_download_deadline(
    layout: NodeLayout,
    triton: TritonServer,
    slow_s3: Callable[..., SlowS3Lister],
    model_name: str,
    slowness: dict[str, object],
) -> None:
    # each read came in well within its own timeout: the listing went on for as long as the store did (for ever)
    store = slow_s3(**slowness)
    conf = settings(layout, triton, "s3://models/m", model_name, download_timeout_s=2.0)
    started = time.monotonic()
    error = expect_failure(
        TransientSourceError,
        ExitCode.SOURCE_TRANSIENT,
        r"s3://models/m: listing did not finish within 2 s \(--download-timeout-s covers the listing and the "
        r"transfer\)",
        layout,
        conf,
    )
    assert 2.0 <= time.monotonic() - started < 4.0, error
    assert store.pages_asked >= 1


def test_the_transfer_has_what_the_listing_left_of_the_deadline(
    layout: NodeLayout, triton: TritonServer, slow_s3: Callable[..., SlowS3Lister], model_name: str
) -> None:
    store = slow_s3(pages=4, page_delay_s=0.5)  # a listing of 2 s, then objects that trickle in
    conf = settings(layout, triton, "s3://models/m", model_name, download_timeout_s=3.0)
    started = time.monotonic()
    expect_failure(
        TransientSourceError,
        ExitCode.SOURCE_TRANSIENT,
        r"download did not finish within 3 s \(the listing took 2\.\d s of it\)",
        layout,
        conf,
    )
    assert time.monotonic() - started < 4.5  # not 2 s of listing + 3 s of transfer
    assert store.pages_asked == 4
