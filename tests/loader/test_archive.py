"""Safe unpacking: what a model archive may and may not do to the node's disk. Archives are built
member by member so each hostile shape (``..``, absolute paths, links out, devices) is exact."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tritonshare.common.errors import ExitCode, InsufficientSpace, InvalidModel, UnsafeArchive
from tritonshare.loader.archive import (
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    Budget,
    looks_like_html,
    member_target,
    unpack,
    unpack_tar,
    unpacker_for,
)

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


# ------------------------------------------------------------------------------ an archive that ends early
# tarfile's stream mode takes the end of the data for the end of the archive; a truncated upload whose stated
# size and checksum were taken of the cut bytes would install a model missing files. Refused as cut short.

CUT_SHORT = r"model\.tar(\.gz)?: not a readable tar archive \(.*: it was cut short\) — upload the whole archive again"
COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "tar": lambda data: data,
    "gzip": gzip.compress,
    "bzip2": bz2.compress,
    "xz": lzma.compress,
}


def tar_of(tmp_path: Path, members: list[Member] = MODEL) -> bytes:
    return make_tar(tmp_path / "whole.tar", members, "w").read_bytes()


def end_of_members(tar: bytes) -> int:
    """Where the last member's data ends (its padding included): where the end-of-archive marker begins."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as reader:
        last = reader.getmembers()[-1]
    return last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def write_archive(tmp_path: Path, data: bytes, compression: str) -> Path:
    """``data`` compressed; named .tar.gz for gzip, .tar otherwise (bzip2 and xz are told by their first bytes)."""
    archive = tmp_path / ("model.tar.gz" if compression == "gzip" else "model.tar")
    archive.write_bytes(COMPRESSORS[compression](data))
    return archive


@pytest.mark.parametrize("compression", COMPRESSORS)
def test_a_tar_cut_at_a_member_boundary_is_refused_as_cut_short(tmp_path: Path, dest: Path, compression: str) -> None:
    tar = tar_of(tmp_path)
    archive = write_archive(tmp_path, tar[: end_of_members(tar)], compression)  # a whole compressed stream
    with pytest.raises(InvalidModel, match=CUT_SHORT) as info:
        unpack(archive, dest)
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT
    assert f"it ends after {end_of_members(tar)} bytes of tar, before the tar's end-of-archive marker" in str(
        info.value
    )


@pytest.mark.parametrize(("compression", "cut"), [("gzip", 8), ("gzip", 1), ("bzip2", 4), ("xz", 12)])
def test_a_compressed_stream_missing_its_last_bytes_is_refused_as_cut_short(
    tmp_path: Path, dest: Path, compression: str, cut: int
) -> None:
    """gzip's last 8 bytes are its CRC-32 and length, xz's last 12 its footer: the tar inside is whole."""
    archive = write_archive(tmp_path, tar_of(tmp_path), compression)
    archive.write_bytes(archive.read_bytes()[:-cut])
    with pytest.raises(InvalidModel, match=CUT_SHORT) as info:
        unpack(archive, dest)
    assert f"its {compression} stream stops before the stream's end" in str(info.value)
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


@pytest.mark.parametrize("compression", COMPRESSORS)
def test_a_tar_ending_in_one_zero_block_is_whole(tmp_path: Path, dest: Path, compression: str) -> None:
    """Some writers end with one zero block, not two; GNU tar accepts that (with a warning), so do we."""
    tar = tar_of(tmp_path)
    archive = write_archive(tmp_path, tar[: end_of_members(tar) + tarfile.BLOCKSIZE], compression)
    assert unpack(archive, dest) == len(MODEL)
    assert (dest / "model" / "1" / "weights.bin").read_bytes() == bytes(range(256)) * 64


