"""The model folder checks and the config.pbtxt edit: what a user sees when a model is not one, and that
the loader's one edit (the name) leaves the rest of their config alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.models import DECOUPLED_CONFIG, IDENTITY_CONFIG, write_model
from tritonshare.common.errors import ExitCode, InvalidModel
from tritonshare.loader.model import find_root, parse_config, prepare, with_name

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")

RICH_CONFIG = """\
# A config with most of the text format's shapes. Comments stay where they are.
platform: "onnxruntime_onnx"   # trailing comment
max_batch_size: 8;
version_policy: { specific { versions: [1, 3] } }
input [
  { name: "IN" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, -1, 0x10 ] reshape: { shape: [ ] } },
  < name: 'in2' data_type: TYPE_STRING dims: [ 1 ] >
]
output: [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] label_filename: "lab" "els.txt" } ]
optimization { cuda { graphs: true } },
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0.0, 1.5e0 ] } ] } ]
}
parameters { key: "x\\tq\\"\\u00e9\\101" value: { string_value: "a\\nb" } }
model_metrics { metric_control [ { histogram_options { buckets: [ -inf, .5, 1.0f, 2E3, inf ] } } ] }
"""

VALID = [IDENTITY_CONFIG, DECOUPLED_CONFIG, RICH_CONFIG, "", "# only a comment\n", 'name: "x"']


def protobuf_accepts(text: str) -> bool:
    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError:
        return False
    return True


@pytest.mark.parametrize("text", VALID)
def test_configs_protobuf_reads_are_read(text: str) -> None:
    assert protobuf_accepts(text)  # the corpus itself is valid Triton ModelConfig text
    parse_config(text, "cfg")


def test_name_is_added_as_a_first_line_when_absent() -> None:
    out = with_name(RICH_CONFIG, "resnet-7", "cfg")
    assert out == 'name: "resnet-7"\n' + RICH_CONFIG
    msg = text_format.Parse(out, model_config_pb2.ModelConfig())
    assert msg.name == "resnet-7" and msg.max_batch_size == 8 and msg.input[1].name == "in2"


@pytest.mark.parametrize("value", ['"old"', "'old'", '"o" "ld"', '""'])
def test_only_the_top_level_name_value_changes(value: str) -> None:
    text = f"# header\nname : {value}  # set by the exporter\n{IDENTITY_CONFIG}"
    out = with_name(text, "mine", "cfg")
    assert out == f'# header\nname : "mine"  # set by the exporter\n{IDENTITY_CONFIG}'
    assert 'name: "INPUT0"' in out  # names of inputs are not the model's name


def test_a_name_that_is_not_a_string_is_refused_with_its_line() -> None:
    with pytest.raises(InvalidModel, match=r"cfg: line 2: 'name' must be a quoted string"):
        with_name("max_batch_size: 0\nname: resnet\n", "x", "cfg")


def test_a_name_set_twice_is_refused_with_both_lines() -> None:
    with pytest.raises(InvalidModel, match=r"'name' is set more than once \(lines 1, 3\)"):
        with_name('name: "a"\nmax_batch_size: 0\nname: "b"\n', "x", "cfg")


BROKEN = [
    ("max_batch_size 8\n", 1, 16, r"expected ':' or '\{' after the field name 'max_batch_size', found '8'"),
    ('input [ { name: "a" }\n', 2, 1, r"expected ',' or '\]' in the list of 'input', found the end of the file"),
    ('input { name: "a"\n\n', 3, 1, r"expected '\}' to close the message, found the end of the file"),
    ('input { name: "a" } }\n', 1, 21, r"expected a field name, found '\}'"),
    ('backend: "python\n', 1, 10, r"a string is not closed on its line"),
    ("max_batch_size: 8x\n", 1, 18, r"a number runs into 'x'"),
    ("dims [ 1, 2 ]\n", 1, 8, r"expected '\{' for an element of 'dims' \(a list of values needs ':'\)"),
    ("dims: [ 1 2 ]\n", 1, 11, r"expected ',' or '\]' in the list of 'dims', found '2'"),
    ("max_batch_size: -\n", 2, 1, r"expected a number after '-' in the value of 'max_batch_size'"),
    ('backend: "python" @\n', 1, 19, r"unexpected character '@'"),
    ("max_batch_size: \n", 2, 1, r"expected a value for 'max_batch_size', found the end of the file"),
    ("input {" * 101 + "}" * 101, 1, 707, r"messages are nested more than 100 deep"),
]


@pytest.mark.parametrize(("text", "line", "column", "why"), BROKEN)
def test_broken_config_names_file_line_and_column(text: str, line: int, column: int, why: str) -> None:
    assert not protobuf_accepts(text)
    with pytest.raises(InvalidModel, match=rf"^s3://b/m: config.pbtxt: line {line}, column {column}: {why}") as info:
        parse_config(text, "s3://b/m: config.pbtxt")
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


def test_an_invalid_escape_is_refused_as_triton_does() -> None:
    # Triton's C++ parser refuses it (seen here: "Invalid escape sequence in string literal", and the model
    # stays name-only); Python's protobuf is lenient, so this case is checked against Triton's behaviour.
    with pytest.raises(InvalidModel, match=r"line 1, column 13: invalid escape '\\\\q' in a string"):
        parse_config('backend: "py\\qthon"\n', "cfg")


# Where Python's protobuf reads what Triton's C++ parser refuses: unknown escapes (above) and Python
# integer prefixes (``0b10`` goes through Python's ``int(text, 0)``).
LAXER_IN_PYTHON = ("invalid escape", "a number runs into 'b'")
_ALPHABET = list("{}[]<>:;,\"' \n#-.0123456789abexyzTYPE_") + ["name", "dims", "input"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([IDENTITY_CONFIG, RICH_CONFIG]), st.integers(0, 10**6), st.sampled_from(_ALPHABET))
def test_never_refuses_what_protobuf_itself_reads(base: str, seed: int, piece: str) -> None:
    """Mutate a valid config by one edit: whenever protobuf's own parser, with Triton's real ModelConfig
    schema, still reads it, ours must too (a false refusal would block a working model)."""
    rng = random.Random(seed)
    at = rng.randrange(len(base) + 1)
    edit = rng.choice(["insert", "delete", "replace"])
    text = base[:at] + ("" if edit == "delete" else piece) + base[at + (0 if edit == "insert" else 1) :]
    if protobuf_accepts(text):
        try:
            parse_config(text, "cfg")
        except InvalidModel as exc:
            assert any(lax in str(exc) for lax in LAXER_IN_PYTHON), exc


# ---- the folder -------------------------------------------------------------------------------------


def test_model_at_the_top_is_the_root_and_gets_the_name(tmp_path: Path) -> None:
    write_model(tmp_path, name="exported-name")
    root = prepare(tmp_path, "mine", "s3://b/m")
    assert root == tmp_path
    assert (root / "config.pbtxt").read_text() == 'name: "mine"\n' + IDENTITY_CONFIG


def test_one_wrapping_folder_is_unwrapped_ignoring_hidden_and_macos_debris(tmp_path: Path) -> None:
    write_model(tmp_path / "resnet")
    (tmp_path / ".DS_Store").write_bytes(b"\0")
    (tmp_path / "__MACOSX").mkdir()
    root = prepare(tmp_path, "mine", "m.tar.gz")
    assert root == tmp_path / "resnet"
    assert (root / "config.pbtxt").read_text().startswith('name: "mine"\n')


def test_two_wrapping_levels_are_not_a_model(tmp_path: Path) -> None:
    write_model(tmp_path / "a" / "b")
    with pytest.raises(InvalidModel, match=r"^m.tar.gz: not a Triton model — .* found a/$"):
        find_root(tmp_path, "m.tar.gz")


def test_a_folder_of_unrelated_files_is_not_a_model_and_the_message_lists_them(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"x")
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(InvalidModel, match=r"gs://b/m: not a Triton model .* found README.md, model.onnx$") as info:
        prepare(tmp_path, "mine", "gs://b/m")
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


def test_a_config_without_a_version_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.pbtxt").write_text(IDENTITY_CONFIG)
    (tmp_path / "v1").mkdir()
    with pytest.raises(InvalidModel, match=r"no numeric version folder .* put a file such as 1/.keep"):
        prepare(tmp_path, "mine", "s3://b/m")


def test_a_model_without_config_is_accepted_as_is(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.onnx").write_bytes(b"onnx")
    assert prepare(tmp_path, "mine", "s3://b/m") == tmp_path
    assert not (tmp_path / "config.pbtxt").exists()  # Triton completes ONNX configs itself


def test_a_broken_config_is_refused_naming_its_path_in_the_source(tmp_path: Path) -> None:
    write_model(tmp_path / "resnet", config=IDENTITY_CONFIG + "input [ { name: 'x' ]\n")
    with pytest.raises(InvalidModel, match=r"^s3://b/m: resnet/config.pbtxt: line 6, column 21: expected"):
        prepare(tmp_path, "mine", "s3://b/m")


def test_a_config_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path)
    (tmp_path / "config.pbtxt").write_bytes(b'backend: "\xff\xfe"\n')
    with pytest.raises(InvalidModel, match=r"config.pbtxt: not UTF-8 text \(byte 10\)"):
        prepare(tmp_path, "mine", "s3://b/m")


def test_python_modules_get_a_pycache_file_so_triton_writes_no_bytecode(tmp_path: Path) -> None:
    write_model(tmp_path)
    (tmp_path / "1" / "__pycache__").unlink()  # as models come from the field
    (tmp_path / "1" / "lib").mkdir()
    (tmp_path / "1" / "lib" / "util.py").write_text("X = 1\n")
    (tmp_path / "1" / "lib" / "__pycache__").mkdir()  # shipped bytecode, stale by definition
    (tmp_path / "1" / "lib" / "__pycache__" / "util.cpython-311.pyc").write_bytes(b"\0")
    prepare(tmp_path, "mine", "s3://b/m")
    for folder in (tmp_path / "1", tmp_path / "1" / "lib"):
        assert (folder / "__pycache__").is_file()
    assert not (tmp_path / "__pycache__").exists()  # no Python module there
