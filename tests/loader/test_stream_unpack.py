"""A tar archive downloaded and unpacked in one pass, against a real HTTP server that can fail on purpose
(and moto for S3): the result, the safety rules of archive.py, verification and retries."""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from tests.loader.test_sources_transport import BODY, RawServer
from tests.support.storage import Fault, HttpFileServer, MotoS3, make_tar, make_zip, tree_bytes
from tritonshare.common.errors import InsufficientSpace, TransientSourceError, UnsafeArchive
from tritonshare.loader.download_options import DownloadOptions
from tritonshare.loader.sources.base import RemoteObject
from tritonshare.loader.sources.http import HttpSource
from tritonshare.loader.sources.local import LocalSource
from tritonshare.loader.sources.s3 import S3Source
from tritonshare.loader.stream_unpack import fetch_and_unpack, streamable

pytestmark = pytest.mark.storage
FAST = DownloadOptions(retries=2, backoff_base_s=0.01, stall_timeout_s=0.5)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\n')
    (folder / "1" / "model.py").write_text("print('hi')\n")
    (folder / "1" / "weights.bin").write_bytes(os.urandom(3_000_000))
    return folder


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    folder = tmp_path / "workspace" / "unpacked"
    folder.mkdir(parents=True)
    return folder


def http_source(server: HttpFileServer, archive: Path) -> Iterator[tuple[HttpSource, RemoteObject]]:
    with closing(HttpSource(server.serve(archive))) as source:
        (obj,) = source.list()
        yield source, obj


@pytest.fixture
def served(http_server: HttpFileServer, model: Path, tmp_path: Path) -> Iterator[tuple[HttpSource, RemoteObject]]:
    yield from http_source(http_server, make_tar(model, tmp_path / "model.tar.gz", arcname="model"))


def test_a_tar_gz_is_unpacked_as_it_arrives_and_never_stored(
    served: tuple[HttpSource, RemoteObject], model: Path, dest: Path
) -> None:
    source, obj = served
    stats = fetch_and_unpack(source, obj, dest, FAST)
    assert tree_bytes(dest / "model") == tree_bytes(model)
    assert (stats.bytes, stats.retries) == (obj.size, 0)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["unpacked"]  # no archive, no pipe left behind


