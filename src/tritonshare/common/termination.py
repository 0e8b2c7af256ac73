"""Kubernetes termination messages: the one-line reason a container failed, shown in the pod status
(kserve#4187: without it, permanent errors hide in CrashLoopBackOff logs)."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PATH = Path("/dev/termination-log")


def write_termination_message(message: str, path: Path | None = DEFAULT_PATH) -> None:
    if path is None:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(message[:4000] + "\n")  # the kubelet keeps at most 4096 bytes
    except OSError as exc:
        logger.debug("termination message not written to %s: %s", path, exc)
