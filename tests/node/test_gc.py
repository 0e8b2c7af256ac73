"""``tritonshare gc`` against the session's real Triton: what dead pods leave behind goes, what live pods
hold stays. Each test manages only its own NAME prefix, so the other tests' models in the shared
repository are out of its reach. Time moves by an injected clock, never by sleeping through a TTL."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.install import install_model, model_ready, wait_model_ready
from tests.support.models import IDENTITY_MODEL, write_model
from tests.support.ports import free_port
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode, InsufficientSpace
from tritonshare.common.layout import NodeLayout
from tritonshare.common.lease import Holder, LeaseStore
from tritonshare.common.triton import TritonClient
from tritonshare.common.unload import UnloadSettings, unload_model
from tritonshare.node import gc as gc_module
from tritonshare.node.gc import Collector, GcSettings, run
from tritonshare.node.gc_command import gc

TTL_S = 60.0
POD_A = Holder(uid="1d5e0c9a-aaaa-4f7b-8c1e-5a3b2c1d0e01", name="resnet-a", namespace="team-a")
POD_B = Holder(uid="1d5e0c9a-bbbb-4f7b-8c1e-5a3b2c1d0e02", name="resnet-b", namespace="team-a")

# initialize() takes a few seconds, so Triton's index says LOADING for that long.
SLOW_LOAD_S = 4
SLOW_LOAD_MODEL = (
    IDENTITY_MODEL
    + f"""
    def initialize(self, args):
        import time

        time.sleep({SLOW_LOAD_S})
"""
)


class Clock:
    """Wall and monotonic time that a test moves by hand: :meth:`advance` moves both, as time passing does;
    :meth:`step` moves the wall clock alone, as an NTP step or a VM resumed from suspend does."""

    def __init__(self) -> None:
        self.now = time.time()
        self.elapsed = 0.0

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.elapsed

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.elapsed += seconds

    def step(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def prefix(layout: NodeLayout, triton: TritonServer) -> Iterator[str]:
    """The test's own NAME prefix; what the test leaves in the shared repository goes at teardown (never
    mid-load: unload waits while Triton says LOADING)."""
    tag = f"gc-{uuid.uuid4().hex[:8]}-"
    yield tag
    for path in layout.repository.glob(f"{tag}*"):
        unload_model(UnloadSettings(name=path.name, layout=layout, triton_url=triton.url, timeout_s=30))


@pytest.fixture
def settings(triton: TritonServer, layout: NodeLayout, tmp_path: Path, prefix: str) -> GcSettings:
    node = replace(layout, leases=tmp_path / "leases")
    return GcSettings(layout=node, triton_url=triton.url, lease_ttl_s=TTL_S, manage=(f"{prefix}*",))


def gc_on(settings: GcSettings, clock: Clock, *, client: TritonClient | None = None) -> Collector:
    """A collector whose wall and monotonic time are the test's clock."""
    return Collector(settings, client=client, clock=clock, monotonic=clock.monotonic)


@pytest.fixture
def collector(settings: GcSettings, clock: Clock) -> Collector:
    return gc_on(settings, clock)


@pytest.fixture
def leases(collector: Collector) -> LeaseStore:
    return collector.store  # the same clock as the collector's


@pytest.fixture
def gc_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="tritonshare.node.gc")
    return caplog


@pytest.fixture
def bare_layout(tmp_path: Path) -> NodeLayout:
    """A node folder no Triton watches: for what needs no model loaded."""
    root = tmp_path / "node"
    layout = NodeLayout(repository=root / "models", staging=root / "staging", leases=root / "leases")
    layout.repository.mkdir(parents=True)
    layout.staging.mkdir()
    return layout


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s}s")
        time.sleep(0.1)


def removed(collector: Collector) -> list[tuple[str, str]]:
    return [(r.kind, r.name) for r in collector.sweep()]


