"""The model folder checks and the config.pbtxt edit: what a user sees when a model is not one, and that
the loader's one edit (the name) leaves the rest of their config alone."""

from __future__ import annotations

import io
import os
import random
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.models import DECOUPLED_CONFIG, IDENTITY_CONFIG, SLOW_CONFIG, write_model
from tests.support.mounts import tmpfs
from tritonshare.common.errors import ExitCode, InsufficientSpace, InvalidModel, UnsafeArchive
from tritonshare.loader.archive import unpack
from tritonshare.loader.model import check_config, find_root, open_modes, prepare, with_name

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

VALID = [IDENTITY_CONFIG, DECOUPLED_CONFIG, SLOW_CONFIG, RICH_CONFIG, "", "# only a comment\n", 'name: "x"']
WHERE = "s3://b/m: config.pbtxt"
HINT = " — Triton cannot read this config.pbtxt; fix it in the model source"


def protobuf_accepts(text: str) -> bool:
    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError:
        return False
    return True


def refusal(text: str) -> InvalidModel:
    with pytest.raises(InvalidModel) as info:
        check_config(text, WHERE)
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT
    assert str(info.value).endswith(HINT)
    return info.value


@pytest.mark.parametrize("text", VALID)
def test_valid_configs_are_accepted(text: str) -> None:
    assert protobuf_accepts(text)  # the corpus itself is valid ModelConfig text (model_metrics: after Triton 2.51)
    check_config(text, "cfg")


# ---- the name edit -----------------------------------------------------------------------------------


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


def test_an_empty_name_then_a_second_one_the_last_gets_the_name_and_triton_still_reads_it() -> None:
    # Triton reads this (seen here, Triton 2.51): a singular field may follow its own empty value.
    out = with_name('name: ""\nmax_batch_size: 0\nname: "b"\n', "mine", "cfg")
    assert out == 'name: ""\nmax_batch_size: 0\nname: "mine"\n'
    assert text_format.Parse(out, model_config_pb2.ModelConfig()).name == "mine"


def test_a_name_that_is_not_a_string_is_refused_with_its_line() -> None:
    with pytest.raises(InvalidModel, match=r"^cfg: line 2, column 7: Expected string but found: 'resnet' — "):
        with_name("max_batch_size: 0\nname: resnet\n", "x", "cfg")


def test_a_name_set_twice_is_refused_at_the_second() -> None:
    with pytest.raises(InvalidModel, match=r"^cfg: line 3, column 7: 'name' is set a second time, .* keep one"):
        with_name('name: "a"\nmax_batch_size: 0\nname: "b"\n', "x", "cfg")


# ---- what Triton's schema refuses ----------------------------------------------------------------------

SCHEMA_MISTAKES = [
    pytest.param(
        IDENTITY_CONFIG + "max_batch_sise: 4\n", 6, 1,
        "ModelConfig has no field 'max_batch_sise' (did you mean 'max_batch_size'?)", id="unknown-field",
    ),
    pytest.param(
        'input [ { name: "a" nmae: "b" } ]\n', 1, 21,
        "ModelInput has no field 'nmae' (did you mean 'name'?)", id="unknown-nested-field",
    ),
    pytest.param(
        "instance_group [ { kind: KIND_CPUS } ]\n", 1, 26,
        "'KIND_CPUS' is not a ModelInstanceGroup.Kind (did you mean KIND_CPU? "
        "values: KIND_AUTO, KIND_GPU, KIND_CPU, KIND_MODEL)", id="bad-enum",
    ),
    pytest.param("max_batch_size: \"8\"\n", 1, 17, "Couldn't parse integer: \"8\"", id="string-for-integer"),
    pytest.param("max_batch_size: 1.5\n", 1, 17, "Couldn't parse integer: 1.5", id="float-for-integer"),
    pytest.param("max_batch_size: 4294967296\n", 1, 17, "Value out of range: 4294967296", id="int32-overflow"),
    pytest.param(
        "dynamic_batching { max_queue_delay_microseconds: -1 }\n", 1, 50, "Value out of range: -1", id="negative-uint",
    ),
    pytest.param("backend: python\n", 1, 10, "Expected string but found: 'python'", id="ident-for-string"),
    pytest.param(
        "model_transaction_policy { decoupled: yes }\n", 1, 39, 'Expected "true" or "false"', id="not-a-bool"
    ),
    pytest.param(
        'backend: "python"\nbackend: "onnx"\n', 2, 10,
        "'backend' is set a second time, and it holds one value; keep one", id="singular-field-twice",
    ),
    pytest.param(
        "dynamic_batching { }\ndynamic_batching { }\n", 2, 18,
        "'dynamic_batching' is set a second time, and it holds one value; keep one", id="singular-message-twice",
    ),
    pytest.param(
        "version_policy { all { } latest { num_versions: 1 } }\n", 1, 26,
        'Field "latest" is specified along with field "all", another member of oneof "policy_choice"',
        id="two-of-a-oneof",
    ),
    pytest.param(
        "input [ { dims [ 1, 2 ] } ]\n", 1, 16, "Expected \":\"", id="list-of-values-without-colon"
    ),
]  # fmt: skip


