"""unload_model's two hazards against real Tritons: a Triton that does not answer may be starting up and
loading the very folder (so it stays), and a Triton in explicit mode keeps serving a model whose folder is
gone until it is told to unload it (so it is told; POLL mode's refusal of that call is fine)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.children import die_with_parent
from tests.support.install import install_model, lease_lock_is_free, model_ready, wait_loading, wait_model_ready
from tests.support.models import SLOW_START_MODEL, write_model
from tests.support.ports import free_port
from tests.support.triton import TritonServer
from tritonshare.common import repository, unload
from tritonshare.common.errors import ExitCode
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder, LeaseStore
from tritonshare.common.triton import TritonClient
from tritonshare.common.unload import POLL_REFUSAL, Activity, UnloadSettings, request_unload, unload_model

POD_A, POD_B = Holder(uid="unload-pod-a"), Holder(uid="unload-pod-b")


def node(root: Path) -> NodeLayout:
    layout = NodeLayout(repository=root / "models", staging=root / "staging", leases=root / "leases")
    layout.repository.mkdir(parents=True)
    layout.staging.mkdir()
    return layout


def publish(layout: NodeLayout, name: str, **kwargs: str) -> Path:
    staged = write_model(layout.staging / f"{name}.test", **kwargs)  # type: ignore[arg-type]
    return staged.rename(layout.model_dir(name))


def unload_settings(layout: NodeLayout, url: str, name: str, holder: Holder | None, timeout_s: float) -> UnloadSettings:
    return UnloadSettings(
        name=name, layout=layout, holder=holder, triton_url=url, timeout_s=timeout_s, poll_interval_s=0.1
    )


def test_unload_leaves_the_folder_and_drops_the_lease_while_triton_does_not_answer(tmp_path: Path) -> None:
    layout = node(tmp_path)
    folder = publish(layout, "m")
    leases = LeaseStore(layout.leases)
    leases.acquire("m", POD_A)
    down = f"http://127.0.0.1:{free_port()}"
    result = unload_model(unload_settings(layout, down, "m", POD_A, timeout_s=0.5))
    assert result.exit_code == ExitCode.TRITON_UNAVAILABLE and not result.removed
    assert folder.is_dir() and os.listdir(layout.staging) == []
    assert leases.leases("m") == []  # this pod's lease is gone: gc may take the folder once Triton answers
    assert result.reason.startswith(f"{folder} stays in the repository: Triton at {down} does not answer")
    assert "this pod's lease on it is dropped — gc removes it once Triton answers" in result.reason


def test_unload_judges_another_pods_lease_by_the_default_ttl_at_least(tmp_path: Path, triton: TritonServer) -> None:
    """A pod with a short --lease-ttl-s must not take a folder from one heartbeating at a tenth of the default."""
    layout = node(tmp_path)
    folder = publish(layout, "m")
    now = time.time()
    LeaseStore(layout.leases, clock=lambda: now - 45).acquire("m", POD_B)  # its last beat: 45 s ago
    LeaseStore(layout.leases).acquire("m", POD_A)
    settings = dataclasses.replace(unload_settings(layout, triton.url, "m", POD_A, timeout_s=5), lease_ttl_s=30.0)
    result = unload_model(settings)  # Triton answers: "m" is not loading there (another repository)
    assert result.kept and not result.removed and folder.is_dir()


def test_without_a_pod_identity_unload_refuses_a_model_pods_hold_unless_forced(
    tmp_path: Path, triton: TritonServer
) -> None:
    """An operator at a shell (no --pod-uid) must not take a model from under the pods serving it by mistake."""
    layout = node(tmp_path)
    folder = publish(layout, "m")
    LeaseStore(layout.leases).acquire("m", Holder(uid="unload-pod-b", name="resnet-b", namespace="team-b"))
    refused = unload_model(unload_settings(layout, triton.url, "m", None, timeout_s=5))
    assert refused.exit_code == ExitCode.INSTALL_CONFLICT and not refused.removed and folder.is_dir()
    assert "in use by team-b/resnet-b (unload-pod-b) (fresh leases)" in refused.reason
    assert "pass --force" in refused.reason
    forced = unload_model(dataclasses.replace(unload_settings(layout, triton.url, "m", None, timeout_s=5), force=True))
    assert forced.removed and forced.exit_code == ExitCode.OK and not folder.exists()
    assert LeaseStore(layout.leases).leases("m") == []  # the pods' leases went with the folder they named


def test_unload_deletes_the_folder_once_names_lock_is_released(
    tmp_path: Path, triton: TritonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader of NAME waits for NAME's lock: it must not also wait behind the delete of a large model."""
    layout = node(tmp_path)
    publish(layout, "m")
    LeaseStore(layout.leases).acquire("m", POD_A)
    free_while_deleting: list[bool] = []

    def discard(path: Path) -> None:
        free_while_deleting.append(lease_lock_is_free(layout, "m"))
        repository.discard(path)

    monkeypatch.setattr(unload, "discard", discard)
    result = unload_model(unload_settings(layout, triton.url, "m", POD_A, timeout_s=5))
    assert result.removed and free_while_deleting == [True]
    assert not layout.model_dir("m").exists() and os.listdir(layout.staging) == []


