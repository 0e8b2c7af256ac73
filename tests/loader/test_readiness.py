"""Waiting for Triton, against the real server: ready, failed with Triton's reason, a stale failure left by
an earlier folder of the same name, a config Triton silently ignores, Triton down, and explicit mode."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests.support.models import BROKEN_MODEL, IDENTITY_CONFIG, SLOW_START_MODEL, write_model
from tests.support.ports import free_port
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode, ReadinessTimeout, TritonLoadFailed, UsageError
from tritonshare.common.layout import NodeLayout
from tritonshare.common.repository import discard, move_out
from tritonshare.common.triton import ModelState, TritonClient
from tritonshare.loader.install import Withdrawal, withdraw
from tritonshare.loader.readiness import PollWaiter, load_explicitly, look, wait_live, wait_polled, wait_unserved
from tritonshare.loader.run import run
from tritonshare.loader.settings import LoaderSettings

pytestmark = pytest.mark.triton


def publish_model(layout: NodeLayout, name: str, **kwargs: str) -> Path:
    staged = write_model(layout.staging / f"{name}.test", **kwargs)  # type: ignore[arg-type]
    target = layout.model_dir(name)
    os.rename(staged, target)
    return target


def wait_for_state(client: TritonClient, name: str, state: str, timeout_s: float = 30) -> ModelState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in client.model_states(name):
            if s.state == state:
                return s
        time.sleep(0.05)
    raise AssertionError(f"{name} never reached {state}: {client.model_states(name)}")


def take_out(layout: NodeLayout, name: str) -> None:
    trash = move_out(layout, name)
    assert trash is not None
    discard(trash)


@pytest.fixture
def client(triton: TritonServer) -> TritonClient:
    return TritonClient(triton.url)


def test_a_published_model_is_awaited_until_ready(layout: NodeLayout, client: TritonClient, model_name: str) -> None:
    publish_model(layout, model_name)
    wait_polled(client, model_name, timeout_s=60)
    assert client.model_ready(model_name)
    take_out(layout, model_name)


def test_a_failing_model_is_reported_with_tritons_reason_well_before_the_deadline(
    layout: NodeLayout, client: TritonClient, model_name: str
) -> None:
    publish_model(layout, model_name, model_py=BROKEN_MODEL)
    started = time.monotonic()
    with pytest.raises(
        TritonLoadFailed, match=rf"Triton failed to load {model_name}: .*this model refuses to load"
    ) as e:
        wait_polled(client, model_name, timeout_s=120)
    assert time.monotonic() - started < 20
    assert e.value.exit_code == ExitCode.TRITON_LOAD_FAILED
    assert str(e.value).endswith("fix the model at its source (config.pbtxt or files; Triton's log on the node has "
                                 "the whole reason)")  # fmt: skip
    assert withdraw(layout, model_name, client, timeout_s=30) is Withdrawal.REMOVED
    assert not layout.model_dir(model_name).exists()


def test_a_failure_left_by_an_earlier_folder_of_the_same_name_is_not_taken_for_the_new_one(
    layout: NodeLayout, client: TritonClient, model_name: str
) -> None:
    publish_model(layout, model_name, config=IDENTITY_CONFIG.replace('"python"', '"no-such-backend"'))
    wait_for_state(client, model_name, "UNAVAILABLE")
    assert withdraw(layout, model_name, client, timeout_s=30) is Withdrawal.REMOVED
    publish_model(layout, model_name)  # a fixed model under the same name, at once
    first = look(client, model_name)
    assert "no-such-backend" in first.failure()  # Triton shows the old failure for the new folder...
    PollWaiter(client, model_name, timeout_s=60).wait()  # ...which must not be taken for this load's
    assert client.model_ready(model_name)
    take_out(layout, model_name)


def test_a_config_triton_cannot_parse_times_out_with_a_hint(
    layout: NodeLayout, client: TritonClient, model_name: str
) -> None:
    # An unknown field: Triton logs "Poll failed" and keeps the model name-only, never UNAVAILABLE.
    publish_model(layout, model_name, config=IDENTITY_CONFIG + "no_such_field: 1\n")
    with pytest.raises(ReadinessTimeout, match=r"Triton has not started loading it .* 'Poll failed'") as e:
        wait_polled(client, model_name, timeout_s=2.5)
    assert e.value.exit_code == ExitCode.READINESS_TIMEOUT
    take_out(layout, model_name)


def test_a_load_held_up_by_another_models_slow_load_times_out_naming_that_model(
    layout: NodeLayout, client: TritonClient, model_name: str
) -> None:
    """Each poll waits for every load it started (REFERENCE §2): a tenant whose initialize() takes long holds up
    every other tenant's load on the node, and the one waiting must be told whose."""
    slow = f"{model_name}-slow"
    publish_model(layout, slow, model_py=SLOW_START_MODEL)
    wait_for_state(client, slow, "LOADING")
    publish_model(layout, model_name)
    with pytest.raises(ReadinessTimeout) as e:
        wait_polled(client, model_name, timeout_s=2)
    assert e.value.exit_code == ExitCode.READINESS_TIMEOUT
    assert f"Triton has not started loading it — Triton's polling waits for the load of {slow} (LOADING)" in str(
        e.value
    )
    wait_polled(client, model_name, timeout_s=60)  # the poll after the slow load takes it
    for name in (model_name, slow):
        take_out(layout, name)


