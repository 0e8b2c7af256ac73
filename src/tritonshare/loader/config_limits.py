"""What a model's config makes Triton allocate as it loads the model, bounded before the model is published.

Triton 2.51 takes these sizes from the config as they are and allocates at load without checking the
allocation, in the process every tenant of the node shares: a size it cannot give takes the server down (seen
here, with a healthy neighbour model: SIGSEGV filling warmup data whose allocation failed, SIGABRT on
std::bad_alloc making sequence slots), or a load never ends while POLL holds every other model's load. The
bounds are far above what a real model asks and far below what fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tritonshare.common.errors import InvalidModel

# Bytes per element Triton 2.51 allocates for synthetic data (GenerateWarmupData: GetDataTypeByteSize, and 4 for a
# type of no fixed size, TYPE_STRING, whose elements it fills with 4-byte zero lengths).
_ELEMENT_BYTES = {"TYPE_BOOL": 1, "TYPE_UINT8": 1, "TYPE_INT8": 1, "TYPE_UINT16": 2, "TYPE_INT16": 2, "TYPE_FP16": 2,
                  "TYPE_BF16": 2, "TYPE_UINT32": 4, "TYPE_INT32": 4, "TYPE_FP32": 4, "TYPE_UINT64": 8, "TYPE_INT64": 8,
                  "TYPE_FP64": 8}  # fmt: skip
# Bounds on what a config makes Triton allocate at load: far above any real warmup sample or initial state, far
# below what a node can give one allocation. Triton checks neither, and a failed allocation takes it down.
LOAD_DATA_BYTES = 1 << 30
WARMUP_REQUESTS = SEQUENCE_SLOTS = 1 << 16


def check_load_data(config: Any, where: str) -> None:
    """Refuse a config (``config``, a ModelConfig message) that makes Triton 2.51 allocate more than it can at load,
    which takes down the server, and every tenant's model with it (seen here):

    - the zero or random data of a ``model_warmup`` input, or a sequence state's zero ``initial_state``, beyond
      :data:`LOAD_DATA_BYTES`: Triton fills the buffer without checking its allocation (SIGSEGV);
    - a warmup ``batch_size`` beyond :data:`WARMUP_REQUESTS`: Triton builds that many requests, one by one (past
      3 GiB in seconds), and the load never ends; POLL waits for it, so no model of the node loads or unloads in
      the meantime; as with a ``count`` that runs the batch beyond :data:`WARMUP_REQUESTS` requests in all;
    - sequence slots beyond :data:`SEQUENCE_SLOTS` (``max_batch_size`` with the sequence batcher's direct strategy,
      its default; ``max_candidate_sequences`` with the oldest): Triton makes that many per instance, and aborts
      when it cannot (std::bad_alloc)."""
    _check_sequence_slots(config, where)
    _check_warmup(config, where)
    for state in config.sequence_batching.state:
        for initial in state.initial_state:
            if initial.WhichOneof("state_data") == "zero_data":
                _check_data_bytes(initial, f"sequence_batching state {state.input_name!r}, initial_state", where)


def _check_sequence_slots(config: Any, where: str) -> None:
    if not config.HasField("sequence_batching"):
        return
    if config.sequence_batching.WhichOneof("strategy_choice") == "oldest":
        slots, field = config.sequence_batching.oldest.max_candidate_sequences, "sequence_batching's oldest strategy"
        said = f"max_candidate_sequences {slots} with {field}"
    else:
        slots, field = config.max_batch_size, "sequence_batching's direct strategy"
        said = f"max_batch_size {slots} with {field}"
    if slots > SEQUENCE_SLOTS:
        raise InvalidModel(
            f"{where}: {said} makes Triton allocate that many sequence slots per instance at load (no node can, "
            f"beyond {SEQUENCE_SLOTS}), and Triton aborts when it cannot, taking down every model of the node — give "
            "the number of sequences the model really batches"
        )


def _check_warmup(config: Any, where: str) -> None:
    for sample in config.model_warmup:
        field = f"model_warmup {sample.name!r}"
        if sample.batch_size > WARMUP_REQUESTS:
            raise InvalidModel(
                f"{where}: {field} has batch_size {sample.batch_size}, and Triton builds one request per unit of it "
                f"before the model is ready (beyond {WARMUP_REQUESTS}, refused here: gigabytes in seconds), holding "
                "every other model's load meanwhile — use the model's real batch size (at most its max_batch_size)"
            )
        if sample.batch_size * sample.count > WARMUP_REQUESTS:
            raise InvalidModel(
                f"{where}: {field} runs {sample.count} times a batch of {sample.batch_size} before the model is ready "
                f"(beyond {WARMUP_REQUESTS} requests, refused here), and Triton holds every other model's load until "
                "it is done — warm up a few times"
            )
        for name, data in sorted(sample.inputs.items()):
            if data.WhichOneof("input_data_type") in ("zero_data", "random_data"):
                _check_data_bytes(data, f"{field}, input {name!r}", where)


def _check_data_bytes(data: Any, field: str, where: str) -> None:
    """Refuse ``data`` (a warmup input or an initial state, of zero or random data) whose dims make more bytes than
    :data:`LOAD_DATA_BYTES`. A variable dimension (-1) Triton refuses itself; a negative size it allocates as none
    and then fails the model alone ("input byte size mismatch")."""
    dims = list(data.dims)
    if -1 in dims:
        return
    count = 1
    for dim in dims:
        count *= dim
    data_type = data.DESCRIPTOR.fields_by_name["data_type"].enum_type.values_by_number.get(data.data_type)
    size = count * _ELEMENT_BYTES.get(data_type.name if data_type else "", 4)
    if size > LOAD_DATA_BYTES:
        raise InvalidModel(
            f"{where}: {field} asks Triton for {size} bytes of synthetic data (dims {dims}), and Triton allocates it "
            f"without checking, at load, taking down every model of the node when it cannot (beyond "
            f"{LOAD_DATA_BYTES} bytes, refused here) — give dims the model really takes"
        )


def check_data_files(root: Path, config: Any, where: str) -> None:
    """Refuse an output's ``label_filename``, a warmup ``input_data_file`` or an initial state's ``data_file`` that
    leads out of the model folder ``root``. Triton 2.51 reads it at load, joined to the model folder (its
    ``warmup/`` or ``initial_state/`` folder for data) with any ``../`` followed, whole and without a bound: one of
    its own pipes (``/proc/self/fd/9``) made it abort (std::length_error), a FIFO held the load for good and, with
    it, POLL for every model of the node, and a file inside of 100 GiB made it abort (std::bad_alloc) (seen here):
    one beyond :data:`LOAD_DATA_BYTES` is refused too. A file that is missing Triton reports itself, failing the
    model alone."""
    real = os.path.realpath(root)
    for field, folder, name in _data_files(config):
        resolved = os.path.realpath(os.path.join(real, folder, name))
        if not (resolved == real or resolved.startswith(real + os.sep)):
            raise InvalidModel(
                f"{where}: {field} {name!r} leads out of the model folder, and Triton would read whatever is there "
                "at load (a pipe or a FIFO takes down, or holds, every model of the node) — put the file in the "
                f"model folder{f' under {folder}/' if folder else ''} and name it from there"
            )
        size = os.stat(resolved).st_size if os.path.isfile(resolved) else 0
        if size > LOAD_DATA_BYTES:
            raise InvalidModel(
                f"{where}: {field} {name!r} has {size} bytes, and Triton reads it whole into memory at load, taking "
                f"down every model of the node when it cannot (beyond {LOAD_DATA_BYTES} bytes, refused here) — warm "
                "up with a sample of the size the model takes"
            )


def _data_files(config: Any) -> Iterator[tuple[str, str, str]]:
    """(field, the folder of the model Triton reads it from, file name) for each data file the config names."""
    for output in config.output:
        if output.label_filename:
            yield f"output {output.name!r}: label_filename", "", output.label_filename
    for sample in config.model_warmup:
        for name, data in sorted(sample.inputs.items()):
            if data.WhichOneof("input_data_type") == "input_data_file":
                yield f"model_warmup {sample.name!r}, input {name!r}: input_data_file", "warmup", data.input_data_file
    for state in config.sequence_batching.state:
        for initial in state.initial_state:
            if initial.WhichOneof("state_data") == "data_file":
                field = f"sequence_batching state {state.input_name!r}, initial_state: data_file"
                yield field, "initial_state", initial.data_file
