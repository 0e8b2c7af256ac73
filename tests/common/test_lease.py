from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from tritonshare.common.errors import UsageError
from tritonshare.common.lease import Heartbeat, Holder, LeaseStore, Release

POD_A = Holder(uid="0b6a8f0e-aaaa-4c1e-9a52-1f0c3c1d2e01", name="resnet-7d9f-abcde", namespace="team-a")
POD_B = Holder(uid="0b6a8f0e-bbbb-4c1e-9a52-1f0c3c1d2e02", name="resnet-7d9f-fghij", namespace="team-a")


class Clock:
    """Wall time that a test moves by hand."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> LeaseStore:
    return LeaseStore(tmp_path / "leases", ttl_s=60, clock=clock)


def test_acquire_writes_one_lease_per_holder_outside_the_repository(store: LeaseStore) -> None:
    store.acquire("resnet", POD_A, source="s3://models/resnet/", digest="sha256:abc")
    path = store.root / "resnet" / f"{POD_A.uid}.json"
    doc = json.loads(path.read_text())
    assert doc["pod_uid"] == POD_A.uid
    assert (doc["pod_name"], doc["pod_namespace"]) == ("resnet-7d9f-abcde", "team-a")
    assert (doc["source"], doc["digest"]) == ("s3://models/resnet/", "sha256:abc")
    [lease] = store.leases("resnet")
    assert lease.holder == POD_A
    assert lease.source == "s3://models/resnet/"


def test_acquire_is_atomic_and_idempotent(store: LeaseStore, clock: Clock) -> None:
    store.acquire("resnet", POD_A, source="s3://a/", digest="d1")
    clock.advance(5)
    store.acquire("resnet", POD_A, source="s3://a/", digest="d2")
    assert sorted(p.name for p in (store.root / "resnet").iterdir()) == [f"{POD_A.uid}.json"]  # no temp left
    [lease] = store.leases("resnet")
    assert lease.digest == "d2"
    assert lease.renewed_at == pytest.approx(clock.now)


def test_refresh_moves_the_heartbeat_and_reports_a_lost_lease(store: LeaseStore, clock: Clock) -> None:
    store.acquire("resnet", POD_A)
    clock.advance(45)
    assert store.refresh("resnet", POD_A) is True
    [lease] = store.leases("resnet")
    assert lease.renewed_at == pytest.approx(clock.now)
    assert lease.acquired_at == pytest.approx(clock.now - 45)
    assert store.refresh("resnet", POD_B) is False
    assert store.leases("resnet") == [lease]  # a refresh never creates a lease


def test_a_lease_is_fresh_until_the_ttl_passes(store: LeaseStore, clock: Clock) -> None:
    store.acquire("resnet", POD_A)
    clock.advance(60)
    assert [lease.holder for lease in store.fresh("resnet")] == [POD_A]
    clock.advance(1)
    assert store.fresh("resnet") == []
    assert len(store.leases("resnet")) == 1  # expired, not gone: gc decides what to do


def test_owned_by_is_per_holder_and_per_name(store: LeaseStore) -> None:
    store.acquire("resnet", POD_A)
    assert store.owned_by("resnet", POD_A)
    assert not store.owned_by("resnet", POD_B)
    assert not store.owned_by("bert", POD_A)


def test_release_of_the_only_holder_removes_the_model(store: LeaseStore) -> None:
    store.acquire("resnet", POD_A)
    removed: list[str] = []
    assert store.release("resnet", POD_A, remove=lambda: removed.append("resnet")) is Release.LAST
    assert removed == ["resnet"]
    assert store.leases("resnet") == []
    assert "resnet" not in store.names()


def test_release_keeps_the_model_while_another_holder_is_fresh(store: LeaseStore, clock: Clock) -> None:
    store.acquire("resnet", POD_A)
    store.acquire("resnet", POD_B)
    removed: list[str] = []
    assert store.release("resnet", POD_A, remove=lambda: removed.append("x")) is Release.SHARED
    assert removed == []
    assert [lease.holder for lease in store.leases("resnet")] == [POD_B]
    clock.advance(30)
    assert store.release("resnet", POD_B, remove=lambda: removed.append("x")) is Release.LAST
    assert removed == ["x"]


def test_release_ignores_expired_holders_and_drops_their_leases(store: LeaseStore, clock: Clock) -> None:
    store.acquire("resnet", POD_B)  # a pod killed with SIGKILL: it never released
    clock.advance(120)
    store.acquire("resnet", POD_A)
    removed: list[str] = []
    assert store.release("resnet", POD_A, remove=lambda: removed.append("x")) is Release.LAST
    assert removed == ["x"]
    assert store.leases("resnet") == []


def test_release_without_a_lease_leaves_the_model_alone(store: LeaseStore) -> None:
    store.acquire("resnet", POD_B)
    removed: list[str] = []
    assert store.release("resnet", POD_A, remove=lambda: removed.append("x")) is Release.NOT_HELD
    assert removed == []
    assert [lease.holder for lease in store.leases("resnet")] == [POD_B]


def test_forget_drops_only_the_holders_own_lease(store: LeaseStore) -> None:
    store.acquire("resnet", POD_A)
    store.acquire("resnet", POD_B)
    assert store.forget("resnet", POD_A) is True
    assert store.forget("resnet", POD_A) is False
    assert [lease.holder for lease in store.leases("resnet")] == [POD_B]


def test_give_up_leaves_the_lease_expired_unless_another_holder_uses_the_model(store: LeaseStore) -> None:
    store.acquire("resnet", POD_A)
    store.give_up("resnet", POD_A)
    assert [lease.holder.uid for lease in store.expired("resnet")] == [POD_A.uid] and store.fresh("resnet") == []
    assert store.expired("resnet")[0].given_up
    store.acquire("llm", POD_A)
    store.acquire("llm", POD_B)
    store.give_up("llm", POD_A)
    assert [lease.holder.uid for lease in store.leases("llm")] == [POD_B.uid]  # B uses it: A's lease just goes


def test_an_unreadable_lease_still_counts_by_its_mtime(store: LeaseStore, clock: Clock) -> None:
    folder = store.root / "resnet"
    folder.mkdir(parents=True)
    (folder / "some-pod.json").write_text("{ torn")
    os.utime(folder / "some-pod.json", (clock.now, clock.now))
    (folder / ".some-pod.json.1234.tmp").write_text("{}")  # a writer killed mid-write: skipped
    [lease] = store.fresh("resnet")
    assert lease.holder.uid == "some-pod"


def test_names_lists_lease_folders_only(store: LeaseStore) -> None:
    store.acquire("resnet", POD_A)
    store.acquire("bert", POD_A)
    (store.root / "not a name").mkdir()
    assert store.names() == ["bert", "resnet"]  # not the .locks folder, nor what no NAME can be


@pytest.mark.parametrize("uid", ["", "../etc", "a/b", ".hidden", "x" * 129])
def test_a_holder_needs_a_uid_fit_for_a_file_name(uid: str) -> None:
    with pytest.raises(UsageError, match="--pod-uid"):
        Holder(uid=uid)


def test_names_are_checked_before_they_become_paths(store: LeaseStore) -> None:
    with pytest.raises(UsageError, match="model name"):
        store.acquire("../models", POD_A)


def test_an_unwritable_lease_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "leases").write_text("not a folder")
    with pytest.raises(UsageError, match="cannot write the lease .* read-write"):
        LeaseStore(tmp_path / "leases").acquire("resnet", POD_A)


def test_the_lock_excludes_other_holders_until_released(store: LeaseStore) -> None:
    order: list[str] = []
    inside = threading.Event()

    def contender() -> None:
        inside.wait()
        with store.lock("resnet"):  # a separate open file: flock makes it wait, as another process would
            order.append("contender")

    thread = threading.Thread(target=contender)
    thread.start()
    with store.lock("resnet"):
        inside.set()
        time.sleep(0.2)
        order.append("holder")
    thread.join(timeout=5)
    assert order == ["holder", "contender"]


def test_heartbeat_keeps_the_lease_fresh_and_retakes_a_lost_one(
    store: LeaseStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    lease = store.acquire("resnet", POD_A, source="s3://a/", digest="d")
    beat = Heartbeat(store, lease, interval_s=0.02)
    clock.advance(50)
    beat.beat()
    assert store.leases("resnet")[0].renewed_at == pytest.approx(clock.now)
    store.drop("resnet")
    with caplog.at_level(logging.WARNING, logger="tritonshare.common.lease"):
        with beat:
            deadline = time.monotonic() + 5
            while not store.leases("resnet") and time.monotonic() < deadline:
                time.sleep(0.01)
    [again] = store.leases("resnet")
    assert (again.holder, again.source, again.digest) == (POD_A, "s3://a/", "d")
    assert "was gone" in caplog.text
    clock.advance(50)
    time.sleep(0.1)
    assert store.leases("resnet")[0].renewed_at == pytest.approx(clock.now - 50)  # stopped: no more beats


def test_heartbeat_beats_ten_times_per_ttl_by_default(store: LeaseStore) -> None:
    assert Heartbeat(store, store.acquire("resnet", POD_A)).interval_s == pytest.approx(6.0)
