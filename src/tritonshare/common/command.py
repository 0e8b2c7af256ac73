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
from tritonshare.common.termination import write_termination_message

logger = logging.getLogger("tritonshare")

F = TypeVar("F", bound=Callable[..., Any])


def option(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """``click.option`` whose environment variable is ``TRITONSHARE_<LONG NAME>``."""
    long = max((d for d in decls if d.startswith("--")), key=len).split("/")[0]
    kwargs.setdefault("envvar", "TRITONSHARE_" + long.lstrip("-").replace("-", "_").upper())
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", True)
    return click.option(*decls, **kwargs)


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
