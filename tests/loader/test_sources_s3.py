"""s3:// against real S3 servers: moto (semantics, corruption), rclone (signatures checked), and an HTTP
server standing in for a failing or stalled S3 endpoint."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.storage import Fault, HttpFileServer, MotoS3, RcloneS3, tree_bytes
from tritonshare.common.errors import SourceAccessDenied, SourceNotFound, TransientSourceError
from tritonshare.loader.download import DownloadOptions, download_all, list_objects
from tritonshare.loader.sources import open_source
from tritonshare.loader.sources.base import Checksum, RemoteObject
from tritonshare.loader.sources.s3 import S3Source

pytestmark = pytest.mark.storage
FAST = DownloadOptions(concurrency=4, retries=2, backoff_base_s=0.01, stall_timeout_s=0.5)


def model_folder(root: Path, name: str = "model", *, weights: int = 300_000) -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\n')
    (folder / "1" / "model.py").write_text("print('hi')\n")
    (folder / "1" / "weights.bin").write_bytes(os.urandom(weights))
    return folder


def listing(uri: str) -> list[RemoteObject]:
    with closing(open_source(uri)) as source:
        return source.list()


def download(uri: str, dest: Path, options: DownloadOptions = FAST) -> None:
    source = open_source(uri)
    try:
        download_all(source, list_objects(source, options), dest, options)
    finally:
        source.close()


def test_a_prefix_is_a_folder_and_never_matches_a_longer_name(s3_server: MotoS3, tmp_path: Path) -> None:
    uri = s3_server.serve(model_folder(tmp_path))
    s3_server.serve(model_folder(tmp_path, "model2"))
    s3_server.put("models", "model/", b"")  # a console's folder marker
    for u in (uri, uri + "/"):
        objects = listing(u)
        assert sorted(o.relpath for o in objects) == ["1/model.py", "1/weights.bin", "config.pbtxt"]


def test_an_exact_key_is_one_file_named_by_its_base_name(s3_server: MotoS3) -> None:
    uri = s3_server.put("models", "archives/model.tar.gz", b"tar bytes")
    (obj,) = listing(uri)
    assert (obj.relpath, obj.size, obj.key) == ("model.tar.gz", 9, "archives/model.tar.gz")
    assert obj.checksum is not None and obj.checksum.value == hashlib.md5(b"tar bytes").hexdigest()


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://models/mod", r"s3://models/mod: no such object and no objects under s3://models/mod/"),
        ("s3://models/model/x/", r"no objects under s3://models/model/x/ — check the bucket and the prefix"),
        ("s3://no-such-bucket/model", r"s3://no-such-bucket/model/: not found \(NoSuchBucket"),
    ],
)
def test_nothing_there_is_not_found_and_names_the_uri(
    s3_server: MotoS3, tmp_path: Path, uri: str, message: str
) -> None:
    s3_server.serve(model_folder(tmp_path))
    with pytest.raises(SourceNotFound, match=message):
        listing(uri)


def test_a_model_downloads_byte_for_byte(s3_server: MotoS3, tmp_path: Path) -> None:
    folder = model_folder(tmp_path, weights=3_000_000)
    (tmp_path / "dest").mkdir()
    download(s3_server.serve(folder), tmp_path / "dest")
    assert tree_bytes(tmp_path / "dest") == tree_bytes(folder)


def test_an_object_whose_bytes_no_longer_match_its_etag_fails_after_retries(s3_server: MotoS3, tmp_path: Path) -> None:
    uri = s3_server.put("models", "m/w.bin", b"A" * 1000)
    s3_server.tamper("models", "m/w.bin", b"B" * 1000)  # no flexible checksum stored: only the ETag tells
    with pytest.raises(TransientSourceError, match=r"m/w.bin: md5 checksum mismatch .*gave up after 3 attempts"):
        download(uri, tmp_path)


def test_a_stored_flexible_checksum_is_checked_while_streaming(s3_server: MotoS3, tmp_path: Path) -> None:
    uri = s3_server.put("models", "m/w.bin", b"A" * 1000, checksum_algorithm="CRC32")
    s3_server.tamper("models", "m/w.bin", b"B" * 1000)
    with pytest.raises(TransientSourceError, match=r"m/w.bin: crc32 checksum mismatch .*gave up after 3 attempts"):
        download(uri, tmp_path)


def test_the_right_credentials_download_from_a_signature_checking_server(
    rclone_s3_server: RcloneS3, tmp_path: Path
) -> None:
    folder = model_folder(tmp_path)
    uri = rclone_s3_server.place(folder)
    (tmp_path / "dest").mkdir()
    download(uri, tmp_path / "dest")
    assert tree_bytes(tmp_path / "dest") == tree_bytes(folder)


@pytest.mark.parametrize(("key", "secret"), [("tritonshare", "wrong-secret"), ("unknown-key", "secret-key")])
def test_wrong_credentials_are_access_denied(
    rclone_s3_server: RcloneS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, secret: str
) -> None:
    uri = rclone_s3_server.place(model_folder(tmp_path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(SourceAccessDenied, match=r"s3://models/model/: access denied .*check the pod's credentials"):
        listing(uri)


def test_no_credentials_at_all_is_access_denied(
    rclone_s3_server: RcloneS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = rclone_s3_server.place(model_folder(tmp_path))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(SourceAccessDenied, match=r"no usable credentials .*check the pod's credentials"):
        listing(uri)


@pytest.fixture
def fake_endpoint(http_server: HttpFileServer, monkeypatch: pytest.MonkeyPatch) -> HttpFileServer:
    """An HTTP server posing as the S3 endpoint: serves /BUCKET/KEY as files, fails on demand."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", http_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    return http_server