def test_a_model_missing_from_tritons_repository_times_out_naming_the_repository(
    client: TritonClient, model_name: str
) -> None:
    with pytest.raises(ReadinessTimeout, match=r"Triton's index does not list it — is Triton's --model-repository"):
        wait_polled(client, model_name, timeout_s=0.3)


def test_triton_down_is_a_readiness_timeout_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ReadinessTimeout, match=rf"Triton is not reachable after 0\.[0-9] s: Triton at {url} did not"):
        wait_live(TritonClient(url), timeout_s=0.5, interval_s=0.1)


def test_explicit_load_against_a_polling_triton_is_a_usage_error_not_a_model_failure(
    layout: NodeLayout, client: TritonClient, model_name: str
) -> None:
    with pytest.raises(
        UsageError, match=rf"runs in POLL mode and refuses to load {model_name} when asked — use --mode poll"
    ):
        load_explicitly(client, model_name, timeout_s=10)


@pytest.mark.parametrize("port", ["grpc_port", "metrics_port"])
def test_a_triton_url_naming_another_of_tritons_ports_is_a_usage_error_at_once(triton: TritonServer, port: str) -> None:
    """Not ten silent minutes and then "not live" or "still serves an earlier NAME": exit 2, naming the ports."""
    client = TritonClient(f"http://127.0.0.1:{getattr(triton, port)}")
    started = time.monotonic()
    with pytest.raises(UsageError, match=r"--triton-url must name Triton's HTTP port \(8000 by default"):
        wait_live(client, timeout_s=30, interval_s=0.1)
    assert time.monotonic() - started < 5


