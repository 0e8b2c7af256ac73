"""file:// and plain paths: listing semantics and streaming, on real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tritonshare.common.errors import SourceError, SourceNotFound, UnsafeArchive, UsageError
from tritonshare.loader.sources import open_source
from tritonshare.loader.sources.local import LocalSource


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_folder_lists_every_file_with_its_relative_path_and_size(tmp_path: Path) -> None:
    write(tmp_path / "m" / "config.pbtxt", b"backend: 'python'\n")
    write(tmp_path / "m" / "1" / "model.py", b"x" * 1000)
    objects = open_source(str(tmp_path / "m")).list()
    assert [(o.relpath, o.size) for o in objects] == [("config.pbtxt", 18), ("1/model.py", 1000)]
    assert all(o.checksum is None and o.version for o in objects)


def test_file_uri_and_plain_path_open_the_same_folder(tmp_path: Path) -> None:
    write(tmp_path / "m" / "a b.txt", b"1")
    by_uri = open_source(f"file://{tmp_path}/m").list()
    by_quoted_uri = open_source(f"file://{tmp_path}/m/a%20b.txt").list()
    assert [o.relpath for o in by_uri] == ["a b.txt"] == [o.relpath for o in by_quoted_uri]


def test_one_file_is_one_object_named_by_its_base_name(tmp_path: Path) -> None:
    write(tmp_path / "model.tar.gz", b"archive")
    (obj,) = open_source(str(tmp_path / "model.tar.gz")).list()
    assert (obj.relpath, obj.size, obj.key) == ("model.tar.gz", 7, str(tmp_path / "model.tar.gz"))


def test_a_missing_path_is_not_found_and_names_it(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFound, match=f"{tmp_path}/nope: no such file or folder"):
        LocalSource(str(tmp_path / "nope")).list()


def test_an_empty_folder_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(SourceNotFound, match="the folder is empty"):
        LocalSource(str(tmp_path / "empty")).list()


def test_a_link_leaving_the_folder_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "m" / "config.pbtxt", b"")
    os.symlink("/etc/hostname", tmp_path / "m" / "stolen")
    with pytest.raises(UnsafeArchive, match="stolen links outside the model folder"):
        LocalSource(str(tmp_path / "m")).list()


def test_a_link_inside_the_folder_is_followed(tmp_path: Path) -> None:
    write(tmp_path / "m" / "1" / "weights.bin", b"w" * 10)
    os.symlink("1/weights.bin", tmp_path / "m" / "alias.bin")
    objects = LocalSource(str(tmp_path / "m")).list()
    assert sorted((o.relpath, o.size) for o in objects) == [("1/weights.bin", 10), ("alias.bin", 10)]


def test_a_link_to_a_folder_inside_is_followed_like_a_link_to_a_file(tmp_path: Path) -> None:
    """``2 -> 1`` (one set of weights served as two versions), ``1 -> v1``: the folder's files are listed under
    the link's name too. They were dropped without a word, so the model installed lacked those versions."""
    write(tmp_path / "m" / "1" / "weights.bin", b"w" * 10)
    os.symlink("1", tmp_path / "m" / "2")
    objects = LocalSource(str(tmp_path / "m")).list()
    assert sorted((o.relpath, o.size) for o in objects) == [("1/weights.bin", 10), ("2/weights.bin", 10)]


@pytest.mark.parametrize("link", [".", "..", "../.."], ids=["itself", "its-parent", "the-model-folder"])
def test_a_link_to_a_folder_holding_it_is_refused_rather_than_walked_forever(tmp_path: Path, link: str) -> None:
    write(tmp_path / "m" / "1" / "sub" / "weights.bin", b"w")
    os.symlink(link, tmp_path / "m" / "1" / "sub" / "loop")
    with pytest.raises(SourceError, match=r"1/sub/loop links to a folder holding it"):
        LocalSource(str(tmp_path / "m")).list()


def test_two_links_leading_to_each_other_are_refused_rather_than_walked_forever(tmp_path: Path) -> None:
    write(tmp_path / "m" / "a" / "x", b"x")
    write(tmp_path / "m" / "b" / "y", b"y")
    os.symlink("../b", tmp_path / "m" / "a" / "to-b")
    os.symlink("../a", tmp_path / "m" / "b" / "to-a")
    with pytest.raises(SourceError, match=r"links to a folder holding it"):
        LocalSource(str(tmp_path / "m")).list()


def test_a_host_in_a_file_uri_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="drop the host 'server'"):
        open_source("file://server/models/m")


def test_an_unknown_scheme_names_the_supported_ones() -> None:
    with pytest.raises(UsageError, match=r"unsupported scheme 'ftp' — use one of .*file://"):
        open_source("ftp://host/m")


def test_fetch_streams_the_bytes_and_reports_progress(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 5)
    write(tmp_path / "m" / "big.bin", data)
    source = LocalSource(str(tmp_path / "m"))
    (obj,) = source.list()
    seen: list[int] = []
    source.fetch(obj, tmp_path / "out.bin", seen.append, 5.0)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert sum(seen) == len(data) and len(seen) == 4  # bounded 1 MiB chunks


def test_fetch_of_a_file_removed_after_listing_is_not_found(tmp_path: Path) -> None:
    write(tmp_path / "m" / "gone.bin", b"x")
    source = LocalSource(str(tmp_path / "m"))
    (obj,) = source.list()
    (tmp_path / "m" / "gone.bin").unlink()
    with pytest.raises(SourceNotFound, match="gone.bin: no such file"):
        source.fetch(obj, tmp_path / "out.bin", lambda _: None, 5.0)


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("s3:/bucket/x", "s3://bucket/x"), ("gs:/models/identity", "gs://models/identity"), ("HTTPS:/h/m", "https://h/m")],
)
def test_a_uri_with_one_slash_is_a_usage_error_naming_the_uri_meant(
    typed: str, meant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # were it read as a path, a folder "s3:" here would be copied
    write(tmp_path / typed.lower() / "config.pbtxt", b"")
    with pytest.raises(UsageError, match=f"one slash after .* — did you mean {meant}\\?"):
        open_source(typed)


def test_an_unknown_scheme_with_one_slash_names_the_supported_ones() -> None:
    with pytest.raises(UsageError, match=r"unsupported scheme 'ftp': use one of .*s3://"):
        open_source("ftp:/host/m")


def test_a_file_uri_with_one_slash_is_a_local_path(tmp_path: Path) -> None:
    write(tmp_path / "m" / "config.pbtxt", b"x")
    (obj,) = open_source(f"file:{tmp_path}/m").list()
    assert obj.key == str(tmp_path / "m" / "config.pbtxt")


def test_a_local_path_with_a_colon_is_read_when_it_starts_with_dot_slash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "s3:" / "m" / "config.pbtxt", b"x")
    (obj,) = open_source("./s3:/m").list()
    assert obj.relpath == "config.pbtxt"


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_source_is_a_usage_error_not_the_working_directory(
    empty: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "config.pbtxt", b"")
    with pytest.raises(UsageError, match="source '': empty"):
        open_source(empty)
