from __future__ import annotations

from pathlib import Path

import pytest

from tritonshare.common.errors import InstallConflict
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import (
    InstallRecord,
    new_staging_dir,
    publish,
    read_record,
    retire,
    write_record,
)


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


def test_retire_renames_out_then_deletes(node: NodeLayout) -> None:
    (node.repository / "m" / "1").mkdir(parents=True)
    assert retire(node, "m") is True
    assert not (node.repository / "m").exists()
    assert list(node.staging.iterdir()) == []
    assert retire(node, "m") is False


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
