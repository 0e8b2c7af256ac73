"""Install identity, reuse and conflicts on a real folder pair; the folders ``withdraw`` must leave in place
whatever Triton would say (one this load reused, one another pod's lease is fresh on, any while Triton does
not answer), and, against real Tritons, one whose load began while ``withdraw`` waited for NAME's lock."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.support.install import lease_lock_is_free, wait_loading, wait_model_ready
from tests.support.models import SLOW_START_MODEL, write_model
from tests.support.ports import free_port
from tests.support.triton import TritonServer
from tritonshare.common import repository
from tritonshare.common.errors import ExitCode, InstallConflict
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder, LeaseStore
from tritonshare.common.repository import RECORD_FILE, InstallRecord, read_record
from tritonshare.common.triton import ModelState, TritonClient
from tritonshare.loader import install as install_module
from tritonshare.loader.install import Withdrawal, existing, install, listing_digest, take_over, withdraw
from tritonshare.loader.sources.base import Checksum, RemoteObject, display_uri, query_identity

OBJECTS = [
    RemoteObject(key="b/m/config.pbtxt", relpath="config.pbtxt", size=120, version="e1"),
    RemoteObject(key="b/m/1/model.py", relpath="1/model.py", size=300, version="e2",
                 checksum=Checksum(algorithm="md5", value="0" * 32)),
]  # fmt: skip


@pytest.fixture
def node(tmp_path: Path) -> NodeLayout:
    layout = NodeLayout(repository=tmp_path / "models", staging=tmp_path / "staging", leases=tmp_path / "leases")
    layout.repository.mkdir()
    layout.staging.mkdir()
    return layout


def record(digest: str = "d1", source: str = "s3://b/m", name: str = "m") -> InstallRecord:
    return InstallRecord(name=name, source=source, digest=digest)


def test_listing_digest_ignores_listing_order_and_sees_every_field() -> None:
    base = listing_digest(OBJECTS)
    assert listing_digest(list(reversed(OBJECTS))) == base
    first, second = OBJECTS
    changed = [
        RemoteObject(key=first.key, relpath=first.relpath, size=121, version="e1"),
        RemoteObject(key=first.key, relpath=first.relpath, size=120, version="e9"),
        RemoteObject(key=first.key, relpath="2/config.pbtxt", size=120, version="e1"),
        RemoteObject(key=first.key, relpath=first.relpath, size=120, version="e1",
                     checksum=Checksum(algorithm="md5", value="1" * 32)),
    ]  # fmt: skip
    digests = {listing_digest([c, second]) for c in changed}
    assert base not in digests and len(digests) == len(changed)


def test_a_free_name_has_no_existing_install(node: NodeLayout) -> None:
    assert existing(node, record()) is None


def test_install_publishes_with_its_record_and_is_then_found_as_the_same(node: NodeLayout, tmp_path: Path) -> None:
    root = write_model(tmp_path / "staged")
    done = install(node, root, record())
    assert done.path == node.model_dir("m") and not done.reused and not root.exists()
    on_disk = read_record(done.path)
    assert on_disk is not None and on_disk.installed_at > 0
    assert existing(node, record()) == on_disk


@pytest.mark.parametrize(
    ("installed", "why"),
    [
        (record(source="gs://other/m"), r"holds 'm' installed from gs://other/m, not s3://b/m"),
        (record(digest="d0"), r"the source changed since \(listing digest d0 → d1\)"),
    ],
)
def test_a_name_holding_another_install_is_a_conflict(
    node: NodeLayout, tmp_path: Path, installed: InstallRecord, why: str
) -> None:
    install(node, write_model(tmp_path / "staged"), installed)
    with pytest.raises(InstallConflict, match=why) as info:
        existing(node, record())
    assert info.value.exit_code == ExitCode.INSTALL_CONFLICT
    assert "tritonshare unload --name m" in str(info.value)


def test_a_folder_not_installed_by_tritonshare_is_a_conflict_and_stays_untouched(node: NodeLayout) -> None:
    theirs = write_model(node.model_dir("m"))
    with pytest.raises(InstallConflict, match=r"exists but was not installed by tritonshare"):
        existing(node, record())
    assert (theirs / "config.pbtxt").exists() and not (theirs / RECORD_FILE).exists()


def test_losing_a_publish_race_to_the_same_source_reuses_the_winner(node: NodeLayout, tmp_path: Path) -> None:
    winner = install(node, write_model(tmp_path / "first"), record())
    second = write_model(tmp_path / "second")
    done = install(node, second, record())
    assert done.reused and done.path == winner.path
    assert second.exists()  # not published: the caller discards its staging folder


def test_losing_a_publish_race_to_another_source_is_a_conflict(node: NodeLayout, tmp_path: Path) -> None:
    install(node, write_model(tmp_path / "first"), record(source="s3://b/other"))
    with pytest.raises(InstallConflict, match=r"installed from s3://b/other, not s3://b/m"):
        install(node, write_model(tmp_path / "second"), record())


def test_withdraw_leaves_the_folder_while_triton_does_not_answer(node: NodeLayout, tmp_path: Path) -> None:
    """Triton loads every model of its repository before it opens its HTTP port: no answer may mean it is
    starting up and loading this very folder, and removing it then hangs its start-up."""
    install(node, write_model(tmp_path / "staged"), record())
    unreachable = TritonClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert withdraw(node, "m", unreachable, timeout_s=0.3, interval_s=0.1) is Withdrawal.UNANSWERED
    assert os.listdir(node.repository) == ["m"] and os.listdir(node.staging) == []


def test_withdraw_never_takes_out_an_install_the_load_reused(node: NodeLayout, tmp_path: Path) -> None:
    install(node, write_model(tmp_path / "staged"), record())
    unreachable = TritonClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert withdraw(node, "m", unreachable, timeout_s=0, reused=True) is Withdrawal.REUSED
    assert os.listdir(node.repository) == ["m"]


def test_withdraw_leaves_a_folder_another_pods_lease_is_fresh_on(node: NodeLayout, tmp_path: Path) -> None:
    install(node, write_model(tmp_path / "staged"), record())
    mine, theirs = Holder(uid="pod-mine"), Holder(uid="pod-theirs")
    leases = LeaseStore(node.leases)
    leases.acquire("m", mine)
    leases.acquire("m", theirs)
    unreachable = TritonClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert withdraw(node, "m", unreachable, timeout_s=0, holder=mine) is Withdrawal.SHARED
    assert os.listdir(node.repository) == ["m"]
    assert sorted(lease.holder.uid for lease in leases.leases("m")) == ["pod-mine", "pod-theirs"]


def test_withdraw_deletes_once_names_lock_is_released_and_forgets_dead_pods_leases(
    node: NodeLayout, tmp_path: Path, triton: TritonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader of NAME waits for NAME's lock: it must not also wait behind the delete of a large model. The
    expired leases of pods that held what is gone go with it, under the lock."""
    install(node, write_model(tmp_path / "staged"), record())
    mine, dead = Holder(uid="pod-mine"), Holder(uid="pod-dead")
    leases = LeaseStore(node.leases)
    LeaseStore(node.leases, clock=lambda: time.time() - 3600).acquire("m", dead)
    leases.acquire("m", mine)
    free_while_deleting: list[bool] = []

    def discard(path: Path) -> None:
        free_while_deleting.append(lease_lock_is_free(node, "m"))
        repository.discard(path)

    monkeypatch.setattr(install_module, "discard", discard)
    client = TritonClient(triton.url)  # it answers: "m" is not loading there (another repository)
    assert withdraw(node, "m", client, timeout_s=5, holder=mine) is Withdrawal.REMOVED
    assert free_while_deleting == [True] and os.listdir(node.repository) == os.listdir(node.staging) == []
    assert [lease.holder.uid for lease in leases.leases("m")] == ["pod-mine"]


