"""What a config makes Triton allocate as it loads the model: bounded before publishing, through ``prepare`` as the
loader runs it; what Triton did with each refused config (a real Triton 2.51) is in the tests' docstrings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import IDENTITY_CONFIG, write_model
from tritonshare.common.errors import ExitCode, InvalidModel
from tritonshare.loader.config_limits import LOAD_DATA_BYTES
from tritonshare.loader.model import prepare

R = pytest.param


def warmup(dims: str, data: str = "zero_data: true", *, batch_size: int = 1, data_type: str = "TYPE_FP32") -> str:
    return IDENTITY_CONFIG + (
        f'model_warmup [ {{ name: "w" batch_size: {batch_size} inputs {{ key: "INPUT0" value {{ '
        f"data_type: {data_type} dims: {dims} {data} }} }} }} ]\n"
    )


def initial_state(dims: str) -> str:
    return IDENTITY_CONFIG.replace("max_batch_size: 0", "max_batch_size: 8") + (
        'sequence_batching { state [ { input_name: "IS" output_name: "OS" data_type: TYPE_FP32 dims: [ 1 ] '
        f'initial_state: {{ data_type: TYPE_FP32 dims: {dims} zero_data: true name: "init" }} }} ] }}\n'
    )


def labels(filename: str) -> str:
    output = 'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]'
    return IDENTITY_CONFIG.replace(output, output.replace(" } ]", f' label_filename: "{filename}" }} ]'))


def sequences(max_batch_size: int, strategy: str) -> str:
    config = IDENTITY_CONFIG.replace("max_batch_size: 0", f"max_batch_size: {max_batch_size}")
    return config + f"sequence_batching {{ {strategy} }}\n"


@pytest.mark.parametrize(
    ("config", "why"),
    [
        R(warmup("[ 1000000000000 ]"), "model_warmup 'w', input 'INPUT0' asks Triton for 4000000000000 bytes",
          id="zero"),
        R(warmup("[ 1000000000000 ]", "random_data: true"), "4000000000000 bytes", id="random"),
        R(warmup("[ 4611686018427387904 ]"), "18446744073709551616 bytes", id="0-bytes-in-tritons-int64"),
        R(warmup("[ 65536, 16385 ]", data_type="TYPE_UINT8"),
          r"1073807360 bytes of synthetic data \(dims \[65536, 16385\]\)", id="just-over"),
        R(warmup("[ 268435457 ]", "random_data: true", data_type="TYPE_STRING"), "1073741828 bytes", id="string"),
        R(warmup("[ -2, -500000000000 ]"), r"4000000000000 bytes of synthetic data \(dims \[-2, -500000000000\]\)",
          id="negatives"),
        R(initial_state("[ 1000000000000 ]"), "sequence_batching state 'IS', initial_state asks Triton for",
          id="initial-state"),
        R(warmup("[ 6 ]", batch_size=2**31 - 1), "batch_size 2147483647, and Triton builds one request per unit",
          id="batch-size"),
        R(warmup("[ 6 ]").replace("batch_size: 1", "batch_size: 2 count: 32769"), "runs 32769 times a batch of 2",
          id="count"),
        R(sequences(2**31 - 1, "direct { }"), "max_batch_size 2147483647 with sequence_batching's direct strategy",
          id="sequence-slots"),
        R(sequences(65537, ""), "max_batch_size 65537 with sequence_batching's direct strategy", id="default-strategy"),
        R(sequences(8, "oldest { max_candidate_sequences: 2147483647 }"),
          "max_candidate_sequences 2147483647 with sequence_batching's oldest strategy", id="oldest-candidates"),
    ],
)  # fmt: skip
def test_a_config_making_triton_allocate_beyond_what_it_checks_at_load_is_refused(
    tmp_path: Path, config: str, why: str
) -> None:
    """Triton 2.51 allocates a warmup sample's zero or random data, and a sequence's zero initial state, at load
    and fills it without checking the allocation: the whole server dies (SIGSEGV) with every tenant's model; a
    warmup batch_size is as many requests built one by one, a load that never ends, as is a huge count; sequence
    batching makes its slots (max_batch_size, or max_candidate_sequences), and Triton aborts (std::bad_alloc) when it
    cannot. Seen with a real Triton."""
    write_model(tmp_path / "m", config=config)
    with pytest.raises(InvalidModel, match=why) as info:
        prepare(tmp_path / "m", "mine", "s3://b/m")
    assert str(info.value).startswith("s3://b/m: config.pbtxt: ")
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


@pytest.mark.parametrize(
    "config",
    [
        R(warmup("[ 6 ]"), id="small"),
        R(warmup("[ 6 ]", batch_size=0), id="batch-0-skipped"),
        R(warmup("[ 1073741824 ]", data_type="TYPE_BOOL"), id="at-the-bound"),
        R(warmup("[ -1 ]"), id="variable"),  # Triton refuses a variable dimension itself: the model alone fails
        R(warmup("[ 2, -2 ]"), id="negative"),  # a negative size: Triton allocates nothing, and fails the model alone
        R(warmup("[ ]", "random_data: true"), id="scalar"),
        R(warmup("[ 1000000000000 ]", 'input_data_file: "raw"'), id="from-a-file"),  # Triton checks the file's size
        R(warmup("[ 6 ]", batch_size=65536), id="batch-at-the-bound"),
        R(warmup("[ 6 ]").replace("batch_size: 1", "batch_size: 2 count: 32768"), id="count-at-the-bound"),
        R(initial_state("[ 1 ]"), id="initial-state"),
        R(initial_state("[ 1000000000000 ]").replace("zero_data: true", 'data_file: "init"'), id="state-from-a-file"),
        R(sequences(65536, "direct { }"), id="sequence-slots-at-the-bound"),
        R(sequences(65536, "oldest { max_candidate_sequences: 65536 }"), id="oldest-candidates-at-the-bound"),
        R(IDENTITY_CONFIG.replace("max_batch_size: 0", "max_batch_size: 2147483647"), id="no-sequence-batcher"),
    ],
)  # fmt: skip
def test_load_data_triton_can_allocate_is_let_through(tmp_path: Path, config: str) -> None:
    write_model(tmp_path / "m", config=config)
    assert prepare(tmp_path / "m", "mine", "s3://b/m") == tmp_path / "m"


@pytest.mark.parametrize(
    ("config", "why"),
    [
        R(warmup("[ 6 ]", f'input_data_file: "{"../" * 12}proc/self/fd/9"'),
          "model_warmup 'w', input 'INPUT0': input_data_file '(../)+proc/self/fd/9' leads out of the model folder",
          id="a-pipe-of-tritons"),
        R(warmup("[ 6 ]", 'input_data_file: "/tmp/fifo"'), "input_data_file '/tmp/fifo' leads out", id="absolute"),
        R(warmup("[ 6 ]", 'input_data_file: "../../neighbour/1/model.py"'), "leads out of the model folder",
          id="another-model"),
        R(initial_state("[ 1 ]").replace("zero_data: true", 'data_file: "../../x"'),
          "initial_state: data_file '../../x' leads out .* model folder under initial_state/",
          id="initial-state"),
        R(labels(f"{'../' * 12}proc/self/fd/9"),
          r"output 'OUTPUT0': label_filename '(\.\./)+proc/self/fd/9' leads out .* in the model folder and name",
          id="labels"),
    ],
)  # fmt: skip
def test_a_data_file_leading_out_of_the_model_is_refused(tmp_path: Path, config: str, why: str) -> None:
    """Triton 2.51 reads a warmup input's data file (and an initial state's) at load, ../ followed, whole: its own
    pipe /proc/self/fd/9 made the real Triton abort (std::length_error), a FIFO held POLL for every model."""
    write_model(tmp_path / "m", config=config)
    (tmp_path / "m" / "warmup").mkdir()
    with pytest.raises(InvalidModel, match=why) as info:
        prepare(tmp_path / "m", "mine", "s3://b/m")
    assert info.value.exit_code == ExitCode.SOURCE_PERMANENT


@pytest.mark.parametrize(
    "config",
    [
        R(warmup("[ 6 ]", 'input_data_file: "raw"'), id="in-warmup"),
        R(warmup("[ 6 ]", 'input_data_file: "sub/../raw"'), id="down-and-back"),
        R(warmup("[ 6 ]", 'input_data_file: "../1/model.py"'), id="elsewhere-in-the-model"),
        R(warmup("[ 6 ]", 'input_data_file: "missing"'), id="missing"),  # Triton fails the model alone
        R(initial_state("[ 1 ]").replace("zero_data: true", 'data_file: "init"'), id="initial-state"),
        R(labels("warmup/raw"), id="labels"),
    ],
)  # fmt: skip
def test_data_files_inside_the_model_are_let_through(tmp_path: Path, config: str) -> None:
    write_model(tmp_path / "m", config=config)
    (tmp_path / "m" / "warmup").mkdir()
    (tmp_path / "m" / "warmup" / "raw").write_bytes(bytes(24))
    assert prepare(tmp_path / "m", "mine", "s3://b/m") == tmp_path / "m"


@pytest.mark.parametrize(
    ("config", "file", "field"),
    [
        R(warmup("[ 6 ]", 'input_data_file: "raw"'), "warmup/raw", "input_data_file 'raw'", id="warmup"),
        R(labels("labels"), "labels", "label_filename 'labels'", id="labels"),
    ],
)  # fmt: skip
def test_a_data_file_beyond_the_bound_is_refused(tmp_path: Path, config: str, file: str, field: str) -> None:
    """Triton reads a warmup data file, or an output's labels, whole at load: a (sparse) one of 100 GiB made the real
    Triton abort (std::bad_alloc); the bound, 1 GiB, is let through (sparse here too: no disk used)."""
    write_model(tmp_path / "m", config=config)
    (tmp_path / "m" / "warmup").mkdir()
    with open(tmp_path / "m" / file, "wb") as data:
        data.truncate(LOAD_DATA_BYTES)
    assert prepare(tmp_path / "m", "mine", "s3://b/m") == tmp_path / "m"
    with open(tmp_path / "m" / file, "ab") as data:
        data.write(b"\0")
    with pytest.raises(InvalidModel, match=f"{field} has 1073741825 bytes, and Triton reads it whole"):
        prepare(tmp_path / "m", "mine", "s3://b/m")
