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
_TABLES_SAID = "'int32_false_true', 'fp32_false_true' or 'bool_false_true'"  # as Triton's messages name them
_CORRID = "CONTROL_SEQUENCE_CORRID"  # the correlation-id control: a typed value, no truth table


def check_triton_rules(config: Any, where: str) -> None:
    """Refuse a config (``config``, a ModelConfig message) that Triton 2.51 refuses without saying so but in its
    log: a negative ``max_batch_size``, a ``preferred_batch_size`` not in 1..``max_batch_size``, a sequence
    control's truth tables not as Triton takes them (:func:`_check_truth_tables`)."""
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
            _check_truth_tables(control, f"sequence_batching control_input {control_input.name!r}", where)


def _check_truth_tables(control: Any, named: str, where: str) -> None:
    """A sequence control's truth tables as Triton 2.51 takes them: none on a correlation-id control, at most
    one on a start, ready or end control, and that one with exactly two values (in this order, as Triton looks).
    A kind Triton does not know (``kind: 7`` parses) is looked at by none of its checks: that model loads."""
    kinds = control.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_number
    if control.kind not in kinds:
        return
    kind = kinds[control.kind].name
    given = [table for table in _TRUTH_TABLES if len(getattr(control, table))]
    if given and kind == _CORRID:
        what = f"{named} has {given[0]} {list(getattr(control, given[0]))} on a {kind} control"
        says = f"sequence batching must not specify either {_TABLES_SAID} for {kind}"
        raise _refused(where, what, says, "a correlation-id control takes no truth table: remove it")
    if len(given) > 1:
        what = f"{named} has {' and '.join(given)}"
        says = f"sequence batching specifies more than one from {_TABLES_SAID.replace(' or ', ' and ')} for {kind}"
        raise _refused(where, what, says, "give one truth table")
    for table in given:
        values = list(getattr(control, table))
        if len(values) != 2:
            what = f"{named} has {table} {values}"
            says = f"sequence batching control '{table}' must have exactly 2 entries"
            raise _refused(where, what, says, "give the false value, then the true one")


def _refused(where: str, what: str, triton_says: str, fix: str) -> InvalidModel:
    return InvalidModel(
        f"{where}: {what}, and Triton refuses such a model ({triton_says!r}) where only its log shows it, so the "
        f"load would wait for its deadline — {fix}"
    )
