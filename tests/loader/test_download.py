"""The download engine's own logic: planning, retries, verification, cancellation, concurrency.

These use a scripted in-memory source (pure logic: the engine only sees the Source protocol) and the real
local source; the same behaviours against real storage servers are in tests/loader/test_sources_*.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.mounts import tmpfs
from tritonshare.common.errors import (
    InsufficientSpace,
    InvalidModel,
    RangeIgnored,
    SourceNotFound,
    TransientSourceError,
    UnsafeArchive,
)
from tritonshare.loader.checksum import cheapest, file_digest, hasher_for
from tritonshare.loader.download import download_all, listed_bytes
from tritonshare.loader.download_options import DownloadOptions
from tritonshare.loader.listing import list_objects
from tritonshare.loader.settings import LoaderSettings
from tritonshare.loader.sources.base import Checksum, Progress, RemoteObject
from tritonshare.loader.sources.local import LocalSource
from tritonshare.loader.sources.stream import Part

FAST = DownloadOptions(concurrency=4, retries=3, backoff_base_s=0.001, progress_interval_s=0.05)
Behaviour = Callable[[RemoteObject, int], bytes]  # (object, attempt) → the bytes this attempt delivers


class ScriptedSource:
    """A source whose objects are in memory and whose attempts follow a script (raise, corrupt, block)."""

    uri = "scripted://models/m"

    def __init__(self, payloads: dict[str, bytes], behaviour: Behaviour | None = None) -> None:
        self.payloads = payloads
        self.behaviour = behaviour or (lambda obj, _attempt: payloads[obj.relpath])
        self.attempts: dict[str, int] = {}
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()

    def objects(self, *, checksum: bool = False) -> list[RemoteObject]:
        return [
            RemoteObject(
                key=f"m/{rel}",
                relpath=rel,
                size=len(data),
                checksum=Checksum(algorithm="md5", value=hashlib.md5(data).hexdigest()) if checksum else None,
            )
            for rel, data in self.payloads.items()
        ]

    def list(self) -> list[RemoteObject]:
        return self.objects()

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        with self.lock:
            attempt = self.attempts[obj.relpath] = self.attempts.get(obj.relpath, 0) + 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            data = self.behaviour(obj, attempt)
            with open(dest, "wb") as fh:
                for i in range(0, len(data), 1000):
                    fh.write(data[i : i + 1000])
                    progress(len(data[i : i + 1000]))
        finally:
            with self.lock:
                self.active -= 1

    def close(self) -> None:
        pass


def model_payloads(count: int = 6) -> dict[str, bytes]:
    return {"config.pbtxt": b"backend: 'python'\n"} | {f"1/part{i}.bin": os.urandom(5000 + i) for i in range(count)}


def assert_same_tree(dest: Path, payloads: dict[str, bytes]) -> None:
    found = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert found == payloads


def test_a_local_folder_lands_byte_for_byte(tmp_path: Path) -> None:
    payloads = {"config.pbtxt": b"x", "1/model.py": b"y" * 10, "1/sub/w.bin": os.urandom(3 << 20)}
    for rel, data in payloads.items():
        (tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / rel).write_bytes(data)
    source = LocalSource(str(tmp_path / "src"))
    (tmp_path / "dest").mkdir()
    stats = download_all(source, source.list(), tmp_path / "dest", FAST)
    assert_same_tree(tmp_path / "dest", payloads)
    assert (stats.objects, stats.bytes, stats.retries) == (3, sum(map(len, payloads.values())), 0)


def test_folders_that_fill_the_disk_are_insufficient_space(tmp_path: Path) -> None:
    """Out of inodes while the download's folders are made: exit 15, as a full disk mid-file is."""
    for i in range(40):
        (tmp_path / "src" / "1" / f"d{i}").mkdir(parents=True)
        (tmp_path / "src" / "1" / f"d{i}" / "w.bin").write_bytes(b"w")
    source = LocalSource(str(tmp_path / "src"))
    with tmpfs(tmp_path / "dest", "1m,nr_inodes=16") as dest:
        with pytest.raises(InsufficientSpace, match=r"the staging filesystem is full — free space on the node"):
            download_all(source, source.list(), dest, FAST)


