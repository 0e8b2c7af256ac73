"""s3:// against real S3 servers: moto (semantics, corruption), rclone (signatures checked), and an HTTP
server standing in for a failing or stalled S3 endpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
import zlib
from base64 import b64encode
from collections.abc import Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.loader.test_sources_transport import BODY, RawServer
from tests.support.ports import free_port
from tests.support.storage import Fault, HttpFileServer, MotoS3, RangeDropper, RcloneS3, tree_bytes
from tritonshare.common.errors import (
    ExitCode,
    InvalidModel,
    SourceAccessDenied,
    SourceError,
    SourceNotFound,
    TransientSourceError,
    UsageError,
)
from tritonshare.loader.download import download_all
from tritonshare.loader.download_options import DownloadOptions
from tritonshare.loader.listing import list_objects
from tritonshare.loader.sources import open_source
from tritonshare.loader.sources.base import Checksum, RemoteObject
from tritonshare.loader.sources.s3 import S3Source, endpoint_for

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


@pytest.mark.parametrize("name", ["v1#final", "v1?draft", "v1 %41"])
def test_hash_question_mark_and_percent_are_characters_of_the_key(s3_server: MotoS3, name: str) -> None:
    s3_server.put("models", "m/v1/config.pbtxt", b"the other model")
    s3_server.put("models", f"m/{name}/config.pbtxt", b"this one")
    (obj,) = listing(f"s3://models/m/{name}")
    assert obj.key == f"m/{name}/config.pbtxt"  # urlsplit read 'v1#final' as 'v1': another model, no error


def test_a_key_whose_name_the_filesystem_cannot_hold_is_an_invalid_model(s3_server: MotoS3, tmp_path: Path) -> None:
    s3_server.put("models", "long/config.pbtxt", b"x")
    s3_server.put("models", "long/" + "a" * 300, b"x")  # S3 allows 1024 bytes; a file name, 255
    (tmp_path / "dest").mkdir()
    with pytest.raises(InvalidModel, match=r"the filesystem cannot hold this name \(File name too long\)") as info:
        download("s3://models/long", tmp_path / "dest")
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


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
        ("s3://no-such-bucket/model", r"s3://no-such-bucket/model/: not found at http://127.0.0.1:\d+ \(NoSuchBucket"),
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


def test_a_wrong_bucket_on_a_custom_endpoint_names_the_endpoint(s3_server: MotoS3) -> None:
    with pytest.raises(SourceNotFound) as caught:
        listing("s3://no-such-bucket/model")
    assert f"not found at {s3_server.endpoint} (NoSuchBucket" in str(caught.value)
    assert "check the bucket and the key (and AWS_ENDPOINT_URL)" in str(caught.value)


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


def test_a_failed_download_wakes_a_read_stalled_on_another_object_at_once(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    (fake_endpoint.root / "models" / "m").mkdir(parents=True)
    (fake_endpoint.root / "models" / "m" / "stalled.bin").write_bytes(b"x" * 100_000)
    fake_endpoint.fail("/models/m/stalled.bin", Fault(stall_after_bytes=10_000))  # then hangs
    fake_endpoint.fail("/models/m/gone.bin", Fault(status=404))
    objects = [RemoteObject(key=f"m/{name}", relpath=name, size=100_000) for name in ("stalled.bin", "gone.bin")]
    options = DownloadOptions(concurrency=2, retries=0, stall_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(SourceNotFound, match="m/gone.bin"):
        download_all(source, objects, tmp_path, options)
    assert time.monotonic() - started < 5  # not the 60 s stall timeout of the other object's read


def test_the_download_deadline_holds_while_the_store_trickles_its_answers_headers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = RawServer(trickle_s=0.25).start()  # a header byte every 0.25 s: 10 s for the head, never a stall
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=len(BODY))
    options = DownloadOptions(stall_timeout_s=5, download_timeout_s=1)
    started = time.monotonic()
    try:
        with closing(S3Source("s3://models/m")) as source, pytest.raises(TransientSourceError) as info:
            download_all(source, [obj], tmp_path, options)
    finally:
        store.stop()
    assert time.monotonic() - started < 3  # (it took the 10 s the head took to come)
    assert str(info.value) == (
        "s3://models/m: download did not finish within 1 s (0.0 of 0.0 MiB) — raise --download-timeout-s or check "
        "the network to the store"
    )
    assert info.value.exit_code == ExitCode.SOURCE_TRANSIENT


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


def test_an_object_only_its_etag_vouches_for_is_asked_for_as_one_range_of_all_its_bytes(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    data, obj = big_object(fake_endpoint)  # below FAST's part size: one request
    download_all(source, [obj], tmp_path, FAST)
    assert (tmp_path / "big.bin").read_bytes() == data
    assert fake_endpoint.ranges == [(0, len(data))]


def test_an_object_grown_since_listing_is_not_cut_to_the_listed_size(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    data, obj = big_object(fake_endpoint)  # this server does not honour If-Match
    listed = dataclasses.replace(obj, size=len(data) - 1000, checksum=None, version='"multipart-2"')
    with pytest.raises(TransientSourceError, match=r"m/big.bin: the store holds 'bytes 0-998999/1000000', not the "
                       r"999000 bytes listed — the object changed since it was listed"):  # fmt: skip
        download_all(source, [listed], tmp_path, FAST)


def test_a_whole_object_range_a_store_ignores_is_accepted(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    data, obj = big_object(fake_endpoint)
    fault = fake_endpoint.fail("/models/m/big.bin", Fault(ignore_range=True))
    stats = download_all(source, [obj], tmp_path, FAST)
    assert (tmp_path / "big.bin").read_bytes() == data and stats.retries == 0 and fault.used == 1


@pytest.fixture
def range_dropper(s3_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[RangeDropper]:
    """moto behind a forwarder that drops the Range header, as the S3 endpoint: a store that ignores Range."""
    dropper = RangeDropper(s3_server.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", dropper.endpoint)
    yield dropper
    dropper.stop()


def test_big_objects_from_a_store_that_ignores_range_come_whole(
    s3_server: MotoS3, range_dropper: RangeDropper, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = model_folder(tmp_path, weights=1_000_000)  # ten parts of PARTS' 100,000 bytes
    (folder / "1" / "other.bin").write_bytes(os.urandom(700_000))  # seven
    uri = s3_server.serve(folder)
    (tmp_path / "dest").mkdir()
    with caplog.at_level(logging.WARNING, logger="tritonshare.loader.sources.s3"):
        download(uri, tmp_path / "dest", PARTS)
    assert tree_bytes(tmp_path / "dest") == tree_bytes(folder)  # (it failed: "the store ignored the Range header")
    warned = [r.getMessage() for r in caplog.records if "ignores the Range header" in r.getMessage()]
    assert warned == [
        "s3://models: the store ignores the Range header (a ranged GET got the whole object) — fetching big objects "
        "whole, one stream each, which is slower than in parallel parts; check the server at AWS_ENDPOINT_URL, or a "
        "proxy in front of it that drops Range"
    ]
    big = {"weights.bin": 1_000_000, "other.bin": 700_000}
    asked = [(line.split()[1].rsplit("/", 1)[1], dropped) for line, dropped in range_dropper.requests if "GET" in line]
    wholes = sorted(name for name, dropped in asked if name in big and dropped == f"bytes=0-{big[name] - 1}")
    parts = [name for name, dropped in asked if name in big and dropped != f"bytes=0-{big[name] - 1}"]
    assert wholes == ["other.bin", "weights.bin"]  # one GET each
    assert 1 <= len(parts) <= PARTS.concurrency  # only those asked before the first answer came


def test_a_big_object_a_store_sends_whole_is_still_verified_against_its_etag(
    s3_server: MotoS3, range_dropper: RangeDropper, tmp_path: Path
) -> None:
    uri = s3_server.put("models", "m/big.bin", b"A" * 1_000_000)
    s3_server.tamper("models", "m/big.bin", b"B" * 1_000_000)  # the listed ETag is A's MD5
    (tmp_path / "dest").mkdir()
    with pytest.raises(TransientSourceError, match=r"m/big.bin: md5 checksum mismatch .*gave up after 3 attempts"):
        download(uri, tmp_path / "dest", PARTS)
    assert [asked for _, asked in range_dropper.requests][-3:] == ["bytes=0-999999"] * 3  # whole, three times


@pytest.mark.parametrize("listed", ["flexible-checksum", "no-etag"])
def test_other_objects_are_asked_for_whole(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path, listed: str
) -> None:
    data, obj = big_object(fake_endpoint)
    if listed == "flexible-checksum":  # asked for whole, with x-amz-checksum-mode: a range would not carry it
        obj = dataclasses.replace(obj, checksum=Checksum(algorithm="sha256", value=hashlib.sha256(data).hexdigest()))
    else:  # no ETag pins a range to the listed object
        obj = dataclasses.replace(obj, version="")
    download_all(source, [obj], tmp_path, FAST)
    assert (tmp_path / "big.bin").read_bytes() == data
    assert fake_endpoint.ranges == [] and [method for method, _ in fake_endpoint.requests] == ["GET"]


def test_a_failed_part_is_retried_alone(fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path) -> None:
    data, obj = big_object(fake_endpoint)
    fake_endpoint.fail("/models/m/big.bin", Fault(status=503, times=1, method="GET"))  # not the checksum's HEAD
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


def test_a_part_cut_by_a_stall_resumes_after_the_bytes_it_wrote(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path
) -> None:
    part = 2 << 20  # two of the engine's 1 MiB reads
    data, obj = big_object(fake_endpoint, size=3 * part)
    fake_endpoint.fail("/models/m/big.bin", Fault(stall_after_bytes=part * 3 // 4, times=1))
    options = DownloadOptions(concurrency=3, retries=2, backoff_base_s=0.01, stall_timeout_s=1.5, part_bytes=part)
    stats = download_all(source, [obj], tmp_path, options)
    assert (tmp_path / "big.bin").read_bytes() == data and stats.bytes == len(data) and stats.retries >= 1
    resumed = [start % part for start, _ in fake_endpoint.ranges if start % part]
    assert resumed == [1 << 20]  # the first 1 MiB read had landed: only the rest is asked again


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "CRC32", "SHA1", "SHA256"])
def test_each_stored_flexible_checksum_is_verified(s3_server: MotoS3, tmp_path: Path, algorithm: str) -> None:
    uri = s3_server.put("models", "m/w.bin", b"A" * 1000, checksum_algorithm=algorithm)
    (tmp_path / "good").mkdir()
    download(uri, tmp_path / "good")
    assert (tmp_path / "good" / "w.bin").read_bytes() == b"A" * 1000
    s3_server.tamper("models", "m/w.bin", b"B" * 1000)
    with pytest.raises(TransientSourceError, match=rf"m/w.bin: {algorithm.lower()} checksum mismatch"):
        download(uri, tmp_path)


def test_a_checksum_a_store_keeps_but_does_not_list_is_asked_for_and_verified(
    rclone_s3_server: RcloneS3, tmp_path: Path
) -> None:
    """rclone serve s3 keeps the CRC32 an SDK uploads with (every AWS SDK since 2025), lists only the MD5 ETag,
    and answers x-amz-checksum-mode: the cheaper checksum is used for a whole object and for one in parts."""
    small, big = os.urandom(1000), os.urandom(1_000_000)
    rclone_s3_server.put("models", "m/small.bin", small, checksum_algorithm="CRC32")
    rclone_s3_server.put("models", "m/big.bin", big, checksum_algorithm="CRC32")
    crc32 = {
        name: b64encode(zlib.crc32(data).to_bytes(4, "big")).decode() for name, data in (("small", small), ("big", big))
    }
    with closing(S3Source("s3://models/m")) as source:
        listed = {obj.relpath: obj for obj in source.list()}
        assert {obj.checksum.algorithm for obj in listed.values() if obj.checksum} == {"md5"}  # all a listing says
        body = source.open(listed["small.bin"], 5.0)  # one range of all its bytes, as before
        body.close()
        assert body.checksum == Checksum(algorithm="crc32", value=crc32["small"])
        assert source.whole_checksum(listed["big.bin"], 5.0) == Checksum(algorithm="crc32", value=crc32["big"])
        (tmp_path / "dest").mkdir()
        download_all(source, list(listed.values()), tmp_path / "dest", PARTS)
    assert (tmp_path / "dest" / "small.bin").read_bytes() == small and (
        tmp_path / "dest" / "big.bin"
    ).read_bytes() == big


@pytest.mark.parametrize("shape", ["one range", "parts"])
def test_a_checksum_sent_with_the_object_is_the_one_verified(
    fake_endpoint: HttpFileServer, source: S3Source, tmp_path: Path, caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    """A CRC32 sent with a whole object's range (or by the HEAD of one in parts) is verified instead of the listed
    MD5: a corrupted body is caught by it, and the ranges asked for are those of before."""
    fake_endpoint.s3_crc32 = True
    data, obj = big_object(fake_endpoint)
    options = FAST if shape == "one range" else PARTS
    fake_endpoint.fail("/models/m/big.bin", Fault(corrupt=True))
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(TransientSourceError, match=r"m/big.bin: crc32 checksum mismatch"),
    ):
        download_all(source, [obj], tmp_path, options)
    assert "md5" not in caplog.text
    assert [method for method, _ in fake_endpoint.requests].count("HEAD") == (shape == "parts")
    fake_endpoint.faults.clear()
    fake_endpoint.ranges.clear()
    with closing(S3Source("s3://models/m")) as again:  # (a failed download stops its source for good)
        download_all(again, [obj], tmp_path, options)
    assert (tmp_path / "big.bin").read_bytes() == data
    parts = [(i, min(i + 100_000, len(data))) for i in range(0, len(data), 100_000)]
    assert sorted(fake_endpoint.ranges) == ([(0, len(data))] if shape == "one range" else parts)


def test_an_exact_key_is_listed_with_its_flexible_checksum_rather_than_its_md5(s3_server: MotoS3) -> None:
    uri = s3_server.put("models", "m/w.bin", b"123456789", checksum_algorithm="CRC64NVME")
    (obj,) = listing(uri)
    assert obj.checksum == Checksum(algorithm="crc64nvme", value="rosUhgp5mIg=")  # the CRC-64/NVME check value


def test_credentials_from_a_shared_credentials_file_are_accepted(
    rclone_s3_server: RcloneS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = model_folder(tmp_path)
    uri = rclone_s3_server.place(folder)
    credentials = tmp_path / "credentials"
    key, secret = rclone_s3_server.access_key, rclone_s3_server.secret_key
    credentials.write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    (tmp_path / "dest").mkdir()
    download(uri, tmp_path / "dest")
    assert tree_bytes(tmp_path / "dest") == tree_bytes(folder)


@pytest.mark.parametrize(
    ("bucket", "region", "custom", "url"),
    [
        ("models", "eu-west-1", "", "https://models.s3.eu-west-1.amazonaws.com/m/a%20b.bin"),
        ("my.models", "us-east-1", "", "https://s3.us-east-1.amazonaws.com/my.models/m/a%20b.bin"),
        ("models", "cn-north-1", "", "https://models.s3.cn-north-1.amazonaws.com.cn/m/a%20b.bin"),
        ("models", "us-east-1", "http://minio:9000/", "http://minio:9000/models/m/a%20b.bin"),
        ("models", "us-east-1", "https://ceph.local/s3", "https://ceph.local/s3/models/m/a%20b.bin"),
    ],
)
def test_aws_is_addressed_by_virtual_host_and_other_stores_by_path(
    bucket: str, region: str, custom: str, url: str
) -> None:
    endpoint = endpoint_for(bucket, region, {"AWS_ENDPOINT_URL": custom} if custom else {})
    located, host, _ = endpoint.locate(bucket, "m/a b.bin")
    assert (located, host) == (url, urlsplit(url).netloc)


def test_an_endpoint_that_is_not_a_url_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="fix AWS_ENDPOINT_URL"):
        endpoint_for("models", "us-east-1", {"AWS_ENDPOINT_URL_S3": "minio:9000"})


class RegionalStore(BaseHTTPRequestHandler):
    """An S3 stand-in whose bucket lives in eu-west-1: a request signed for another region gets S3's answer
    (400 AuthorizationHeaderMalformed, the region in x-amz-bucket-region); one signed for eu-west-1 a listing."""

    scopes: list[str] = []  # the region each request was signed for

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        scope = self.headers["Authorization"].split("Credential=")[1].split(",")[0]
        self.scopes.append(scope.split("/")[2])
        if "/eu-west-1/" not in scope:
            self._answer(
                400, b"<Error><Code>AuthorizationHeaderMalformed</Code></Error>", {"x-amz-bucket-region": "eu-west-1"}
            )
            return
        key = b"<Contents><Key>m/w.bin</Key><Size>3</Size><ETag>x</ETag></Contents>"
        self._answer(200, b"<ListBucketResult>" + key + b"<IsTruncated>false</IsTruncated></ListBucketResult>", {})

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        pass


@pytest.fixture
def regional_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[RegionalStore]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), RegionalStore)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    RegionalStore.scopes = []
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    yield RegionalStore
    server.shutdown()
    server.server_close()


def test_a_bucket_in_another_region_is_followed_once(regional_store: type[RegionalStore]) -> None:
    assert [o.relpath for o in listing("s3://models/m")] == ["w.bin"]
    assert regional_store.scopes == ["us-east-1", "eu-west-1"]


CHILD = """
import sys
from pathlib import Path
from tritonshare.loader.download_options import DownloadOptions
from tritonshare.loader.download import download_all
from tritonshare.loader.listing import list_objects
from tritonshare.loader.sources import open_source

