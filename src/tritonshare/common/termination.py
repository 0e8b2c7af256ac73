"""Kubernetes termination messages: the one-line reason a container failed, shown in the pod status
(kserve#4187: without it, permanent errors hide in CrashLoopBackOff logs)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PATH = Path("/dev/termination-log")


def container_default() -> Path | None:
    """The default for a command an operator also runs by hand (``unload``) and for usage errors:
    :data:`DEFAULT_PATH` when this process is its container's main one (PID 1: the image's entrypoint),
    else none — an operator's ``kubectl exec`` into a running container must not put its failure, or its
    typo, where the kubelet will read that container's reason when it stops."""
    return DEFAULT_PATH if os.getpid() == 1 else None


def write_termination_message(message: str, path: Path | None = DEFAULT_PATH) -> None:
    if path is None:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(message[:4000] + "\n")  # the kubelet keeps at most 4096 bytes
    except OSError as exc:
        logger.debug("termination message not written to %s: %s", path, exc)