@pytest.mark.parametrize(("text", "line", "column", "why"), SCHEMA_MISTAKES)
def test_what_triton_would_not_read_is_refused_with_line_column_and_reason(
    text: str, line: int, column: int, why: str
) -> None:
    assert not protobuf_accepts(text)  # as Triton's own schema says
    assert str(refusal(text)).startswith(f"{WHERE}: line {line}, column {column}: {why}")


def test_an_unknown_field_with_no_near_name_lists_the_fields_there_are() -> None:
    message = str(refusal("input [ { tensor_size: 1 } ]\n"))
    assert "ModelInput has no field 'tensor_size' (its fields: name, data_type, format, dims, reshape," in message


def test_lenient_checking_lets_a_newer_tritons_fields_through_and_still_refuses_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    newer = IDENTITY_CONFIG + 'model_future_option { enabled: true }\ninput [ { name: "X", future_layout: 2 } ]\n'
    assert "has no field 'model_future_option'" in str(refusal(newer))  # strict, the default
    assert check_config(newer, WHERE, lenient=True)
    assert "line" in caplog.text and "'model_future_option'" in caplog.text and "unchecked" in caplog.text
    with pytest.raises(InvalidModel, match="Couldn't parse integer"):  # what the schema knows is still checked
        check_config(newer + "max_batch_size: many\n", WHERE, lenient=True)
    with pytest.raises(InvalidModel, match="is not a DataType"):  # an unknown enum value is not a field
        check_config(newer + 'input [ { name: "Y", data_type: TYPE_FP128, dims: [1] } ]\n', WHERE, lenient=True)


def test_a_duplicate_of_an_empty_scalar_is_read_as_triton_reads_it() -> None:
    # Triton 2.51 loads this (seen here): proto3 cannot tell an empty value from an absent one.
    check_config(IDENTITY_CONFIG + "max_batch_size: 0\n", "cfg")


# ---- the structure ------------------------------------------------------------------------------------

BROKEN = [
    ("max_batch_size 8\n", 1, 16, r'Expected ":"'),
    ('input [ { name: "a" }\n', 2, 1, r'Expected ","'),
    ('input { name: "a" } }\n', 1, 21, r"Expected identifier or number, got \}"),
    ('backend: "python\n', 1, 10, r"a string is not closed on its line"),
    ("max_batch_size: 8x\n", 1, 18, r"a number runs into 'x'; separate them with a space"),
    ("input { dims: [ 1 2 ] }\n", 1, 19, r'Expected ","'),
    ('backend: "python" @\n', 1, 19, r"unexpected character '@'"),
    ("input {" * 101 + "}" * 101, 1, 8, r"ModelInput has no field 'input'"),
]


@pytest.mark.parametrize(("text", "line", "column", "why"), BROKEN)
def test_broken_config_names_file_line_and_column(text: str, line: int, column: int, why: str) -> None:
    assert not protobuf_accepts(text)
    with pytest.raises(InvalidModel, match=rf"^s3://b/m: config.pbtxt: line {line}, column {column}: {why}") as info:
        check_config(text, "s3://b/m: config.pbtxt")
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


# ---- what Python's parser reads and Triton's C++ parser refuses -------------------------------------------