source = open_source(sys.argv[1])
options = DownloadOptions(concurrency=16)
download_all(source, list_objects(source, options), Path(sys.argv[2]), options)
source.close()
print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])
"""


@pytest.mark.slow
def test_memory_stays_flat_while_a_big_object_comes_in_parts_and_is_hashed(
    rclone_s3_server: RcloneS3, tmp_path: Path
) -> None:
    folder = tmp_path / "big"
    folder.mkdir()
    with open(folder / "weights.bin", "wb") as fh:
        for _ in range(96):
            fh.write(os.urandom(1 << 20))  # 96 MiB: twelve parts, verified against the MD5 ETag
    uri = rclone_s3_server.place(folder)
    (tmp_path / "dest").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, uri, str(tmp_path / "dest")], capture_output=True, text=True, check=True
    )
    assert (tmp_path / "dest" / "weights.bin").read_bytes() == (folder / "weights.bin").read_bytes()
    peak_mib = int(done.stdout.split()[-1]) / 1024  # VmHWM: this process's peak resident set, in KiB
    assert peak_mib < 100, f"peak RSS {peak_mib:.0f} MiB for a 96 MiB object"


def test_an_endpoint_that_is_not_s3_is_named_not_taken_for_a_wrong_bucket(
    fake_endpoint: HttpFileServer, source: S3Source
) -> None:
    # AWS_ENDPOINT_URL pointing at some other web server: its 404 carries no S3 error
    with pytest.raises(SourceError) as caught:
        source.list()
    assert not isinstance(caught.value, SourceNotFound)
    assert f"s3://models/m/: not found at {fake_endpoint.endpoint} (HTTP 404" in str(caught.value)
    assert "this endpoint does not answer like S3; check AWS_ENDPOINT_URL" in str(caught.value)
