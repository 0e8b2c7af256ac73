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


def test_a_layout_whose_mounts_cannot_be_read_is_judged_by_the_rest(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging").check(fdinfo=tmp_path / "no-proc")


NESTINGS = [
    pytest.param("models", "models/staging", "leases", "staging", "repository", id="staging-in-repository"),
    pytest.param("node/models", "node", "leases", "repository", "staging", id="repository-in-staging"),
    pytest.param("models", "staging", "models/leases", "leases", "repository", id="leases-in-repository"),
    pytest.param("models", "staging", "staging/leases", "leases", "staging", id="leases-in-staging"),
    pytest.param("leases/models", "staging", "leases", "repository", "leases", id="repository-in-leases"),
    pytest.param("models", "leases/staging", "leases", "staging", "leases", id="staging-in-leases"),
]


@pytest.mark.parametrize(("repository", "staging", "leases", "inner", "outer"), NESTINGS)
def test_any_folder_inside_another_is_refused_naming_both_and_what_to_set(
    tmp_path: Path, repository: str, staging: str, leases: str, inner: str, outer: str
) -> None:
    paths = {"repository": tmp_path / repository, "staging": tmp_path / staging, "leases": tmp_path / leases}
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
    with pytest.raises(UsageError) as info:
        NodeLayout(**paths).check()
    message = str(info.value)
    assert f"{inner} {paths[inner]} is inside the {outer} {paths[outer]}:" in message
    assert f"--{inner} (TRITONSHARE_{inner.upper()})" in message
    assert f"--{outer} (TRITONSHARE_{outer.upper()})" in message
    assert info.value.exit_code == ExitCode.USAGE


def test_the_repository_inside_staging_is_refused_even_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "node" / "models").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "models").symlink_to(tmp_path / "node" / "models")
    layout = NodeLayout(repository=tmp_path / "elsewhere" / "models", staging=tmp_path / "node", leases=tmp_path / "l")
    with pytest.raises(UsageError, match=f"repository {tmp_path / 'node' / 'models'} is inside the staging"):
        layout.check()


def test_two_roles_on_one_folder_are_refused(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    layout = NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging", leases=tmp_path / "staging")
    with pytest.raises(UsageError, match=f"leases {tmp_path / 'staging'} is the same folder as the staging"):
        layout.check()


def test_a_missing_leases_folder_beside_the_others_is_fine(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "staging").mkdir()
    NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging", leases=tmp_path / "leases").check()
    assert not (tmp_path / "leases").exists()  # the lease store makes it when it first writes