def test_a_long_transfer_logs_its_progress(
    served: tuple[HttpSource, RemoteObject], dest: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source, obj = served
    caplog.set_level(logging.INFO, logger="tritonshare")
    fetch_and_unpack(source, obj, dest, DownloadOptions(progress_interval_s=0.0))  # every read is "long"
    assert re.search(r"downloading and unpacking \S*model\.tar\.gz: [0-9.]+ of [0-9.]+ MiB, [0-9.]+ MiB/s", caplog.text)


def test_a_plain_tar_from_s3_is_unpacked(s3_server: MotoS3, model: Path, dest: Path, tmp_path: Path) -> None:
    archive = make_tar(model, tmp_path / "model.tar", compression="")
    uri = s3_server.put("models", "archives/model.tar", archive.read_bytes())
    with closing(S3Source(uri)) as source:
        (obj,) = source.list()
        fetch_and_unpack(source, obj, dest, FAST)
    assert tree_bytes(dest) == tree_bytes(model)


def test_bytes_corrupted_in_transit_are_caught_and_the_archive_streamed_again(
    served: tuple[HttpSource, RemoteObject], http_server: HttpFileServer, model: Path, dest: Path
) -> None:
    source, obj = served
    http_server.fail("/model.tar.gz", Fault(corrupt=True, times=1))  # a damaged gzip header: unpacking fails too
    stats = fetch_and_unpack(source, obj, dest, FAST)
    assert tree_bytes(dest / "model") == tree_bytes(model) and stats.retries == 1


def test_corruption_that_never_stops_fails_as_transient_naming_the_checksum(
    served: tuple[HttpSource, RemoteObject], http_server: HttpFileServer, dest: Path
) -> None:
    source, obj = served
    http_server.fail("/model.tar.gz", Fault(corrupt=True))
    with pytest.raises(TransientSourceError, match=r"model.tar.gz: sha256 checksum mismatch .*after 3 attempts"):
        fetch_and_unpack(source, obj, dest, FAST)


def test_a_stall_mid_archive_is_retried_from_a_clean_folder(
    served: tuple[HttpSource, RemoteObject], http_server: HttpFileServer, model: Path, dest: Path
) -> None:
    source, obj = served
    http_server.fail("/model.tar.gz", Fault(stall_after_bytes=1_500_000, times=1))
    stats = fetch_and_unpack(source, obj, dest, FAST)
    assert tree_bytes(dest / "model") == tree_bytes(model) and stats.retries == 1


def test_a_trickle_that_never_stalls_ends_at_the_download_deadline(
    served: tuple[HttpSource, RemoteObject], http_server: HttpFileServer, dest: Path
) -> None:
    # each read waits to fill its buffer (a MiB), so the deadline checked between reads came hours late
    source, obj = served
    http_server.fail("/model.tar.gz", Fault(trickle=True))
    options = DownloadOptions(retries=0, stall_timeout_s=5, download_timeout_s=1)
    started = time.monotonic()
    with pytest.raises(TransientSourceError, match=r"not downloaded within 1 s"):
        fetch_and_unpack(source, obj, dest, options)
    assert time.monotonic() - started < 4


def test_headers_that_trickle_in_end_at_the_download_deadline(dest: Path) -> None:
    store = RawServer(trickle_s=0.25).start()  # a header byte every 0.25 s: 10 s for the head, never a stall
    obj = RemoteObject(key=f"{store.url}/model.tar", relpath="model.tar", size=len(BODY))
    options = DownloadOptions(retries=0, stall_timeout_s=5, download_timeout_s=1)
    started = time.monotonic()
    try:
        with closing(HttpSource(obj.key)) as source, pytest.raises(TransientSourceError) as info:
            fetch_and_unpack(source, obj, dest, options)
    finally:
        store.stop()
    assert time.monotonic() - started < 3  # (it took the 10 s the head took to come)
    assert re.fullmatch(r".*/model.tar: not downloaded within 1 s \(0.0 MiB so far\) — raise --download-timeout-s .*",
                        str(info.value))  # fmt: skip


def evil_tar(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in ("model/config.pbtxt", "../escape.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
        tar.addfile(tarfile.TarInfo("padding.bin"), io.BytesIO(b""))
    return path


def test_an_escaping_member_is_refused_by_archive_rules_without_retrying(
    http_server: HttpFileServer, dest: Path, tmp_path: Path
) -> None:
    for source, obj in http_source(http_server, evil_tar(tmp_path / "evil.tar.gz")):
        with pytest.raises(UnsafeArchive, match=r"evil.tar.gz: member '../escape.txt' is refused"):
            fetch_and_unpack(source, obj, dest, FAST)
    assert [m for m, _ in http_server.requests].count("GET") == 1
    assert not (tmp_path / "workspace" / "escape.txt").exists()


def test_an_archive_inflating_beyond_the_budget_is_insufficient_space(
    served: tuple[HttpSource, RemoteObject], dest: Path
) -> None:
    source, obj = served
    with pytest.raises(InsufficientSpace, match=r"model.tar.gz: unpacking 'model/1/weights.bin' would bring"):
        fetch_and_unpack(source, obj, dest, FAST, max_bytes=1_000_000)


def test_only_a_single_tar_from_a_streaming_source_is_streamed(
    http_server: HttpFileServer, model: Path, tmp_path: Path
) -> None:
    archives = [make_tar(model, tmp_path / name) for name in ("m.tar.gz", "m.tgz", "m.TAR")]
    archives.append(make_zip(model, tmp_path / "m.zip"))
    for archive in archives:
        for source, obj in http_source(http_server, archive):
            expected = (source, obj) if archive.suffix != ".zip" else None
            assert streamable(source, [obj]) == expected, archive.name
    local = LocalSource(str(archives[0]))
    assert streamable(local, local.list()) is None  # a file on a volume is copied to staging, then unpacked
    with closing(HttpSource(http_server.url("m.tar.gz"))) as source:
        two = [RemoteObject(key="a", relpath="a.tar", size=1), RemoteObject(key="b", relpath="b.tar", size=1)]
        assert streamable(source, two) is None
