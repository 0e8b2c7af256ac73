"""Mounts for tests that need the kernel's view of them (root only; skipped elsewhere)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tritonshare.common.layout import NodeLayout


def mount(*args: str) -> None:
    out = subprocess.run(["mount", *args], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount here (needs root): {out.stderr.strip()}")


@contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (created) on its own tmpfs of ``size`` (mount's ``size=`` option, e.g. "1m"); unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder))
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@contextmanager
def two_mounts(root: Path) -> Iterator[NodeLayout]:
    """models/ and staging/ as two bind mounts of one filesystem (two hostPath or subPath volumes): the same
    st_dev, but rename(2) does not cross mounts."""
    host, mounted = root / "host", root / "mnt"
    for sub in ("models", "staging"):
        (host / sub).mkdir(parents=True)
        (mounted / sub).mkdir(parents=True)
    mount("--bind", str(host / "models"), str(mounted / "models"))
    try:
        mount("--bind", str(host / "staging"), str(mounted / "staging"))
        try:
            yield NodeLayout(repository=mounted / "models", staging=mounted / "staging", leases=host / "leases")
        finally:
            subprocess.run(["umount", str(mounted / "staging")], check=True)
    finally:
        subprocess.run(["umount", str(mounted / "models")], check=True)
