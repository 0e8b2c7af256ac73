"""What every ``tritonshare`` subcommand shares: options that are also ``TRITONSHARE_<OPTION>`` variables,
the click classes of the group and its commands (:class:`Group`, :class:`Command`: ``--log-format`` and
``--log-level`` after the command too, unknown ``TRITONSHARE_*`` variables warned of, usage errors in the
termination log and the chosen log format), and how a command ends (:func:`run_command`): the error tree
mapped to exit codes and a termination message, SIGTERM and SIGINT turned into an exception so the command
cleans up before it exits, and any other exception reported as the bug it is. Used by :mod:`tritonshare.cli`
and by the node agents' commands (which the layer contract keeps from importing the CLI)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import click
from click.core import ParameterSource

from tritonshare.common.errors import STOP_SIGNALS, ExitCode, Stopped, TritonshareError, UsageError
from tritonshare.common.layout import DEFAULT_LEASES, DEFAULT_REPOSITORY, DEFAULT_STAGING
from tritonshare.common.logs import configure_logging
from tritonshare.common.termination import DEFAULT_PATH, write_termination_message
from tritonshare.common.triton import check_triton_url
from tritonshare.common.usage import report_usage_error, warn_unknown_variables

logger = logging.getLogger("tritonshare")

F = TypeVar("F", bound=Callable[..., Any])


def option(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """``click.option`` whose environment variable is ``TRITONSHARE_<LONG NAME>``."""
    return click.option(*decls, **_with_envvar(decls, kwargs))


def _with_envvar(decls: tuple[str, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    long = max((d for d in decls if d.startswith("--")), key=len).split("/")[0]
    kwargs.setdefault("envvar", "TRITONSHARE_" + long.lstrip("-").replace("-", "_").upper())
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", True)
    return kwargs


def options(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Several options as one decorator, in the order they are listed (and shown in ``--help``)."""

    def apply(fn: F) -> F:
        for decorator in reversed(decorators):
            fn = decorator(fn)
        return fn

    return apply


# The options several subcommands share, spelled once.
repository_option = option(
    "--repository",
    type=click.Path(path_type=Path),
    default=DEFAULT_REPOSITORY,
    help="Triton's model repository (POLL mode) on the node.",
)
staging_option = option(
    "--staging",
    type=click.Path(path_type=Path),
    default=DEFAULT_STAGING,
    help="Staging folder: same filesystem as the repository, outside it.",
)
leases_option = option(
    "--leases",
    type=click.Path(path_type=Path),
    default=DEFAULT_LEASES,
    help="The node's lease folder (outside the repository): which pods use each model, by their heartbeats.",
)
termination_log_option = option(
    "--termination-log",
    type=click.Path(path_type=Path),
    default=DEFAULT_PATH,
    help="Where the one-line failure reason goes (Kubernetes terminationMessagePath).",
)
# For `unload`, which operators also run by hand in a running container: /dev/termination-log only as the
# container's main process (termination.container_default).
operator_termination_log_option = option(
    "--termination-log",
    type=click.Path(path_type=Path),
    default=None,
    help="Where the one-line failure reason goes (Kubernetes terminationMessagePath); default "
    "/dev/termination-log when run as the container's main process (PID 1), else none.",
)


