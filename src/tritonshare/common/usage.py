"""What ``tritonshare`` tells a user about how it was called, beyond click's own checks:

- a ``TRITONSHARE_*`` variable that no command reads (``TRITONSHARE_TIMEOUTS``: a misspelt option would
  otherwise be ignored without a word) is warned of, naming the closest variable a command does read;
- a usage error (exit 2) goes where the command's other failures go: its termination log, and with
  ``--log-format json`` the log as one JSON line, instead of click's plain text alone.

Both read a command line click may not have parsed, so they take the arguments and the environment as they
are (used by :mod:`tritonshare.common.command`'s click classes).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import click

from tritonshare.common.logs import FORMATTERS, configure_logging
from tritonshare.common.termination import container_default, write_termination_message

logger = logging.getLogger("tritonshare")

PREFIX = "TRITONSHARE_"
# Variables of that prefix that are not a command's options: the test suite's own (tests/support), the
# benchmarks' (bench/) and the build's (setup.py), set in a developer's shell and inherited by the commands they start.
NOT_OPTIONS = ("TRITONSHARE_TEST_", "TRITONSHARE_BENCH_", "TRITONSHARE_YARDSTICK", "TRITONSHARE_COMPILE")
TERMINATION_LOG_VARIABLE = PREFIX + "TERMINATION_LOG"
LOG_FORMAT_VARIABLE = PREFIX + "LOG_FORMAT"


def known_variables(command: click.Command) -> set[str]:
    """Every environment variable an option or argument of ``command`` or of its subcommands reads."""
    names: set[str] = set()
    for param in command.params:
        envvar = param.envvar
        names.update([envvar] if isinstance(envvar, str) else envvar or ())
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            names |= known_variables(sub)
    return names


def unknown_variables(command: click.Command, environ: Mapping[str, str]) -> dict[str, str | None]:
    """The ``TRITONSHARE_*`` variables of ``environ`` that no command of ``command``'s tree reads, each with
    the closest name one does read (None when none is close). A variable of another subcommand (the shared
    ConfigMap's TRITONSHARE_STAGING while ``gc`` runs) is known, not reported."""
    known = known_variables(command)
    return {
        name: next(iter(difflib.get_close_matches(name, known, n=1)), None)
        for name in sorted(environ)
        if name.startswith(PREFIX) and name not in known and not name.startswith(NOT_OPTIONS)
    }


def warn_unknown_variables(command: click.Command, environ: Mapping[str, str]) -> None:
    for name, closest in unknown_variables(command, environ).items():
        guess = f"did you mean {closest}? " if closest else ""
        logger.warning(
            "%s is set, but no tritonshare option reads it: %s(`tritonshare COMMAND --help` lists each "
            "option's variable)",
            name,
            guess,
        )


def given(args: Sequence[str], option: str) -> str | None:
    """The last value given to ``option`` in ``args`` (``--opt VALUE`` or ``--opt=VALUE``), read without
    parsing them: they may be what click could not parse."""
    value = None
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(option + "="):
            value = arg.partition("=")[2]
    return value


def usage_message(exc: click.UsageError) -> str:
    """Click's message, on one line, naming the command and where its options are listed."""
    path = exc.ctx.command_path if exc.ctx is not None else "tritonshare"
    return f"{path}: {exc.format_message()} — see `{path} --help`"


def report_usage_error(exc: click.UsageError, args: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Write a usage error to the termination log (``--termination-log`` on the command line, else
    TRITONSHARE_TERMINATION_LOG, else /dev/termination-log when this is the container's main process: a bad
    value in the pod's ConfigMap shows in its status, an operator's typo in ``kubectl exec`` does not), and with
    ``--log-format json``
    (after the command or before it, or TRITONSHARE_LOG_FORMAT) log it. Returns whether it was logged; click
    prints it as plain text otherwise."""
    message = usage_message(exc)
    termination_log = given(args, "--termination-log") or environ.get(TERMINATION_LOG_VARIABLE)
    write_termination_message(message, Path(termination_log) if termination_log else container_default())
    formats = [given(args, "--log-format"), environ.get(LOG_FORMAT_VARIABLE)]
    if next((f for f in formats if f in FORMATTERS), "plain") != "json":
        return False
    configure_logging(log_format="json")  # the error may have come before --log-format was read
    logger.error("%s", message)
    return True
