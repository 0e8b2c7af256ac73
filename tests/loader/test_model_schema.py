"""The config check against the real thing. The vendored schema knows every field the test Triton and the
installed tritonclient know; the check and a real Triton 2.51 agree on which configs can be read; and
``tritonshare load`` of a config Triton cannot read stops at once with exit 10, where Triton itself would
only log "Poll failed" and the loader would wait out its deadline (exit 13)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from tests.support.models import IDENTITY_CONFIG, write_model
from tests.support.triton import REPO_ROOT, TritonServer, triton_venv
from tritonshare.common.errors import ExitCode, InvalidModel
from tritonshare.common.layout import NodeLayout
from tritonshare.common.triton import TritonClient
from tritonshare.loader import model_config_pb2
from tritonshare.loader.model import check_config, with_name

pytestmark = [pytest.mark.triton]

TRITONSHARE = REPO_ROOT / ".venv" / "bin" / "tritonshare"

# ---- the vendored schema ------------------------------------------------------------------------------


def schema_entries(serialized: bytes) -> dict[str, tuple[object, ...]]:
    """Every field (number, type, label, message or enum type) and enum value (number) of a serialized
    model_config.proto descriptor, by dotted name."""
    entries: dict[str, tuple[object, ...]] = {}

    def walk(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            entries[f"{prefix}{message.name}.{field.name}"] = (field.number, field.type, field.label, field.type_name)
        for nested in message.nested_type:
            walk(f"{prefix}{message.name}.", nested)
        for enum in message.enum_type:
            entries.update({f"{prefix}{message.name}.{enum.name}.{v.name}": (v.number,) for v in enum.value})

    proto = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    for message in proto.message_type:
        walk("", message)
    for enum in proto.enum_type:
        entries.update({f"{enum.name}.{v.name}": (v.number,) for v in enum.value})
    return entries


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while data[pos] & 0x80:
        value, shift, pos = value | (data[pos] & 0x7F) << shift, shift + 7, pos + 1
    return value | data[pos] << shift, pos + 1


def tritons_own_schema() -> bytes:
    """The model_config.proto descriptor compiled into the test Triton's libtritonserver: protoc's C++
    output embeds it serialized, from its file name and package to its ``syntax`` field (12), the last."""
    libs = sorted(triton_venv().glob("lib/python3*/site-packages/nvidia_pytriton.libs/libtritonserver*.so"))
    assert libs, f"no libtritonserver in {triton_venv()} — run scripts/setup.sh"
    data = libs[0].read_bytes()
    start = pos = data.find(b"\n\x12model_config.proto\x12\tinference")
    assert start >= 0, f"{libs[0]} holds no model_config.proto descriptor"
    while pos - start < 1 << 20:  # every field of a FileDescriptorProto here is length-delimited
        tag = data[pos]
        length, pos = _varint(data, pos + 1)
        pos += length
        if tag == 0x62:  # field 12, wire type 2: syntax
            return data[start:pos]
    raise AssertionError(f"{libs[0]}: no end found for the model_config.proto descriptor")


def missing_from_vendored(other: bytes) -> dict[str, tuple[object, ...]]:
    ours = schema_entries(model_config_pb2.DESCRIPTOR.serialized_pb)
    return {name: entry for name, entry in schema_entries(other).items() if ours.get(name) != entry}


def test_the_vendored_schema_knows_every_field_the_test_triton_knows() -> None:
    theirs = schema_entries(tritons_own_schema())
    assert "ModelConfig.max_batch_size" in theirs and "DataType.TYPE_FP32" in theirs  # the extraction worked
    assert missing_from_vendored(tritons_own_schema()) == {}  # so no config this Triton reads is refused


def test_the_vendored_schema_knows_every_field_the_installed_tritonclient_knows() -> None:
    tritonclient_schema = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    missing = missing_from_vendored(tritonclient_schema.DESCRIPTOR.serialized_pb)
    assert missing == {}, "Triton added config fields: run scripts/vendor_model_config.py"


# ---- the check and a real Triton agree ------------------------------------------------------------------

# Spellings Triton's C++ parser reads, in one config: CRLF, a form feed, adjacent and single-quoted strings,
# angle brackets, separators, an enum by number, hex and octal, "False", escapes, an empty name set twice.
ODD_BUT_READABLE = (
    'name: ""\r\nname: ""\r\n'
    "backend: \"py\" 'thon';\r\n"
    "max_batch_size:\f0,\r\n"
    'input < name: "INPUT0" data_type: 11 dims: [ -0x1 ] >\r\n'
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -01 ] } ]\r\n'
    "instance_group [ { kind: KIND_CPU count: 1 } ]\r\n"
    "model_transaction_policy { decoupled: False }\r\n"
    'parameters { key: "k" value: { string_value: "\\u00e9\\x41\\101\\?" } }\r\n'
)

# Triton 2.51 refuses each of these (seen here): the model stays name-only and only "Poll failed" is logged.
UNREADABLE = {
    "unknown-field": IDENTITY_CONFIG + "max_batch_sise: 0\n",
    "bad-enum": IDENTITY_CONFIG.replace("KIND_CPU", "KIND_CPUS"),
    "wrong-type": IDENTITY_CONFIG.replace("max_batch_size: 0", 'max_batch_size: "0"'),
    "set-twice": IDENTITY_CONFIG + 'backend: "python"\n',
    "oneof": IDENTITY_CONFIG + "version_policy { all { } latest { num_versions: 1 } }\n",
    "escape": IDENTITY_CONFIG + 'parameters { key: "a" value: { string_value: "x\\qy" } }\n',
    "binary": IDENTITY_CONFIG.replace("max_batch_size: 0", "max_batch_size: 0b0"),
    "underscore": IDENTITY_CONFIG.replace("count: 1", "count: 1_0"),
    "plus": IDENTITY_CONFIG.replace("count: 1", "count: +1"),
    "nbsp": IDENTITY_CONFIG.replace("max_batch_size: 0", "max_batch_size:\u00a00"),
}
READABLE = {"plain": IDENTITY_CONFIG, "odd": ODD_BUT_READABLE}


def publish(layout: NodeLayout, name: str, config: str) -> None:
    staged = write_model(layout.staging / f"{name}.test")
    (staged / "config.pbtxt").write_bytes(config.encode())  # as written: CRLF and all
    os.rename(staged, layout.model_dir(name))


def readable(config: str) -> bool:
    try:
        check_config(config, "cfg")
    except InvalidModel:
        return False
    return True


def test_triton_loads_exactly_the_configs_the_check_accepts(
    layout: NodeLayout, triton: TritonServer, model_name: str, cleanup: list[str]
) -> None:
    assert all(readable(c) for c in READABLE.values()) and not any(readable(c) for c in UNREADABLE.values())
    for case, config in (READABLE | UNREADABLE).items():
        name = f"{model_name}-{case}"
        cleanup.append(name)
        publish(layout, name, with_name(config, name, "cfg") if case in READABLE else config)
    client = TritonClient(triton.url)
    deadline = time.monotonic() + 60
    refused = {f"Poll failed for model directory '{model_name}-{case}'" for case in UNREADABLE}
    while time.monotonic() < deadline:
        ready = {case for case in READABLE if client.model_ready(f"{model_name}-{case}")}
        if ready == set(READABLE) and all(line in triton.log_text() for line in refused):
            break
        time.sleep(0.5)
    states = {s.name.removeprefix(f"{model_name}-"): s.state for s in client.repository_index()}
    assert {case: states.get(case) for case in READABLE} == dict.fromkeys(READABLE, "READY"), triton.log_tail()
    assert {case: states.get(case) for case in UNREADABLE} == dict.fromkeys(UNREADABLE, ""), triton.log_tail()
    assert all(line in triton.log_text() for line in refused)


# ---- tritonshare load ------------------------------------------------------------------------------------


def test_load_of_a_config_triton_cannot_read_exits_10_at_once_and_leaves_nothing(
    layout: NodeLayout, triton: TritonServer, model_name: str, tmp_path: Path
) -> None:
    source = write_model(tmp_path / "identity", config=IDENTITY_CONFIG + "max_batch_sise: 0\n")
    termination = tmp_path / "termination-log"
    before = set(os.listdir(layout.repository)) | {f"staging/{n}" for n in os.listdir(layout.staging)}
    started = time.monotonic()
    proc = subprocess.run(
        [str(TRITONSHARE), "load", str(source), "--name", model_name, "--repository", str(layout.repository),
         "--staging", str(layout.staging), "--triton-url", triton.url, "--termination-log", str(termination),
         "--timeout-s", "60"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    took_s = time.monotonic() - started
    assert proc.returncode == ExitCode.SOURCE_PERMANENT, proc.stderr
    assert took_s < 15  # not the 60 s readiness deadline, which ended in exit 13 before the schema check
    message = termination.read_text()
    assert "config.pbtxt: line 6, column 1: ModelConfig has no field 'max_batch_sise' " in message
    assert "(did you mean 'max_batch_size'?)" in message and "fix it in the model source" in message
    assert message.count("\n") == 1  # one line, as the pod status shows it
    after = set(os.listdir(layout.repository)) | {f"staging/{n}" for n in os.listdir(layout.staging)}
    assert after == before
    assert TritonClient(triton.url).model_states(model_name) == []