# Each of these made Triton 2.51 list the model by name only, logging "Poll failed" (seen here), while
# Python's protobuf reads it: unknown escapes, Python's integer spellings through ``int(text, 0)``, and
# Python's Unicode-aware whitespace.
STRICTER_THAN_PYTHON = [
    pytest.param('parameters { key: "a" value: { string_value: "x\\qy" } }\n', 1, 48,
                 r"invalid escape '\\\\q' in a string", id="escape"),
    pytest.param("max_batch_size: 0b0\n", 1, 18, r"a number runs into 'b'; separate them with a space", id="binary"),
    pytest.param("max_batch_size: 1_0\n", 1, 18, r"a number runs into '_'", id="underscore"),
    pytest.param("max_batch_size: +1\n", 1, 17, r"a '\+' sign: Triton reads numbers without one", id="plus"),
    pytest.param("max_batch_size:\u00a00\n", 1, 16,
                 r"the non-ASCII character U\+00A0 outside a string: Triton reads only ASCII there", id="nbsp"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "line", "column", "why"), STRICTER_THAN_PYTHON)
def test_what_only_pythons_parser_reads_is_refused_as_triton_does(text: str, line: int, column: int, why: str) -> None:
    assert protobuf_accepts(text)  # the reason for this pass
    with pytest.raises(InvalidModel, match=rf"^cfg: line {line}, column {column}: {why}"):
        check_config(text, "cfg")


LAXER_IN_PYTHON = ("invalid escape", "a number runs into", "a '+' sign", "the non-ASCII character")
_ALPHABET = list("{}[]<>:;,\"' \n#-+.0123456789abexyzTYPE_\u00a0") + ["name", "dims", "input"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([IDENTITY_CONFIG, RICH_CONFIG]), st.integers(0, 10**6), st.sampled_from(_ALPHABET))
def test_never_refuses_what_protobuf_itself_reads(base: str, seed: int, piece: str) -> None:
    """Mutate a valid config by one edit: whenever protobuf's own parser, with Triton's real ModelConfig
    schema, still reads it, so must the check, but for the C++ parser's stricter reading above (a false
    refusal would block a working model)."""
    rng = random.Random(seed)
    at = rng.randrange(len(base) + 1)
    edit = rng.choice(["insert", "delete", "replace"])
    text = base[:at] + ("" if edit == "delete" else piece) + base[at + (0 if edit == "insert" else 1) :]
    if protobuf_accepts(text):
        try:
            check_config(text, "cfg")
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


def test_a_broken_config_is_refused_naming_its_path_in_the_source_and_left_as_it_was(tmp_path: Path) -> None:
    config = IDENTITY_CONFIG + 'backend: "onnxruntime"\n'
    write_model(tmp_path / "resnet", config=config)
    with pytest.raises(InvalidModel, match=r"^s3://b/m: resnet/config.pbtxt: line 6, column 10: 'backend' is set a"):
        prepare(tmp_path, "mine", "s3://b/m")
    assert (tmp_path / "resnet" / "config.pbtxt").read_text() == config


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


# ---- links: what is published never leads outside itself --------------------------------------------------


def test_a_link_inside_what_was_unpacked_but_outside_the_model_root_is_refused(tmp_path: Path) -> None:
    # the archive's checks hold for the folder it was unpacked into; the published root is one level down
    neighbour = tmp_path / "neighbour" / "1"
    neighbour.mkdir(parents=True)
    (neighbour / "model.onnx").write_bytes(b"SECRET-WEIGHTS")
    unpacked = tmp_path / "unpacked"
    write_model(unpacked / "m")
    (unpacked / "m" / "1" / "model.onnx").symlink_to("../../../neighbour/1/model.onnx")
    with pytest.raises(UnsafeArchive, match=r"m.tgz: '1/model.onnx' links to '\.\./\.\./\.\./neighbour/") as info:
        prepare(unpacked, "mine", "m.tgz")
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


def test_a_config_that_is_a_link_is_replaced_by_a_file_and_its_target_kept(tmp_path: Path) -> None:
    write_model(tmp_path)
    shipped = tmp_path / "1" / "config.txt"
    os.replace(tmp_path / "config.pbtxt", shipped)
    (tmp_path / "config.pbtxt").symlink_to("1/config.txt")
    before = shipped.read_text()
    umask = os.umask(0o077)  # a restrictive umask must not make the config unreadable to Triton's user
    try:
        prepare(tmp_path, "mine", "m.tgz")
    finally:
        os.umask(umask)
    config = tmp_path / "config.pbtxt"
    assert not config.is_symlink() and config.read_text().startswith('name: "mine"')
    assert stat.S_IMODE(config.stat().st_mode) == 0o644
    assert shipped.read_text() == before
    assert not list(tmp_path.glob(".config.pbtxt*"))


