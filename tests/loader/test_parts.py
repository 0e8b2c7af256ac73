"""Big objects in ranged parts against real stores: the checksum, followed by its own hasher thread while
the parts land, still catches a byte gone wrong in the middle of the object, and nothing keeps reading
the file once a download has ended, however it ended."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tests.support.storage import GcsEmulator, MotoS3
from tritonshare.common.errors import ExitCode, SourceNotFound, TransientSourceError
from tritonshare.loader.download import download_all
from tritonshare.loader.download_options import DownloadOptions
from tritonshare.loader.listing import list_objects
from tritonshare.loader.parts import reserve
from tritonshare.loader.sources import open_source

pytestmark = pytest.mark.storage
PART = 256 << 10
PARTS = DownloadOptions(concurrency=4, retries=1, backoff_base_s=0.01, stall_timeout_s=5, part_bytes=PART)
DATA = os.urandom(8 * PART)  # eight parts


def flipped(data: bytes, offset: int) -> bytes:
    """``data`` with one bit changed at ``offset``: same size, so only the checksum can tell."""
    return data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1 :]


def download(uri: str, dest: Path) -> None:
    source = open_source(uri)
    try:
        download_all(source, list_objects(source, PARTS), dest, PARTS)
    finally:
        source.close()


def hashers_running() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name == "tritonshare-hash"]


def test_a_bit_flipped_in_a_middle_part_fails_the_md5_etag_after_parts_and_whole(
    s3_server: MotoS3, tmp_path: Path
) -> None:
    s3_server.put("models", "m/big.bin", DATA)
    s3_server.tamper("models", "m/big.bin", flipped(DATA, 5 * PART + 1234))  # inside part 5 of 8
    mismatch = r"m/big.bin: md5 checksum mismatch .*gave up after 2 attempts"  # parts, then whole
    with pytest.raises(TransientSourceError, match=mismatch) as caught:
        download("s3://models/m", tmp_path)
    assert caught.value.exit_code == ExitCode.SOURCE_TRANSIENT
    assert hashers_running() == []


def test_a_byte_flipped_in_a_middle_part_fails_the_crc32c(gcs_server: GcsEmulator, tmp_path: Path) -> None:
    gcs_server.put("models", "m/big.bin", DATA)
    gcs_server.tamper("models", "m/big.bin", flipped(DATA, 3 * PART + 77))  # inside part 3 of 8
    with pytest.raises(TransientSourceError, match=r"m/big.bin: crc32c checksum mismatch"):
        download("gs://models/m", tmp_path)
    assert hashers_running() == []


def test_a_byte_flipped_in_a_middle_part_fails_the_crc64nvme_s3_states_when_asked(
    s3_server: MotoS3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s3_server.put("models", "m/big.bin", DATA, checksum_algorithm="CRC64NVME")
    s3_server.tamper("models", "m/big.bin", flipped(DATA, 6 * PART + 5))
    with pytest.raises(TransientSourceError, match=r"m/big.bin: crc64nvme checksum mismatch"):  # not the MD5
        download("s3://models/m", tmp_path)
    parts_failed = [r.getMessage() for r in caplog.records if "fetching it again in one piece" in r.getMessage()]
    assert parts_failed and "crc64nvme checksum mismatch" in parts_failed[0]  # the parts, before the whole
    assert hashers_running() == []


def test_a_multipart_upload_is_verified_by_its_full_object_crc64nvme(s3_server: MotoS3, tmp_path: Path) -> None:
    data = os.urandom(6 << 20)  # two upload parts of at least 5 MiB, as S3 requires; 24 download parts
    s3_server.put_multipart("models", "m/big.bin", data)
    (tmp_path / "good").mkdir()
    download("s3://models/m", tmp_path / "good")
    assert (tmp_path / "good" / "big.bin").read_bytes() == data
    s3_server.tamper("models", "m/big.bin", flipped(data, 3 * PART + 9))  # its ETag is no MD5: only the CRC tells
    with pytest.raises(TransientSourceError, match=r"m/big.bin: crc64nvme checksum mismatch"):
        download("s3://models/m", tmp_path)


def test_hashers_run_for_the_objects_being_fetched_not_one_per_big_file(s3_server: MotoS3, tmp_path: Path) -> None:
    for i in range(12):
        s3_server.put("models", f"m/shard-{i:02}.bin", os.urandom(4 * PART))  # 12 big files of 4 parts
    peak, done = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(hashers_running()))
            done.wait(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        download("s3://models/m", tmp_path)  # 4 download threads
    finally:
        done.set()
        watcher.join()
    assert len(list(tmp_path.glob("shard-*.bin"))) == 12
    assert 1 <= peak <= 5, peak  # the objects whose parts are in flight (4 threads), not 12


def test_the_same_object_untouched_lands_byte_for_byte(s3_server: MotoS3, tmp_path: Path) -> None:
    s3_server.put("models", "m/big.bin", DATA)
    download("s3://models/m", tmp_path)
    assert (tmp_path / "big.bin").read_bytes() == DATA
    assert hashers_running() == []


def test_a_download_stopped_by_another_object_leaves_no_hasher_reading(s3_server: MotoS3, tmp_path: Path) -> None:
    s3_server.put("models", "m/big.bin", DATA)
    s3_server.put("models", "m/gone.bin", DATA + DATA)  # larger: its parts are fetched first, and fail
    source = open_source("s3://models/m")
    try:
        objects = list_objects(source, PARTS)
        s3_server.client.delete_object(Bucket="models", Key="m/gone.bin")  # gone between listing and GET
        with pytest.raises(SourceNotFound, match="m/gone.bin"):
            download_all(source, objects, tmp_path, PARTS)
    finally:
        source.close()
    assert hashers_running() == []  # big.bin's hasher, waiting for bytes that never came, was stopped


def test_a_part_file_is_allocated_at_its_full_size_before_any_part_lands(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    target.write_bytes(b"stale bytes from an earlier attempt")
    reserve(target, 3 * PART + 5)
    assert target.stat().st_size == 3 * PART + 5
    assert target.stat().st_blocks * 512 >= 3 * PART + 5  # on disk, not sparse (ext4, xfs, tmpfs)
    assert target.read_bytes() == bytes(3 * PART + 5)
