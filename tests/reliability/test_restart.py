"""A restarted init container: ``tritonshare load`` run again for the same pod — after a clean exit, after being
killed mid-download, after being killed between publish and ready — ends with the one install serving, reused
when it was already complete, without downloading again."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bench.faults.kill_loader import SourceKind, installed_problem, staging_of, start_load
from bench.faults.node import Node, remove, run_gc, run_load

from tests.support.install import model_ready
from tests.support.models import write_model
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode
from tritonshare.common.lease import Holder, LeaseStore
from tritonshare.common.repository import RECORD_FILE

pytestmark = [pytest.mark.triton]

REUSED = "reusing it, nothing to download"


@pytest.fixture
def unload_after(node: Node, triton: TritonServer) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        remove(node, triton, name)


def large_model(tmp_path: Path) -> SourceKind:
    model = write_model(tmp_path / "model", padding_bytes=32 << 20)
    return SourceKind("path", str(model), model)


def kill_when(
    node: Node, triton: TritonServer, kind: SourceKind, name: str, log: Path, moment: Callable[[], bool]
) -> None:
    """Start a loader and SIGKILL it as soon as ``moment()`` holds (the test fails if it exits first)."""
    process = start_load(node, triton, kind, name, log)
    deadline = time.monotonic() + 60
    while not moment():
        assert process.poll() is None, f"the loader exited {process.returncode} before the kill:\n{log.read_text()}"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_a_second_run_reuses_the_install_quickly_and_leaves_its_record_untouched(
    node: Node, triton: TritonServer, model_name: str, tmp_path: Path, unload_after: list[str]
) -> None:
    source = str(write_model(tmp_path / "model", padding_bytes=8 << 20))
    unload_after.append(model_name)
    first = run_load(node, triton.url, source, model_name)
    assert first.code == ExitCode.OK, first.log
    record = node.layout.model_dir(model_name) / RECORD_FILE
    recorded, recorded_ns = record.read_bytes(), record.stat().st_mtime_ns

    again = run_load(node, triton.url, source, model_name)
    assert again.code == ExitCode.OK, again.log
    assert REUSED in again.log and "phase download" not in again.log
    assert record.read_bytes() == recorded and record.stat().st_mtime_ns == recorded_ns
    assert again.seconds < first.seconds, (again.seconds, first.seconds)  # no download, no load to wait for
    assert model_ready(triton, model_name)


def test_a_run_after_a_kill_mid_download_installs_a_complete_model_and_gc_takes_the_leftover(
    node: Node, triton: TritonServer, model_name: str, tmp_path: Path, unload_after: list[str]
) -> None:
    kind = large_model(tmp_path)
    unload_after.append(model_name)
    kill_when(node, triton, kind, model_name, tmp_path / "killed.log", lambda: bool(staging_of(node, model_name)))
    leftover = staging_of(node, model_name)
    assert leftover and not node.layout.model_dir(model_name).exists()

    again = run_load(node, triton.url, kind.uri, model_name)
    assert again.code == ExitCode.OK, again.log
    assert "phase download took" in again.log  # nothing complete to reuse: downloaded afresh
    assert installed_problem(node.layout.model_dir(model_name), kind, model_name) is None
    assert model_ready(triton, model_name)
    gc_takes_leftovers_of(node, triton, model_name)


def test_a_run_after_a_kill_between_publish_and_ready_reuses_the_published_model(
    node: Node, triton: TritonServer, model_name: str, tmp_path: Path, unload_after: list[str]
) -> None:
    kind = large_model(tmp_path)
    unload_after.append(model_name)
    folder = node.layout.model_dir(model_name)
    kill_when(node, triton, kind, model_name, tmp_path / "killed.log", folder.exists)
    assert not model_ready(triton, model_name)  # killed before Triton had it ready

    again = run_load(node, triton.url, kind.uri, model_name)
    assert again.code == ExitCode.OK, again.log
    assert REUSED in again.log and "phase download" not in again.log
    assert installed_problem(folder, kind, model_name) is None
    assert model_ready(triton, model_name)
    # The kill may land after the publishing rename and before the killed run removed its (emptied)
    # workspace; a later run never touches another run's workspace, so that leftover is gc's to take.
    gc_takes_leftovers_of(node, triton, model_name)


def gc_takes_leftovers_of(node: Node, triton: TritonServer, model_name: str) -> None:
    """Run gc (TTL 1 s) while a live pod holds the model: staging is emptied, the model keeps serving."""
    time.sleep(1.5)  # any leftover is now older than gc's TTL of 1 s
    leases, pod = LeaseStore(node.leases, ttl_s=1), Holder(uid="restarted-pod")
    leases.acquire(model_name, pod)  # the pod's proxy holds the model, so gc keeps it
    try:
        gc = run_gc(node, triton, ttl_s=1, manage=model_name)
    finally:
        leases.forget(model_name, pod)
    assert gc.returncode == 0, gc.stderr
    assert staging_of(node, model_name) == []
    assert model_ready(triton, model_name)