def write_tree(root: Path, members: list[Member] = MODEL) -> Path:
    for kind, name, data in members:
        if kind == "dir":
            (root / name).mkdir(parents=True, exist_ok=True)
        else:
            (root / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return root


@pytest.mark.parametrize("tool", ["tar", "bsdtar"])
@pytest.mark.parametrize(
    ("flags", "name"), [("-cf", "m.tar"), ("-czf", "m.tar.gz"), ("-cjf", "m.tar"), ("-cJf", "m.tar")]
)
def test_what_gnu_tar_and_bsdtar_write_is_whole(tmp_path: Path, dest: Path, tool: str, flags: str, name: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (Debian: libarchive-tools)")
    root = write_tree(tmp_path / "src")
    subprocess.run([tool, flags, str(tmp_path / name), "-C", str(root), "model"], check=True)
    assert unpack(tmp_path / name, dest) == len(MODEL)
    assert (dest / "model" / "1" / "weights.bin").read_bytes() == bytes(range(256)) * 64


def test_a_gnu_tar_archive_cut_at_a_member_boundary_is_refused(tmp_path: Path, dest: Path) -> None:
    root = write_tree(tmp_path / "src")
    subprocess.run(["tar", "-cf", str(tmp_path / "whole.tar"), "-C", str(root), "model"], check=True)
    tar = (tmp_path / "whole.tar").read_bytes()
    archive = write_archive(tmp_path, tar[: end_of_members(tar)], "gzip")
    with pytest.raises(InvalidModel, match=CUT_SHORT):
        unpack(archive, dest)


def test_a_block_neither_member_nor_end_marker_is_refused(tmp_path: Path, dest: Path) -> None:
    """tarfile's stream mode also took an unreadable header after the first member for the end."""
    tar = tar_of(tmp_path)
    end = end_of_members(tar)
    archive = write_archive(tmp_path, tar[:end] + b"\xff" * tarfile.BLOCKSIZE + tar[end:], "gzip")
    with pytest.raises(InvalidModel, match=rf"at byte {end} of the tar stands a block that is neither") as info:
        unpack(archive, dest)
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


def test_a_gzip_stream_with_a_wrong_checksum_is_refused(tmp_path: Path, dest: Path) -> None:
    archive = write_archive(tmp_path, tar_of(tmp_path), "gzip")
    data = bytearray(archive.read_bytes())
    data[-8] ^= 0xFF  # the CRC-32 of the uncompressed bytes: tarfile's stream mode never read it
    archive.write_bytes(bytes(data))
    with pytest.raises(InvalidModel, match=r"model\.tar\.gz: not a readable tar archive \(damaged gzip data: .*check"):
        unpack(archive, dest)


@pytest.mark.parametrize("compression", ["gzip", "bzip2"])
def test_concatenated_streams_read_as_one(tmp_path: Path, dest: Path, compression: str) -> None:
    """As ``gzip -d`` reads ``cat a.gz b.gz`` (and pbzip2 writes bzip2): the end marker is in the second stream."""
    tar = tar_of(tmp_path)
    half = len(tar) // 2
    compress = COMPRESSORS[compression]
    archive = tmp_path / "model.tar"
    archive.write_bytes(compress(tar[:half]) + compress(tar[half:]))
    assert unpack(archive, dest) == len(MODEL)
    assert (dest / "model" / "1" / "weights.bin").read_bytes() == bytes(range(256)) * 64


def test_zeros_after_the_gzip_stream_are_ignored(tmp_path: Path, dest: Path) -> None:
    """Padding a tape or a careless copy leaves; ``gzip -d`` ignores it too."""
    archive = write_archive(tmp_path, tar_of(tmp_path), "gzip")
    archive.write_bytes(archive.read_bytes() + bytes(10240))
    assert unpack(archive, dest) == len(MODEL)


@pytest.mark.parametrize("compression", ["tar", "gzip"])
def test_from_a_pipe_reading_stops_at_the_archives_end(tmp_path: Path, dest: Path, compression: str) -> None:
    """As the streamed download feeds it: what follows the archive's end (the record's zero padding, bytes
    after the gzip stream) is not waited for; the writer still holds the pipe open when the unpack returns."""
    tar = tar_of(tmp_path)
    data = COMPRESSORS[compression](tar[: end_of_members(tar) + tarfile.BLOCKSIZE]) + bytes(4096)
    pipe = tmp_path / "model.tar.gz"
    os.mkfifo(pipe)
    unpacked = threading.Event()
    writer = threading.Thread(target=hold_open_after_writing, args=(pipe, data, unpacked))
    writer.start()
    try:
        assert unpack_tar(pipe, dest, Budget(pipe, None)) == len(MODEL)
        assert writer.is_alive()  # the pipe has not ended: the unpack did not wait for it to
    finally:
        unpacked.set()
        writer.join(10)


def hold_open_after_writing(pipe: Path, data: bytes, unpacked: threading.Event) -> None:
    with open(pipe, "wb") as out:
        out.write(data)
        out.flush()
        unpacked.wait(10)


# ------------------------------------------------------------------ links judged in the finished tree


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_link_that_a_later_link_carries_outside_is_refused_and_nothing_is_written_out(
    tmp_path: Path, dest: Path, suffix: str
) -> None:
    # ``c/c/c/../../..`` stays inside while ``c`` does not exist; once ``c -> .`` lands, it climbs three levels
    victim = tmp_path / "out" / "victim.txt"
    victim.write_text("untouched")
    archive = make(
        tmp_path,
        suffix,
        [
            *MODEL,
            ("symlink", "model/1/victim", "c/c/c/c/../../../../../victim.txt"),
            ("symlink", "model/1/c", "."),
        ],
    )
    with pytest.raises(UnsafeArchive, match=r"'model/1/victim' links to .*outside the model folder once every member"):
        unpack(archive, dest)
    assert victim.read_text() == "untouched"


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_the_folder_itself_as_a_member_is_skipped(tmp_path: Path, dest: Path, suffix: str) -> None:
    # what ``tar -C model -czf m.tgz .`` writes: a first member ``./``, then ``./config.pbtxt``, …
    inside = [(kind, "./" + name.removeprefix("model/"), data) for kind, name, data in MODEL[1:]]
    members: list[Member] = [("dir", "./", b""), *inside]
    unpack(make(tmp_path, suffix, members), dest)
    assert (dest / "config.pbtxt").read_text() == 'backend: "python"\n'
    assert (dest / "1" / "weights.bin").stat().st_size == 256 * 64


def test_an_archive_packed_with_gnu_tar_from_inside_its_folder_unpacks(tmp_path: Path, dest: Path) -> None:
    folder = tmp_path / "model"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\n')
    (folder / "1" / "model.py").write_text("print('hi')\n")
    archive = tmp_path / "m.tgz"
    subprocess.run(["tar", "-C", str(folder), "-czf", str(archive), "."], check=True)
    unpack(archive, dest)
    assert (dest / "1" / "model.py").read_text() == "print('hi')\n"


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_the_folder_itself_as_anything_but_a_folder_is_refused(tmp_path: Path, dest: Path, kind: str) -> None:
    archive = make(tmp_path, ".tar", [(kind, "./", "x")])
    with pytest.raises(UnsafeArchive, match=r"member '\./' is refused"):
        unpack(archive, dest)


# ------------------------------------------------------------------ members that cannot be unpacked


@pytest.mark.parametrize(
    ("suffix", "members"),
    [
        (".tar.gz", [("file", "model/1", "a file"), ("file", "model/1/model.py", "x")]),
        (".zip", [("file", "model/1", "a file"), ("file", "model/1/model.py", "x")]),
        (".tar.gz", [("dir", "model", b""), ("hardlink", "model/copy.py", "model/missing.py")]),
    ],
    ids=["tar-file-as-folder", "zip-file-as-folder", "tar-hardlink-to-nothing"],
)
def test_members_that_cannot_stand_as_they_are_make_an_invalid_model(
    tmp_path: Path, dest: Path, suffix: str, members: list[Member]
) -> None:
    with pytest.raises(InvalidModel, match=r"its members cannot be unpacked as they stand") as info:
        unpack(make(tmp_path, suffix, members), dest)
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


def test_a_link_target_with_a_nul_byte_is_refused(tmp_path: Path, dest: Path) -> None:
    # a target longer than ustar's 100 bytes goes into a pax header, where a NUL survives
    archive = make(tmp_path, ".tar", [*MODEL[:2], ("symlink", "model/x", "a" * 120 + "\0b")])
    with pytest.raises(UnsafeArchive, match=r"member 'model/x' is refused"):
        unpack(archive, dest)


# ------------------------------------------------------------------ memory bounded by what is read


def test_a_huge_long_name_header_is_refused_before_it_is_read(tmp_path: Path, dest: Path) -> None:
    declared = 1 << 30  # 1 GiB of name: tarfile would read it whole into memory
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = tarfile.GNUTYPE_LONGNAME, declared
    archive = tmp_path / "long.tar.gz"
    with gzip.open(archive, "wb", compresslevel=1) as out:
        out.write(header.tobuf(format=tarfile.GNU_FORMAT))
        out.write(b"model/config.pbtxt" + bytes((1 << 20) - 18))  # the first MiB of the name: enough to refuse
    with pytest.raises(InvalidModel, match=r"of 1073741824 bytes, more than the 65536 any path needs"):
        unpack(archive, dest)


def test_a_zip_link_with_a_huge_target_is_refused_before_it_is_read(tmp_path: Path, dest: Path) -> None:
    archive = make(tmp_path, ".zip", [*MODEL[:2], ("symlink", "model/x", "a/" * 4096)])
    with pytest.raises(UnsafeArchive, match=r"member 'model/x' is refused: it is a link whose target is 8192 bytes"):
        unpack(archive, dest)


def test_memory_does_not_keep_every_member_header(tmp_path: Path, dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[int] = []
    original = tarfile.TarFile.next

    def next_member(self: tarfile.TarFile) -> tarfile.TarInfo | None:
        kept.append(len(self.members))  # type: ignore[attr-defined]
        return original(self)

    monkeypatch.setattr(tarfile.TarFile, "next", next_member)
    unpack(make(tmp_path, ".tar.gz", [*MODEL, *[("file", f"model/1/f{i}", "x") for i in range(50)]]), dest)
    assert len(kept) > 50 and max(kept) <= 1


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_member_nested_deeper_than_any_model_is_refused(tmp_path: Path, dest: Path, suffix: str) -> None:
    # 1,100 levels: the loader's tree walks hit RecursionError (exit 1) and left the workspace behind
    deep = "model/" + "d/" * 1100 + "f.py"
    archive = make(tmp_path, suffix, [*MODEL, ("file", deep, "x")])
    with pytest.raises(UnsafeArchive, match=r"its path is 1102 levels deep, more than 64"):
        unpack(archive, dest)


# ------------------------------------------------------------------ bounds, exactly


def test_a_long_name_header_just_over_the_bound_is_refused(tmp_path: Path, dest: Path) -> None:
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = tarfile.GNUTYPE_LONGNAME, MAX_HEADER_BYTES + 1
    archive = tmp_path / "long.tar"
    archive.write_bytes(header.tobuf(format=tarfile.GNU_FORMAT) + bytes(MAX_HEADER_BYTES + 512))
    with pytest.raises(InvalidModel, match=rf"of {MAX_HEADER_BYTES + 1} bytes, more than the {MAX_HEADER_BYTES}"):
        unpack(archive, dest)


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_model_of_exactly_the_free_space_unpacks_and_a_byte_more_does_not(
    tmp_path: Path, dest: Path, suffix: str
) -> None:
    files = [("file", f"model/1/part{i}.bin", bytes(1000)) for i in range(3)]  # each fits; together 3000 bytes
    archive = make(tmp_path, suffix, files)
    assert unpack(archive, dest, max_bytes=3000) == 3
    shutil.rmtree(dest / "model")
    with pytest.raises(InsufficientSpace, match=r"'model/1/part2.bin' would bring the model to 3000 bytes"):
        unpack(archive, dest, max_bytes=2999)


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_member_exactly_as_deep_as_the_bound_unpacks(tmp_path: Path, dest: Path, suffix: str) -> None:
    deepest = "/".join(["d"] * (MAX_DEPTH - 1)) + "/f.py"  # MAX_DEPTH parts
    unpack(make(tmp_path, suffix, [("file", deepest, "x")]), dest)
    assert (dest / deepest).read_text() == "x"
    with pytest.raises(UnsafeArchive, match=rf"{MAX_DEPTH + 1} levels deep"):
        unpack(make(tmp_path / "out", suffix, [("file", "d/" + deepest, "x")]), dest)


# ------------------------------------------------------------------ odd but legitimate, or odd and refused


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_windows_drive_path_is_refused(tmp_path: Path, dest: Path, suffix: str) -> None:
    with pytest.raises(UnsafeArchive, match=r"member 'C:/evil.txt' is refused: its path is absolute"):
        unpack(make(tmp_path, suffix, [("file", "C:/evil.txt", "x")]), dest)


def test_a_hard_link_in_a_folder_is_read_from_the_archives_root(tmp_path: Path, dest: Path) -> None:
    # "../x" from model/1 stays inside; from the root (where tar resolves hard links) it leaves.
    archive = make_tar(tmp_path / "m.tar", [*MODEL, ("hardlink", "model/1/copy", "../config.pbtxt")], "w")
    with pytest.raises(UnsafeArchive, match=r"it links to '\.\./config\.pbtxt', outside the model folder"):
        unpack(archive, dest)


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_a_link_to_nothing_is_refused(tmp_path: Path, dest: Path, suffix: str) -> None:
    with pytest.raises(UnsafeArchive, match=r"member 'model/x' is refused: it links to the absolute path ''"):
        unpack(make(tmp_path, suffix, [*MODEL[:2], ("symlink", "model/x", "")]), dest)


def test_a_zip_member_repeated_as_a_link_replaces_the_earlier_one(tmp_path: Path, dest: Path) -> None:
    with pytest.warns(UserWarning, match="Duplicate name"):  # zipfile's own, on writing
        archive = make_zip(
            tmp_path / "m.zip",
            [*MODEL, ("symlink", "model/1/latest", "model.py"), ("symlink", "model/1/latest", "weights.bin")],
        )
    unpack(archive, dest)
    assert os.readlink(dest / "model" / "1" / "latest") == "weights.bin"


def test_a_zip_made_without_unix_modes_unpacks_its_files(tmp_path: Path, dest: Path) -> None:
    # Windows' and many other tools' zips carry no Unix mode: external_attr's high half is 0.
    archive = tmp_path / "m.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        info = zipfile.ZipInfo("model/config.pbtxt")
        info.external_attr = 0x20  # MS-DOS "archive" attribute only
        zf.writestr(info, 'backend: "python"\n')
    unpack(archive, dest)
    assert (dest / "model" / "config.pbtxt").read_text() == 'backend: "python"\n'


def test_the_folder_itself_as_a_zip_file_is_refused(tmp_path: Path, dest: Path) -> None:
    # ("./", ending in "/", is a folder to zipfile whatever its mode, and skipped)
    with pytest.raises(UnsafeArchive, match=r"member '\.' is refused"):
        unpack(make(tmp_path, ".zip", [("file", ".", "x")]), dest)


@pytest.mark.parametrize(
    ("head", "html"),
    [
        (b"<!DOCTYPE html><html><body>Sign in</body></html>", True),
        (b"\xef\xbb\xbf\r\n  <!-- login --><HTML><head>", True),  # a BOM, blank lines, a comment, upper case
        (b"<?xml version='1.0'?><Error><Code>AccessDenied</Code></Error>", False),  # XML, not a page
        (b"PK\x03\x04model/index.html<html>", False),  # an archive holding a page is an archive
        (b"\x1f\x8b\x08\x00<html>", False),
    ],
)
def test_an_html_page_is_told_from_an_archive_that_mentions_one(head: bytes, html: bool) -> None:
    assert looks_like_html(head) is html