def test_a_model_whose_lease_expired_is_removed_and_triton_stops_serving_it(
    triton: TritonServer,
    layout: NodeLayout,
    collector: Collector,
    leases: LeaseStore,
    clock: Clock,
    prefix: str,
    gc_log: pytest.LogCaptureFixture,
) -> None:
    name = f"{prefix}dead"
    install_model(layout, triton, name)
    leases.acquire(name, POD_A, source="file:///models/m", digest="sha256:1")
    clock.advance(TTL_S + 1)  # the pod was SIGKILLed: no heartbeat since
    assert removed(collector) == [("model", name)]
    assert not layout.model_dir(name).exists()
    assert leases.leases(name) == []
    assert not [p for p in layout.staging.iterdir() if p.name.startswith(name)]  # renamed out, then deleted
    wait_for(lambda: not model_ready(triton, name), f"Triton still serves {name}")
    assert f"gc removed model {name}" in gc_log.text
    assert f"last heartbeat came 61s ago from {POD_A}" in gc_log.text


def test_a_model_with_a_fresh_lease_stays(
    triton: TritonServer, layout: NodeLayout, collector: Collector, leases: LeaseStore, clock: Clock, prefix: str
) -> None:
    name = f"{prefix}alive"
    install_model(layout, triton, name)
    leases.acquire(name, POD_A)
    for _ in range(3):  # the proxy's heartbeat keeps it well past one TTL
        clock.advance(TTL_S * 0.8)
        assert leases.refresh(name, POD_A)
        assert removed(collector) == []
    assert layout.model_dir(name).is_dir()
    assert model_ready(triton, name)


def test_a_shared_model_stays_while_any_holder_is_fresh(
    triton: TritonServer,
    layout: NodeLayout,
    collector: Collector,
    leases: LeaseStore,
    clock: Clock,
    prefix: str,
    gc_log: pytest.LogCaptureFixture,
) -> None:
    name = f"{prefix}shared"
    install_model(layout, triton, name)
    leases.acquire(name, POD_A)
    leases.acquire(name, POD_B)
    clock.advance(40)
    leases.refresh(name, POD_B)
    clock.advance(40)  # A: 80 s without a beat (dead); B: 40 s (alive)
    assert removed(collector) == [("lease", f"{name} {POD_A}")]  # only the dead pod's lease goes
    assert model_ready(triton, name)
    clock.advance(TTL_S - 40 + 1)  # now B is gone too
    assert removed(collector) == [("model", name)]
    assert f"from {POD_B}" in gc_log.text
    wait_for(lambda: not model_ready(triton, name), f"Triton still serves {name}")


def test_a_model_without_a_lease_is_removed_once_older_than_the_ttl(
    triton: TritonServer,
    layout: NodeLayout,
    collector: Collector,
    clock: Clock,
    prefix: str,
    gc_log: pytest.LogCaptureFixture,
) -> None:
    name = f"{prefix}unleased"
    install_model(layout, triton, name)  # as an older loader, or a pod gone before its lease was written
    assert removed(collector) == []
    clock.advance(TTL_S + 30)
    assert removed(collector) == [("model", name)]
    assert "no lease, and installed" in gc_log.text
    wait_for(lambda: not model_ready(triton, name), f"Triton still serves {name}")


def test_models_outside_the_managed_patterns_are_never_touched(
    settings: GcSettings, layout: NodeLayout, triton: TritonServer, clock: Clock, prefix: str
) -> None:
    kept, managed = f"{prefix}operator", f"{prefix}tenant"
    install_model(layout, triton, kept)
    install_model(layout, triton, managed)
    collector = gc_on(replace(settings, manage=(f"{prefix}ten*", f"{prefix}x*")), clock)
    clock.advance(TTL_S + 30)
    assert removed(collector) == [("model", managed)]
    assert model_ready(triton, kept)


