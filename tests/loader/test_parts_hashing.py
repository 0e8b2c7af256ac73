"""The hashers of big objects (pure logic on local files: the parts are written, then reported landed)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from tritonshare.common.errors import TransientSourceError
from tritonshare.loader.parts import HASHING_AT_ONCE, Split, hashing_slots
from tritonshare.loader.sources.base import Checksum, RemoteObject

PART = 1 << 20


class CountingSlots(threading.BoundedSemaphore):
    """The download's hashing slots, counting how many are held at once."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.held = self.peak = 0
        self.count_lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        acquired = super().acquire(blocking, timeout)
        with self.count_lock:
            self.held += acquired
            self.peak = max(self.peak, self.held)
        return acquired

    def __enter__(self, blocking: bool = True, timeout: float | None = None, /) -> bool:
        return self.acquire(blocking, timeout)  # threading.Semaphore binds __enter__ to its own acquire

    def release(self, n: int = 1) -> None:
        with self.count_lock:
            self.held -= n
        super().release(n)


def landed_split(folder: Path, name: str, slots: threading.Semaphore, *, md5: str | None = None) -> Split:
    """A 4-part object already on disk, its parts reported landed in reverse order."""
    data = os.urandom(4 * PART)
    (folder / name).write_bytes(data)
    checksum = Checksum(algorithm="md5", value=md5 or hashlib.md5(data).hexdigest())
    obj = RemoteObject(key=f"m/{name}", relpath=name, size=len(data), checksum=checksum)
    split = Split(obj, folder / name, PART, checksum, slots)
    split.begin()  # as the engine does when it starts fetching the first part
    for index in reversed(range(len(split.parts))):
        split.landed(index, split.parts[index].length)
        split.complete(index)
    return split


def test_many_big_objects_are_hashed_a_few_at_a_time(tmp_path: Path) -> None:
    slots = CountingSlots(HASHING_AT_ONCE)
    splits = [landed_split(tmp_path, f"w{i}.bin", slots) for i in range(3 * HASHING_AT_ONCE)]
    try:
        for split in splits:
            split.verify()  # raises on a mismatch
    finally:
        for split in splits:
            split.close()
    assert 1 <= slots.peak <= HASHING_AT_ONCE  # mapped windows stay bounded whatever the number of files


def test_a_wrong_checksum_is_reported_once_the_hasher_has_read_everything(tmp_path: Path) -> None:
    split = landed_split(tmp_path, "w.bin", hashing_slots(), md5="0" * 32)
    try:
        with pytest.raises(TransientSourceError, match=r"m/w.bin: md5 checksum mismatch \(store 0{32}, downloaded "):
            split.verify()
    finally:
        split.close()


def test_a_hasher_waiting_for_bytes_that_never_come_stops_when_closed(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(bytes(4 * PART))
    obj = RemoteObject(key="m/w.bin", relpath="w.bin", size=4 * PART, checksum=Checksum(algorithm="md5", value="0"))
    split = Split(obj, tmp_path / "w.bin", PART, obj.checksum, hashing_slots())
    split.begin()
    split.landed(0, PART // 2)  # half of the first part, then the download is cancelled
    split.close()
    assert not [thread for thread in threading.enumerate() if thread.name == "tritonshare-hash"]
