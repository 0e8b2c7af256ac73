"""gs:// against the GCS emulator, and an HTTP server standing in for a refusing or failing GCS endpoint."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.support.storage import Fault, GcsEmulator, HttpFileServer, RangeDropper, tree_bytes
from tritonshare.common.errors import SourceAccessDenied, SourceNotFound, TransientSourceError
from tritonshare.loader.checksum import file_digest
from tritonshare.loader.download import download_all
from tritonshare.loader.download_options import DownloadOptions
from tritonshare.loader.listing import list_objects
from tritonshare.loader.sources import open_source
from tritonshare.loader.sources.base import RemoteObject
from tritonshare.loader.sources.gcs import GcsSource, GoogleAuth

pytestmark = pytest.mark.storage
FAST = DownloadOptions(concurrency=4, retries=2, backoff_base_s=0.01, stall_timeout_s=0.5)


def model_folder(root: Path, name: str = "model") -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\n')
    (folder / "1" / "weights.bin").write_bytes(os.urandom(1_500_000))
    return folder


def download(uri: str, dest: Path, options: DownloadOptions = FAST) -> None:
    source = open_source(uri)
    try:
        download_all(source, list_objects(source, options), dest, options)
    finally:
        source.close()


@pytest.mark.parametrize("name", ["v1#final", "v1?draft"])
def test_hash_and_question_mark_are_characters_of_the_object_name(gcs_server: GcsEmulator, name: str) -> None:
    gcs_server.put("models", "m/v1/config.pbtxt", b"the other model")
    gcs_server.put("models", f"m/{name}/config.pbtxt", b"this one")
    (obj,) = list_objects(open_source(f"gs://models/m/{name}"), FAST)
    assert obj.key == f"m/{name}/config.pbtxt"


def test_a_prefix_is_a_folder_and_never_matches_a_longer_name(gcs_server: GcsEmulator, tmp_path: Path) -> None:
    uri = gcs_server.serve(model_folder(tmp_path))
    gcs_server.serve(model_folder(tmp_path, "model2"))
    source = open_source(uri)
    objects = source.list()
    source.close()
    assert sorted(o.relpath for o in objects) == ["1/weights.bin", "config.pbtxt"]
    weights = next(o for o in objects if o.relpath == "1/weights.bin")
    assert weights.checksum is not None and weights.checksum.algorithm == "crc32c"
    assert weights.checksum.value == file_digest(tmp_path / "model" / "1" / "weights.bin", "crc32c")


def test_an_exact_name_is_one_file(gcs_server: GcsEmulator) -> None:
    uri = gcs_server.put("models", "archives/model.zip", b"zip bytes")
    source = GcsSource(uri)
    (obj,) = source.list()
    source.close()
    assert (obj.relpath, obj.size, obj.key) == ("model.zip", 9, "archives/model.zip") and obj.version.isdigit()


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("gs://models/mod", r"gs://models/mod: no such object and no objects under gs://models/mod/"),
        ("gs://models/model/x/", r"no objects under gs://models/model/x/ — check the bucket and the prefix"),
        ("gs://no-such-bucket/m", r"gs://no-such-bucket/m/: not found"),
    ],
)
def test_nothing_there_is_not_found(gcs_server: GcsEmulator, tmp_path: Path, uri: str, message: str) -> None:
    gcs_server.serve(model_folder(tmp_path))
    source = GcsSource(uri)
    with pytest.raises(SourceNotFound, match=message):
        source.list()
    source.close()


def test_a_model_downloads_byte_for_byte(gcs_server: GcsEmulator, tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    (tmp_path / "dest").mkdir()
    download(gcs_server.serve(folder), tmp_path / "dest")
    assert tree_bytes(tmp_path / "dest") == tree_bytes(folder)


def test_an_object_whose_bytes_no_longer_match_its_crc32c_fails(gcs_server: GcsEmulator, tmp_path: Path) -> None:
    uri = gcs_server.put("models", "m/w.bin", b"A" * 1000)
    gcs_server.tamper("models", "m/w.bin", b"B" * 1000)
    with pytest.raises(TransientSourceError, match=r"m/w.bin: crc32c checksum mismatch .*gave up after 3 attempts"):
        download(uri, tmp_path)


def test_a_wrong_bucket_on_an_emulator_names_the_emulator(gcs_server: GcsEmulator) -> None:
    source = GcsSource("gs://no-such-bucket/m")
    with pytest.raises(SourceNotFound) as caught:
        source.list()
    source.close()
    assert f"gs://no-such-bucket/m/: not found at {gcs_server.endpoint}" in str(caught.value)
    assert "(and STORAGE_EMULATOR_HOST)" in str(caught.value)


@pytest.fixture
def fake_endpoint(http_server: HttpFileServer, monkeypatch: pytest.MonkeyPatch) -> HttpFileServer:
    """An HTTP server posing as the GCS endpoint, to make it refuse, fail or stall."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", http_server.endpoint)
    return http_server


