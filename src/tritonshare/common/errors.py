"""The one error tree of tritonshare, and the exit codes the commands map it to.

::

    TritonshareError                       exit 1   (unexpected; a bug or an unplanned condition)
    ├── UsageError                         exit 2   bad option or argument
    ├── SourceError                        exit 10  permanent source error: retrying will not help
    │   ├── SourceNotFound                          object or prefix does not exist
    │   ├── SourceAccessDenied                      credentials missing or refused
    │   ├── InvalidModel                            layout or config.pbtxt is not a Triton model
    │   │   └── NotAnArchive                        an archive's bytes are not one: damaged, cut short, or a page
    │   └── UnsafeArchive                           archive member escapes its folder or links out
    ├── TransientSourceError               exit 11  network/server trouble that outlived retries or the deadline
    │   └── RangeIgnored                            a part's GET came back whole (the store ignores Range): the
    │                                               download engine fetches the object whole instead
    ├── TritonLoadFailed                   exit 12  Triton marked the model UNAVAILABLE (carries Triton's reason)
    ├── ReadinessTimeout                   exit 13  the readiness deadline passed
    ├── InstallConflict                    exit 14  NAME is installed from a different source
    ├── InsufficientSpace                  exit 15  not enough free disk for the download
    └── TritonUnavailable                  exit 16  Triton's API cannot be reached (proxy, unload)

    Stopped (a BaseException: a stop, not an error)
                                           exit 128+N, as a shell reports it: 130 SIGINT, 143 SIGTERM
                                                    (common/command.py turns the signal into it so clean-up
                                                    runs, then exits with this code; loader/stop.py raises it
                                                    in a load a thread runs)

Third-party exceptions are translated into these once, at the boundary where they are raised
(``raise SourceAccessDenied(msg) from exc``). Messages say what failed, on which object, and what to do.
"""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes. Kubernetes shows them in the pod status; keep them stable."""

    OK = 0
    UNEXPECTED = 1
    USAGE = 2
    SOURCE_PERMANENT = 10
    SOURCE_TRANSIENT = 11
    TRITON_LOAD_FAILED = 12
    READINESS_TIMEOUT = 13
    INSTALL_CONFLICT = 14
    INSUFFICIENT_SPACE = 15
    TRITON_UNAVAILABLE = 16
    INTERRUPTED = 130  # SIGINT (128 + 2)
    TERMINATED = 143  # SIGTERM (128 + 15): the pod was deleted while the command ran


# The signals that stop a command, and the exit code each ends it with (128 + N, as a shell reports it).
STOP_SIGNALS: dict[signal.Signals, ExitCode] = {
    signal.SIGTERM: ExitCode.TERMINATED,
    signal.SIGINT: ExitCode.INTERRUPTED,
}


class Stopped(BaseException):
    """A stop signal, raised in the main thread by :func:`~tritonshare.common.command.run_command`'s handler
    (or, for a load a thread runs, by :class:`~tritonshare.loader.stop.Stop`) so that every ``finally`` and
    ``with`` on the way out runs (the loader discards its staging folder, drops its lease, cancels and joins
    its download threads). A BaseException, like KeyboardInterrupt, so no ``except Exception`` mistakes it for
    a failure to retry or report."""

    def __init__(self, signum: int, activity: str = "") -> None:
        self.signal = signal.Signals(signum)
        self.activity = activity  # what the command was doing when the signal came, if it said (doing())
        super().__init__(f"stopped by {self.signal.name}" + (f" while {activity}" if activity else ""))

    @property
    def exit_code(self) -> ExitCode:
        return STOP_SIGNALS[self.signal]


class TritonshareError(Exception):
    """Base of every error tritonshare raises on purpose."""

    exit_code: ExitCode = ExitCode.UNEXPECTED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(TritonshareError):
    exit_code = ExitCode.USAGE


class SourceError(TritonshareError):
    """A permanent problem with the model source: retrying the same input will fail the same way."""

    exit_code = ExitCode.SOURCE_PERMANENT


class SourceNotFound(SourceError):
    pass


class SourceAccessDenied(SourceError):
    pass


class InvalidModel(SourceError):
    pass


class NotAnArchive(InvalidModel):
    """A file named (or sniffed) as an archive whose bytes are not a readable one of its kind: damaged, cut
    short, or another file altogether (a login or error page served at its URL). Keeps its parts so that the
    loader, which knows where the bytes came from, can say so (:func:`tritonshare.loader.archive.from_source`)."""

    def __init__(self, what: str, *, kind: str, reason: str, advice: str) -> None:
        super().__init__(f"{what}: not a readable {kind} archive ({reason}) — {advice}")
        self.kind, self.reason, self.advice = kind, reason, advice


class UnsafeArchive(SourceError):
    pass


class TransientSourceError(TritonshareError):
    """The source could not be read in time although it may exist: network, throttling, 5xx, stalls."""

    exit_code = ExitCode.SOURCE_TRANSIENT


class RangeIgnored(TransientSourceError):
    """The store answered a request for part of an object with the whole object (a 200 to a ranged GET): the
    store, or a proxy in front of it, ignores Range. Not worth retrying; the object can still come whole."""


class TritonLoadFailed(TritonshareError):
    exit_code = ExitCode.TRITON_LOAD_FAILED


class ReadinessTimeout(TritonshareError):
    exit_code = ExitCode.READINESS_TIMEOUT


class InstallConflict(TritonshareError):
    exit_code = ExitCode.INSTALL_CONFLICT


class InsufficientSpace(TritonshareError):
    exit_code = ExitCode.INSUFFICIENT_SPACE


class TritonUnavailable(TritonshareError):
    exit_code = ExitCode.TRITON_UNAVAILABLE


def cannot_listen(what: str, host: str, port: int, option: str, exc: OSError) -> UsageError:
    """A server of ours could not bind its port (in use, or not allowed): what to change."""
    reason = exc.strerror or exc
    return UsageError(f"{what}: cannot listen on {host}:{port}: {reason} — choose another {option} or --host")


def clip(text: str, limit: int = 300) -> str:
    """Cut a body quoted from a server to a readable length."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
