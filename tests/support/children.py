"""Servers the tests start as child processes: none may outlive the test run that started it; their memory."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path


def die_with_parent() -> None:
    """In the child before exec (``preexec_fn``): get SIGTERM when the parent dies, so a test run that is killed
    (a timeout, ^C twice, SIGKILL) leaves no server behind. Linux; the parent is the thread that started the
    child, so start it from the thread that outlives it (the tests start their servers from the main thread)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def vm_kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` figure in KiB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/{pid}/status")


def socket_inodes(pid: int) -> set[str]:
    """The inodes of process ``pid``'s sockets, read from its ``/proc`` fd links; an fd closed between the listing
    and its reading (the process closing connections as a test watches it) is passed over. Raises
    FileNotFoundError when the process is gone."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except FileNotFoundError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    return inodes