def test_a_refusal_is_access_denied(fake_endpoint: HttpFileServer) -> None:
    fake_endpoint.fail("/", Fault(status=403))
    source = GcsSource("gs://models/m")
    with pytest.raises(SourceAccessDenied, match=r"gs://models/m/: access denied .*GOOGLE_APPLICATION_CREDENTIALS"):
        source.list()
    source.close()


def test_a_404_for_the_listed_generation_is_transient_and_one_for_the_name_is_not_found(
    fake_endpoint: HttpFileServer,
) -> None:
    # GCS answers 404 for a generation replaced since the listing (S3: 412): a new listing finds the new one
    fake_endpoint.fail("/", Fault(status=404))
    source = GcsSource("gs://models/m")
    pinned = RemoteObject(key="m/w.bin", relpath="w.bin", size=10, version="1700000000000001")
    with pytest.raises(TransientSourceError, match=r"the generation listed is gone .*replaced since it was listed"):
        source.open(pinned, 1.0)
    with pytest.raises(SourceNotFound, match=r"not found .*check the bucket and the name"):
        source.open(dataclasses.replace(pinned, version=""), 1.0)
    source.close()


def test_a_server_answering_503_is_retried_then_transient(fake_endpoint: HttpFileServer) -> None:
    fake_endpoint.fail("/", Fault(status=503))
    source = GcsSource("gs://models/m")
    with pytest.raises(TransientSourceError, match=r"gs://models/m/: the store failed .*gave up after 3 attempts"):
        list_objects(source, FAST)
    source.close()
    assert sum(path.startswith("/storage/v1/b/models/o?") for _, path in fake_endpoint.requests) == 3


def test_a_stalled_download_fails_within_the_stall_timeout(fake_endpoint: HttpFileServer, tmp_path: Path) -> None:
    fake_endpoint.fail("/", Fault(stall_after_bytes=0))
    source = GcsSource("gs://models/m")
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=10, version="1")
    started = time.monotonic()
    with pytest.raises(TransientSourceError, match=r"gs://models/m/w.bin: the store did not answer in time"):
        download_all(source, [obj], tmp_path, DownloadOptions(retries=0, stall_timeout_s=0.5))
    source.close()
    assert time.monotonic() - started < 3


