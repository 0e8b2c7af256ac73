"""The thin CLI's own logic: what a restarted proxy's reinstall runs is what `tritonshare load` would run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tests.support.ports import free_port
from tritonshare.cli import _reinstall_settings, main
from tritonshare.common.errors import ExitCode
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder
from tritonshare.common.usage import unknown_variables
from tritonshare.proxy.settings import ProxySettings


def test_a_proxys_reinstall_takes_the_loaders_options_from_the_pods_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "TRITONSHARE_CONFIG_CHECK": "lenient",
        "TRITONSHARE_MODE": "explicit",
        "TRITONSHARE_CONCURRENCY": "3",
        "TRITONSHARE_DOWNLOAD_TIMEOUT_S": "120",
        "TRITONSHARE_REQUIRE_GPU_MEMORY_MIB": "2048",
        "TRITONSHARE_TERMINATION_LOG": str(tmp_path / "termination-log"),
    }.items():
        monkeypatch.setenv(name, value)
    layout = NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging", leases=tmp_path / "leases")
    holder = Holder(uid="uid-1", name="pod-1", namespace="team")
    proxy = ProxySettings(name="m", triton_url="http://10.0.0.1:8000", layout=layout, holder=holder, lease_ttl_s=90)

    loader = _reinstall_settings("https://user:pw@host/m.tar.gz", proxy)

    assert (loader.source, loader.name, loader.layout, loader.triton_url) == (
        "https://user:pw@host/m.tar.gz",
        "m",
        layout,
        "http://10.0.0.1:8000",
    )
    assert (loader.config_check, loader.mode, loader.concurrency) == ("lenient", "explicit", 3)
    assert (loader.download_timeout_s, loader.require_gpu_memory_mib) == (120.0, 2048)
    assert (loader.holder, loader.lease_ttl_s) == (holder, 90)
    assert loader.termination_log is None  # the proxy's termination message is its own exit's


@pytest.mark.parametrize("url", ["ftp://x", "", "http://", "http://127.0.0.1:99999", "http://127.0.0.1:0"])
@pytest.mark.parametrize("command", [["load", "/models/m"], ["unload"], ["gc", "--once"]])
def test_a_triton_url_that_cannot_be_one_is_a_usage_error(command: list[str], url: str) -> None:
    """Not a traceback and exit 1 ("a bug") on the first call to Triton: exit 2 naming the option."""
    name = [] if command[0] == "gc" else ["--name", "m"]
    result = CliRunner().invoke(main, [*command, *name, "--triton-url", url])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--triton-url'" in result.output and "is not http(s)://HOST[:PORT]" in result.output


@pytest.mark.parametrize("address", ["not a host", "127.0.0.1", ":8001", "host:port", "host:70000"])
def test_a_triton_grpc_address_that_is_not_host_port_is_a_usage_error(address: str) -> None:
    result = CliRunner().invoke(main, ["proxy", "--name", "m", "--triton-grpc", address])
    assert result.exit_code == 2 and "is not HOST:PORT" in result.output, result.output


@pytest.mark.parametrize("where", ["option", "variable"])
def test_a_negative_max_body_bytes_is_a_usage_error(where: str) -> None:
    args = ["proxy", "--name", "m", *(["--max-body-bytes", "-1"] if where == "option" else [])]
    result = CliRunner().invoke(main, args, env={"TRITONSHARE_MAX_BODY_BYTES": "-1"} if where == "variable" else {})
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Invalid value for '--max-body-bytes'" in result.output and "-1 is not in the range x>=0" in result.output


@pytest.mark.parametrize(("source", "said"), [("", "empty"), ("s3:/bucket/x", "did you mean s3://bucket/x?")])
def test_a_source_that_cannot_be_meant_exits_2_before_triton_is_waited_for(
    source: str, said: str, tmp_path: Path
) -> None:
    for folder in ("r", "s", "l"):
        (tmp_path / folder).mkdir()
    (tmp_path / "config.pbtxt").write_text('backend: "python"\n')  # the working directory, read as a path
    cmd = [
        sys.executable, "-m", "tritonshare.cli", "load", source, "--name", "m", "--repository", str(tmp_path / "r"),
        "--staging", str(tmp_path / "s"), "--leases", str(tmp_path / "l"), "--triton-url",
        f"http://127.0.0.1:{free_port()}", "--timeout-s", "5", "--termination-log", str(tmp_path / "termination"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert said in proc.stderr
    assert not (tmp_path / "r" / "m").exists()  # the working directory was not installed


def _commands(command: click.Command, path: str = "tritonshare") -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, f"{path} {name}")


def test_every_option_of_every_command_says_what_it_does_in_help() -> None:
    """`--help` is the first thing read at 3 am: no option listed there without a line saying what it does."""
    silent = [
        f"{path} {option.opts[-1]}"
        for path, command in _commands(main)
        for option in command.params
        if isinstance(option, click.Option) and not (option.help or "").strip()
    ]
    assert silent == []


def test_every_argument_a_variable_can_give_names_it_in_help() -> None:
    """click lists an option's variable, not an argument's: the command's own text must name it."""
    arguments = [
        (path, argument)
        for path, command in _commands(main)
        for argument in command.params
        if isinstance(argument, click.Argument) and argument.envvar
    ]
    assert arguments, "no argument is read from a variable: `load SOURCE` (TRITONSHARE_SOURCE) was"
    unnamed = [
        f"{path} {argument.name}: {argument.envvar}"
        for path, argument in arguments
        if str(argument.envvar) not in CliRunner().invoke(main, [*path.split()[1:], "--help"]).output
    ]
    assert unnamed == []