def _triton_url(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return check_triton_url(value)
    except UsageError as exc:
        raise click.BadParameter(str(exc)) from exc


def triton_url_option(help: str = "Triton's HTTP endpoint.") -> Callable[[F], F]:  # noqa: A002 (click's word)
    return option("--triton-url", default="http://127.0.0.1:8000", callback=_triton_url, help=help)


# ---- the click classes: the group, and every command in it ---------------------------------------------

# The logging options: the group's (``tritonshare --log-format json load …``), and again every command's.
LOG_OPTIONS: dict[str, dict[str, Any]] = {
    "--log-format": {
        "type": click.Choice(["plain", "json"]),
        "default": "plain",
        "help": "Log line format: json is one JSON object per line (what log collectors in a pod want).",
    },
    "--log-level": {
        "type": click.Choice(["debug", "info", "warning", "error"]),
        "default": "info",
        "help": "Lowest level of the log lines written (debug adds details: each request the proxy refuses, …).",
    },
}


def log_options(fn: F) -> F:
    """The group's logging options, passed to its body as ``log_format`` and ``log_level``."""
    for decl, kwargs in reversed(LOG_OPTIONS.items()):
        fn = option(decl, **kwargs)(fn)
    return fn


def _set_logging(ctx: click.Context, param: click.Parameter, value: str) -> None:
    """A command's own --log-format or --log-level, when given after its name, overrides the group's."""
    if param.name and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
        configure_logging(**{param.name: value})


class Command(click.Command):
    """Every ``tritonshare`` subcommand: it also takes ``--log-format`` and ``--log-level`` after its name,
    and before its body runs warns of each ``TRITONSHARE_*`` variable no command reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for decl, settings in LOG_OPTIONS.items():
            same = _with_envvar((decl,), {**settings, "help": settings["help"] + " Also after the command."})
            self.params.append(click.Option([decl], expose_value=False, is_eager=True, callback=_set_logging, **same))

    def invoke(self, ctx: click.Context) -> Any:
        warn_unknown_variables(ctx.find_root().command, os.environ)
        return super().invoke(ctx)


class Group(click.Group):
    """The ``tritonshare`` group: its commands are each a :class:`Command`, and a usage error (exit 2) — the
    group's or a command's, while parsing or raised by a command's body — is also written to the
    termination log and, with ``--log-format json``, logged as JSON instead of printed as click's text."""

    command_class = Command

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        given = list(args)  # click's parser consumes the list it is given
        with _usage_errors_reported(given):
            context = super().make_context(info_name, args, parent, **extra)
        context.meta[_ARGS] = given
        return context

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_errors_reported(ctx.meta.get(_ARGS, [])):
            return super().invoke(ctx)


_ARGS = "tritonshare.args"  # the group's command line, in its context's meta, for a usage error's report


@contextmanager
def _usage_errors_reported(args: list[str]) -> Iterator[None]:
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:  # click >= 8.2
        raise  # `tritonshare` alone: the help, not an error
    except click.UsageError as exc:
        if report_usage_error(exc, args, os.environ):
            raise click.exceptions.Exit(exc.exit_code) from exc  # logged: click prints nothing more
        raise


_Handler = Callable[[int, FrameType | None], Any] | int | None  # what signal.signal takes and returns

_activities: list[str] = []  # what the command is doing, innermost last (main thread only)
_holding: list[int] = []  # one entry per held_stops block the main thread is in
_deferred: list[int] = []  # stop signals that came meanwhile


@contextmanager
def held_stops() -> Iterator[None]:
    """A stop signal that comes within waits for the block's end, and stops the command there: for a step
    that must not be cut from what records it (the loader's publishing rename, and its note that it published,
    which decides whether the lease is given up or dropped). Outside the main thread, where no signal is
    raised, a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _holding.append(1)
    try:
        yield
    finally:
        _holding.pop()
        if not _holding and _deferred:
            signum = _deferred[0]
            _deferred.clear()
            _stop(signum)  # the pod goes: it wins over a failure


@contextmanager
def doing(activity: str) -> Iterator[None]:
    """Name what the command is doing for the message a stop signal leaves: ``with doing("downloading"):``
    → "stopped by SIGTERM while downloading"."""
    _activities.append(activity)
    try:
        yield
    finally:
        _activities.pop()


def run_command(
    action: Callable[[], int | None], *, termination_log: Path | None = None, stop_on_signals: bool = True
) -> None:
    """Run a command body and exit: with its code; with the error tree's code and a termination message;
    on SIGTERM or SIGINT, once the body has cleaned up, with 143 or 130 and a message saying so; on any
    other exception, with 1, its traceback logged and a message asking for a report.

    ``stop_on_signals=False`` leaves SIGTERM and SIGINT as they are, for a command that handles them itself
    (the proxy drains its requests first)."""
    with _stop_signals(stop_on_signals):
        code = _ended(action, termination_log)
    sys.exit(int(code))


def _ended(action: Callable[[], int | None], termination_log: Path | None) -> int:
    """The exit code of ``action``, its failure or stop reported."""
    try:
        try:
            return int(action() or ExitCode.OK)
        finally:
            _ignore_stop_signals()  # the body has ended: a signal now must not interrupt the report
    except TritonshareError as exc:
        return _report(str(exc), exc.exit_code, termination_log)
    except Stopped as stop:
        logger.warning("%s: cleaned up, exiting with %d", stop, stop.exit_code)
        return _report(_stop_message(stop), stop.exit_code, termination_log, logged=True)
    except KeyboardInterrupt:  # SIGINT in a command that handles signals itself (stop_on_signals=False)
        return ExitCode.INTERRUPTED
    except Exception as exc:  # a bug, or a failure nobody translated into the error tree
        logger.exception("unexpected error")
        message = f"unexpected error: {type(exc).__name__}: {exc} — a bug in tritonshare; please report it"
        return _report(message, ExitCode.UNEXPECTED, termination_log, logged=True)


def _report(message: str, code: ExitCode, termination_log: Path | None, *, logged: bool = False) -> int:
    if not logged:
        logger.error("%s", message)
    write_termination_message(message, termination_log)
    return int(code)


def _stop_message(stop: Stopped) -> str:
    context = click.get_current_context(silent=True)
    command = ""
    if context is not None:
        name = context.params.get("name")
        command = f" (`{context.command_path}{f' --name {name}' if name else ''}`)"
    return f"{stop}{command}"


# ---- signal handlers ----------------------------------------------------------------------------------

_previous: dict[signal.Signals, _Handler] = {}  # the handlers run_command replaced, restored when it ends


@contextmanager
def _stop_signals(enabled: bool) -> Iterator[None]:
    """While the body runs, SIGTERM and SIGINT raise :class:`Stopped` in the main thread; afterwards the
    handlers are what they were (a command run in-process, as tests do, leaves no trace)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    _previous.update(previous)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _previous.clear()


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    if _event_loop_running():
        _default(signum, frame)
        return
    if _holding:
        _deferred.append(signum)  # raised at the end of the held_stops block
        return
    _stop(signum)


def _stop(signum: int) -> NoReturn:
    """Raise Stopped for ``signum``, naming what the command was doing."""
    _ignore_stop_signals()  # a second signal must not cut the clean-up short
    raise Stopped(signum, _activities[-1] if _activities else "")


def _ignore_stop_signals() -> None:
    if _previous:  # only while run_command's handlers are installed
        for sig in STOP_SIGNALS:
            signal.signal(sig, _already_stopping)


def _already_stopping(signum: int, _frame: FrameType | None) -> None:
    logger.warning(
        "received %s while ending: cleaning up first, then exiting (SIGKILL stops at once, leaving what the "
        "command staged for `tritonshare gc`)",
        signal.Signals(signum).name,
    )


def _event_loop_running() -> bool:
    """Whether an asyncio (or uvloop) event loop runs in this thread. An exception raised from a signal
    handler inside one does not unwind the command: uvloop logs and swallows it, asyncio tears the loop
    down mid-callback. A command running a loop installs its own handlers (``loop.add_signal_handler``),
    which replace these; until it has, the signal gets the handling it had before run_command."""
    asyncio = sys.modules.get("asyncio")  # not imported: no loop can be running
    return asyncio is not None and asyncio._get_running_loop() is not None


def _default(signum: int, frame: FrameType | None) -> None:
    """What the signal did before run_command: the previous handler, or the default action (for SIGTERM,
    the end of the process, by the signal)."""
    sig = signal.Signals(signum)
    previous = _previous.get(sig, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
