"""The thin CLI's own logic: what a restarted proxy's reinstall runs is what `tritonshare load` would run."""

from __future__ import annotations

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