def test_a_model_triton_is_loading_waits_for_a_later_pass(
    triton: TritonServer,
    layout: NodeLayout,
    collector: Collector,
    leases: LeaseStore,
    clock: Clock,
    prefix: str,
    gc_log: pytest.LogCaptureFixture,
) -> None:
    name = f"{prefix}loading"
    leases.acquire(name, POD_A)
    staged = write_model(layout.staging / f"{name}.test", model_py=SLOW_LOAD_MODEL)
    os.rename(staged, layout.model_dir(name))
    client = TritonClient(triton.url)
    wait_for(lambda: any(s.state == "LOADING" for s in client.model_states(name)), f"{name} never LOADING")
    clock.advance(TTL_S + 1)  # the loader died mid-load
    assert removed(collector) == []
    assert layout.model_dir(name).is_dir()
    assert f"gc keeps {name} this pass: Triton is LOADING it" in gc_log.text
    wait_model_ready(triton, name)  # the load was not disturbed
    assert removed(collector) == [("model", name)]
    wait_for(lambda: not model_ready(triton, name), f"Triton still serves {name}")


def test_a_model_whose_load_began_during_the_pass_is_asked_about_again_before_its_rename(
    triton: TritonServer,
    layout: NodeLayout,
    collector: Collector,
    leases: LeaseStore,
    clock: Clock,
    prefix: str,
    gc_log: pytest.LogCaptureFixture,
) -> None:
    first, starting = f"{prefix}a-dead", f"{prefix}b-starting"
    install_model(layout, triton, first)
    leases.acquire(first, POD_A)
    clock.advance(TTL_S + 30)  # the pod on `first` died; `starting` below looks older than the TTL too
    results: list[list[tuple[str, str]]] = []
    sweep = threading.Thread(target=lambda: results.append(removed(collector)))
    with leases.lock(first):  # the pass stops at `first` (a loader holds its lock) while Triton picks up the next
        os.rename(
            write_model(layout.staging / f"{starting}.test", model_py=SLOW_LOAD_MODEL), layout.model_dir(starting)
        )
        sweep.start()
        client = TritonClient(triton.url)
        wait_for(lambda: any(s.state == "LOADING" for s in client.model_states(starting)), f"{starting} never LOADING")
    sweep.join(timeout=30)
    assert results == [[("model", first)]]
    assert layout.model_dir(starting).is_dir()
    assert f"gc keeps {starting} this pass: Triton is LOADING it" in gc_log.text
    wait_model_ready(triton, starting)  # the load was not disturbed
    wait_for(lambda: not model_ready(triton, first), f"Triton still serves {first}")


def test_staging_leftovers_older_than_the_ttl_go_and_fresh_ones_stay(
    layout: NodeLayout, collector: Collector, clock: Clock, prefix: str
) -> None:
    killed = layout.staging / f"{prefix}m.download.{uuid.uuid4().hex[:12]}"
    (killed / "1").mkdir(parents=True)
    (killed / "1" / "model.plan").write_bytes(b"partial")
    cut_short = layout.staging / f"{prefix}o.retired.{uuid.uuid4().hex[:12]}"
    cut_short.mkdir()  # a delete after a retire that did not finish
    clock.advance(TTL_S + 1)
    downloading = layout.staging / f"{prefix}n.download.{uuid.uuid4().hex[:12]}"
    (downloading / "1").mkdir(parents=True)
    (downloading / "1" / "model.plan").write_bytes(b"growing")
    os.utime(downloading / "1" / "model.plan", (clock.now, clock.now))  # written "just now" in gc's time
    assert sorted(removed(collector)) == sorted([("staging", killed.name), ("staging", cut_short.name)])
    assert not killed.exists() and not cut_short.exists()
    assert (downloading / "1" / "model.plan").read_bytes() == b"growing"


def test_unpacked_files_with_old_mtimes_do_not_make_a_download_look_abandoned(
    layout: NodeLayout, collector: Collector, prefix: str
) -> None:
    unpacking = layout.staging / f"{prefix}m.download.{uuid.uuid4().hex[:12]}"
    (unpacking / "1").mkdir(parents=True)
    (unpacking / "1" / "model.onnx").write_bytes(b"from a 2019 tarball")
    for path in (unpacking / "1" / "model.onnx", unpacking / "1", unpacking):
        os.utime(path, (1_560_000_000, 1_560_000_000))  # tar keeps the archive's mtimes
    assert removed(collector) == []  # ctime says the files were made here just now
    assert unpacking.is_dir()


