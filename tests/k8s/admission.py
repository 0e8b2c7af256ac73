"""Evaluate a ValidatingAdmissionPolicy's CEL offline, as the API server would for one object.

cel-python (``celpy``) runs the expressions; no API server is involved. Kubernetes type-checks the
expressions against the object's schema first, which this does not: it tells what a policy admits, while
`kubectl apply --dry-run=server` remains the check that the API server accepts the policy at all.
"""

from __future__ import annotations

from typing import Any

import celpy

Obj = dict[str, Any]


def refusals(policy: Obj, obj: Obj, namespace: Obj) -> list[str]:
    """The messages of the policy's validations that refuse ``obj`` in ``namespace``; [] when admitted.

    A validation whose expression fails to evaluate raises: on the API server it would refuse the object
    (``failurePolicy: Fail``) for a reason no message states."""
    spec = policy["spec"]
    env = celpy.Environment()
    activation: Obj = {"object": obj, "namespaceObject": namespace, "variables": {}}
    for variable in spec.get("variables", []):  # in order: a variable may use the ones before it
        activation["variables"][variable["name"]] = _evaluate(env, variable["expression"], activation)
    refused = []
    for validation in spec["validations"]:
        admitted = _evaluate(env, validation["expression"], activation)
        assert isinstance(admitted, bool), f"{validation['expression']!r} gave {admitted!r}, not a bool"
        if not admitted:
            refused.append(validation.get("message", validation["expression"]))
    return refused


def _evaluate(env: celpy.Environment, expression: str, activation: Obj) -> Any:
    program = env.program(env.compile(expression))
    return _plain(program.evaluate(celpy.json_to_cel(activation)))


def _plain(value: Any) -> Any:
    """CEL values back to Python's (a variable's value is bound again as JSON for the next expression).

    Lists and maps are walked whatever their class: celpy returns a concatenation (``a + b``) as a plain
    ``list`` of CEL values, and a ``BoolType`` left inside would come back as an int (it is one, not a bool)."""
    if isinstance(value, celpy.celtypes.BoolType):
        return bool(value)
    if isinstance(value, dict):  # MapType too
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):  # ListType too
        return [_plain(v) for v in value]
    if isinstance(value, celpy.celtypes.StringType):
        return str(value)
    if isinstance(value, celpy.celtypes.IntType):
        return int(value)
    return value