def test_a_load_begun_while_unload_waited_for_the_lock_keeps_the_folder(
    triton: TritonServer, layout: NodeLayout, model_name: str
) -> None:
    """Triton is asked again under NAME's lock: the wait before it may have seen a quiet Triton that began
    loading NAME while the lock was held (removing the folder then would cut the load from under Triton).
    The polling Triton: in explicit mode Triton 2.51's index call can block until a load ends."""
    leases = LeaseStore(layout.leases)
    leases.acquire(model_name, POD_A)
    results: list[unload.UnloadResult] = []
    settings = unload_settings(layout, triton.url, model_name, POD_A, timeout_s=1)
    with leases.lock(model_name):
        folder = publish(layout, model_name, model_py=SLOW_START_MODEL)  # Triton loads it at its next poll
        unloading = threading.Thread(target=lambda: results.append(unload_model(settings)))
        unloading.start()  # it finds Triton quiet (most often: the poll is up to 1 s away) and waits for the lock
        wait_loading(triton, model_name)
    unloading.join()
    assert results[0].left is Activity.LOADING and results[0].exit_code == ExitCode.READINESS_TIMEOUT
    assert folder.is_dir() and leases.leases(model_name) == []  # left for gc; this pod's lease is dropped
    wait_model_ready(triton, model_name)  # the load was not cut from under Triton
    assert unload_model(unload_settings(layout, triton.url, model_name, None, timeout_s=30)).removed


def test_unload_while_triton_starts_up_leaves_the_folder_it_is_loading_and_triton_comes_up(tmp_path: Path) -> None:
    """Triton loads its repository before it opens its HTTP port: removing the folder then hangs start-up."""
    layout = node(tmp_path)
    folder = publish(layout, "victim", model_py=SLOW_START_MODEL)
    server = TritonServer(repository=layout.repository, log_path=tmp_path / "triton.log")
    cmd, env = server.command()
    with open(server.log_path, "ab") as log:
        server.process = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
    try:
        deadline = time.monotonic() + 30
        while "loading: victim:1" not in server.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.live(), "Triton answered before it loaded the repository: the test proves nothing"
        result = unload_model(unload_settings(layout, server.url, "victim", None, timeout_s=1))
        assert result.exit_code == ExitCode.TRITON_UNAVAILABLE and not result.removed and folder.is_dir()
        assert "lease on it is dropped" not in result.reason  # no pod identity: it held no lease to drop
        wait_model_ready(server, "victim", timeout_s=60)  # start-up went on: the load was not cut from under it
    finally:
        server.stop()


