"""The node's disk fills up while a model is being fetched: the loader exits 15 with a message that says so and
what to do, and leaves nothing in the repository or staging — whether the fill is one the space check could not
see (no size announced), one that came after it (another writer), or an archive that inflates past the disk.
A ``.tar.gz`` over HTTP is unpacked as it arrives (never stored): its members are counted against the free space
as their headers come in, and a disk filled by another writer meanwhile fails the unpacking the same way.

The node folder is a 16 MiB tmpfs; the loader is the ``tritonshare load`` console script, as a pod runs it."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from bench.faults.node import Node, entries, run_load

from tests.reliability.conftest import BlobServer
from tests.support.models import write_model
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode, InsufficientSpace
from tritonshare.loader.run import run
from tritonshare.loader.settings import LoaderSettings
from tritonshare.loader.sources.base import Progress, RemoteObject
from tritonshare.loader.sources.local import LocalSource

pytestmark = [pytest.mark.triton]

FULL = "the staging filesystem is full — free space on the node"


def model_archive(tmp_path: Path, *, weights: bytes) -> bytes:
    """A .tar.gz of an identity model whose version folder also holds ``weights``."""
    model = write_model(tmp_path / "model")
    (model / "1" / "weights.bin").write_bytes(weights)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=1) as tar:
        tar.add(model, arcname="model")
    return out.getvalue()


def fill(path: Path, *, leave_bytes: int) -> None:
    """Write ``path`` until its filesystem has about ``leave_bytes`` free."""
    free = os.statvfs(path.parent)
    with open(path, "wb", buffering=0) as out:
        left = free.f_bavail * free.f_frsize - leave_bytes
        while left > 0:
            left -= out.write(b"\0" * min(left, 1 << 20))


def assert_refused_for_space(node: Node, outcome_code: int, message: str, *fragments: str) -> None:
    assert outcome_code == ExitCode.INSUFFICIENT_SPACE, message
    for fragment in fragments:
        assert fragment in message
    assert message.count("\n") == 1  # one line in the pod status
    assert entries(node) == set(), "a load that ran out of space left something behind"


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("weights.bin", "weights.bin: the staging filesystem is full — free space on the node"),  # fills the disk
        ("model.tar.gz", "model.tar.gz: unpacking 'model/1/weights.bin' would bring the model to"),  # streamed
    ],
    ids=["file", "tar.gz"],
)
def test_a_download_of_unannounced_size_that_fills_the_disk_exits_15_and_leaves_nothing(
    small_disk: Node,
    triton: TritonServer,
    blob_server: Callable[..., BlobServer],
    model_name: str,
    tmp_path: Path,
    name: str,
    refusal: str,
) -> None:
    """A plain file fills the disk (ENOSPC); a streamed archive's members are counted against the free space
    as their headers arrive, so the one that would not fit is refused before it is written."""
    data = model_archive(tmp_path, weights=os.urandom(24 << 20))  # 24 MiB > 16 MiB
    server = blob_server(data, name=name, chunked=True)
    outcome = run_load(small_disk, triton.url, server.url, model_name, "--timeout-s", "5", "--retries", "2")
    assert_refused_for_space(small_disk, outcome.code, outcome.message, refusal, "free space on the node")
    assert "0.0 MiB to download" in outcome.log  # the space check had nothing to go on
    assert os.statvfs(small_disk.root).f_bfree * os.statvfs(small_disk.root).f_frsize > 15 << 20  # space given back


def test_space_taken_by_another_writer_after_the_check_exits_15_and_leaves_nothing(
    small_disk: Node, triton: TritonServer, blob_server: Callable[..., BlobServer], model_name: str, tmp_path: Path
) -> None:
    filler = small_disk.root / "another-pod.bin"
    server = blob_server(
        model_archive(tmp_path, weights=os.urandom(6 << 20)), before_body=lambda: fill(filler, leave_bytes=1 << 20)
    )
    outcome = run_load(small_disk, triton.url, server.url, model_name, "--timeout-s", "5", "--retries", "2")
    assert "6.0 MiB to download, 16.0 MiB free" in outcome.log  # the check passed: there was room then
    assert_refused_for_space(small_disk, outcome.code, outcome.message, f"unpacking model.tar.gz: {FULL}")
    assert filler.exists()  # the other writer's file is not the loader's to remove


def test_an_archive_that_inflates_beyond_the_disk_exits_15_and_leaves_nothing(
    small_disk: Node, triton: TritonServer, blob_server: Callable[..., BlobServer], model_name: str, tmp_path: Path
) -> None:
    server = blob_server(model_archive(tmp_path, weights=bytes(64 << 20)))  # 64 MiB of zeros, ~64 KiB packed
    outcome = run_load(small_disk, triton.url, server.url, model_name, "--timeout-s", "5")
    assert_refused_for_space(small_disk, outcome.code, outcome.message, "weights.bin")
    assert "free" in outcome.message


class _FillsAfterTheLastObject(LocalSource):
    """A local folder source after whose last object another writer takes every byte left on the disk."""

    disk: Path

    def list(self) -> list[RemoteObject]:
        self._left = len(objects := super().list())
        return objects

    def fetch(self, obj: RemoteObject, dest: Path, progress: Progress, stall_timeout_s: float) -> None:
        super().fetch(obj, dest, progress, stall_timeout_s)
        self._left -= 1
        if self._left == 0:
            fill(self.disk / "another-pod.bin", leave_bytes=0)


def test_a_disk_that_fills_between_download_and_publish_is_insufficient_space(
    small_disk: Node, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    """Another writer takes the last bytes of the disk right after the download: writing the install record
    fails with ENOSPC, which is InsufficientSpace (exit 15) like a disk that fills mid-download — not an
    unexpected OSError (exit 1 and a traceback, as before loader/install.py translated it), and the staging
    folder goes.

    Driven in-process through ``run``'s ``open_source`` seam: the disk must fill in the short gap after the last
    object lands, which only the source itself can time."""
    _FillsAfterTheLastObject.disk = small_disk.root
    source = write_model(tmp_path / "m", padding_bytes=1 << 20)
    settings = LoaderSettings(
        source=str(source), name=model_name, layout=small_disk.layout, triton_url=triton.url,
        timeout_s=5, concurrency=1, termination_log=None,
    )  # fmt: skip
    with pytest.raises(InsufficientSpace, match="full"):
        run(settings, open_source=_FillsAfterTheLastObject)
    assert entries(small_disk) == set()


def test_a_load_that_finds_the_disk_full_when_taking_its_lease_exits_15(
    small_disk: Node, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    """The lease folder lies on the node's disk beside the repository (one hostPath): on a full disk the lease
    cannot be written, and the loader must say the disk is full (exit 15, "free space on the node") — not call
    it a usage error (exit 2) telling the user to mount the node folder read-write, which it is."""
    source = write_model(tmp_path / "m")
    fill(small_disk.root / "another-pod.bin", leave_bytes=0)
    outcome = run_load(
        small_disk, triton.url, str(source), model_name,
        "--pod-uid", "pod-a", "--leases", str(small_disk.leases), "--timeout-s", "5",
    )  # fmt: skip
    assert_refused_for_space(
        small_disk, outcome.code, outcome.message, "the filesystem is full — free space on the node"
    )
    assert "read-write" not in outcome.message
    assert not list(small_disk.leases.glob(f"{model_name}/*")), "a lease or its temporary file stayed"
