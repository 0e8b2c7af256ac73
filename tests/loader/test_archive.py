"""Safe unpacking: what a model archive may and may not do to the node's disk. Archives are built
member by member so each hostile shape (``..``, absolute paths, links out, devices) is exact."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from tritonshare.common.errors import ExitCode, InsufficientSpace, InvalidModel, UnsafeArchive
from tritonshare.loader.archive import member_target, unpack, unpacker_for

Member = tuple[str, str, bytes | str]  # (kind: file|dir|symlink|hardlink|chr|fifo, name, data or link target)


def make_tar(path: Path, members: list[Member], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tar:  # type: ignore[call-overload]
        for kind, name, data in members:
            info = tarfile.TarInfo(name)
            payload = None
            if kind == "file":
                payload = data if isinstance(data, bytes) else data.encode()
                info.size = len(payload)
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            else:
                info.type = {
                    "symlink": tarfile.SYMTYPE,
                    "hardlink": tarfile.LNKTYPE,
                    "chr": tarfile.CHRTYPE,
                    "fifo": tarfile.FIFOTYPE,
                }[kind]
                info.linkname = str(data)
            tar.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return path


def make_zip(path: Path, members: list[Member]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for kind, name, data in members:
            info = zipfile.ZipInfo(name)
            kinds = {
                "file": stat.S_IFREG | 0o644,
                "dir": stat.S_IFDIR | 0o755,
                "symlink": stat.S_IFLNK | 0o777,
                "chr": stat.S_IFCHR | 0o644,
            }
            info.external_attr = kinds[kind] << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return path


MODEL: list[Member] = [
    ("dir", "model", b""),
    ("file", "model/config.pbtxt", 'backend: "python"\n'),
    ("dir", "model/1", b""),
    ("file", "model/1/model.py", "print('hi')\n"),
    ("file", "model/1/weights.bin", bytes(range(256)) * 64),
]


def make(tmp_path: Path, suffix: str, members: list[Member]) -> Path:
    path = tmp_path / f"model{suffix}"
    if suffix == ".zip":
        return make_zip(path, members)
    return make_tar(path, members, "w:gz" if suffix in (".tar.gz", ".tgz") else "w")


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    out = tmp_path / "out" / "dest"
    out.mkdir(parents=True)
    return out


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tgz", ".zip"])
def test_model_archive_unpacks_with_its_content(tmp_path: Path, dest: Path, suffix: str) -> None:
    archive = make(tmp_path, suffix, MODEL)
    assert unpack(archive, dest) == len(MODEL)
    assert (dest / "model" / "config.pbtxt").read_text() == 'backend: "python"\n'
    assert (dest / "model" / "1" / "weights.bin").read_bytes() == bytes(range(256)) * 64


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip", ".tar"])
def test_archive_without_a_suffix_is_recognised_by_its_first_bytes(tmp_path: Path, dest: Path, suffix: str) -> None:
    archive = make(tmp_path, suffix, MODEL)
    bare = archive.rename(tmp_path / "download")
    unpack(bare, dest)
    assert (dest / "model" / "1" / "model.py").exists()


def test_a_file_that_is_no_archive_is_an_invalid_model(tmp_path: Path, dest: Path) -> None:
    plain = tmp_path / "model.bin"
    plain.write_bytes(b"just bytes" * 100)
    assert unpacker_for(plain) is None
    with pytest.raises(InvalidModel, match=r"model.bin: not an archive of a known kind"):
        unpack(plain, dest)


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_truncated_archive_is_an_invalid_model(tmp_path: Path, dest: Path, suffix: str) -> None:
    archive = make(tmp_path, suffix, MODEL)
    archive.write_bytes(archive.read_bytes()[:300])
    with pytest.raises(InvalidModel, match=r"not a readable (tar|zip) archive") as info:
        unpack(archive, dest)
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


ESCAPES = ["../evil.txt", "model/../../evil.txt", "/tmp/evil.txt", "..\\evil.txt"]


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
@pytest.mark.parametrize("name", ESCAPES)
def test_a_member_climbing_out_is_refused_by_name_and_nothing_lands_outside(
    tmp_path: Path, dest: Path, suffix: str, name: str
) -> None:
    archive = make(tmp_path, suffix, [*MODEL[:2], ("file", name, "pwned")])
    with pytest.raises(UnsafeArchive, match=r"member '.*evil\.txt' is refused") as info:
        unpack(archive, dest)
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT
    assert not list(tmp_path.rglob("evil.txt"))
    assert not Path("/tmp/evil.txt").exists()


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
@pytest.mark.parametrize("link", ["/etc/passwd", "../../outside", "../../dest2"])
def test_a_symlink_pointing_out_is_refused(tmp_path: Path, dest: Path, suffix: str, link: str) -> None:
    archive = make(tmp_path, suffix, [*MODEL[:2], ("symlink", "model/escape", link)])
    with pytest.raises(UnsafeArchive, match=r"member 'model/escape' is refused: it links to"):
        unpack(archive, dest)
    assert not os.path.lexists(dest / "model" / "escape")


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_symlink_inside_the_folder_is_kept(tmp_path: Path, dest: Path, suffix: str) -> None:
    archive = make(tmp_path, suffix, [*MODEL, ("symlink", "model/1/latest.bin", "weights.bin")])
    unpack(archive, dest)
    link = dest / "model" / "1" / "latest.bin"
    assert link.is_symlink() and link.read_bytes() == (dest / "model" / "1" / "weights.bin").read_bytes()


def test_a_hardlink_to_a_file_outside_is_refused(tmp_path: Path, dest: Path) -> None:
    archive = make_tar(tmp_path / "m.tar", [*MODEL[:2], ("hardlink", "model/passwd", "../etc/passwd")], "w")
    with pytest.raises(UnsafeArchive, match=r"member 'model/passwd' is refused"):
        unpack(archive, dest)


def test_a_hardlink_inside_the_folder_is_kept(tmp_path: Path, dest: Path) -> None:
    archive = make_tar(tmp_path / "m.tar", [*MODEL, ("hardlink", "model/1/copy.bin", "model/1/weights.bin")], "w")
    unpack(archive, dest)
    assert os.path.samefile(dest / "model" / "1" / "copy.bin", dest / "model" / "1" / "weights.bin")


def test_a_link_then_a_member_written_through_it_cannot_leave(tmp_path: Path, dest: Path) -> None:
    # The classic two-step escape: a link that is harmless on its own, then a file written "inside" it.
    (dest.parent / "victim").mkdir()
    os.symlink("../victim", dest / "door")  # a link already in the folder, as an earlier member left it
    with pytest.raises(UnsafeArchive, match=r"member 'door/evil.txt' is refused: it would be written through a link"):
        member_target(dest, "door/evil.txt", tmp_path / "m.tar")


@pytest.mark.parametrize(("kind", "what"), [("chr", "device file"), ("fifo", "FIFO")])
def test_device_files_and_fifos_are_refused_in_tar(tmp_path: Path, dest: Path, kind: str, what: str) -> None:
    archive = make_tar(tmp_path / "m.tar.gz", [*MODEL[:2], (kind, "model/dev", "")])
    with pytest.raises(UnsafeArchive, match=rf"member 'model/dev' is a {what}"):
        unpack(archive, dest)
    assert not os.path.lexists(dest / "model" / "dev")


def test_device_files_are_refused_in_zip(tmp_path: Path, dest: Path) -> None:
    archive = make_zip(tmp_path / "m.zip", [*MODEL[:2], ("chr", "model/dev", b"")])
    with pytest.raises(UnsafeArchive, match=r"member 'model/dev' is a device file"):
        unpack(archive, dest)


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_an_archive_inflating_beyond_the_free_space_stops_before_filling_the_disk(
    tmp_path: Path, dest: Path, suffix: str
) -> None:
    archive = make(tmp_path, suffix, [("file", "model/1/big.bin", bytes(1 << 20))])
    assert archive.stat().st_size < 64 * 1024  # zeros compress: the listed size said nothing
    with pytest.raises(
        InsufficientSpace, match=r"unpacking 'model/1/big.bin' would bring the model to 1048576"
    ) as info:
        unpack(archive, dest, max_bytes=100_000)
    assert info.value.exit_code == ExitCode.INSUFFICIENT_SPACE
    assert not (dest / "model" / "1" / "big.bin").exists()