def test_gc_never_deletes_what_it_did_not_make_in_staging_even_the_repository_inside_it(
    tmp_path: Path, clock: Clock, gc_log: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "node"  # TRITONSHARE_STAGING=/var/lib/tritonshare: the layout check refuses it, gc copes too
    layout = NodeLayout(repository=root / "models", staging=root, leases=root / "leases")
    write_model(layout.model_dir("resnet"))
    (root / "notes.txt").write_text("operator's")
    (root / f"resnet.download.{'z' * 12}").mkdir()  # not an ID tritonshare makes
    collector = gc_on(
        GcSettings(layout=layout, lease_ttl_s=TTL_S), clock, client=TritonClient(f"http://127.0.0.1:{free_port()}")
    )
    collector.store.acquire("resnet", POD_A)
    clock.advance(TTL_S + 30)
    collector.store.refresh("resnet", POD_A)  # the pod using resnet is alive
    assert removed(collector) == []
    assert removed(collector) == []
    assert (layout.model_dir("resnet") / "config.pbtxt").is_file()
    assert (root / "notes.txt").read_text() == "operator's"
    assert (root / f"resnet.download.{'z' * 12}").is_dir()
    assert gc_log.text.count(f"gc leaves {layout.repository} alone: tritonshare did not make it") == 1


def test_a_stalled_download_stays_while_its_loader_holds_a_fresh_lease(
    bare_layout: NodeLayout, clock: Clock, gc_log: pytest.LogCaptureFixture
) -> None:
    workspace = bare_layout.staging / f"resnet.download.{uuid.uuid4().hex[:12]}"
    (workspace / "1").mkdir(parents=True)
    (workspace / "1" / "model.plan").write_bytes(b"first bytes, then the source stalled")
    retired = bare_layout.staging / f"resnet.retired.{uuid.uuid4().hex[:12]}"
    retired.mkdir()
    collector = gc_on(
        GcSettings(layout=bare_layout, lease_ttl_s=TTL_S), clock, client=TritonClient(f"http://127.0.0.1:{free_port()}")
    )
    clock.advance(TTL_S + 30)
    collector.store.acquire("resnet", POD_A)  # the loader's heartbeat goes on
    assert removed(collector) == [("staging", retired.name)]  # a retired folder is nobody's workspace
    assert (workspace / "1" / "model.plan").is_file()
    assert f"gc keeps {workspace}: {POD_A} holds a fresh lease on resnet" in gc_log.text
    clock.advance(TTL_S + 1)  # the loader died: no heartbeat since
    assert removed(collector) == [("staging", workspace.name), ("leases", "resnet")]
    assert not workspace.exists()


def test_a_crash_looping_loader_keeps_only_its_newest_workspace(bare_layout: NodeLayout, clock: Clock) -> None:
    # An init container OOM-killed mid-download restarts in the same pod (same lease): each attempt leaves one.
    attempts = []
    for _ in range(3):
        workspace = bare_layout.staging / f"llm.download.{uuid.uuid4().hex[:12]}"
        (workspace / "1").mkdir(parents=True)
        (workspace / "1" / "weights.bin").write_bytes(b"part of the weights")
        attempts.append(workspace)
        time.sleep(0.02)  # the later attempt is the newer one
    collector = gc_on(
        GcSettings(layout=bare_layout, lease_ttl_s=TTL_S), clock, client=TritonClient(f"http://127.0.0.1:{free_port()}")
    )
    clock.advance(TTL_S + 30)
    collector.store.acquire("llm", POD_A)  # the latest attempt's heartbeat
    assert sorted(removed(collector)) == sorted([("staging", w.name) for w in attempts[:2]])
    assert attempts[2].exists()  # the one a live loader may be using (its source stalled)


def test_without_triton_no_model_is_removed_but_staging_still_is(
    bare_layout: NodeLayout, tmp_path: Path, clock: Clock, gc_log: pytest.LogCaptureFixture
) -> None:
    write_model(bare_layout.model_dir("resnet"))
    leftover = bare_layout.staging / f"resnet.download.{uuid.uuid4().hex[:12]}"
    leftover.mkdir()
    settings = GcSettings(layout=bare_layout, lease_ttl_s=TTL_S)
    collector = gc_on(settings, clock, client=TritonClient(f"http://127.0.0.1:{free_port()}"))
    clock.advance(TTL_S + 30)
    assert removed(collector) == [("staging", leftover.name)]
    assert bare_layout.model_dir("resnet").is_dir()
    assert "gc removes no more models this pass: Triton at" in gc_log.text


def test_a_folder_no_lease_can_name_is_left_alone_and_the_pass_goes_on(
    triton: TritonServer, bare_layout: NodeLayout, tmp_path: Path, clock: Clock, gc_log: pytest.LogCaptureFixture
) -> None:
    write_model(bare_layout.model_dir(".editor-backup"))
    write_model(bare_layout.model_dir("resnet"))
    settings = GcSettings(layout=bare_layout, triton_url=triton.url, lease_ttl_s=TTL_S)
    clock.advance(TTL_S + 30)
    assert removed(gc_on(settings, clock)) == [("model", "resnet")]
    assert bare_layout.model_dir(".editor-backup").is_dir()
    assert "gc leaves .editor-backup alone" in gc_log.text


def test_a_linked_model_and_one_gc_cannot_move_stay_and_the_rest_of_the_pass_goes_on(
    triton: TritonServer,
    bare_layout: NodeLayout,
    tmp_path: Path,
    clock: Clock,
    gc_log: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One entry gc cannot rename (a link to a model elsewhere: EISDIR; an operator's root-owned folder:
    EACCES) ended the whole pass, every pass: staging and orphan leases were never cleaned."""
    elsewhere = write_model(tmp_path / "elsewhere" / "linked")
    bare_layout.model_dir("linked").symlink_to(elsewhere)
    for name in ("resnet", "stuck"):
        write_model(bare_layout.model_dir(name))
    leftover = bare_layout.staging / f"resnet.download.{uuid.uuid4().hex[:12]}"
    leftover.mkdir()
    collector = gc_on(GcSettings(layout=bare_layout, triton_url=triton.url, lease_ttl_s=TTL_S), clock)
    collector.store.acquire("crashed", POD_A)
    moving = gc_module.move_out

    def move_out(layout: NodeLayout, name: str) -> Path | None:
        if name == "stuck":
            raise PermissionError(13, "Permission denied", str(layout.model_dir(name)))
        return moving(layout, name)

    monkeypatch.setattr(gc_module, "move_out", move_out)
    clock.advance(TTL_S + 30)
    assert sorted(removed(collector)) == [("leases", "crashed"), ("model", "resnet"), ("staging", leftover.name)]
    assert bare_layout.model_dir("linked").is_symlink() and (elsewhere / "config.pbtxt").is_file()
    assert bare_layout.model_dir("stuck").is_dir()
    assert "gc cannot remove stuck: [Errno 13] Permission denied" in gc_log.text


def test_after_the_wall_clock_steps_ahead_gc_removes_nothing_until_live_pods_have_beaten_again(
    triton: TritonServer, bare_layout: NodeLayout, clock: Clock, gc_log: pytest.LogCaptureFixture
) -> None:
    """A VM resumed after an hour's suspend: every heartbeat looks an hour old, the live pod's included, until
    it beats again (within a tenth of the TTL). gc holds off for a TTL; then the dead pod's model goes."""
    for name in ("alive", "dead"):
        write_model(bare_layout.model_dir(name))
    workspace = bare_layout.staging / f"loading.download.{uuid.uuid4().hex[:12]}"
    workspace.mkdir()  # a loader still downloading (its lease fresh, not yet installed)
    collector = gc_on(GcSettings(layout=bare_layout, triton_url=triton.url, lease_ttl_s=TTL_S), clock)
    leases = collector.store
    leases.acquire("dead", POD_B)
    clock.advance(TTL_S + 1)  # POD_B was SIGKILLed a while ago
    leases.acquire("alive", POD_A)
    leases.acquire("loading", POD_A)
    clock.step(3600)
    assert removed(collector) == []
    assert "the wall clock stepped 3600s ahead" in gc_log.text
    for beat in range(1, 11):  # the live pod beats a tenth of the TTL apart; gc holds for one TTL
        clock.advance(TTL_S / 10)
        assert leases.refresh("alive", POD_A) and leases.refresh("loading", POD_A)
        os.utime(workspace, (clock.now, clock.now))  # its download goes on
        assert removed(collector) == ([("model", "dead")] if beat == 10 else [])  # then what is dead goes
    assert bare_layout.model_dir("alive").is_dir() and workspace.is_dir()


def test_a_small_step_of_the_wall_clock_holds_nothing(
    triton: TritonServer, bare_layout: NodeLayout, clock: Clock, gc_log: pytest.LogCaptureFixture
) -> None:
    """NTP's small corrections are within the heartbeat margin (nine missed beats): no hold."""
    write_model(bare_layout.model_dir("dead"))
    collector = gc_on(GcSettings(layout=bare_layout, triton_url=triton.url, lease_ttl_s=TTL_S), clock)
    collector.store.acquire("dead", POD_B)
    clock.advance(TTL_S + 1)
    clock.step(TTL_S / 10 - 1)
    assert removed(collector) == [("model", "dead")]
    assert "stepped" not in gc_log.text


def test_a_model_whose_loader_gave_it_up_goes_at_the_next_pass(
    triton: TritonServer, bare_layout: NodeLayout, clock: Clock, gc_log: pytest.LogCaptureFixture
) -> None:
    """A loader stopped while Triton loaded what it published expires its lease: no TTL to wait."""
    write_model(bare_layout.model_dir("stopped"))
    collector = gc_on(GcSettings(layout=bare_layout, triton_url=triton.url, lease_ttl_s=TTL_S), clock)
    collector.store.acquire("stopped", POD_A)
    collector.store.give_up("stopped", POD_A)
    assert removed(collector) == [("model", "stopped")]
    assert f"every lease expired: {POD_A} gave the model up (its load failed or was stopped)" in gc_log.text


def test_staging_is_cleaned_first_so_a_full_disk_is_freed_even_when_the_models_step_fails(
    bare_layout: NodeLayout, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    leftover = bare_layout.staging / f"resnet.download.{uuid.uuid4().hex[:12]}"
    (leftover / "1").mkdir(parents=True)
    collector = gc_on(GcSettings(layout=bare_layout, lease_ttl_s=TTL_S), clock)

    def full() -> list[object]:
        raise InsufficientSpace("creating leases/.locks: the filesystem is full — free space on the node")

    monkeypatch.setattr(collector, "_models", full)
    clock.advance(TTL_S + 1)
    with pytest.raises(InsufficientSpace):
        collector.sweep()
    assert not leftover.exists()


def test_a_staging_tree_deeper_than_python_recurses_is_judged_and_deleted(
    bare_layout: NodeLayout, clock: Clock
) -> None:
    leftover = bare_layout.staging / f"deep.download.{uuid.uuid4().hex[:12]}"
    deep = leftover
    deep.mkdir()
    for _ in range(1200):  # RecursionError in the sidecar: it crash-looped (os.makedirs recurses too)
        deep = deep / "d"
        deep.mkdir()
    (deep / "f").write_bytes(b"x")
    clock.advance(TTL_S + 1)
    assert removed(gc_on(GcSettings(layout=bare_layout, lease_ttl_s=TTL_S), clock)) == [("staging", leftover.name)]
    assert not leftover.exists()


def test_leases_of_dead_pods_go_while_another_pod_holds_the_model(bare_layout: NodeLayout, clock: Clock) -> None:
    write_model(bare_layout.model_dir("resnet"))
    collector = gc_on(GcSettings(layout=bare_layout, lease_ttl_s=TTL_S), clock)
    dead = [Holder(uid=f"killed-{i}") for i in range(5)]  # SIGKILLed in a rollout: no release
    for holder in dead:
        collector.store.acquire("resnet", holder)
    clock.advance(TTL_S + 1)
    collector.store.acquire("resnet", POD_A)  # the pod serving it now
    assert sorted(removed(collector)) == sorted(("lease", f"resnet {holder}") for holder in dead)
    assert [lease.holder for lease in collector.store.leases("resnet")] == [POD_A]
    assert bare_layout.model_dir("resnet").is_dir()


def test_leases_of_models_that_are_not_installed_go_once_expired(
    bare_layout: NodeLayout, tmp_path: Path, clock: Clock
) -> None:
    collector = gc_on(GcSettings(layout=bare_layout, lease_ttl_s=TTL_S), clock)
    collector.store.acquire("crashed", POD_A)  # its loader died before publishing
    clock.advance(TTL_S + 1)
    collector.store.acquire("downloading", POD_B)  # a loader at work: its model is not there yet
    assert removed(collector) == [("leases", "crashed")]
    assert collector.store.names() == ["downloading"]


def test_run_sweeps_every_interval_until_stopped(bare_layout: NodeLayout, tmp_path: Path, clock: Clock) -> None:
    settings = GcSettings(layout=bare_layout, lease_ttl_s=TTL_S, interval_s=0.1)
    stop = threading.Event()
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(run(settings, stop=stop, clock=clock, monotonic=clock.monotonic))
    )
    thread.start()
    try:
        leftover = bare_layout.staging / f"m.download.{uuid.uuid4().hex[:12]}"
        leftover.mkdir()
        time.sleep(0.3)
        assert leftover.exists()  # young: passes go by and leave it
        clock.advance(TTL_S + 30)
        wait_for(lambda: not leftover.exists(), "a later pass did not remove the leftover", timeout_s=5)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert codes == [ExitCode.OK]


def test_the_command_makes_one_pass_with_options_from_the_environment(
    triton: TritonServer, bare_layout: NodeLayout, tmp_path: Path, gc_log: pytest.LogCaptureFixture
) -> None:
    write_model(bare_layout.model_dir("resnet"))
    store = LeaseStore(bare_layout.leases)
    store.acquire("resnet", POD_A)
    old = time.time() - 120
    os.utime(store.path("resnet", POD_A), (old, old))  # the last heartbeat was two minutes ago
    args = ["--once", "--repository", str(bare_layout.repository), "--staging", str(bare_layout.staging)]
    env = {
        "TRITONSHARE_LEASES": str(bare_layout.leases),
        "TRITONSHARE_LEASE_TTL_S": "60",
        "TRITONSHARE_TRITON_URL": triton.url,
        "TRITONSHARE_TERMINATION_LOG": str(tmp_path / "termination-log"),
    }
    result = CliRunner().invoke(gc, args, env=env)
    assert result.exit_code == ExitCode.OK, result.output
    assert not bare_layout.model_dir("resnet").exists()
    assert "gc removed model resnet" in gc_log.text


def test_the_command_refuses_a_repository_inside_staging(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    termination = tmp_path / "termination-log"
    args = ["--once", "--repository", str(tmp_path / "models"), "--staging", str(tmp_path)]
    result = CliRunner().invoke(
        gc, [*args, "--leases", str(tmp_path / "leases"), "--termination-log", str(termination)]
    )
    assert result.exit_code == ExitCode.USAGE
    assert f"repository {tmp_path / 'models'} is inside the staging {tmp_path}" in termination.read_text()
    assert (tmp_path / "models").is_dir()


def test_the_command_refuses_a_missing_repository(tmp_path: Path) -> None:
    (tmp_path / "staging").mkdir()
    termination = tmp_path / "termination-log"
    args = ["--once", "--repository", str(tmp_path / "models"), "--staging", str(tmp_path / "staging")]
    result = CliRunner().invoke(gc, [*args, "--termination-log", str(termination)])
    assert result.exit_code == ExitCode.USAGE
    assert "repository folder" in termination.read_text()
    assert "does not exist" in termination.read_text()
