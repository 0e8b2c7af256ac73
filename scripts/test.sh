#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every check: lint, types, layer contract, then all tests
# (unit, integration against a real Triton and real storage servers, manifests).
# Extra arguments go to pytest, e.g. scripts/test.sh -k proxy
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
say "ruff";   .venv/bin/ruff check src tests bench scripts && .venv/bin/ruff format --check src tests bench scripts
say "mypy";   .venv/bin/mypy
say "layers"; .venv/bin/lint-imports
say "pytest"; .venv/bin/pytest "$@"
