from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.mounts import mount, tmpfs
from tests.support.mounts import two_mounts as bind_mounts
from tritonshare.common.errors import ExitCode, InstallConflict, InsufficientSpace, UsageError
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import (
    RECORD_FILE,
    InstallRecord,
    discard,
    move_out,
    new_staging_dir,
    publish,
    read_record,
    write_record,
)

RECORD = InstallRecord(name="m", source="s3://b/m/", digest="abc", installed_at=1.0)


@pytest.fixture
def node(tmp_path: Path) -> NodeLayout:
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    return NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging")


def test_publish_moves_the_whole_folder_in_one_rename(node: NodeLayout) -> None:
    staged = new_staging_dir(node, "m")
    (staged / "1").mkdir()
    (staged / "1" / "model.py").write_text("x")
    inode = staged.stat().st_ino
    target = publish(node, staged, "m")
    assert target == node.repository / "m"
    assert target.stat().st_ino == inode  # same directory, moved — not copied
    assert (target / "1" / "model.py").read_text() == "x"
    assert not staged.exists()


def test_publish_refuses_to_replace_an_existing_model(node: NodeLayout) -> None:
    (node.repository / "m").mkdir()
    (node.repository / "m" / "keep").write_text("theirs")
    staged = new_staging_dir(node, "m")
    with pytest.raises(InstallConflict, match="another pod"):
        publish(node, staged, "m")
    assert (node.repository / "m" / "keep").read_text() == "theirs"


def test_move_out_renames_into_staging_and_discard_deletes(node: NodeLayout) -> None:
    (node.repository / "m" / "1").mkdir(parents=True)
    trash = move_out(node, "m")
    assert trash is not None and trash.parent == node.staging and (trash / "1").is_dir()
    assert not (node.repository / "m").exists()
    discard(trash)
    assert list(node.staging.iterdir()) == []
    assert move_out(node, "m") is None


def test_record_round_trip_and_garbage(node: NodeLayout) -> None:
    folder = node.repository / "m"
    folder.mkdir()
    assert read_record(folder) is None
    record = InstallRecord(name="m", source="s3://b/m/", digest="abc", installed_at=1.0)
    write_record(folder, record)
    assert read_record(folder) == record
    assert record.same_content(InstallRecord(name="m", source="s3://b/m/", digest="abc", installed_at=2.0))
    (folder / "tritonshare.json").write_text("{not json")
    assert read_record(folder) is None


@pytest.mark.parametrize(
    ("recorded", "asked", "same"),
    [
        ("s3://b/m", "s3://b/m/", True),  # one folder, however spelled (the digest tells an object m apart)
        ("gs://b/m/", "gs://b/m", True),
        ("file:///models/m", "/models/m/", True),
        ("/models/m", "/models/./m", True),
        ("s3://b/m", "s3://b/n", False),
        ("https://h/m/", "https://h/m", False),  # two URLs a server may answer differently
    ],
)
def test_one_source_spelled_two_ways_is_the_same_install(recorded: str, asked: str, same: bool) -> None:
    """A restarted pod whose SOURCE gained a trailing slash got exit 14 against its own install."""
    record = InstallRecord(name="m", source=recorded, digest="abc")
    assert record.same_content(InstallRecord(name="m", source=asked, digest="abc")) is same
    assert not record.same_content(InstallRecord(name="m", source=asked, digest="abd"))


def test_a_record_is_readable_by_other_users_whatever_the_umask(node: NodeLayout) -> None:
    """The gc and the proxy read records, maybe as another user than the loader."""
    folder = node.repository / "m"
    folder.mkdir()
    old = os.umask(0o077)
    try:
        write_record(folder, RECORD)
    finally:
        os.umask(old)
    assert stat.S_IMODE((folder / RECORD_FILE).stat().st_mode) == 0o644
    assert [p.name for p in folder.iterdir()] == [RECORD_FILE]  # no temporary file left


def test_a_read_only_node_folder_is_a_usage_error_naming_the_mount(tmp_path: Path) -> None:
    """A read-only volume is the pod's configuration (exit 2, as for the lease folder), not exit 1, "a bug"."""
    with tmpfs(tmp_path / "node", "1m") as root:
        node = NodeLayout(repository=root / "models", staging=root / "staging")
        node.repository.mkdir()
        node.staging.mkdir()
        mount("-o", "remount,ro", str(root))
        with pytest.raises(UsageError, match=r"Read-only file system — mount the node folder read-write"):
            new_staging_dir(node, "m")


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a 1 MiB tmpfs with nothing free but what ``folder`` already holds."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "m").mkdir()
        write_record(disk / "m", RECORD)
        with pytest.raises(OSError, match="No space left"), open(disk / "filler", "wb", buffering=0) as out:
            while True:
                out.write(bytes(64 << 10))
        yield disk / "m"


def test_a_record_written_on_a_full_disk_is_insufficient_space_and_the_old_one_stays_whole(full_disk: Path) -> None:
    with pytest.raises(InsufficientSpace, match=r"tritonshare.json: the filesystem is full — free space on the node"):
        write_record(full_disk, InstallRecord(name="m", source="s3://b/other/", digest="def"))
    assert read_record(full_disk) == RECORD
    assert [p.name for p in full_disk.iterdir()] == [RECORD_FILE]


@pytest.fixture
def two_mounts(tmp_path: Path) -> Iterator[NodeLayout]:
    with bind_mounts(tmp_path) as layout:
        yield layout


def test_the_layout_check_finds_two_mounts_of_one_filesystem(two_mounts: NodeLayout) -> None:
    with pytest.raises(UsageError, match=r"are separate mounts of one filesystem"):
        two_mounts.check()


def test_publishing_across_two_mounts_of_one_filesystem_is_a_usage_error(two_mounts: NodeLayout) -> None:
    # the mounts changed after the layout check: the rename says the same
    staged = new_staging_dir(two_mounts, "m")
    (staged / "1").mkdir()
    with pytest.raises(UsageError, match=r"are separate mounts .* mount one volume holding both folders") as info:
        publish(two_mounts, staged, "m")
    assert info.value.exit_code == ExitCode.USAGE
    assert f"staging {two_mounts.staging} and the repository {two_mounts.repository}" in str(info.value)
    assert (staged / "1").is_dir()  # nothing moved: the caller discards it
    assert list(two_mounts.repository.iterdir()) == []


def test_retiring_across_two_mounts_is_the_same_usage_error(two_mounts: NodeLayout) -> None:
    (two_mounts.repository / "m" / "1").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"are separate mounts"):
        move_out(two_mounts, "m")
    assert (two_mounts.repository / "m" / "1").is_dir()