def test_a_pycache_link_is_replaced_by_a_plain_file(tmp_path: Path) -> None:
    write_model(tmp_path)
    cache = tmp_path / "1" / "__pycache__"
    cache.unlink(missing_ok=True)
    cache.symlink_to("elsewhere")  # dangling: touching it would create 1/elsewhere
    prepare(tmp_path, "mine", "m.tgz")
    assert cache.is_file() and not cache.is_symlink()
    assert not (tmp_path / "1" / "elsewhere").exists()


def test_a_folder_named_as_the_install_record_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path)
    (tmp_path / "tritonshare.json").mkdir()
    with pytest.raises(InvalidModel, match=r"tritonshare.json is a folder or a link in the model.*rename it"):
        prepare(tmp_path, "mine", "m.tgz")


# ---- file modes: Triton runs as another user than the loader (k8s/base: 1000 and 65532) -------------------


def modes(top: Path) -> dict[str, str]:
    return {p.relative_to(top).as_posix(): stat.filemode(p.lstat().st_mode) for p in [top, *top.rglob("*")]}


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder another user can reach (pytest's own are 0700 under /tmp/pytest-of-root)."""
    folder = Path(tempfile.mkdtemp(prefix="tritonshare-modes-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def model_archive(path: Path) -> Path:
    """A .tar.gz as tools that write through ``tempfile`` make them: private folders and files."""
    with tarfile.open(path, "w:gz") as tar:
        for name, mode, data in [
            ("m", 0o700, None),
            ("m/1", 0o700, None),
            ("m/config.pbtxt", 0o600, b'backend: "onnxruntime"\n'),
            ("m/1/model.onnx", 0o600, b"weights"),
            ("m/1/convert.sh", 0o700, b"#!/bin/sh\n"),
        ]:
            info = tarfile.TarInfo(name)
            info.mode, info.type = mode, tarfile.REGTYPE if data is not None else tarfile.DIRTYPE
            info.size = len(data or b"")
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def test_an_archive_of_private_files_is_installed_readable_by_tritons_user(shared_tmp: Path) -> None:
    dest = shared_tmp / "out"
    dest.mkdir()
    unpack(model_archive(shared_tmp / "m.tar.gz"), dest)
    assert modes(dest)["m/1/model.onnx"] == "-rw-------"  # as packed
    root = prepare(dest, "mine", "m.tar.gz")
    assert modes(root) == {
        ".": "drwxr-xr-x",
        "1": "drwxr-xr-x",
        "1/model.onnx": "-rw-r--r--",
        "1/convert.sh": "-rwxr-xr-x",  # executable stays executable, for everyone
        "config.pbtxt": "-rw-r--r--",
    }
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return  # reading as another user needs root (and util-linux's setpriv)
    as_triton = [setpriv, "--reuid=1000", "--regid=1000", "--clear-groups", "cat"]
    out = subprocess.run([*as_triton, str(root / "config.pbtxt"), str(root / "1" / "model.onnx")], capture_output=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == b'name: "mine"\nbackend: "onnxruntime"\nweights'


def test_modes_are_set_exactly_through_unreadable_folders_and_links_are_not_followed(tmp_path: Path) -> None:
    top = tmp_path / "model"
    write_model(top)
    (top / "1" / "locked").mkdir()
    (top / "1" / "locked" / "data.bin").write_bytes(b"x")
    (top / "1" / "setuid").write_bytes(b"x")
    (top / "1" / "setuid").chmod(0o4750)
    (top / "config.pbtxt").chmod(0o666)  # world-writable in a shared repository: not kept
    (top / "1" / "locked" / "data.bin").chmod(0o200)
    (top / "1" / "locked").chmod(0)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the model's")
    outside.chmod(0o600)
    (top / "1" / "link").symlink_to(outside)
    open_modes(top)
    found = modes(top)
    assert found["1/locked"] == "drwxr-xr-x" and found["1/locked/data.bin"] == "-rw-r--r--"
    assert found["1/setuid"] == "-rwxr-xr-x"
    assert found["config.pbtxt"] == found["1/model.py"] == "-rw-r--r--"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600


# ---- a full disk while the loader edits the model ------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on its own 1 MiB tmpfs (needs root); unmounted after the test."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def test_a_disk_that_fills_before_the_config_gets_its_name_is_insufficient_space(small_disk: Path) -> None:
    """The name line makes a config of 4090 bytes take a second page, and the disk has none left: exit 15 with
    the advice a full disk gets mid-download, not an unexpected OSError (exit 1, a traceback)."""
    top = small_disk / "download"
    write_model(top, config=IDENTITY_CONFIG + "#" * (4089 - len(IDENTITY_CONFIG)) + "\n")
    with pytest.raises(OSError, match="No space left"), open(small_disk / "another-pod.bin", "wb", buffering=0) as out:
        while True:
            out.write(bytes(4096))
    with pytest.raises(InsufficientSpace) as info:
        prepare(top, "mine", "s3://b/m")
    assert info.value.exit_code == ExitCode.INSUFFICIENT_SPACE
    assert str(info.value) == (
        f"s3://b/m: writing {top / 'config.pbtxt'}: the filesystem is full — free space on the node"
    )


@pytest.mark.parametrize(
    "folder",
    ["9223372036854775808", "99999999999999999999", " 99999999999999999999", "+9223372036854775808x",
     "-9223372036854775809"],
)  # fmt: skip
def test_a_folder_triton_would_read_as_a_number_beyond_int64_is_refused(tmp_path: Path, folder: str) -> None:
    """std::stoll, as Triton reads a sub-folder's name, skips white space, takes a sign and stops at the first
    non-digit; beyond int64 it throws what Triton 2.51 does not catch (it aborts)."""
    write_model(tmp_path / "m")
    (tmp_path / "m" / folder).mkdir()
    with pytest.raises(InvalidModel, match="int64"):
        prepare(tmp_path / "m", "mine", "s3://b/m")


@pytest.mark.parametrize("folder", ["9223372036854775807", "-9223372036854775808", "0999999999999999999999", "x9" * 20])
def test_folders_triton_reads_without_aborting_are_let_through(tmp_path: Path, folder: str) -> None:
    """int64's own bounds fit; a leading zero makes Triton skip the folder before reading it; a name not
    starting with a number is no version."""
    write_model(tmp_path / "m")
    (tmp_path / "m" / folder).mkdir()
    assert prepare(tmp_path / "m", "mine", "s3://b/m") == tmp_path / "m"


R = pytest.param


@pytest.mark.parametrize(
    ("config", "library"),
    [
        R(IDENTITY_CONFIG.replace('"python"', '"onnxruntime"'), "libtriton_onnxruntime.so", id="model-folder"),
        R(IDENTITY_CONFIG, "1/libtriton_python.so", id="version-folder"),  # before Triton's own Python backend
        R(IDENTITY_CONFIG.replace('"python"', '"custom"\nruntime: "custom.so"'), "1/custom.so", id="runtime"),
        R(None, "libtriton_tensorrt.so", id="no-config"),
        R(IDENTITY_CONFIG, "2abc/libtriton_python.so", id="read-as-a-version"),  # std::stoll: version 2
    ],
)  # fmt: skip
def test_a_backend_library_in_the_model_is_refused(tmp_path: Path, config: str | None, library: str) -> None:
    """Triton looks for the model's backend library in the version folder and the model folder first, and loads
    it into its own process: one tenant's native code in the server all share (an aborting one took the real
    Triton down)."""
    write_model(tmp_path / "m", config=config or IDENTITY_CONFIG)
    if config is None:
        (tmp_path / "m" / "config.pbtxt").unlink()
    (tmp_path / "m" / library).parent.mkdir(exist_ok=True)
    (tmp_path / "m" / library).write_bytes(b"\x7fELF")
    with pytest.raises(InvalidModel) as info:
        prepare(tmp_path / "m", "mine", "s3://b/m")
    assert str(info.value) == (
        f"s3://b/m: {library} is where Triton looks for the model's backend library, and Triton would load it into "
        "its own process, which every model of the node shares — remove it and use a backend installed with Triton"
    )


@pytest.mark.parametrize(
    ("config", "library"),
    [
        R(IDENTITY_CONFIG, "1/lib/libtriton_python.so", id="deeper"),  # Triton does not look there
        R(IDENTITY_CONFIG, "1/libcustom_ops.so", id="another-library"),  # the model's code may load it, in its stub
        R(IDENTITY_CONFIG.replace('"python"', '"python"\nruntime: "model.py"'), "1/model.py", id="python-runtime"),
    ],
)  # fmt: skip
def test_libraries_triton_does_not_load_as_a_backend_are_let_through(tmp_path: Path, config: str, library: str) -> None:
    write_model(tmp_path / "m", config=config)
    (tmp_path / "m" / library).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "m" / library).write_bytes(b"\x7fELF")
    assert prepare(tmp_path / "m", "mine", "s3://b/m") == tmp_path / "m"
