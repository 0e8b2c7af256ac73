#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the local demo: real Triton, tritonshare load from a local HTTP server,
# tritonshare proxy, inference through it (REST + gRPC), refusals, SIGTERM → drain → unload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py