@pytest.fixture
def source(fake_endpoint: HttpFileServer) -> Iterator[S3Source]:
    """``s3://models/m`` on the fake endpoint, closed after the test."""
    with closing(S3Source("s3://models/m")) as opened:
        yield opened


def test_a_server_answering_500_is_retried_then_transient(fake_endpoint: HttpFileServer, source: S3Source) -> None:
    fake_endpoint.fail("/models", Fault(status=500))
    with pytest.raises(TransientSourceError, match=r"s3://models/m/: the store failed .*gave up after 3 attempts"):
        list_objects(source, FAST)
    assert len(fake_endpoint.requests) == 3


def test_a_stalled_read_fails_after_the_stall_timeout_and_is_retried(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    (fake_endpoint.root / "models" / "m").mkdir(parents=True)
    (fake_endpoint.root / "models" / "m" / "w.bin").write_bytes(b"x" * 100_000)
    fault = fake_endpoint.fail("/models/m/w.bin", Fault(stall_after_bytes=10_000, times=1))
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=100_000)
    stats = download_all(source, [obj], tmp_path, FAST)
    assert (tmp_path / "w.bin").read_bytes() == b"x" * 100_000
    assert stats.retries == 1 and fault.used == 1


def test_a_server_that_never_answers_fails_within_the_stall_timeout(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    fake_endpoint.fail("/models", Fault(stall_after_bytes=0))
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=10)
    started = time.monotonic()
    with pytest.raises(TransientSourceError, match=r"s3://models/m/w.bin: the store did not answer in time"):
        download_all(source, [obj], tmp_path, DownloadOptions(retries=0, stall_timeout_s=0.5))
    assert time.monotonic() - started < 3


def test_an_endpoint_nobody_listens_on_is_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with pytest.raises(TransientSourceError, match=r"s3://models/m/: connection failed .*check AWS_ENDPOINT_URL"):
        listing("s3://models/m")


def big_object(endpoint: HttpFileServer, size: int = 1_000_000) -> tuple[bytes, RemoteObject]:
    data = os.urandom(size)
    (endpoint.root / "models" / "m").mkdir(parents=True)
    (endpoint.root / "models" / "m" / "big.bin").write_bytes(data)
    md5 = hashlib.md5(data).hexdigest()
    obj = RemoteObject(
        key="m/big.bin", relpath="big.bin", size=size, checksum=Checksum(algorithm="md5", value=md5), version=f'"{md5}"'
    )
    return data, obj


PARTS = DownloadOptions(concurrency=4, retries=2, backoff_base_s=0.01, stall_timeout_s=0.5, part_bytes=100_000)


def test_a_big_object_is_fetched_in_parallel_ranged_parts(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    data, obj = big_object(fake_endpoint)
    stats = download_all(source, [obj], tmp_path, PARTS)
    assert (tmp_path / "big.bin").read_bytes() == data and stats.bytes == len(data)
    assert sorted(fake_endpoint.ranges) == [(i, min(i + 100_000, len(data))) for i in range(0, len(data), 100_000)]


def test_a_failed_part_is_retried_alone(fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path) -> None:
    data, obj = big_object(fake_endpoint)
    fake_endpoint.fail("/models/m/big.bin", Fault(status=503, times=1))
    stats = download_all(source, [obj], tmp_path, PARTS)
    assert (tmp_path / "big.bin").read_bytes() == data
    assert stats.retries == 1 and len(fake_endpoint.ranges) == 10  # the refused request served nothing


def test_a_corrupted_part_fails_the_checksum_and_the_object_is_fetched_again(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    data, obj = big_object(fake_endpoint)
    fake_endpoint.fail("/models/m/big.bin", Fault(corrupt=True, times=1))
    download_all(source, [obj], tmp_path, PARTS)
    assert (tmp_path / "big.bin").read_bytes() == data
    assert [method for method, _ in fake_endpoint.requests].count("GET") == 11  # 10 parts, then whole
