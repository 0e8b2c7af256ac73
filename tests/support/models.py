"""Small real Triton models (Python backend) written by the tests."""

from __future__ import annotations

from pathlib import Path

IDENTITY_CONFIG = """\
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

IDENTITY_MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""

# The identity model over strings (INPUT0 BYTES [-1] -> OUTPUT0 BYTES): the same model.py serves it.
BYTES_IDENTITY_CONFIG = IDENTITY_CONFIG.replace("TYPE_FP32", "TYPE_STRING")

# A model whose initialize() raises: Triton marks it UNAVAILABLE with this text as the reason.
BROKEN_MODEL = """\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("tritonshare-test: this model refuses to load")

    def execute(self, requests):
        return []
"""

# Decoupled: each request yields one response per element of INPUT0, then the final flag.
DECOUPLED_CONFIG = """\
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

DECOUPLED_MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            for v in x:
                t = pb_utils.Tensor("OUTPUT0", np.array([v], dtype=np.float32))
                sender.send(pb_utils.InferenceResponse([t]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def write_model(
    root: Path,
    *,
    name: str | None = None,
    config: str = IDENTITY_CONFIG,
    model_py: str = IDENTITY_MODEL,
    version: str = "1",
    padding_bytes: int = 0,
) -> Path:
    """Write a model folder at ``root`` (config.pbtxt + VERSION/model.py). ``name`` adds a name line;
    ``padding_bytes`` adds a weights-like file to make the model as large as a test needs."""
    (root / version).mkdir(parents=True, exist_ok=True)
    text = (f'name: "{name}"\n' if name else "") + config
    (root / "config.pbtxt").write_text(text)
    (root / version / "model.py").write_text(model_py)
    # What the loader does too: a plain file named __pycache__ keeps the Python backend from writing
    # bytecode into the model folder, which POLL would see as a change and reload the model.
    (root / version / "__pycache__").touch()
    if padding_bytes:
        with open(root / version / "weights.bin", "wb") as fh:
            block = bytes(range(256)) * 4096
            left = padding_bytes
            while left > 0:
                fh.write(block[: min(left, len(block))])
                left -= len(block)
    return root


# Identity that takes ``SLOW_MODEL_DELAY_S`` per request: keeps requests in flight for drain tests.
SLOW_MODEL_DELAY_S = 0.4
SLOW_CONFIG = IDENTITY_CONFIG.replace("count: 1", "count: 4")
SLOW_MODEL = f"""\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({SLOW_MODEL_DELAY_S})
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
"""


# Identity whose initialize() takes ``SLOW_START_S``: Triton says LOADING (or, starting up, does not answer)
# for that long.
SLOW_START_S = 6
SLOW_START_MODEL = "import time\n\n\n" + IDENTITY_MODEL.replace(
    "class TritonPythonModel:\n",
    f"class TritonPythonModel:\n    def initialize(self, args):\n        time.sleep({SLOW_START_S})\n\n",
)
