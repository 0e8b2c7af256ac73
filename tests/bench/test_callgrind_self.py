"""bench/callgrind_self.py: a callgrind dump's self costs, callees' inclusive costs left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.callgrind_self import self_costs

# A dump as callgrind writes it: compressed names, a call whose inclusive cost (the line after calls=) belongs
# to the callee, and a later reference to a named function by its id alone.
DUMP = """\
version: 1
events: Ir
ob=(1) /usr/bin/python3.11
fl=(1) ???
fn=(1) _PyEval_EvalFrameDefault
0 100
cob=(2) /lib/libc.so.6
cfn=(2) memcpy
calls=3 0
0 900
+2 50
ob=(2)
fn=(2)
0 30
ob=(1)
fn=(1)
* 7
totals: 187
"""


def test_self_costs_leave_out_what_a_callee_spent() -> None:
    costs = self_costs(DUMP.splitlines())
    assert costs == {("/usr/bin/python3.11", "_PyEval_EvalFrameDefault"): 157, ("/lib/libc.so.6", "memcpy"): 30}


def test_the_report_is_per_request_from_the_served_file(tmp_path: Path) -> None:
    dump = tmp_path / "tritonshare-rest.callgrind"
    dump.write_text(DUMP)
    dump.with_suffix(".served").write_text("10\n")
    out = subprocess.run(
        [sys.executable, "bench/callgrind_self.py", str(dump)], check=True, capture_output=True, text=True
    ).stdout
    assert out.startswith("19 instructions per request (10 requests)")  # (157 + 30) / 10
    assert "16  _PyEval_EvalFrameDefault  [python3.11]" in out
