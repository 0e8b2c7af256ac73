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


# What the kubelet reads of the file: its LAST 4096 bytes (kubelet's tail.ReadAtMost). A longer message would lose
# its beginning, the part that says what failed; so it is cut to fit, by bytes (UTF-8), from its end.
MAX_BYTES = 4096


def write_termination_message(message: str, path: Path | None = DEFAULT_PATH) -> None:
    if path is None:
        return
    try:
        with open(path, "wb") as fh:
            fh.write(fit(message))
    except OSError as exc:
        logger.debug("termination message not written to %s: %s", path, exc)


def fit(message: str, limit: int = MAX_BYTES) -> bytes:
    """``message`` and a newline in at most ``limit`` bytes of UTF-8: cut at a character, marked with "…"."""
    data = message.encode("utf-8", errors="replace") + b"\n"
    if len(data) <= limit:
        return data
    cut = data[: limit - len("…\n".encode())].decode("utf-8", errors="ignore")  # a character cut in two goes
    return (cut + "…\n").encode()
