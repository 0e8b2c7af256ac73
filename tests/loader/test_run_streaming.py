"""``tritonshare load`` of a ``.tar.gz`` over HTTP (and from S3 and GCS): the archive is unpacked as it arrives and
never lands in staging, against real storage servers and the real Triton. A damaged archive exits with its code
and leaves nothing: bytes damaged in transit are a transient failure (11, retried first), an archive damaged at
the source is the source's fault (10, not retried) — also one cut short exactly between two members, or missing
only its gzip trailer, whose size and checksum agree — an archive whose member climbs out is refused (10)."""

from __future__ import annotations

import gzip
import io
import logging
import os
import stat
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from bench.faults.node import Node, run_load

from tests.support.models import write_model
from tests.support.storage import Fault, HttpFileServer, files_under, make_tar, make_zip, tree_bytes
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode, InsufficientSpace
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import RECORD_FILE, read_record
from tritonshare.common.triton import TritonClient
from tritonshare.loader.run import run
from tritonshare.loader.settings import LoaderSettings

pytestmark = [pytest.mark.triton, pytest.mark.storage]

WEIGHTS_BYTES = 16 << 20  # random: the .tar.gz is as large as the model


def settings(layout: NodeLayout, triton: TritonServer, source: str, name: str, **kw: object) -> LoaderSettings:
    base: dict[str, object] = {"timeout_s": 60.0, "poll_interval_s": 0.1, "termination_log": None}
    return LoaderSettings(source=source, name=name, layout=layout, triton_url=triton.url, **{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """An identity model with 16 MiB of random weights beside it."""
    folder = write_model(tmp_path / "model")
    (folder / "1" / "weights.bin").write_bytes(os.urandom(WEIGHTS_BYTES))
    return folder


def model_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for _, path in files_under(folder))


@dataclass
class StagingWatch:
    """Looks at the loader's staging folders in a loop while a load runs: the largest number of bytes they held
    at once, and every regular file named like the archive."""

    staging: Path
    prefix: str
    archive_name: str
    peak_bytes: int = 0
    archives_seen: set[str] = field(default_factory=set)
    looks: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.done.is_set():
            self.look()

    def look(self) -> None:
        total = 0
        for top in [e for e in os.scandir(self.staging) if e.name.startswith(self.prefix)]:
            for folder, _, names in os.walk(top.path):
                for name in names:
                    try:
                        info = os.lstat(os.path.join(folder, name))
                    except FileNotFoundError:
                        continue  # discarded while we looked
                    if stat.S_ISREG(info.st_mode):  # the named pipe the archive streams through is no file
                        total += info.st_size
                        if name == self.archive_name:
                            self.archives_seen.add(os.path.join(folder, name))
        self.peak_bytes = max(self.peak_bytes, total)
        self.looks += 1


def watching(staging: Path, prefix: str, archive_name: str, load: Callable[[], int]) -> tuple[int, StagingWatch]:
    watch = StagingWatch(staging, prefix, archive_name)
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    try:
        code = load()
    finally:
        watch.done.set()
        watcher.join(10)
    return code, watch


def test_a_tar_gz_over_http_is_unpacked_as_it_arrives_never_stored_and_served(
    layout: NodeLayout,
    triton: TritonServer,
    http_server: HttpFileServer,
    model: Path,
    model_name: str,
    tmp_path: Path,
    cleanup: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = http_server.serve(make_tar(model, tmp_path / "model.tar.gz", arcname="model"))
    caplog.set_level(logging.INFO, logger="tritonshare")
    cleanup.append(model_name)
    conf = settings(layout, triton, url, model_name)
    code, watch = watching(layout.staging, f"{model_name}.", "model.tar.gz", lambda: run(conf))
    assert code == ExitCode.OK
    assert "phase download took" in caplog.text and "s (unpacked as it arrived)" in caplog.text
    assert "phase unpack took" not in caplog.text
    assert watch.looks >= 10 and watch.peak_bytes >= WEIGHTS_BYTES // 2  # it watched while the files landed
    assert not watch.archives_seen  # the archive never landed in staging...
    assert watch.peak_bytes < model_bytes(model) + (1 << 20)  # ...so staging never held much more than the model
    installed = tree_bytes(layout.model_dir(model_name))
    assert installed["1/weights.bin"] == (model / "1" / "weights.bin").read_bytes()
    assert set(installed) == {"1/__pycache__", "1/model.py", "1/weights.bin", "config.pbtxt", RECORD_FILE}
    assert TritonClient(triton.url).model_ready(model_name)

    first = read_record(layout.model_dir(model_name))
    assert run(conf) == ExitCode.OK  # the record of a streamed install is the one a restarted loader finds
    assert read_record(layout.model_dir(model_name)) == first and "already holds" in caplog.text


@pytest.mark.parametrize("store", ["s3_server", "gcs_server"])
def test_a_tar_gz_in_s3_or_gcs_is_streamed_too(
    store: str,
    request: pytest.FixtureRequest,
    layout: NodeLayout,
    triton: TritonServer,
    model: Path,
    model_name: str,
    tmp_path: Path,
    cleanup: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    archive = make_tar(model, tmp_path / "model.tar.gz", arcname="model")
    uri = request.getfixturevalue(store).put("models", "archives/model.tar.gz", archive.read_bytes())
    caplog.set_level(logging.INFO, logger="tritonshare")
    cleanup.append(model_name)
    assert run(settings(layout, triton, uri, model_name)) == ExitCode.OK
    assert "s (unpacked as it arrived)" in caplog.text and "phase unpack took" not in caplog.text
    assert tree_bytes(layout.model_dir(model_name))["1/weights.bin"] == (model / "1" / "weights.bin").read_bytes()
    assert TritonClient(triton.url).model_ready(model_name)


def room_for(staging: Path, prefix: str, capacity: int) -> Callable[[Path], int]:
    """Free space of a staging volume of ``capacity`` bytes: less what the loader's folders hold now."""

    def free(_path: Path) -> int:
        held = [path for path in staging.iterdir() if path.name.startswith(prefix)]
        return capacity - sum(file.stat().st_size for folder in held for _, file in files_under(folder))

    return free


def test_a_volume_with_room_for_the_model_once_takes_a_streamed_tar_but_not_a_zip(
    layout: NodeLayout,
    triton: TritonServer,
    http_server: HttpFileServer,
    model: Path,
    model_name: str,
    tmp_path: Path,
    cleanup: list[str],
) -> None:
    """Peak disk use: a tar is unpacked as it streams, so it needs room for the model once; a zip (its directory
    is at its end) must land before it is unpacked, so it needs room for the archive and the model."""
    free = room_for(layout.staging, f"{model_name}.", capacity=model_bytes(model) * 3 // 2)
    zip_url = http_server.serve(make_zip(model, tmp_path / "model.zip", arcname="model"))
    with pytest.raises(InsufficientSpace, match=r"model.zip: unpacking .* free space on the node"):
        run(settings(layout, triton, zip_url, model_name), disk_free=free)
    assert not layout.model_dir(model_name).exists()

    tar_url = http_server.serve(make_tar(model, tmp_path / "model.tar.gz", arcname="model"))
    cleanup.append(model_name)
    assert run(settings(layout, triton, tar_url, model_name), disk_free=free) == ExitCode.OK
    assert TritonClient(triton.url).model_ready(model_name)


def damaged_at_the_source(model: Path, tmp_path: Path) -> Path:
    """The archive cut in the middle of its weights, served as it is (its size and checksums agree)."""
    whole = make_tar(model, tmp_path / "whole.tar.gz", arcname="model").read_bytes()
    cut = tmp_path / "model.tar.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    return cut


def cut_at_a_member_boundary(model: Path, tmp_path: Path) -> Path:
    """The tar cut right before its last member, then gzipped whole: the gzip stream ends as it should, the tar
    has no end-of-archive marker, the model misses a file; served as it is (its size and checksums agree)."""
    whole = make_tar(model, tmp_path / "whole.tar", compression="", arcname="model").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        last = tar.getmembers()[-1]
    cut = tmp_path / "model.tar.gz"
    cut.write_bytes(gzip.compress(whole[: last.offset], compresslevel=1))
    return cut


def gzip_trailer_missing(model: Path, tmp_path: Path) -> Path:
    """The whole tar, but the gzip stream without its last 8 bytes (CRC-32 and length), served as it is."""
    whole = make_tar(model, tmp_path / "whole.tar.gz", arcname="model").read_bytes()
    cut = tmp_path / "model.tar.gz"
    cut.write_bytes(whole[:-8])
    return cut


UNREADABLE = "model.tar.gz: not a readable tar archive"


def climbing_out(model: Path, tmp_path: Path) -> Path:
    archive = tmp_path / "model.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(model, arcname="model")
        info = tarfile.TarInfo("../../escaped.pbtxt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    return archive


@pytest.mark.parametrize(
    ("make", "fault", "code", "reason", "gets"),
    [
        (None, Fault(corrupt=True), ExitCode.SOURCE_TRANSIENT, "model.tar.gz: sha256 checksum mismatch", 2),
        (damaged_at_the_source, None, ExitCode.SOURCE_PERMANENT, UNREADABLE, 1),
        (cut_at_a_member_boundary, None, ExitCode.SOURCE_PERMANENT, f"{UNREADABLE} (it ends after", 1),
        (gzip_trailer_missing, None, ExitCode.SOURCE_PERMANENT, f"{UNREADABLE} (its gzip stream stops before", 1),
        (climbing_out, None, ExitCode.SOURCE_PERMANENT, "model.tar.gz: member '../../escaped.pbtxt' is refused", 1),
    ],
    ids=[
        "corrupted-in-transit",
        "truncated-at-the-source",
        "cut-at-a-member-boundary",
        "gzip-trailer-missing",
        "member-climbing-out",
    ],
)
def test_a_damaged_archive_exits_with_its_code_and_leaves_nothing(
    node_root: Path,
    triton: TritonServer,
    http_server: HttpFileServer,
    model: Path,
    model_name: str,
    tmp_path: Path,
    make: Callable[[Path, Path], Path] | None,
    fault: Fault | None,
    code: ExitCode,
    reason: str,
    gets: int,
) -> None:
    archive = (make or (lambda m, t: make_tar(m, t / "model.tar.gz", arcname="model")))(model, tmp_path)
    url = http_server.serve(archive)
    if fault is not None:
        http_server.fail("/model.tar.gz", fault)
    node = Node(node_root)
    before = {p.name for p in node.layout.staging.iterdir()}
    outcome = run_load(node, triton.url, url, model_name, "--retries", "1")
    assert outcome.code == code, outcome.log
    assert reason in outcome.message and outcome.message.count("\n") == 1  # one line in the pod status
    assert [m for m, _ in http_server.requests].count("GET") == gets  # only a transient failure is retried
    assert not node.layout.model_dir(model_name).exists()
    assert {p.name for p in node.layout.staging.iterdir()} == before  # nothing left in staging
    assert not (node_root / "escaped.pbtxt").exists() and not (node.layout.staging / "escaped.pbtxt").exists()
