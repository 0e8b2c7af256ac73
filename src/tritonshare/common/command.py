"""What every ``tritonshare`` subcommand shares: options that are also ``TRITONSHARE_<OPTION>`` variables,
and the mapping of the error tree to exit codes and a termination message. Used by :mod:`tritonshare.cli`
and by the node agents' commands (which the layer contract keeps from importing the CLI)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from tritonshare.common.errors import ExitCode, TritonshareError
from tritonshare.common.layout import DEFAULT_LEASES, DEFAULT_REPOSITORY, DEFAULT_STAGING
from tritonshare.common.termination import DEFAULT_PATH, write_termination_message

logger = logging.getLogger("tritonshare")

F = TypeVar("F", bound=Callable[..., Any])


def option(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """``click.option`` whose environment variable is ``TRITONSHARE_<LONG NAME>``."""
    long = max((d for d in decls if d.startswith("--")), key=len).split("/")[0]
    kwargs.setdefault("envvar", "TRITONSHARE_" + long.lstrip("-").replace("-", "_").upper())
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", True)
    return click.option(*decls, **kwargs)


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


def run_command(action: Callable[[], int | None], *, termination_log: Path | None = None) -> None:
    """Run a command body, mapping the error tree to exit codes and a termination message."""
    try:
        code = action()
    except TritonshareError as exc:
        logger.error("%s", exc)
        write_termination_message(str(exc), termination_log)
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(int(code or ExitCode.OK))