def test_transient_failures_are_retried_with_growing_jittered_backoff(tmp_path: Path) -> None:
    payloads = model_payloads(1)

    def flaky(obj: RemoteObject, attempt: int) -> bytes:
        if obj.relpath == "1/part0.bin" and attempt <= 3:
            raise TransientSourceError(f"{obj.key}: HTTP 503")
        return payloads[obj.relpath]

    source = ScriptedSource(payloads, flaky)
    delays: list[float] = []
    options = DownloadOptions(retries=3, backoff_base_s=1.0, backoff_max_s=3.0)
    stats = download_all(source, source.objects(), tmp_path, options, sleep=delays.append, rand=lambda: 0.5)
    assert_same_tree(tmp_path, payloads)
    assert stats.retries == 3 and stats.bytes == sum(map(len, payloads.values()))  # failed bytes not counted
    assert delays == [0.75, 1.5, 2.25]  # half to all of 1, 2, then 4 capped at 3


def test_retries_are_bounded_and_the_error_names_the_object(tmp_path: Path) -> None:
    def broken(obj: RemoteObject, attempt: int) -> bytes:
        raise TransientSourceError(f"{obj.key}: connection reset")

    source = ScriptedSource({"w.bin": b"1"}, broken)
    with pytest.raises(TransientSourceError, match=r"m/w.bin: connection reset \(gave up after 4 attempts\)"):
        download_all(source, source.objects(), tmp_path, FAST)
    assert source.attempts == {"w.bin": 4}


def test_a_permanent_error_stops_everything_without_retrying(tmp_path: Path) -> None:
    payloads = model_payloads(20)

    def one_missing(obj: RemoteObject, attempt: int) -> bytes:
        if obj.relpath == "1/part3.bin":
            raise SourceNotFound(f"{obj.key}: no such key")
        time.sleep(0.05)
        return payloads[obj.relpath]

    source = ScriptedSource(payloads, one_missing)
    with pytest.raises(SourceNotFound, match="part3.bin: no such key"):
        download_all(source, source.objects(), tmp_path, FAST)
    assert source.attempts["1/part3.bin"] == 1
    assert len(source.attempts) < len(payloads)  # the queued objects were never started
    assert source.active == 0  # every worker had finished when the error came out


def test_a_corrupted_transfer_is_caught_by_its_checksum_and_retried(tmp_path: Path) -> None:
    payloads = {"w.bin": os.urandom(4000)}

    def corrupt_once(obj: RemoteObject, attempt: int) -> bytes:
        data = payloads[obj.relpath]
        return bytes([data[0] ^ 1]) + data[1:] if attempt == 1 else data

    source = ScriptedSource(payloads, corrupt_once)
    stats = download_all(source, source.objects(checksum=True), tmp_path, FAST)
    assert (tmp_path / "w.bin").read_bytes() == payloads["w.bin"] and stats.retries == 1