def test_pollings_refusal_of_the_unload_call_counts_as_done(
    triton: TritonServer, layout: NodeLayout, model_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    install_model(layout, triton, model_name)
    client = TritonClient(triton.url)
    refusal = client.unload(model_name)
    assert (refusal.status, refusal.error_text()) == (503, POLL_REFUSAL)  # what Triton 2.51 answers in POLL mode
    assert request_unload(client, model_name)  # and the call counts as done: there, removing the folder unloads
    with caplog.at_level(logging.WARNING, logger="tritonshare.common.unload"):
        result = unload_model(unload_settings(layout, triton.url, model_name, None, timeout_s=30))
    assert result.removed and result.unloaded and result.exit_code == ExitCode.OK
    assert not model_ready(triton, model_name)
    assert [r.getMessage() for r in caplog.records if r.name == "tritonshare.common.unload"] == []


# ---- explicit mode: a Triton of its own, with --model-control-mode=explicit (tests/conftest.py) -------------


def loaded(server: TritonServer, layout: NodeLayout, name: str) -> TritonClient:
    publish(layout, name)
    client = TritonClient(server.url)
    assert client.load(name).status == 200 and client.model_ready(name)
    return client


def test_in_explicit_mode_unload_makes_triton_stop_serving_the_model(
    explicit_triton: tuple[TritonServer, NodeLayout], model_name: str
) -> None:
    server, layout = explicit_triton
    client = loaded(server, layout, model_name)
    LeaseStore(layout.leases).acquire(model_name, POD_A)
    result = unload_model(unload_settings(layout, server.url, model_name, POD_A, timeout_s=10))
    assert result.removed and result.unloaded and result.exit_code == ExitCode.OK
    assert not client.model_ready(model_name)
    assert not layout.model_dir(model_name).exists()


def test_in_explicit_mode_a_model_another_pod_holds_keeps_being_served(
    explicit_triton: tuple[TritonServer, NodeLayout], model_name: str
) -> None:
    server, layout = explicit_triton
    client = loaded(server, layout, model_name)
    leases = LeaseStore(layout.leases)
    leases.acquire(model_name, POD_A)
    leases.acquire(model_name, POD_B)
    result = unload_model(unload_settings(layout, server.url, model_name, POD_A, timeout_s=10))
    assert result.kept and result.exit_code == ExitCode.OK
    assert client.model_ready(model_name) and layout.model_dir(model_name).is_dir()
    assert request_unload(client, model_name)  # tidy up: Triton accepts, and stops serving it
    assert not client.model_ready(model_name)


# ---- `tritonshare unload`, the command: its exit code and termination message ------------------------------


def unload_command(layout: NodeLayout, url: str, message: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "tritonshare.cli", "unload", "--name", "m", "--repository", str(layout.repository),
        "--staging", str(layout.staging), "--leases", str(layout.leases), "--triton-url", url,
        "--termination-log", str(message), *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSHARE_")}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_a_failed_unload_command_says_why_in_its_termination_log(tmp_path: Path, triton: TritonServer) -> None:
    """As `load` and `proxy` do: a preStop hook or a Job running unload shows its reason in the pod status."""
    layout = node(tmp_path)
    folder = publish(layout, "m")
    message = tmp_path / "termination-log"
    down = f"http://127.0.0.1:{free_port()}"
    done = unload_command(layout, down, message, "--pod-uid", POD_A.uid, "--timeout-s", "0.5")
    assert done.returncode == ExitCode.TRITON_UNAVAILABLE, done.stderr
    assert message.read_text().startswith(f"{folder} stays in the repository: Triton at {down} does not answer")
    assert done.stderr.count("stays in the repository") == 1, done.stderr  # logged once, as the exit's reason

    message.unlink()
    LeaseStore(layout.leases).acquire("m", Holder(uid="unload-pod-b", name="resnet-b", namespace="team-b"))
    done = unload_command(layout, triton.url, message, "--timeout-s", "5")  # an operator: no --pod-uid
    assert done.returncode == ExitCode.INSTALL_CONFLICT, done.stderr
    assert message.read_text().startswith("m stays in the repository: in use by team-b/resnet-b (unload-pod-b)")
    assert done.stderr.count("stays in the repository") == 1, done.stderr
    assert folder.is_dir()


def test_an_unload_command_that_succeeds_writes_no_termination_message(tmp_path: Path, triton: TritonServer) -> None:
    layout = node(tmp_path)
    folder = publish(layout, "m")
    LeaseStore(layout.leases).acquire("m", POD_A)
    message = tmp_path / "termination-log"
    done = unload_command(layout, triton.url, message, "--pod-uid", POD_A.uid, "--timeout-s", "5")
    assert done.returncode == ExitCode.OK, done.stderr
    assert not folder.exists() and not message.exists()


def test_a_pod_holding_no_lease_leaves_the_model_served_and_exits_0(
    triton: TritonServer, layout: NodeLayout, model_name: str
) -> None:
    """Not this pod's to remove (its lease was given up, or never taken): kept, at once, not waited on."""
    install_model(layout, triton, model_name)
    result = unload_model(unload_settings(layout, triton.url, model_name, POD_A, timeout_s=5))
    assert result.kept and not result.removed and result.exit_code == ExitCode.OK
    assert model_ready(triton, model_name) and layout.model_dir(model_name).is_dir()
    assert unload_model(unload_settings(layout, triton.url, model_name, None, timeout_s=30)).removed  # tidy up


def test_unloading_a_name_with_no_folder_removes_nothing_and_exits_0(tmp_path: Path, triton: TritonServer) -> None:
    layout = node(tmp_path)
    result = unload_model(unload_settings(layout, triton.url, "absent", None, timeout_s=5))
    assert not result.removed and result.unloaded and result.exit_code == ExitCode.OK
