"""Two pods, one node, one NAME. Pods of the same model started together each run their loader at once: all
succeed on one install, which Triton loads once. Pods of different models under one NAME: one wins, every other
loader exits 14 saying whose NAME it is and what to do, and the winner's model keeps serving untouched."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from bench.faults.kill_loader import SourceKind, installed_problem, staging_of
from bench.faults.node import LoadOutcome, Node, remove, run_load

from tests.support.models import write_model
from tests.support.triton import TritonServer
from tritonshare.common.errors import ExitCode
from tritonshare.common.repository import read_record

pytestmark = [pytest.mark.triton]

PODS = 3


@pytest.fixture
def unload_after(node: Node, triton: TritonServer) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        remove(node, triton, name)


def load_together(node: Node, triton: TritonServer, name: str, sources: list[str]) -> list[LoadOutcome]:
    with ThreadPoolExecutor(len(sources)) as pool:
        return list(pool.map(lambda source: run_load(node, triton.url, source, name), sources))


def infer_identity(triton: TritonServer, name: str) -> None:
    client = httpclient.InferenceServerClient(triton.url.removeprefix("http://"), network_timeout=30)
    try:
        data = np.array([1.5, -2.0, 3.25], dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", [3], "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer(name, [tensor]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def triton_events(triton: TritonServer, name: str) -> list[str]:
    """Triton's load/unload log lines for NAME, as "loaded" / "unloaded"."""
    return re.findall(rf"successfully (loaded|unloaded) '{re.escape(name)}'", triton.log_text())


def test_pods_of_the_same_model_loading_at_once_all_succeed_on_one_install_loaded_once(
    node: Node, triton: TritonServer, model_name: str, tmp_path: Path, unload_after: list[str]
) -> None:
    model = write_model(tmp_path / "model", padding_bytes=16 << 20)
    unload_after.append(model_name)
    outcomes = load_together(node, triton, model_name, [str(model)] * PODS)

    assert [o.code for o in outcomes] == [ExitCode.OK] * PODS, [o.log for o in outcomes]
    installed = [o for o in outcomes if f"{model_name} is ready (installed)" in o.log]
    assert len(installed) == 1, [o.log for o in outcomes]  # one pod installed it, the others reused it
    assert (
        installed_problem(node.layout.model_dir(model_name), SourceKind("path", str(model), model), model_name) is None
    )
    assert staging_of(node, model_name) == []  # the losers' downloads are gone
    infer_identity(triton, model_name)
    assert triton_events(triton, model_name) == ["loaded"]


def test_different_models_under_one_name_one_wins_the_others_exit_14_and_the_winner_keeps_serving(
    node: Node, triton: TritonServer, model_name: str, tmp_path: Path, unload_after: list[str]
) -> None:
    sources = [str(write_model(tmp_path / f"team-{i}", padding_bytes=(4 + 4 * i) << 20)) for i in range(PODS)]
    unload_after.append(model_name)
    outcomes = load_together(node, triton, model_name, sources)

    codes = sorted(o.code for o in outcomes)
    assert codes == [ExitCode.OK] + [ExitCode.INSTALL_CONFLICT] * (PODS - 1), [o.log for o in outcomes]
    winner = sources[[o.code for o in outcomes].index(ExitCode.OK)]
    record = read_record(node.layout.model_dir(model_name))
    assert record is not None and record.source == winner
    for outcome in outcomes:
        if outcome.code == ExitCode.INSTALL_CONFLICT:
            assert model_name in outcome.message and f"tritonshare unload --name {model_name}" in outcome.message
            assert outcome.message.count("\n") == 1
    assert staging_of(node, model_name) == []
    infer_identity(triton, model_name)
    assert triton_events(triton, model_name) == ["loaded"]  # never reloaded or unloaded by a loser

    late = run_load(node, triton.url, str(write_model(tmp_path / "late")), model_name)  # a pod scheduled later
    assert late.code == ExitCode.INSTALL_CONFLICT and f"installed from {winner}" in late.message
    infer_identity(triton, model_name)
    assert triton_events(triton, model_name) == ["loaded"]
