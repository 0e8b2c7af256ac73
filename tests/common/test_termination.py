"""The termination message as the kubelet reads it: the file's last 4096 bytes."""

from __future__ import annotations

from pathlib import Path

from tritonshare.common.termination import write_termination_message


def kubelet_reads(path: Path) -> str:
    """What the pod status shows: the last 4096 bytes of the file (kubelet's tail.ReadAtMost), as UTF-8."""
    return path.read_bytes()[-4096:].decode("utf-8")


def test_a_short_message_is_written_whole_on_one_line(tmp_path: Path) -> None:
    write_termination_message("m1: access denied — check the pod's credentials", tmp_path / "log")
    assert kubelet_reads(tmp_path / "log") == "m1: access denied — check the pod's credentials\n"


def test_a_long_message_keeps_its_beginning_within_4096_bytes_of_whole_characters(tmp_path: Path) -> None:
    """Regression: the message was cut at 4000 characters, so one quoting non-ASCII text (a server's page, a
    reason full of "—") ran past 4096 bytes, and the kubelet, which keeps the END of the file, dropped the part
    saying what failed."""
    message = "s3://bucket/m/: access denied — " + "—" * 3000 + " the end"
    write_termination_message(message, tmp_path / "log")
    data = (tmp_path / "log").read_bytes()
    assert len(data) <= 4096
    shown = kubelet_reads(tmp_path / "log")  # whole characters: it decodes
    assert shown.startswith("s3://bucket/m/: access denied — ") and shown.endswith("—…\n")
    assert len(shown.encode()) > 4090  # cut where it had to be, not before


def test_a_message_of_exactly_the_limit_is_not_cut(tmp_path: Path) -> None:
    write_termination_message("x" * 4095, tmp_path / "log")
    assert (tmp_path / "log").read_bytes() == b"x" * 4095 + b"\n"
