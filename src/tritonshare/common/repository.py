"""Publishing into and removing from Triton's repository, the two filesystem moves that must be atomic.

- publish: a complete folder staged beside the repository enters it by one ``rename(2)``
  (triton#356: POLL loaded a half-copied model).
- retire: a model leaves by a rename out of the repository, then a delete in staging
  (``rm -rf`` in place is not atomic: a poll mid-delete sees a "modified" model).

Each installed model carries ``tritonshare.json``, the record of what was installed (source URI and
content digest), so a restarted init container can tell "already mine" from "someone else's".
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonshare.common.errors import InstallConflict
from tritonshare.common.layout import NodeLayout

logger = logging.getLogger(__name__)

RECORD_FILE = "tritonshare.json"


@dataclass(frozen=True, kw_only=True)
class InstallRecord:
    name: str
    source: str
    digest: str
    installed_at: float = 0.0

    def same_content(self, other: InstallRecord) -> bool:
        return (self.name, self.source, self.digest) == (other.name, other.source, other.digest)


def read_record(model_dir: Path) -> InstallRecord | None:
    try:
        doc = json.loads((model_dir / RECORD_FILE).read_text())
        return InstallRecord(
            name=str(doc["name"]),
            source=str(doc["source"]),
            digest=str(doc["digest"]),
            installed_at=float(doc.get("installed_at", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(model_dir: Path, record: InstallRecord) -> None:
    (model_dir / RECORD_FILE).write_text(json.dumps(asdict(record), indent=2) + "\n")


def new_staging_dir(layout: NodeLayout, name: str, purpose: str = "download") -> Path:
    """A fresh, uniquely named folder in staging (never inside the repository)."""
    path = layout.staging / f"{name}.{purpose}.{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o755)
    return path


def publish(layout: NodeLayout, staged: Path, name: str) -> Path:
    """Move a complete model folder into the repository with one rename. Refuses to replace an
    existing folder (``rename`` onto a non-empty directory fails, and onto an empty one we check first)."""
    target = layout.model_dir(name)
    if target.exists():
        raise InstallConflict(f"{target} appeared while installing — another pod is installing {name!r}")
    try:
        os.rename(staged, target)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise InstallConflict(f"{target} appeared while installing — another pod is installing {name!r}") from exc
        raise
    logger.info("published %s", target)
    return target


def retire(layout: NodeLayout, name: str) -> bool:
    """Rename ``repository/NAME`` out into staging, then delete it. Returns False if it was not there."""
    source = layout.model_dir(name)
    trash = layout.staging / f"{name}.retired.{uuid.uuid4().hex[:12]}"
    try:
        os.rename(source, trash)
    except FileNotFoundError:
        return False
    logger.info("moved %s out of the repository to %s", source, trash)
    discard(trash)
    return True


def discard(path: Path) -> None:
    """Delete a staging folder; never raises (a leftover is reported, and gc removes it later)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``predicate()`` until true or the deadline; returns the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
