"""Where things live on a node: Triton's repository and the staging folder beside it.

Default layout (REFERENCE §2: staging must be outside the repository root, on the same filesystem)::

    /var/lib/tritonshare/
    ├── models/     Triton's --model-repository (POLL mode); one folder per model NAME
    ├── staging/    downloads in progress and folders on their way out
    └── leases/     which pods use each model, with their heartbeats (common/lease.py)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tritonshare.common.errors import UsageError

DEFAULT_ROOT = Path("/var/lib/tritonshare")
DEFAULT_REPOSITORY = DEFAULT_ROOT / "models"
DEFAULT_STAGING = DEFAULT_ROOT / "staging"
DEFAULT_LEASES = DEFAULT_ROOT / "leases"

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


@dataclass(frozen=True, kw_only=True)
class NodeLayout:
    repository: Path = DEFAULT_REPOSITORY
    staging: Path = DEFAULT_STAGING
    leases: Path = DEFAULT_LEASES  # outside the repository: a file in a model folder would make POLL reload it

    def model_dir(self, name: str) -> Path:
        return self.repository / name

    def check(self) -> None:
        """Both folders exist, staging is outside the repository and on the same filesystem."""
        for label, path in (("repository", self.repository), ("staging", self.staging)):
            if not path.is_dir():
                raise UsageError(f"{label} folder {path} does not exist — create it or mount the node folder")
        repo, staging = self.repository.resolve(), self.staging.resolve()
        if staging == repo or repo in staging.parents:
            raise UsageError(
                f"staging {staging} is inside the repository {repo}: Triton would see partial models — "
                "put it beside the repository"
            )
        if os.stat(repo).st_dev != os.stat(staging).st_dev:
            raise UsageError(
                f"staging {staging} and repository {repo} are on different filesystems, so a model cannot "
                "be published by one rename — put both under the same mount"
            )
