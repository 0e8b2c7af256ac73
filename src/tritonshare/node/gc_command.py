"""The ``tritonshare gc`` command; ``tritonshare.cli`` adds it with ``main.add_command(gc)``.

Same conventions as every subcommand (:mod:`tritonshare.common.command`): each option is also
``TRITONSHARE_<OPTION>``, options become frozen settings, and the command body imports its modules lazily.
"""

from __future__ import annotations

from pathlib import Path

import click

from tritonshare.common.command import (
    Command,
    leases_option,
    option,
    options,
    repository_option,
    run_command,
    staging_option,
    termination_log_option,
    triton_url_option,
)
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import DEFAULT_TTL_S


@click.command(cls=Command)
@options(repository_option, staging_option, leases_option)
@triton_url_option("Triton's HTTP endpoint (asked what is LOADING).")
@option(
    "--lease-ttl-s",
    type=click.FloatRange(min=1),
    default=DEFAULT_TTL_S,
    help="A lease not refreshed for this long belongs to a dead pod; also the age of removable staging leftovers.",
)
@option("--interval-s", type=click.FloatRange(min=0.1), default=30.0, help="Time between passes.")
@option("--once", is_flag=True, default=False, help="Make one pass and exit (a CronJob, or by hand).")
@option(
    "--manage",
    multiple=True,
    default=("*",),
    help="Only model NAMEs matching one of these glob patterns are removed; others are never touched. Repeatable.",
)
@termination_log_option
def gc(
    repository: Path,
    staging: Path,
    leases: Path,
    triton_url: str,
    lease_ttl_s: float,
    interval_s: float,
    once: bool,
    manage: tuple[str, ...],
    termination_log: Path,
) -> None:
    """Remove models whose pods are gone (every lease expired, or no lease and older than the TTL) and
    staging leftovers; rename out of the repository before deleting, never while Triton is LOADING the model.

    Runs on every Triton node (a DaemonSet beside Triton's); every removal is logged with its reason.
    """
    from tritonshare.node.gc import GcSettings, run

    settings = GcSettings(
        layout=NodeLayout(repository=repository, staging=staging, leases=leases),
        triton_url=triton_url,
        lease_ttl_s=lease_ttl_s,
        interval_s=interval_s,
        once=once,
        manage=manage,
    )
    run_command(lambda: run(settings), termination_log=termination_log)
