#!/usr/bin/env bash
# The proxy benchmark's load, again and again against one Triton, until MINUTES pass or Triton dies: each round is
# the yardstick's REST (wrk) and gRPC unary (h2load) points at c=1 and c=16, then bench/stream_bench.py's streaming
# points at c=1 and c=16, SECONDS each, through TARGET — `ours` (a `tritonshare proxy` from .venv-opt, else .venv),
# `nginx` (the yardstick's baseline, gRPC body limit lifted as in proxy_bench.sh) or `direct` (Triton itself).
# Made to tell whether a Triton crash seen in benchmark runs (Triton 2.51's Python backend, SIGSEGV in its
# execute) comes with the proxy's traffic: run it for each TARGET and compare the rounds each survived.
# With GDB=1, gdb waits on Triton and, at a SIGSEGV/SIGABRT/SIGBUS, saves the registers, the faulting
# instructions, the thread's backtrace, the mappings and every thread's backtrace in the kept logs.
# Prints one line per round and the total; exit 1 if Triton died (its logs kept), 0 if it lived to the end.
# usage: bench/faults/triton_turns.sh MINUTES [ours|nginx|direct] [SECONDS]   (needs scripts/setup.sh --bench)
set -uo pipefail
cd "$(dirname "$0")/../.."
minutes=${1:?usage: bench/faults/triton_turns.sh MINUTES [ours|nginx|direct] [SECONDS]}
target=${2:-ours} secs=${3:-5}
root=$(pwd)
yard=${TRITONSHARE_YARDSTICK:-$(cd ../shared/bench && pwd)}
venv=.venv-opt; [ -x "$venv/bin/tritonshare" ] || venv=.venv
export PY="$root/.venv/bin/python"
run=$(mktemp -d /tmp/tritonshare-turns.XXXXXX)
cp -r "$yard/models/identity" "$run/" && mkdir -p "$run/models" "$run/staging" && mv "$run/identity" "$run/models/"
touch "$run/models/identity/1/__pycache__"  # as the loader does (POLL would reload a model writing it)
port() { "$PY" -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
th=$(port) tg=$(port) tm=$(port)
triton=$(bash "$yard/triton-up.sh" "$root/.venv-triton" "$run/models" "$th" "$tg" "$tm" "$run/triton.log")
died=0
cleanup() {
  local regions=() region p
  for p in $(pgrep -g "$triton" -f triton_python_backend_stub); do  # their /dev/shm regions, left if Triton died
    region=$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | sed -n 3p) || true
    if [ -n "$region" ]; then regions+=("/dev/shm/$region"); fi
  done
  [ -f "$run/nginx/nginx.pid" ] && kill -QUIT "$(cat "$run/nginx/nginx.pid")" 2>/dev/null
  [ -n "${proxy:-}" ] && kill "$proxy" 2>/dev/null
  kill -- "-$triton" 2>/dev/null; sleep 0.5; kill -9 -- "-$triton" 2>/dev/null
  rm -f "${regions[@]}"
  if [ "$died" = 1 ]; then mkdir -p "$run.logs" && cp "$run"/*.log "$run"/*.txt "$run.logs/" 2>/dev/null
    echo "logs kept in $run.logs" >&2; fi
  rm -rf "$run"
}
trap cleanup EXIT
for _ in $(seq 1 240); do curl -fs "http://127.0.0.1:$th/v2/models/identity/ready" >/dev/null 2>&1 && break; sleep 0.25; done
if [ "${GDB:-0}" = 1 ]; then
  gdb -p "$triton" -batch -ex "handle all nostop noprint pass" -ex "handle SIGSEGV stop print nopass" \
    -ex "handle SIGABRT stop print nopass" -ex "handle SIGBUS stop print nopass" -ex continue \
    -ex "info registers" -ex 'x/6i $pc' -ex bt -ex "info proc mappings" -ex "thread apply all bt 12" \
    >"$run/gdb.txt" 2>&1 &
  gdb_pid=$!
  sleep 3
fi
case $target in
  direct) hp=$th gp=$tg pids=$triton ;;
  nginx)
    hp=$(port) gp=$(port); mkdir -p "$run/yard"; cp "$yard/nginx-up.sh" "$run/yard/"
    sed 's#listen 127.0.0.1:@GRPC@ http2;#& client_max_body_size 0;#' "$yard/nginx.conf.in" >"$run/yard/nginx.conf.in"
    pids=$(bash "$run/yard/nginx-up.sh" "$run/nginx" identity "$th" "$tg" "$hp" "$gp") ;;
  ours)
    hp=$(port) gp=$(port) mp=$(port)
    "$root/$venv/bin/tritonshare" --log-level warning proxy --name identity --host 127.0.0.1 \
      --triton-url "http://127.0.0.1:$th" --triton-grpc "127.0.0.1:$tg" --http-port "$hp" --grpc-port "$gp" \
      --metrics-port "$mp" --no-unload --repository "$run/models" --staging "$run/staging" 2>"$run/proxy.log" &
    proxy=$! pids=$!
    for _ in $(seq 1 60); do curl -fs "http://127.0.0.1:$hp/v2/health/live" >/dev/null 2>&1 && break; sleep 0.1; done ;;
  *) echo "target: ours, nginx or direct, not $target" >&2; exit 2 ;;
esac
echo "# $(date -u +%FT%TZ) Triton turns through $target for $minutes min, ${secs}s per point"
end=$(($(date +%s) + 60 * minutes)) rounds=0
while [ "$(date +%s)" -lt "$end" ]; do
  rounds=$((rounds + 1))
  # shellcheck disable=SC2086  # pids: one or more
  # (a Triton held by gdb answers nothing: each step is bounded)
  timeout $((8 * secs + 60)) bash "$yard/proxy-bench.sh" "$target" identity "$hp" "$gp" "$secs" $pids >"$run/round.txt" 2>&1
  timeout $((2 * secs + 60)) "$PY" bench/stream_bench.py "127.0.0.1:$gp" --seconds "$secs" --label "$target" \
    --pids $pids >>"$run/round.txt" 2>&1
  if ! curl -fs --max-time 10 "http://127.0.0.1:$th/v2/health/live" >/dev/null 2>&1; then
    died=1
    if [ -n "${gdb_pid:-}" ]; then timeout 120 tail --pid="$gdb_pid" -f /dev/null; fi  # gdb saving what it saw
    echo "round $rounds: Triton DEAD; the round so far:"; sed 's/^/  /' "$run/round.txt"
    grep -A8 "Signal (" "$run/triton.log" | head -12
    break
  fi
  echo "round $rounds: $(awk '{printf "%s %s %s | ", $2, $3, $4}' "$run/round.txt")"
done
echo "$target: $rounds rounds, Triton $([ "$died" = 1 ] && echo "died in round $rounds" || echo alive)"
exit "$died"
