"""Config rules Triton 2.51 enforces only in its log: a model breaking one fails every poll ("Poll failed for model
directory ...") while Triton's index lists its folder with no state and no reason, so a load waits out its deadline
and then can only say that Triton did not load the model (exit 13). The cheap ones are checked here, in Triton's
words, so such a load fails in a second (exit 10) naming the field.

Each rule is Triton's own (``ValidateModelConfig``), never stricter: ``tests/loader/test_config_rules.py`` places
every config refused here, and every one let through beside it, in a real Triton.
"""

from __future__ import annotations

from typing import Any

from tritonshare.common.errors import InvalidModel

_TRUTH_TABLES = ("int32_false_true", "fp32_false_true", "bool_false_true")  # a sequence control's two values


def check_triton_rules(config: Any, where: str) -> None:
    """Refuse a config (``config``, a ModelConfig message) that Triton 2.51 refuses without saying so but in its
    log: a negative ``max_batch_size``, a ``preferred_batch_size`` not in 1..``max_batch_size``, a sequence
    control's truth table without exactly two values."""
    batch = config.max_batch_size
    if batch < 0:
        what, fix = f"max_batch_size is {batch}", "give 0 for a model that does not batch, else the largest batch"
        raise _refused(where, what, "'max_batch_size' must be non-negative value", fix)
    for size in config.dynamic_batching.preferred_batch_size:
        if size <= 0:
            what = f"dynamic_batching has preferred_batch_size {size}"
            raise _refused(where, what, "dynamic batching preferred size must be positive", "give sizes from 1 up")
        if size > batch:
            what = f"dynamic_batching's preferred_batch_size {size} is more than max_batch_size {batch}"
            fix = "give sizes up to max_batch_size, or raise it"
            raise _refused(where, what, "dynamic batching preferred size must be <= max batch size", fix)
    for control_input in config.sequence_batching.control_input:
        for control in control_input.control:
            for table in _TRUTH_TABLES:
                values = list(getattr(control, table))
                if values and len(values) != 2:
                    what = f"sequence_batching control_input {control_input.name!r} has {table} {values}"
                    says = f"sequence batching control '{table}' must have exactly 2 entries"
                    raise _refused(where, what, says, "give the false value, then the true one")


def _refused(where: str, what: str, triton_says: str, fix: str) -> InvalidModel:
    return InvalidModel(
        f"{where}: {what}, and Triton refuses such a model ({triton_says!r}) where only its log shows it, so the "
        f"load would wait for its deadline — {fix}"
    )
