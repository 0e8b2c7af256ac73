"""Where things live on a node: Triton's repository, and the staging and leases folders beside it.

Default layout (REFERENCE §2: staging must be outside the repository root, on the same filesystem; none of the
three folders may lie inside another, :meth:`NodeLayout.check`)::

    /var/lib/tritonshare/
    ├── models/     Triton's --model-repository (POLL mode); one folder per model NAME
    ├── staging/    downloads in progress and folders on their way out
    └── leases/     which pods use each model, with their heartbeats (common/lease.py)
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tritonshare.common.errors import UsageError

DEFAULT_ROOT = Path("/var/lib/tritonshare")
DEFAULT_REPOSITORY = DEFAULT_ROOT / "models"
DEFAULT_STAGING = DEFAULT_ROOT / "staging"
DEFAULT_LEASES = DEFAULT_ROOT / "leases"
FDINFO = Path("/proc/self/fdinfo")
# what to do when staging and the repository are separate mounts (the layout check; the publishing rename)
ONE_VOLUME = "mount one volume holding both folders, e.g. one hostPath for their parent, not one volume or subPath each"

# Triton model names are folder names; keep them to a portable, URL-safe set so the proxy can match
# them exactly in paths and protobuf fields.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_model_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise UsageError(
            f"model name {name!r} is not valid — use 1-128 characters of letters, digits, '_', '-', '.', "
            "starting with a letter or digit"
        )
    return name


def is_model_name(name: str) -> bool:
    """Whether ``name`` is a valid model name (:func:`check_model_name` without the error)."""
    return bool(_NAME.fullmatch(name)) and name not in (".", "..")


@dataclass(frozen=True, kw_only=True)
class NodeLayout:
    repository: Path = DEFAULT_REPOSITORY
    staging: Path = DEFAULT_STAGING
    leases: Path = DEFAULT_LEASES  # outside the repository: a file in a model folder would make POLL reload it

    def model_dir(self, name: str) -> Path:
        return self.repository / name

    def check(self, fdinfo: Path = FDINFO) -> None:
        """Both folders exist; repository, staging and leases are apart (none inside another) and staging is
        on the repository's filesystem, through the same mount (``fdinfo``: where the kernel tells it)."""
        for label, path in (("repository", self.repository), ("staging", self.staging)):
            if not path.is_dir():
                raise UsageError(f"{label} folder {path} does not exist — create it or mount the node folder")
        folders = {label: path.resolve() for label, path in self._folders().items()}
        for outer, inner in itertools.permutations(folders, 2):
            if folders[inner] == folders[outer] or folders[outer] in folders[inner].parents:
                raise _nested(inner, folders[inner], outer, folders[outer])
        repo, staging = folders["repository"], folders["staging"]
        if os.stat(repo).st_dev != os.stat(staging).st_dev:
            raise UsageError(
                f"staging {staging} and repository {repo} are on different filesystems, so a model cannot "
                "be published by one rename — put both under the same mount"
            )
        mounts = {_mount_id(repo, fdinfo), _mount_id(staging, fdinfo)}
        if len(mounts) > 1 and None not in mounts:
            raise UsageError(
                f"staging {staging} and repository {repo} are separate mounts of one filesystem, and rename(2) "
                f"does not cross mounts, so a model cannot be published — {ONE_VOLUME}"
            )

    def _folders(self) -> dict[str, Path]:
        return {"repository": self.repository, "staging": self.staging, "leases": self.leases}


def _mount_id(folder: Path, fdinfo: Path) -> str | None:
    """The id of the mount ``folder`` is reached through, as the kernel resolved it (the ``mnt_id`` of an open
    descriptor, proc(5)); None where it cannot be read (not Linux): the publishing rename then finds two
    mounts out, after the download."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        with open(fdinfo / str(fd)) as info:
            return next((line.split()[1] for line in info if line.startswith("mnt_id:")), None)
    except OSError:
        return None
    finally:
        os.close(fd)


# What goes wrong when a folder lies inside another, by the outer folder.
_INSIDE = {
    "repository": "Triton takes every folder in its repository for a model (partial downloads, lease files)",
    "staging": "staging holds only tritonshare's temporary folders, which loaders and gc delete",
    "leases": "the lease store takes every folder in it for a model's leases",
}
_DEFAULTS = {"repository": DEFAULT_REPOSITORY, "staging": DEFAULT_STAGING, "leases": DEFAULT_LEASES}


def _nested(inner: str, inner_path: Path, outer: str, outer_path: Path) -> UsageError:
    where = "is the same folder as" if inner_path == outer_path else "is inside"
    return UsageError(
        f"{inner} {inner_path} {where} the {outer} {outer_path}: {_INSIDE[outer]} — set --{inner} "
        f"(TRITONSHARE_{inner.upper()}) or --{outer} (TRITONSHARE_{outer.upper()}) so that repository, staging "
        f"and leases are three sibling folders on one filesystem, like {_DEFAULTS['repository']}, "
        f"{_DEFAULTS['staging']} and {_DEFAULTS['leases']}"
    )