def test_a_load_begun_while_withdraw_waited_for_the_lock_keeps_the_folder(
    triton: TritonServer, layout: NodeLayout, model_name: str
) -> None:
    """Triton is asked again under NAME's lock: the wait before it may have seen a quiet Triton that began
    loading NAME while the lock was held (removing the folder then would cut the load from under Triton).
    The polling Triton: in explicit mode Triton 2.51's index call can block until a load ends."""
    client = TritonClient(triton.url)
    outcome: list[Withdrawal] = []
    staged = write_model(layout.staging / f"{model_name}.test", model_py=SLOW_START_MODEL)
    with LeaseStore(layout.leases).lock(model_name):
        folder = install(layout, staged, record(name=model_name)).path  # Triton loads it at its next poll
        withdrawing = threading.Thread(target=lambda: outcome.append(withdraw(layout, model_name, client, timeout_s=1)))
        withdrawing.start()  # it finds Triton quiet (most often: the poll is up to 1 s away) and waits for the lock
        wait_loading(triton, model_name)
    withdrawing.join()
    assert outcome == [Withdrawal.LOADING] and folder.is_dir()
    wait_model_ready(triton, model_name)  # the load was not cut from under Triton
    assert withdraw(layout, model_name, client, timeout_s=30) is Withdrawal.REMOVED


