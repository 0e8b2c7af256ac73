"""``tritonshare load`` stopped by SIGTERM mid-download, as when its pod is deleted while the init container
fetches the model: the console script in a subprocess, a real HTTP server sending the archive slowly, the
real Triton. The loader must clean up before it exits — nothing left in staging to fail the next loader's
free-space check, no lease for its pod — exit 143 and say why in its termination message."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.models import SLOW_START_MODEL, write_model
from tests.support.storage import CrawlingHttpServer, Fault, big_model
from tests.support.triton import REPO_ROOT, TritonServer
from tritonshare.common import repository
from tritonshare.common.command import run_command
from tritonshare.common.errors import ExitCode
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder, LeaseStore
from tritonshare.common.repository import read_record
from tritonshare.common.triton import TritonClient
from tritonshare.loader.run import run
from tritonshare.loader.settings import LoaderSettings

pytestmark = [pytest.mark.triton, pytest.mark.storage]

TRITONSHARE = REPO_ROOT / ".venv" / "bin" / "tritonshare"
MIB = 1 << 20


@dataclass(frozen=True)
class Loader:
    """One ``tritonshare load`` of a model as one pod."""

    layout: NodeLayout
    triton_url: str
    source: str
    name: str
    pod_uid: str
    folder: Path

    @property
    def termination_log(self) -> Path:
        return self.folder / f"termination-{self.pod_uid}"

    @property
    def stderr(self) -> Path:
        return self.folder / f"stderr-{self.pod_uid}"

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        layout = self.layout
        cmd = [
            str(TRITONSHARE), "load", self.source, "--name", self.name, "--repository", str(layout.repository),
            "--staging", str(layout.staging), "--leases", str(layout.leases), "--pod-uid", self.pod_uid,
            "--triton-url", self.triton_url, "--termination-log", str(self.termination_log), "--timeout-s", "60",
            *extra,
        ]  # fmt: skip
        with open(self.stderr, "wb") as err:
            return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)

    def holds_lease(self) -> bool:
        return LeaseStore(self.layout.leases).owned_by(self.name, Holder(uid=self.pod_uid))


def staged(layout: NodeLayout, name: str) -> list[str]:
    """The staging entries a loader of ``name`` made (``NAME.download.<id>``)."""
    return sorted(entry for entry in os.listdir(layout.staging) if entry.startswith(f"{name}."))


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stop_with_sigterm(proc: subprocess.Popen[bytes], server: CrawlingHttpServer) -> float:
    """SIGTERM once the download is under way; the seconds the loader took to exit."""
    wait_for(lambda: server.sent >= 2 * MIB or proc.poll() is not None, "the download to start")
    assert proc.poll() is None, "the loader ended before it was stopped"
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    proc.wait(timeout=60)
    return time.monotonic() - stopped


@pytest.mark.parametrize("packing", ["zip", "tar"])
def test_sigterm_mid_download_cleans_up_exits_143_and_the_next_load_succeeds(
    packing: str,
    crawling_server: CrawlingHttpServer,
    layout: NodeLayout,
    triton: TritonServer,
    model_name: str,
    tmp_path: Path,
    cleanup: list[str],
) -> None:
    source = crawling_server.serve(big_model(tmp_path, packing))
    first = Loader(layout, triton.url, source, model_name, f"pod-{uuid.uuid4().hex[:8]}", tmp_path)
    proc = first.start()
    took = stop_with_sigterm(proc, crawling_server)

    log = first.stderr.read_text()
    assert proc.returncode == 143, log  # ExitCode.TERMINATED: 128 + SIGTERM, what a shell shows for a kill
    message = first.termination_log.read_text()
    assert message.startswith("stopped by SIGTERM while downloading")
    assert f"`tritonshare load --name {model_name}`" in message
    assert took < 10, f"clean-up took {took:.1f} s: the kubelet's grace period is 30 s by default"
    assert staged(layout, model_name) == []  # the partial download is gone
    assert not layout.model_dir(model_name).exists()
    assert not first.holds_lease()
    assert "Traceback" not in log

    crawling_server.bytes_per_s = 0  # the next pod's loader, right away, at full speed
    second = Loader(layout, triton.url, source, model_name, f"pod-{uuid.uuid4().hex[:8]}", tmp_path)
    cleanup.append(model_name)
    assert second.start().wait(timeout=90) == ExitCode.OK, second.stderr.read_text()
    assert TritonClient(triton.url).model_ready(model_name)
    assert second.holds_lease()
    assert staged(layout, model_name) == []


def test_sigterm_while_download_threads_wait_on_a_stalled_store_still_cleans_up(
    crawling_server: CrawlingHttpServer, layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    """The download threads notice the stop only when their read returns: at the latest after
    --stall-timeout-s, which must therefore stay under the pod's grace period for the clean-up to finish."""
    source = crawling_server.serve(big_model(tmp_path, "zip"))
    crawling_server.fail("/identity.zip", Fault(stall_after_bytes=MIB))  # every ranged GET hangs after 1 MiB
    loader = Loader(layout, triton.url, source, model_name, f"pod-{uuid.uuid4().hex[:8]}", tmp_path)
    proc = loader.start("--stall-timeout-s", "3")
    wait_for(lambda: ("GET", "/identity.zip") in crawling_server.requests, "the download to start")
    time.sleep(0.5)  # the threads are now blocked reading
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    assert proc.wait(timeout=60) == 143, loader.stderr.read_text()
    assert time.monotonic() - stopped < 3 + 5
    assert loader.termination_log.read_text().startswith("stopped by SIGTERM")
    assert staged(layout, model_name) == []
    assert not loader.holds_lease()


