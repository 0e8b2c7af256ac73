from __future__ import annotations

from pathlib import Path

import pytest

from tritonshare.common.errors import ExitCode, UsageError
from tritonshare.common.layout import NodeLayout, check_model_name


@pytest.mark.parametrize("name", ["resnet50", "a", "m-1.2_x", "A" * 128])
def test_valid_model_names_pass(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "-x", ".hidden", "a/b", "a%2Fb", "a b", "A" * 129, "é"])
def test_invalid_model_names_are_usage_errors(name: str) -> None:
    with pytest.raises(UsageError, match="model name") as info:
        check_model_name(name)
    assert info.value.exit_code == ExitCode.USAGE


def test_layout_accepts_sibling_folders(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging").check()


def test_staging_inside_repository_is_refused(tmp_path: Path) -> None:
    (tmp_path / "models" / "staging").mkdir(parents=True)
    layout = NodeLayout(repository=tmp_path / "models", staging=tmp_path / "models" / "staging")
    with pytest.raises(UsageError, match="inside the repository"):
        layout.check()


def test_missing_folders_name_the_folder(tmp_path: Path) -> None:
    layout = NodeLayout(repository=tmp_path / "nope", staging=tmp_path)
    with pytest.raises(UsageError, match=str(tmp_path / "nope")):
        layout.check()


def test_different_filesystems_are_refused(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.fail("this test needs /dev/shm on a filesystem other than the temp folder")
    (tmp_path / "models").mkdir()
    layout = NodeLayout(repository=tmp_path / "models", staging=shm)
    with pytest.raises(UsageError, match="different filesystems"):
        layout.check()