def test_without_credentials_requests_are_anonymous(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # not on GCE: do not wait for a metadata server
    monkeypatch.setenv("CLOUDSDK_CONFIG", "/nonexistent")  # no gcloud user credentials either
    source = GcsSource("gs://public-bucket/model")
    assert source.endpoint == "https://storage.googleapis.com"
    assert GoogleAuth(source.uri).headers() == {}  # no Authorization header: public buckets stay readable
    source.close()


def test_a_big_object_comes_in_ranged_parts_and_is_verified_by_its_crc32c(
    gcs_server: GcsEmulator, tmp_path: Path
) -> None:
    folder = model_folder(tmp_path)
    uri = gcs_server.serve(folder)
    options = DownloadOptions(concurrency=4, retries=1, stall_timeout_s=5, part_bytes=300_000)  # 5 parts
    (tmp_path / "dest").mkdir()
    download(uri, tmp_path / "dest", options)
    assert tree_bytes(tmp_path / "dest") == tree_bytes(folder)


def test_a_big_object_corrupted_in_the_store_fails_its_crc32c_after_parts_and_whole(
    gcs_server: GcsEmulator, tmp_path: Path
) -> None:
    data = os.urandom(1_000_000)
    uri = gcs_server.put("models", "m/w.bin", data)
    gcs_server.tamper("models", "m/w.bin", bytes([data[0] ^ 1]) + data[1:])
    options = DownloadOptions(retries=1, backoff_base_s=0.01, stall_timeout_s=5, part_bytes=300_000)
    with pytest.raises(TransientSourceError, match=r"m/w.bin: crc32c checksum mismatch"):
        download(uri, tmp_path, options)


@pytest.fixture
def range_dropper(gcs_server: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[RangeDropper]:
    """The emulator behind a forwarder that drops the Range header, as STORAGE_EMULATOR_HOST: a store (or a proxy
    in front of it) that ignores Range."""
    dropper = RangeDropper(gcs_server.port).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", dropper.endpoint)
    yield dropper
    dropper.stop()


def media_gets(dropper: RangeDropper) -> list[tuple[str, str]]:
    """(object name, Range dropped) of each download request the forwarder saw."""
    gets = [(line.split()[1], dropped) for line, dropped in dropper.requests]
    return [(unquote(path.split("?")[0].rsplit("/o/", 1)[1]), dropped) for path, dropped in gets if "alt=media" in path]


PARTS = DownloadOptions(concurrency=4, retries=1, backoff_base_s=0.01, stall_timeout_s=5, part_bytes=300_000)


def test_big_objects_from_a_store_that_ignores_range_come_whole(
    gcs_server: GcsEmulator, range_dropper: RangeDropper, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = model_folder(tmp_path)  # 1.5 MB of weights: five parts of 300,000 bytes
    (folder / "1" / "other.bin").write_bytes(os.urandom(700_000))  # three
    uri = gcs_server.serve(folder)
    (tmp_path / "dest").mkdir()
    with caplog.at_level(logging.WARNING):
        download(uri, tmp_path / "dest", PARTS)
    assert tree_bytes(tmp_path / "dest") == tree_bytes(folder)  # (it failed: "the store ignored the Range header")
    warned = [r.getMessage() for r in caplog.records if "ignores the Range header" in r.getMessage()]
    assert warned == [
        "gs://models: the store ignores the Range header (a ranged GET got the whole object) — fetching big objects "
        "whole, one stream each, which is slower than in parallel parts; check the server at STORAGE_EMULATOR_HOST, "
        "which drops Range or ignores it"
    ]
    big = ("model/1/other.bin", "model/1/weights.bin")
    gets = media_gets(range_dropper)
    assert sorted(name for name, dropped in gets if name in big and not dropped) == sorted(big)  # one GET each
    assert 1 <= sum(1 for name, dropped in gets if name in big and dropped) <= PARTS.concurrency


def test_a_big_object_a_store_sends_whole_is_still_verified_against_its_crc32c(
    gcs_server: GcsEmulator, range_dropper: RangeDropper, tmp_path: Path
) -> None:
    data = os.urandom(1_000_000)
    uri = gcs_server.put("models", "m/w.bin", data)
    gcs_server.tamper("models", "m/w.bin", bytes([data[0] ^ 1]) + data[1:])  # the listed CRC32C is the original's
    with pytest.raises(TransientSourceError, match=r"m/w.bin: crc32c checksum mismatch .*gave up after 2 attempts"):
        download(uri, tmp_path, PARTS)
    assert [dropped for _, dropped in media_gets(range_dropper)][-2:] == ["", ""]  # whole, twice


def _no_ambient_google_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # not on GCE: do not wait for a metadata server
    monkeypatch.setenv("CLOUDSDK_CONFIG", "/nonexistent")  # no gcloud user credentials either


@pytest.mark.parametrize("content", [None, "{not json", '{"type": "service_account"}'])
def test_an_unusable_credentials_file_is_access_denied_naming_it_not_anonymous(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str | None
) -> None:
    _no_ambient_google_credentials(monkeypatch)
    key_file = tmp_path / "key.json"  # missing, malformed, or a key without its fields
    if content is not None:
        key_file.write_text(content)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    with pytest.raises(
        SourceAccessDenied,
        match=rf"gs://private/m: GOOGLE_APPLICATION_CREDENTIALS={key_file} cannot be used .*mount the service account",
    ):
        GoogleAuth("gs://private/m").headers()


def test_falling_back_to_anonymous_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _no_ambient_google_credentials(monkeypatch)
    auth = GoogleAuth("gs://public-bucket/model")
    with caplog.at_level(logging.INFO, logger="tritonshare.loader.sources.gcs"):
        assert auth.headers() == {} and auth.headers() == {}
    said = [r.getMessage() for r in caplog.records if "anonymous" in r.getMessage()]
    assert said == ["gs://public-bucket/model: no Google credentials found: anonymous requests"]