class FakeTriton:
    """Replays index entries, for the waiter's judgement alone (the real sequences are tested above)."""

    url = "http://fake"

    def __init__(self, states: list[ModelState]) -> None:
        self.states = states

    def model_ready(self, name: str) -> bool:
        return False

    def repository_index(self) -> list[ModelState]:
        return self.states


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_an_unchanging_failure_counts_once_the_stale_grace_has_passed() -> None:
    fake, clock = FakeTriton([ModelState(name="m", version="1", state="UNAVAILABLE", reason="bad")]), FakeClock()
    waiter = PollWaiter(fake, "m", timeout_s=100, stale_grace_s=5, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    with pytest.raises(TritonLoadFailed, match="bad"):
        waiter.wait()
    assert 5 <= clock.now < 6


def test_unloaded_is_never_a_load_failure() -> None:
    fake, clock = FakeTriton([ModelState(name="m", version="1", state="UNAVAILABLE", reason="unloaded")]), FakeClock()
    waiter = PollWaiter(fake, "m", timeout_s=40, stale_grace_s=5, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    with pytest.raises(ReadinessTimeout, match=r"not ready 40\.0 s after publishing: Triton has not started loading"):
        waiter.wait()


def test_the_loads_holding_up_polling_are_named_only_while_triton_has_not_started_on_the_model() -> None:
    others = [ModelState(name=f"o{i}", version="1", state="LOADING", reason="") for i in range(5)]
    ready = ModelState(name="r", version="1", state="READY", reason="")
    clock = FakeClock()
    not_started = ModelState(name="m", version="", state="", reason="")  # in the index by name only
    loading = ModelState(name="m", version="1", state="LOADING", reason="")
    for own, says in (
        ([not_started], "waits for the load of o0, o1, o2 and 2 more (LOADING)"),
        ([loading], "Triton is still LOADING it"),
    ):
        fake = FakeTriton([*others, ready, *own])
        waiter = PollWaiter(fake, "m", timeout_s=1, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
        with pytest.raises(ReadinessTimeout, match=re.escape(says)):
            waiter.wait()
    fake = FakeTriton([ready, ModelState(name="m", version="", state="", reason="")])
    waiter = PollWaiter(fake, "m", timeout_s=1, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    with pytest.raises(ReadinessTimeout, match="its polling may be held up by another model's load, or config"):
        waiter.wait()


def test_a_reused_install_not_ready_in_time_is_not_said_to_have_been_published() -> None:
    fake, clock = FakeTriton([]), FakeClock()
    waiter = PollWaiter(fake, "m", timeout_s=3, clock=clock, sleep=clock.sleep, reused=True)  # type: ignore[arg-type]
    with pytest.raises(
        ReadinessTimeout, match=r"^m is not ready 3\.0 s after finding it already installed \(reused\):"
    ):
        waiter.wait()


# ---- explicit mode: a Triton of its own, with --model-control-mode=explicit (tests/conftest.py) -------------


def test_explicit_mode_loads_and_the_model_is_ready(explicit_triton: tuple[TritonServer, NodeLayout]) -> None:
    server, layout = explicit_triton
    publish_model(layout, "good")
    client = TritonClient(server.url)
    assert not client.model_ready("good")  # explicit mode loads nothing by itself
    load_explicitly(client, "good", timeout_s=60)
    assert client.model_ready("good")


def test_explicit_mode_reports_tritons_reason(explicit_triton: tuple[TritonServer, NodeLayout]) -> None:
    server, layout = explicit_triton
    publish_model(layout, "broken", model_py=BROKEN_MODEL)
    with pytest.raises(
        TritonLoadFailed, match=r"Triton failed to load broken: .*this model refuses to load.* — fix the model at its"
    ):
        load_explicitly(TritonClient(server.url), "broken", timeout_s=60)


def test_run_in_explicit_mode_publishes_then_loads(
    explicit_triton: tuple[TritonServer, NodeLayout], tmp_path: Path
) -> None:
    server, layout = explicit_triton
    conf = LoaderSettings(source=str(write_model(tmp_path / "m")), name="via-run", layout=layout,
                          triton_url=server.url, mode="explicit", timeout_s=60, termination_log=None)  # fmt: skip
    assert run(conf) == ExitCode.OK
    assert TritonClient(server.url).model_ready("via-run")


def test_before_publishing_the_wait_for_an_earlier_name_ends_at_its_deadline_or_a_new_folder(
    explicit_triton: tuple[TritonServer, NodeLayout], model_name: str
) -> None:
    """Explicit mode serves a model whose folder is gone until told otherwise: an earlier NAME that Triton keeps
    serving holds a poll-mode publish until the deadline; another loader's folder of NAME ends the wait at once."""
    server, layout = explicit_triton
    folder = publish_model(layout, model_name)
    client = TritonClient(server.url)
    load_explicitly(client, model_name, timeout_s=60)
    take_out(layout, model_name)  # Triton is not told: it serves the earlier NAME on
    started = time.monotonic()
    with pytest.raises(ReadinessTimeout, match=rf"Triton still serves an earlier {model_name} 0\.\d s after"):
        wait_unserved(client, model_name, folder, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5
    publish_model(layout, model_name)
    wait_unserved(client, model_name, folder, timeout_s=60)  # returns: install() sorts out whose folder it is
    assert client.unload(model_name).status == 200