def test_sigterm_while_triton_loads_leaves_the_install_abandoned_to_the_next_pods_loader(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str]
) -> None:
    """A pod deleted while Triton loads its model (a rollout to a new SOURCE, typically): the folder must stay
    (removing it mid-load hangs Triton's polling), and the new pod's loader must take it over once Triton has
    loaded it — not refuse it as an install in use (exit 14) for a TTL because it has no lease and is recent."""
    old = write_model(tmp_path / "v1", model_py=SLOW_START_MODEL)
    first = Loader(layout, triton.url, str(old), model_name, f"pod-{uuid.uuid4().hex[:8]}", tmp_path)
    cleanup.append(model_name)
    proc = first.start()
    client = TritonClient(triton.url)
    wait_for(lambda: any(s.state == "LOADING" for s in client.model_states(model_name)), "Triton to load it", 60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143, first.stderr.read_text()
    assert first.termination_log.read_text().startswith("stopped by SIGTERM while waiting for Triton to load")
    assert layout.model_dir(model_name).is_dir() and staged(layout, model_name) == []
    assert LeaseStore(layout.leases).expired(model_name) == LeaseStore(layout.leases).leases(model_name) != []

    wait_for(lambda: client.model_ready(model_name), "Triton to finish the load it had begun", 60)
    new = write_model(tmp_path / "v2")
    second = Loader(layout, triton.url, str(new), model_name, f"pod-{uuid.uuid4().hex[:8]}", tmp_path)
    assert second.start().wait(timeout=90) == ExitCode.OK, second.stderr.read_text()
    assert read_record(layout.model_dir(model_name)).source == str(new)  # type: ignore[union-attr]
    assert [lease.holder.uid for lease in LeaseStore(layout.leases).leases(model_name)] == [second.pod_uid]


def test_sigterm_as_the_publishing_rename_lands_gives_the_install_up_like_a_sigterm_while_triton_loads(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path, cleanup: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The signal comes just after the rename that publishes (here: as the repository folder is flushed, the
    fault injected at that OS call). The folder this loader published stays, so its lease must be left
    expired (given up), as after a SIGTERM while Triton loads — it was dropped instead, as if nothing had been
    published, and a recent folder without a lease is kept a TTL by gc and refused to the next pod's loader.
    In this process, as ``tritonshare load`` runs it (run_command's signal handlers), for the timing."""
    flush = repository._flush_repository

    def pod_deleted_as_the_rename_lands(folder: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        flush(folder)

    monkeypatch.setattr(repository, "_flush_repository", pod_deleted_as_the_rename_lands)
    holder = Holder(uid=f"pod-{uuid.uuid4().hex[:8]}")
    conf = LoaderSettings(
        source=str(write_model(tmp_path / "m")), name=model_name, layout=layout, triton_url=triton.url,
        holder=holder, termination_log=tmp_path / "termination", timeout_s=60,
    )  # fmt: skip
    cleanup.append(model_name)
    with pytest.raises(SystemExit) as ended:
        run_command(lambda: run(conf), termination_log=conf.termination_log)
    assert ended.value.code == ExitCode.TERMINATED
    assert layout.model_dir(model_name).is_dir() and staged(layout, model_name) == []
    leases = LeaseStore(layout.leases)
    assert [lease.holder.uid for lease in leases.leases(model_name)] == [holder.uid], "the lease was dropped"
    assert leases.expired(model_name) == leases.leases(model_name)  # given up: abandoned at once to gc