def test_urls_naming_other_objects_by_their_query_are_other_installs_re_signed_ones_the_same() -> None:
    # display_uri masks every query value (signatures stay out of logs): the digest keeps what names the object
    a, b = "https://h/download?model=a", "https://h/download?model=b"
    assert display_uri(a) == display_uri(b)
    assert listing_digest(OBJECTS, query_identity(a)) != listing_digest(OBJECTS, query_identity(b))
    signed = "https://h/m.tgz?X-Amz-Date=1&X-Amz-Signature=aa&version=3"
    resigned = "https://h/m.tgz?version=3&X-Amz-Date=2&X-Amz-Signature=bb"
    assert query_identity(signed) == query_identity(resigned) == "version=3"
    assert query_identity("https://h/m.tgz") == query_identity("/models/m") == ""
    assert listing_digest(OBJECTS, "") == listing_digest(OBJECTS)  # installs from plain URLs keep their digest


def test_a_file_where_the_folder_would_be_is_a_conflict(node: NodeLayout) -> None:
    node.model_dir("m").write_text("an operator's note")
    with pytest.raises(InstallConflict, match=r"exists but was not installed by tritonshare"):
        existing(node, record())
    assert node.model_dir("m").read_text() == "an operator's note"


def test_withdraw_waits_for_a_load_under_way_to_end_then_takes_the_folder_out(
    triton: TritonServer, layout: NodeLayout, model_name: str
) -> None:
    """LOADING is waited out (up to ``timeout_s``), not taken as a reason to leave the folder at once."""
    staged = write_model(layout.staging / f"{model_name}.test", model_py=SLOW_START_MODEL)
    install(layout, staged, record(name=model_name))  # Triton loads it at its next poll, for SLOW_START_S
    wait_loading(triton, model_name)
    client = TritonClient(triton.url)
    assert withdraw(layout, model_name, client, timeout_s=60, interval_s=0.1) is Withdrawal.REMOVED
    assert not layout.model_dir(model_name).exists()


def test_withdraw_asks_an_explicit_mode_triton_to_stop_serving_what_it_took_out(
    explicit_triton: tuple[TritonServer, NodeLayout], tmp_path: Path, model_name: str
) -> None:
    """Explicit mode keeps serving a model whose folder is gone, holding its GPU memory, until told."""
    server, layout = explicit_triton
    install(layout, write_model(tmp_path / "staged"), record(name=model_name))
    client = TritonClient(server.url)
    assert client.load(model_name).status == 200 and client.model_ready(model_name)
    assert withdraw(layout, model_name, client, timeout_s=5) is Withdrawal.REMOVED
    deadline = time.monotonic() + 10
    while client.model_ready(model_name):
        assert time.monotonic() < deadline, "Triton still serves a withdrawn model"
        time.sleep(0.1)


class LeaseTakenDuringTheWait(TritonClient):
    """A real Triton client; while ``withdraw`` first asks it about NAME, another pod takes a lease on NAME."""

    def __init__(self, url: str, leases: LeaseStore, holder: Holder) -> None:
        super().__init__(url)
        self.leases, self.holder = leases, holder

    def model_states(self, name: str) -> list[ModelState]:
        if not self.leases.leases(name):
            self.leases.acquire(name, self.holder)
        return super().model_states(name)


def test_a_lease_taken_while_withdraw_waited_keeps_the_folder(
    node: NodeLayout, tmp_path: Path, triton: TritonServer
) -> None:
    install(node, write_model(tmp_path / "staged"), record())
    client = LeaseTakenDuringTheWait(triton.url, LeaseStore(node.leases), Holder(uid="pod-new"))
    assert withdraw(node, "m", client, timeout_s=5) is Withdrawal.SHARED
    assert os.listdir(node.repository) == ["m"]


def test_take_over_never_touches_a_folder_without_tritonshares_record(node: NodeLayout, triton: TritonServer) -> None:
    """Even when every lease on NAME has expired: an operator's folder is not tritonshare's to retire."""
    theirs = write_model(node.model_dir("m"))
    LeaseStore(node.leases, clock=lambda: time.time() - 3600).acquire("m", Holder(uid="pod-dead"))
    assert not take_over(node, record(), TritonClient(triton.url), holder=Holder(uid="pod-new"))
    assert (theirs / "config.pbtxt").exists()