def test_a_checksum_that_never_matches_fails_as_transient(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = ScriptedSource({"w.bin": b"good"}, lambda _obj, _attempt: b"evil")
    with pytest.raises(TransientSourceError, match=r"m/w.bin: md5 checksum mismatch .*\(gave up after 4 attempts\)"):
        download_all(source, source.objects(checksum=True), tmp_path, FAST)
    assert "retry 1 of 3" in caplog.text


def test_a_short_transfer_is_caught_by_its_size(tmp_path: Path) -> None:
    source = ScriptedSource({"w.bin": b"12345"}, lambda _obj, attempt: b"123" if attempt == 1 else b"12345")
    stats = download_all(source, source.objects(), tmp_path, FAST)
    assert (tmp_path / "w.bin").read_bytes() == b"12345" and stats.retries == 1


@pytest.mark.parametrize("relpath", ["../escape.bin", "/etc/cron.d/x", "a/../../b", ""])
def test_a_path_escaping_the_folder_is_refused_before_anything_is_written(tmp_path: Path, relpath: str) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    source = ScriptedSource({"ok.bin": b"1", relpath: b"2"})
    with pytest.raises(UnsafeArchive, match="would land outside the download folder"):
        download_all(source, source.objects(), dest, FAST)
    assert list(tmp_path.rglob("*")) == [dest] and source.attempts == {}


def test_a_file_used_as_a_folder_is_an_invalid_model(tmp_path: Path) -> None:
    source = ScriptedSource({"1": b"file", "1/model.py": b"x"})
    with pytest.raises(InvalidModel, match="m/1 is a file but other objects use it as a folder"):
        download_all(source, source.objects(), tmp_path, FAST)


def test_two_names_for_one_path_are_an_invalid_model(tmp_path: Path) -> None:
    source = ScriptedSource({"1/model.py": b"x", "1//./model.py": b"y"})
    with pytest.raises(InvalidModel, match="both map to '1//./model.py'"):
        download_all(source, source.objects(), tmp_path, FAST)
    assert list(tmp_path.iterdir()) == []


def test_nested_folders_are_made_and_filled(tmp_path: Path) -> None:
    payloads = {"config.pbtxt": b"c", "1/a/b/w.bin": b"w", "1/a/x.bin": b"x", "2/model.py": b"m"}
    source = ScriptedSource(payloads)
    download_all(source, source.objects(), tmp_path, FAST)
    landed = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert landed == payloads


def test_concurrency_is_bounded_by_the_option(tmp_path: Path) -> None:
    payloads = model_payloads(12)

    def slow(obj: RemoteObject, attempt: int) -> bytes:
        time.sleep(0.05)
        return payloads[obj.relpath]

    source = ScriptedSource(payloads, slow)
    download_all(source, source.objects(), tmp_path, DownloadOptions(concurrency=3))
    assert source.max_active == 3


def test_the_overall_deadline_cancels_a_slow_download_promptly(tmp_path: Path) -> None:
    def crawl(obj: RemoteObject, attempt: int) -> bytes:
        time.sleep(0.02)
        return b"x" * 1000

    payloads = {f"{i}.bin": b"x" * 1000 for i in range(200)}
    source = ScriptedSource(payloads, crawl)
    started = time.monotonic()
    with pytest.raises(TransientSourceError, match=r"did not finish within 0.3 s \(0.0 of 0.2 MiB\)"):
        download_all(source, source.objects(), tmp_path, DownloadOptions(concurrency=2, download_timeout_s=0.3))
    assert time.monotonic() - started < 1.0 and source.active == 0


def test_progress_is_logged_with_a_rate(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    payloads = model_payloads(4)

    def slow(obj: RemoteObject, attempt: int) -> bytes:
        time.sleep(0.1)
        return payloads[obj.relpath]

    caplog.set_level(logging.INFO, logger="tritonshare.loader.download")
    source = ScriptedSource(payloads, slow)
    download_all(source, source.objects(), tmp_path, DownloadOptions(concurrency=1, progress_interval_s=0.05))
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("downloading")]
    assert progress and all("MiB/s" in line for line in progress)
    assert "downloaded scripted://models/m: 5 objects" in caplog.text


def test_a_full_disk_is_insufficient_space(tmp_path: Path) -> None:
    os.symlink("/dev/full", tmp_path / "w.bin")  # writes there fail with ENOSPC, like a full volume
    source = ScriptedSource({"w.bin": b"x" * 5000})
    with pytest.raises(InsufficientSpace, match="w.bin: the staging filesystem is full"):
        download_all(source, source.objects(), tmp_path, FAST)


def test_listing_is_retried_on_transient_errors() -> None:
    calls: list[int] = []

    class FlakyList(ScriptedSource):
        def list(self) -> list[RemoteObject]:
            calls.append(1)
            if len(calls) < 3:
                raise TransientSourceError("listing: HTTP 500")
            return super().list()

    objects = list_objects(FlakyList({"a": b"12"}), FAST, sleep=lambda _: None)
    assert [o.relpath for o in objects] == ["a"] and len(calls) == 3 and listed_bytes(objects) == 2


def test_options_come_from_the_loader_settings() -> None:
    settings = LoaderSettings(source="s3://b/m", name="m", concurrency=7, retries=2, stall_timeout_s=9.0)
    options = DownloadOptions.from_settings(settings)
    assert (options.concurrency, options.retries, options.stall_timeout_s) == (7, 2, 9.0)
    assert options.download_timeout_s == settings.download_timeout_s


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ("md5", "25f9e794323b453885f5181f1b624d0b"),
        ("sha256", "15e2b0d3c33891ebb0f1ef609ec419420c20e320ce94c65fbc8c3312448eb225"),
        ("crc32c", "4waSgw=="),  # 0xE3069283, the CRC-32C check value
        ("crc32", "y/Q5Jg=="),  # 0xCBF43926, the CRC-32 check value
        ("crc64nvme", "rosUhgp5mIg="),  # 0xAE8B14860A799888, the CRC-64/NVME check value
    ],
)
def test_digests_match_the_reference_check_values(tmp_path: Path, algorithm: str, expected: str) -> None:
    (tmp_path / "f").write_bytes(b"123456789")
    assert file_digest(tmp_path / "f", algorithm) == expected


