#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every check: lint, types, layer contract, then all tests
# (unit, integration against a real Triton and real storage servers, manifests).
# The tests run against tritonshare as the image ships it: the proxy's request path compiled by mypyc
# (setup.py; built into .build/compiled, again only when the sources change); the few that spy on the proxy's
# methods run after, against the source tree. TRITONSHARE_COMPILE=0 runs them all against the source tree.
# Extra arguments go to pytest, e.g. scripts/test.sh -k proxy
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
# One command a line: under `set -e` a failure on the left of `&&` does not stop the script (a lint error
# went through CI that way).
say "ruff";   .venv/bin/ruff check src tests bench scripts setup.py
              .venv/bin/ruff format --check src tests bench scripts setup.py
say "mypy";   .venv/bin/mypy
say "layers"; .venv/bin/lint-imports
if [ "${TRITONSHARE_COMPILE:-1}" = 0 ]; then
  say "pytest (source tree)"; .venv/bin/pytest "$@"
  exit
fi
say "compile"; .venv/bin/python scripts/compile.py --python .venv/bin/python --target .build/compiled
say "pytest (the proxy compiled)"
PYTHONPATH="$PWD/.build/compiled" TRITONSHARE_TEST_BUILD=compiled .venv/bin/pytest "$@"
say "pytest (the tests marked interpreted, against the source tree)"
status=0; .venv/bin/pytest -m interpreted "$@" || status=$?
[ "$status" -eq 0 ] || [ "$status" -eq 5 ]  # 5: none of them selected