@pytest.fixture
def gc_once(tmp_path: Path) -> list[str]:
    """`tritonshare gc --once` over empty node folders, Triton unreachable: a command that logs a line and ends."""
    for folder in ("r", "s", "l"):
        (tmp_path / folder).mkdir()
    return ["gc", "--once", "--repository", str(tmp_path / "r"), "--staging", str(tmp_path / "s"),
            "--leases", str(tmp_path / "l"), "--triton-url", f"http://127.0.0.1:{free_port()}"]  # fmt: skip


def test_a_misspelt_variable_is_warned_of_once_naming_the_option_meant(gc_once: list[str]) -> None:
    env = {
        "TRITONSHARE_TIMEOUTS": "5",  # misspelt: no command reads it
        "TRITONSHARE_SOURCE": "s3://bucket/m/",  # load's and the proxy's, in the ConfigMap gc shares: no warning
        "TRITONSHARE_POD_UID": "uid-1",
    }
    result = CliRunner().invoke(main, gc_once, env=env)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "TRITONSHARE_" in line]
    assert len(warnings) == 1, result.stderr
    assert "WARNING" in warnings[0] and "TRITONSHARE_TIMEOUTS is set, but no tritonshare option reads it" in warnings[0]
    assert "did you mean TRITONSHARE_TIMEOUT_S?" in warnings[0]


