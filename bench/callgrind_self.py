"""Where a callgrind dump's instructions went: self cost by library and by function, per request.

``callgrind_annotate`` reports the interpreter's recursive calls as 200 % of the total (CPython's evaluation loop
calls itself through ``PyObject_Call``) and stops there; this reads the dump's self costs directly. With
``bench/instructions.py --keep DIR`` each dump has a ``.served`` file beside it, the requests (messages) of its
window, and the figures are per request; otherwise, or with ``--per 1``, totals.

usage: python bench/callgrind_self.py DUMP [--per N] [--top 40]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

# "fn=(12) name" names id 12; a later "fn=(12)" refers to it (callgrind's name compression).
_NAMED = re.compile(r"\((\d+)\)(?: (.*))?")
_COST = re.compile(r"[0-9+*-]")


class Names:
    """One compressed-name table (objects, or functions)."""

    def __init__(self) -> None:
        self._by_id: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        match = _NAMED.fullmatch(text)
        if match is None:
            return text
        key, name = match.groups()
        if name is not None:
            self._by_id[key] = name
        return self._by_id.get(key, f"({key})")


def self_costs(lines: list[str]) -> Counter[tuple[str, str]]:
    """Instructions (the first event) spent in each (object, function) itself: cost lines after a ``calls=``
    line are the callee's inclusive cost and are left out."""
    objects, functions = Names(), Names()
    costs: Counter[tuple[str, str]] = Counter()
    obj = fn = ""
    after_call = False
    for line in lines:
        if line.startswith("ob="):
            obj = objects(line[3:])
        elif line.startswith("fn="):
            fn = functions(line[3:])
        elif line.startswith("cob="):
            objects(line[4:])
        elif line.startswith("cfn="):
            functions(line[4:])
        elif line.startswith("calls="):
            after_call = True
        elif _COST.match(line):
            if after_call:
                after_call = False
                continue
            fields = line.split()
            if len(fields) >= 2:
                costs[obj, fn] += int(fields[1])
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", type=Path)
    parser.add_argument("--per", type=int, help="divide by this many requests (default: the .served file, else 1)")
    parser.add_argument("--top", type=int, default=40, help="functions shown")
    args = parser.parse_args()
    served = args.dump.with_suffix(".served")
    per = args.per or (int(served.read_text()) if served.exists() else 1)
    costs = self_costs(args.dump.read_text(errors="replace").splitlines())
    by_object: Counter[str] = Counter()
    for (obj, _), n in costs.items():
        by_object[obj] += n
    print(f"{sum(costs.values()) / per:,.0f} instructions per request ({per} requests)\n\nby library:")
    for obj, n in by_object.most_common(8):
        print(f"{n / per:>10,.0f}  {obj}")
    print("\nby function (self):")
    for (obj, fn), n in costs.most_common(args.top):
        print(f"{n / per:>10,.0f}  {fn[:100]}  [{obj.rsplit('/', 1)[-1]}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