class Chunks:
    """A response body handing out ``data`` in network-sized pieces; it may crawl or be cut on purpose."""

    def __init__(self, data: bytes, *, checksum: Checksum | None, delay_s: float, cut_after: int | None) -> None:
        self.data, self.checksum, self.delay_s, self.cut_after = data, checksum, delay_s, cut_after
        self.sent = 0

    def readinto(self, buffer: memoryview, /) -> int:
        if self.cut_after is not None and self.sent >= self.cut_after:
            raise TransientSourceError("connection reset by peer")
        time.sleep(self.delay_s)
        count = min(len(buffer), 64 << 10, len(self.data) - self.sent)
        buffer[:count] = self.data[self.sent : self.sent + count]
        self.sent += count
        return count

    def abort(self) -> None:
        self.cut_after = self.sent

    def close(self) -> None:
        pass


class StreamedSource:
    """One object served as byte streams (whole or ranges), as the network sources do: the engine writes,
    hashes and verifies. ``slow_offsets`` crawl; ``cuts`` (offset → bytes) and ``corrupt`` hit the first
    request for a range starting there, once."""

    uri = "scripted://models/big"

    def __init__(self, data: bytes, *, slow_offsets: frozenset[int] = frozenset(), cuts: dict[int, int] | None = None):
        self.data = data
        self.slow_offsets = slow_offsets
        self.cuts = dict(cuts or {})
        self.corrupt: set[int] = set()
        self.whole_only: set[int] = set()  # a part starting there is answered whole (RangeIgnored), as a proxy might
        self.stated: Checksum | None = None  # what a whole-object response states (S3's flexible checksum)
        self.asked: Checksum | Exception | None = None  # what whole_checksum answers (S3: a HEAD), or raises
        self.requests: list[Part | None] = []
        self.lock = threading.Lock()

    def object(self, checksum: Checksum | None = None) -> RemoteObject:
        md5 = Checksum(algorithm="md5", value=hashlib.md5(self.data).hexdigest())
        return RemoteObject(key="m/big.bin", relpath="big.bin", size=len(self.data), checksum=checksum or md5)

    def list(self) -> list[RemoteObject]:
        return [self.object()]

    def open(self, obj: RemoteObject, stall_timeout_s: float, part: Part | None = None) -> Chunks:
        with self.lock:
            self.requests.append(part)
            start = part.offset if part else 0
            cut, corrupt = self.cuts.pop(start, None), start in self.corrupt
            self.corrupt.discard(start)
        if part and start in self.whole_only:
            raise RangeIgnored(f"m/big.bin (bytes {start}-): the store ignored the Range header")
        data = self.data[start : start + part.length] if part else self.data
        if corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        delay = 0.002 if start in self.slow_offsets else 0.0
        return Chunks(data, checksum=None if part else self.stated, delay_s=delay, cut_after=cut)

    def ranged(self, obj: RemoteObject) -> bool:
        return True

    def whole_checksum(self, obj: RemoteObject, stall_timeout_s: float) -> Checksum | None:
        if isinstance(self.asked, Exception):
            raise self.asked
        return self.asked

    def abort(self) -> None:
        pass  # its bodies are aborted one by one

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        raise AssertionError("the engine reads stream sources itself")

    def close(self) -> None:
        pass


PARTED = DownloadOptions(concurrency=4, retries=2, backoff_base_s=0.001, part_bytes=256 << 10)
BIG = os.urandom(2 << 20)  # eight parts of 256 KiB


def test_parts_landing_out_of_order_are_verified_whole(tmp_path: Path) -> None:
    source = StreamedSource(BIG, slow_offsets=frozenset({0}))  # the first part lands last
    stats = download_all(source, [source.object()], tmp_path, PARTED)
    assert (tmp_path / "big.bin").read_bytes() == BIG and (stats.bytes, stats.retries) == (len(BIG), 0)
    assert sorted(p.offset for p in source.requests if p) == list(range(0, len(BIG), 256 << 10))


def test_a_part_cut_midway_resumes_from_the_bytes_that_landed(tmp_path: Path) -> None:
    source = StreamedSource(BIG, cuts={512 << 10: 3 * (64 << 10)})  # part 2 breaks after three reads
    stats = download_all(source, [source.object()], tmp_path, PARTED)
    assert (tmp_path / "big.bin").read_bytes() == BIG and stats.retries == 1 and stats.bytes == len(BIG)
    assert Part((512 << 10) + 3 * (64 << 10), (256 << 10) - 3 * (64 << 10)) in source.requests


def test_a_corrupted_part_fails_the_checksum_and_the_object_comes_again_whole(tmp_path: Path) -> None:
    source = StreamedSource(BIG)
    source.corrupt.add(768 << 10)
    stats = download_all(source, [source.object()], tmp_path, PARTED)
    assert (tmp_path / "big.bin").read_bytes() == BIG and stats.bytes == len(BIG)
    assert source.requests[-1] is None  # after the parts, one whole request