def test_every_variable_the_manifests_and_docs_name_is_one_a_command_reads() -> None:
    """What the shipped manifests and the docs set must never be warned of as unknown."""
    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text() for p in [root / "README.md", *root.glob("docs/*.md"), *root.glob("k8s/**/*.*")]]
    names = {name for text in texts for name in re.findall(r"\bTRITONSHARE_[A-Z0-9_]*[A-Z0-9]\b", text)}
    misspelt = {m for text in texts for m in re.findall(r"\b(TRITONSHARE_\w+) is set, but no tritonshare option", text)}
    names -= misspelt  # the README's example of the warning
    assert "TRITONSHARE_SOURCE" in names and "TRITONSHARE_LOG_FORMAT" in names
    assert unknown_variables(main, dict.fromkeys(names, "x")) == {}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["load", "/models/m", "--name", "m", "--triton-url", "ftp://x"], "Invalid value for '--triton-url'"),
        (["load", "--name", "m"], "Missing argument 'SOURCE'"),
        (["load", "/models/m", "--name", "m", "--timeout-s=-1"], "Invalid value for '--timeout-s'"),
        (["lod", "/models/m"], "No such command 'lod'. (Did you mean one of: 'load', 'unload'?)"),
    ],
)
@pytest.mark.parametrize("where", ["option", "variable"])
def test_a_usage_error_exits_2_with_clicks_message_in_the_termination_log(
    args: list[str], said: str, where: str, tmp_path: Path
) -> None:
    """The pod status shows why the container would not start, not only its log."""
    termination = tmp_path / "termination-log"
    given = ["--termination-log", str(termination)] if where == "option" else []
    env = {"TRITONSHARE_TERMINATION_LOG": str(termination)} if where == "variable" else {}
    result = CliRunner().invoke(main, [*args, *given], env=env)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert said in result.stderr and "Usage:" in result.stderr  # click's own text, as before
    message = termination.read_text()
    assert said in message and "--help`" in message and message.count("\n") == 1


@pytest.mark.parametrize("pid", [1, 4242])
def test_a_usage_error_goes_to_the_default_termination_log_only_as_the_containers_main_process(
    pid: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped manifests name no --termination-log: the kubelet reads /dev/termination-log of the
    entrypoint (PID 1) — a bad value in the ConfigMap shows in the pod status. An operator's typo in a
    `kubectl exec` (another PID) must not become the container's reason when it stops."""
    default = tmp_path / "dev-termination-log"
    monkeypatch.setattr("tritonshare.common.termination.DEFAULT_PATH", default)
    monkeypatch.setattr("tritonshare.common.termination.os.getpid", lambda: pid)
    result = CliRunner().invoke(main, ["load", "--name", "m"], env={"TRITONSHARE_TERMINATION_LOG": None})
    assert result.exit_code == ExitCode.USAGE, result.output
    if pid == 1:
        assert "Missing argument 'SOURCE'" in default.read_text()
    else:
        assert not default.exists()


@pytest.mark.parametrize("where", ["before the command", "after the command", "variable"])
def test_with_json_logs_a_usage_error_is_one_json_line_and_exits_2(where: str) -> None:
    """A log collector parses every line: click's plain usage text would be the one line it cannot."""
    args = ["load", "/models/m", "--name", "m", "--triton-url", "ftp://x"]
    args = {
        "before the command": ["--log-format", "json", *args],
        "after the command": [*args, "--log-format", "json"],
        "variable": args,
    }[where]
    result = CliRunner().invoke(main, args, env={"TRITONSHARE_LOG_FORMAT": "json"} if where == "variable" else {})
    assert result.exit_code == ExitCode.USAGE, result.output
    [line] = result.stderr.splitlines()
    logged = json.loads(line)
    assert logged["level"] == "error"
    assert "load: Invalid value for '--triton-url'" in logged["msg"] and "is not http(s)://HOST" in logged["msg"]


def test_log_format_and_level_are_taken_after_the_command_too(gc_once: list[str]) -> None:
    result = CliRunner().invoke(main, [*gc_once, "--log-format", "json"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines and all(json.loads(line)["logger"].startswith("tritonshare") for line in lines)
    assert any("one pass" in json.loads(line)["msg"] for line in lines)

    # Given before the command, the format holds when only the level follows it.
    result = CliRunner().invoke(main, ["--log-format", "json", *gc_once, "--log-level", "debug"])
    assert result.exit_code == 0, result.output
    assert all(json.loads(line) for line in result.stderr.splitlines())
    result = CliRunner().invoke(main, ["--log-format", "json", *gc_once, "--log-level", "warning"])
    assert result.exit_code == 0 and result.stderr == "", result.output
