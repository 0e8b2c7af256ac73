"""Config rules Triton 2.51 enforces only in its log, checked before publishing (exit 10 in a second, not exit 13
after the deadline) — and held to Triton's own: each refused config fails a real Triton's poll, each let through
loads."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.install import own_triton_serving
from tests.support.models import IDENTITY_CONFIG, write_model
from tritonshare.common.errors import ExitCode, InvalidModel
from tritonshare.common.triton import TritonClient
from tritonshare.loader.model import prepare

R = pytest.param


def batching(max_batch_size: int, extra: str = "") -> str:
    return IDENTITY_CONFIG.replace("max_batch_size: 0", f"max_batch_size: {max_batch_size}") + extra


def start_control(table: str, values: str) -> str:
    return batching(
        8,
        'sequence_batching { control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START '
        f"{table}: {values} }} ] }} ] }}\n",
    )


def sequence_control(name: str, kind: str, fields: str) -> str:
    return batching(
        8, f'sequence_batching {{ control_input [ {{ name: "{name}" control [ {{ kind: {kind} {fields} }} ] }} ] }}\n'
    )


REFUSED = [
    R(batching(-1), "max_batch_size is -1", "'max_batch_size' must be non-negative value", id="negative-batch"),
    R(batching(8, "dynamic_batching { preferred_batch_size: [ 16 ] }\n"),
      "preferred_batch_size 16 is more than max_batch_size 8", "must be <= max batch size", id="preferred-over"),
    R(batching(0, "dynamic_batching { preferred_batch_size: [ 4 ] }\n"),
      "preferred_batch_size 4 is more than max_batch_size 0", "must be <= max batch size", id="preferred-no-batching"),
    R(batching(8, "dynamic_batching { preferred_batch_size: [ 4, 0 ] }\n"),
      "has preferred_batch_size 0", "preferred size must be positive", id="preferred-zero"),
    R(start_control("int32_false_true", "[ 1 ]"), "control_input 'START' has int32_false_true [1]",
      "'int32_false_true' must have exactly 2 entries", id="one-value"),
    R(start_control("fp32_false_true", "[ 0, 1, 2 ]"), "has fp32_false_true [0.0, 1.0, 2.0]",
      "'fp32_false_true' must have exactly 2 entries", id="three-values"),
    R(sequence_control("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_UINT64 int32_false_true: [ 0, 1 ]"),
      "control_input 'CORRID' has int32_false_true [0, 1] on a CONTROL_SEQUENCE_CORRID control",
      "must not specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for CONTROL_SEQUENCE_CORRID",
      id="corrid-with-values"),
    R(sequence_control("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_UINT64 bool_false_true: [ true ]"),
      "control_input 'CORRID' has bool_false_true [True] on a CONTROL_SEQUENCE_CORRID control",
      "must not specify either", id="corrid-with-one-value"),
    R(sequence_control("START", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ]"),
      "control_input 'START' has int32_false_true and fp32_false_true",
      "specifies more than one from 'int32_false_true', 'fp32_false_true' and 'bool_false_true' for "
      "CONTROL_SEQUENCE_START", id="two-tables"),
    R(sequence_control("END", "CONTROL_SEQUENCE_END", "int32_false_true: [ 0, 1 ] fp32_false_true: [ 1 ]"),
      "control_input 'END' has int32_false_true and fp32_false_true", "specifies more than one from",
      id="two-tables-one-short"),
]  # fmt: skip

LET_THROUGH = [
    R(batching(8, "dynamic_batching { preferred_batch_size: [ 2, 8 ] }\n"), id="preferred-up-to-the-batch"),
    R(batching(0, "dynamic_batching { }\n"), id="dynamic-batching-without-batching"),
    R(start_control("int32_false_true", "[ 0, 1 ]"), id="two-values"),
    R(start_control("fp32_false_true", "[ 0, 1 ]"), id="two-floats"),
    R(sequence_control("READY", "CONTROL_SEQUENCE_READY", "bool_false_true: [ false, true ]"), id="two-bools"),
    R(sequence_control("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_UINT64"), id="corrid-without-values"),
    # A kind by number that Triton 2.51 does not know: none of its checks looks at that control, and it loads.
    R(sequence_control("C", "7", "int32_false_true: [ 1 ] fp32_false_true: [ 0 ]"), id="unknown-kind"),
]


@pytest.mark.parametrize(("config", "what", "triton_says"), REFUSED)
def test_a_config_triton_refuses_only_in_its_log_is_refused_at_once(
    tmp_path: Path, config: str, what: str, triton_says: str
) -> None:
    write_model(tmp_path / "m", config=config)
    started = time.monotonic()
    with pytest.raises(InvalidModel) as info:
        prepare(tmp_path / "m", "mine", "s3://b/m")
    message = str(info.value)
    assert message.startswith("s3://b/m: config.pbtxt: ") and f"{what}, and Triton refuses such a model" in message
    assert triton_says in message and "the load would wait for its deadline" in message
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("config", LET_THROUGH)
def test_a_config_within_tritons_rules_is_let_through(tmp_path: Path, config: str) -> None:
    write_model(tmp_path / "m", config=config)
    assert prepare(tmp_path / "m", "mine", "s3://b/m") == tmp_path / "m"


@pytest.mark.triton
def test_the_rules_are_tritons_own(tmp_path: Path) -> None:
    """Every config refused above fails a real Triton's poll (its log says why; its index lists the folder with no
    state and no reason), and every one let through loads READY: the loader is never stricter than Triton here."""
    refused = {f"refused-{p.id}": p.values[0] for p in REFUSED}
    allowed = {f"allowed-{p.id}": p.values[0] for p in LET_THROUGH}
    with own_triton_serving(tmp_path, "neighbour") as server:
        triton = TritonClient(server.url)
        for name, config in {**refused, **allowed}.items():
            write_model(tmp_path / "staging" / name, name=name, config=str(config))
            os.rename(tmp_path / "staging" / name, server.repository / name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = _index(triton)
            if all(states.get(name) == "READY" for name in allowed):
                break
            time.sleep(0.5)
        time.sleep(2)  # two more polls for the refused ones
        states, log = _index(triton), server.log_text()
    assert {name: states.get(name) for name in allowed} == dict.fromkeys(allowed, "READY")
    assert {name: states.get(name) for name in refused} == dict.fromkeys(refused, "")  # listed, never with a state
    for name in refused:
        assert f"Poll failed for model directory '{name}'" in log, name


def _index(triton: TritonClient) -> dict[str, str]:
    return {entry.name: entry.state for entry in triton.repository_index()}