def test_parts_a_store_answers_whole_give_way_to_one_whole_fetch_once_the_others_end(tmp_path: Path) -> None:
    source = StreamedSource(BIG, slow_offsets=frozenset({0}))  # part 0 is still landing when part 1 is refused
    source.whole_only.add(256 << 10)
    stats = download_all(source, [source.object()], tmp_path, PARTED)
    assert (tmp_path / "big.bin").read_bytes() == BIG and (stats.bytes, stats.retries) == (len(BIG), 0)
    assert source.requests[-1] is None and source.requests.count(None) == 1  # once every part asked has ended


def test_a_stream_is_hashed_as_it_is_written_and_a_mismatch_is_transient(tmp_path: Path) -> None:
    source = StreamedSource(BIG[:5000])
    wrong = Checksum(algorithm="md5", value="0" * 32)
    with pytest.raises(TransientSourceError, match=r"m/big.bin: md5 checksum mismatch .*after 3 attempts"):
        download_all(source, [source.object(wrong)], tmp_path, PARTED)
    assert source.requests == [None, None, None]


def test_a_checksum_the_response_states_is_preferred_when_cheaper(tmp_path: Path) -> None:
    source = StreamedSource(BIG[:5000])
    source.stated = checksum_of_bytes(BIG[:5000], "crc32c")  # like S3 returning x-amz-checksum-crc32c
    stale_md5 = Checksum(algorithm="md5", value="0" * 32)  # never computed: CRC32C is far cheaper
    download_all(source, [source.object(stale_md5)], tmp_path, PARTED)
    assert (tmp_path / "big.bin").read_bytes() == BIG[:5000]


def test_parts_are_verified_by_the_cheaper_checksum_the_store_states_when_asked(tmp_path: Path) -> None:
    source = StreamedSource(BIG)
    source.asked = checksum_of_bytes(BIG, "crc64nvme")  # like S3's HEAD with x-amz-checksum-mode
    stale_md5 = Checksum(algorithm="md5", value="0" * 32)  # never computed: CRC64NVME is far cheaper
    download_all(source, [source.object(stale_md5)], tmp_path, PARTED)
    assert (tmp_path / "big.bin").read_bytes() == BIG and None not in source.requests  # parts only


def test_parts_whose_stated_checksum_disagrees_fail_then_come_whole(tmp_path: Path) -> None:
    source = StreamedSource(BIG)
    source.asked = Checksum(algorithm="crc64nvme", value="AAAAAAAAAAA=")
    source.stated = checksum_of_bytes(BIG, "crc32c")  # the whole answer states the right one
    download_all(source, [source.object()], tmp_path, PARTED)
    assert (tmp_path / "big.bin").read_bytes() == BIG and source.requests[-1] is None


def test_asking_for_the_checksum_may_fail_then_the_listed_one_is_verified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = StreamedSource(BIG)
    source.asked = TransientSourceError("s3://models/m/big.bin: the store did not answer in time")
    with pytest.raises(TransientSourceError, match=r"m/big.bin: md5 checksum mismatch"):
        download_all(source, [source.object(Checksum(algorithm="md5", value="0" * 32))], tmp_path, PARTED)
    assert "verifying m/big.bin by its listed checksum" in caplog.text


def checksum_of_bytes(data: bytes, algorithm: str) -> Checksum:
    hasher = hasher_for(algorithm)
    hasher.update(data)
    return Checksum(algorithm=algorithm, value=hasher.value())


def test_the_cheapest_known_checksum_wins() -> None:
    md5, crc = Checksum(algorithm="md5", value="a"), Checksum(algorithm="crc32c", value="b")
    assert cheapest(md5, None, crc) is crc and cheapest(md5) is md5
    assert cheapest(Checksum(algorithm="blake3", value="c")) is None and cheapest() is None
    crc64 = Checksum(algorithm="crc64nvme", value="d")
    assert cheapest(md5, crc64) is crc64 and cheapest(md5, crc, crc64) is crc  # CRC64NVME's import costs more


def test_part_size_grows_with_the_object_to_bound_the_number_of_requests() -> None:
    options = DownloadOptions()  # 8 MiB parts, at most 64 of them
    sizes = [options.part_size(size) >> 20 for size in (200 << 20, 512 << 20, 513 << 20, 2 << 30)]
    assert sizes == [8, 8, 9, 32]
    assert DownloadOptions(part_bytes=100_000).part_size(1_000_000) == 100_000
