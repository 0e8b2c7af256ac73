"""How a command ends (:func:`tritonshare.common.command.run_command`): exit codes, the termination message,
and real SIGTERM/SIGINT sent to this process turned into a clean-up before the exit."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tritonshare.common.command import doing, run_command
from tritonshare.common.errors import ExitCode, InstallConflict


def exit_code(action: Callable[[], int | None], termination_log: Path, **kwargs: bool) -> int:
    with pytest.raises(SystemExit) as exited:
        run_command(action, termination_log=termination_log, **kwargs)
    assert isinstance(exited.value.code, int)
    return exited.value.code


def signal_self(sig: signal.Signals) -> None:
    """Send ``sig`` to this process and give the main thread the moment it needs to run its handler."""
    os.kill(os.getpid(), sig)
    time.sleep(5)
    raise AssertionError(f"{sig.name} did not stop the command")


@pytest.fixture
def message(tmp_path: Path) -> Path:
    return tmp_path / "termination-log"


def test_the_body_s_code_is_the_exit_code_and_no_message_is_written(message: Path) -> None:
    assert exit_code(lambda: None, message) == ExitCode.OK
    assert exit_code(lambda: ExitCode.READINESS_TIMEOUT, message) == ExitCode.READINESS_TIMEOUT
    assert not message.exists()


def test_an_error_of_the_tree_exits_with_its_code_and_message(message: Path) -> None:
    def action() -> None:
        raise InstallConflict("m1 is installed from s3://other — unload it first")

    assert exit_code(action, message) == ExitCode.INSTALL_CONFLICT
    assert message.read_text() == "m1 is installed from s3://other — unload it first\n"


def test_an_unexpected_exception_exits_1_with_its_traceback_logged_and_a_report_request(
    message: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def action() -> None:
        {"present": 1}["missing"]

    with caplog.at_level(logging.ERROR, logger="tritonshare"):
        assert exit_code(action, message) == ExitCode.UNEXPECTED
    assert message.read_text() == "unexpected error: KeyError: 'missing' — a bug in tritonshare; please report it\n"
    [record] = [r for r in caplog.records if r.name == "tritonshare"]
    assert record.exc_info is not None and record.exc_info[0] is KeyError  # the traceback is in the log


def test_sigterm_runs_the_body_s_clean_up_then_exits_143_saying_what_it_stopped(message: Path) -> None:
    cleaned: list[str] = []
    before = signal.getsignal(signal.SIGTERM)

    def action() -> None:
        try:
            with doing("downloading"):
                signal_self(signal.SIGTERM)
        finally:
            cleaned.append("workspace discarded")

    assert exit_code(action, message) == 143  # ExitCode.TERMINATED
    assert cleaned == ["workspace discarded"]
    assert message.read_text() == "stopped by SIGTERM while downloading\n"
    assert signal.getsignal(signal.SIGTERM) is before  # a command run in-process leaves the handlers as they were


def test_a_second_sigterm_does_not_cut_the_clean_up_short(message: Path, caplog: pytest.LogCaptureFixture) -> None:
    cleaned: list[str] = []

    def action() -> None:
        try:
            signal_self(signal.SIGTERM)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the kubelet, or an impatient operator, again
            time.sleep(0.2)  # the handler runs here, during the clean-up
            cleaned.append("lease dropped")

    with caplog.at_level(logging.WARNING, logger="tritonshare"):
        assert exit_code(action, message) == ExitCode.TERMINATED
    assert cleaned == ["lease dropped"]
    assert "received SIGTERM while ending: cleaning up first" in caplog.text
    assert message.read_text() == "stopped by SIGTERM\n"


def test_sigint_stops_the_same_way_with_130(message: Path) -> None:
    assert exit_code(lambda: signal_self(signal.SIGINT), message) == 130  # ExitCode.INTERRUPTED
    assert message.read_text() == "stopped by SIGINT\n"


def test_a_command_that_handles_signals_itself_keeps_its_own_handlers(message: Path) -> None:
    seen: list[object] = []
    before = signal.getsignal(signal.SIGTERM)
    assert exit_code(lambda: seen.append(signal.getsignal(signal.SIGTERM)), message, stop_on_signals=False) == 0
    assert seen == [before]


# A command whose body runs an event loop (the proxy) and has not installed its own handlers yet: an exception
# raised into the loop would be swallowed by uvloop (it logs it and serves on, exit 0 two seconds later), so the
# signal keeps its default action — the process ends, by the signal.
_LOOP_BODY = """
import asyncio, os, signal, threading, uvloop
from tritonshare.common.command import run_command

async def serve() -> None:
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()  # arrives while the loop waits
    await asyncio.sleep(5)
    print("still serving after SIGTERM", flush=True)

run_command(lambda: {runner}.run(serve()))
"""


@pytest.mark.parametrize("runner", ["asyncio", "uvloop"])
def test_sigterm_inside_an_event_loop_ends_the_process_as_before(runner: str) -> None:
    code = textwrap.dedent(_LOOP_BODY).format(runner=runner)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "still serving" not in proc.stdout
