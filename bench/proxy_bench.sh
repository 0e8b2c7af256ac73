#!/usr/bin/env bash
# The proxy yardstick in one run: real Triton, then the same REST (wrk), gRPC unary (h2load) and gRPC
# streaming (bench/stream_bench.py: bidi ModelStreamInfer) load direct to Triton, through nginx (the
# baseline), and through `tritonshare proxy`; CPU µs per request of each proxy process, rps, latency; and the
# proxy's RSS idle and after load. With ROUNDS > 1, nginx and the proxy take turns ROUNDS times (which goes first
# alternates, so a load that drifts on a shared node weighs on both alike), and bench/proxy_summary.py prints
# the median of each point and the bars. h2load counts a gRPC reply as a success whatever its grpc-status and wrk
# any HTTP answer, so each turn is checked by the counts of the proxy (its /metrics) and Triton
# (nv_inference_request_failure), read before and after it (bench/answers.py); a turn whose answers were not all
# successes has its points left out and the run exits 1.
# usage: bench/proxy_bench.sh [SECONDS] [ROUNDS] [VENV...]   (needs scripts/setup.sh --bench; uses ../shared/bench)
# The proxy runs from .venv-opt (tritonshare on an optimized CPython, as in the image: bench/target.py), else .venv,
# or from TRITONSHARE_BENCH_VENV. Each VENV after ROUNDS runs one more proxy from that venv, labelled
# "ours@VENV", taking turns with the others: `bench/proxy_bench.sh 5 3 .venv` puts two interpreters side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
rounds=${2:-1}
extra=("${@:3}")
venv=${TRITONSHARE_BENCH_VENV:-}
if [ -z "$venv" ]; then if [ -x .venv-opt/bin/tritonshare ]; then venv=.venv-opt; else venv=.venv; fi; fi
yard=${TRITONSHARE_YARDSTICK:-$(cd ../shared/bench && pwd)}
root=$(pwd)
run=$(mktemp -d /tmp/tritonshare-bench.XXXXXX)
mkdir -p "$run/models" "$run/staging"
cp -r "$yard/models/identity" "$run/models/"
# as the loader does: keep the Python backend from writing __pycache__ into the model (POLL would reload it)
touch "$run/models/identity/1/__pycache__"
port() { "$root/.venv/bin/python" -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
th=$(port) tg=$(port) tm=$(port) nh=$(port) ng=$(port)
pids=()
cleanup() {
  local status=$?
  # the Python backend's /dev/shm regions, named on its stubs' command lines: a Triton that died leaves them for good
  local regions=() region
  if [ -n "${triton:-}" ]; then
    for p in $(pgrep -g "$triton" -f triton_python_backend_stub); do
      region=$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | sed -n 3p) || true
      if [ -n "$region" ]; then regions+=("/dev/shm/$region"); fi
    done
  fi
  [ -f "$run/nginx/nginx.pid" ] && kill -QUIT "$(cat "$run/nginx/nginx.pid")" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -n "${triton:-}" ] && kill -- "-$triton" 2>/dev/null || true
  sleep 0.5
  # Python backend stubs ignore SIGTERM and outlive a Triton that died: the group goes by SIGKILL
  [ -n "${triton:-}" ] && kill -9 -- "-$triton" 2>/dev/null || true
  rm -f "${regions[@]}"
  if [ "$status" != 0 ]; then  # a failed run keeps Triton's and the proxies' logs, to tell why
    mkdir -p "$run.logs" && cp "$run"/*.log "$run.logs/" 2>/dev/null || true
    echo "proxy_bench.sh: logs kept in $run.logs" >&2
  fi
  rm -rf "$run"
}
trap cleanup EXIT
triton=$(bash "$yard/triton-up.sh" "$root/.venv-triton" "$run/models" "$th" "$tg" "$tm" "$run/triton.log")
for _ in $(seq 1 120); do
  curl -fs "http://127.0.0.1:$th/v2/models/identity/ready" >/dev/null 2>&1 && break; sleep 0.25
done
# nginx counts a whole gRPC stream as one request body: its default client_max_body_size (1 MiB) resets a bidi
# stream after ~10,000 of the yardstick's 100-byte messages. Whoever streams through nginx lifts it; so does
# this baseline.
mkdir -p "$run/yard"
cp "$yard/nginx-up.sh" "$run/yard/"
sed 's#listen 127.0.0.1:@GRPC@ http2;#& client_max_body_size 0;#' "$yard/nginx.conf.in" >"$run/yard/nginx.conf.in"
grep -q 'http2; client_max_body_size 0;' "$run/yard/nginx.conf.in" || {
  echo "proxy_bench.sh: cannot lift nginx's gRPC body limit: $yard/nginx.conf.in has no 'listen 127.0.0.1:@GRPC@ http2;'" >&2
  exit 1
}
nginx_pids=$(bash "$run/yard/nginx-up.sh" "$run/nginx" identity "$th" "$tg" "$nh" "$ng")
declare -A http_port grpc_port metrics_port pid_of
labels=(ours)
# LABEL VENV: one `tritonshare proxy` from VENV
start_proxy() {
  local hp gp mp
  hp=$(port) gp=$(port) mp=$(port)
  "$root/$2/bin/tritonshare" --log-level warning proxy --name identity --host 127.0.0.1 \
    --triton-url "http://127.0.0.1:$th" --triton-grpc "127.0.0.1:$tg" \
    --http-port "$hp" --grpc-port "$gp" --metrics-port "$mp" --no-unload \
    --repository "$run/models" --staging "$run/staging" 2>"$run/proxy-${1//[^a-z0-9]/_}.log" &
  pid_of[$1]=$!; pids+=("$!"); http_port[$1]=$hp; grpc_port[$1]=$gp; metrics_port[$1]=$mp
  for _ in $(seq 1 60); do curl -fs "http://127.0.0.1:$hp/v2/health/live" >/dev/null 2>&1 && break; sleep 0.1; done
}
start_proxy ours "$venv"
for v in "${extra[@]}"; do labels+=("ours@$v"); start_proxy "ours@$v" "$v"; done
proxy=${pid_of[ours]}
rss() { awk '/^VmRSS/{print $2}' "/proc/$1/status"; }
hwm() { awk '/^VmHWM/{print $2}' "/proc/$1/status"; }
echo "# $(date -u +%FT%TZ) $(nproc) cores, ${secs}s per point; CPU = utime+stime of the proxy process(es)"
for label in "${labels[@]}"; do
  v=$venv; [ "$label" = ours ] || v=${label#ours@}
  echo "# $label: tritonshare from $("$root/.venv/bin/python" bench/target.py "$v")"
done
echo "tritonshare proxy idle RSS: $(( $(rss "$proxy") / 1024 )) MiB"
export PY="$root/.venv/bin/python"
# LABEL GRPC_PORT [PID...]: a failed stream shows on its line (Nok/Mfailed) and does not stop the run
stream() { "$PY" bench/stream_bench.py "127.0.0.1:$2" --seconds "$secs" --label "$1" --pids "${@:3}" || true; }
nginx() { bash "$yard/proxy-bench.sh" nginx identity "$nh" "$ng" "$secs" $nginx_pids; stream nginx "$ng" $nginx_pids; }
# LABEL: one of the proxies
ours_turn() {
  bash "$yard/proxy-bench.sh" "$1" identity "${http_port[$1]}" "${grpc_port[$1]}" "$secs" "${pid_of[$1]}"
  stream "$1" "${grpc_port[$1]}" "${pid_of[$1]}"
}
direct() { bash "$yard/proxy-bench.sh" direct identity "$th" "$tg" "$secs"; stream direct "$tg"; }
# LABEL WHEN: Triton's metrics page, and the proxy's for one of ours, saved before or after LABEL's turn (an
# unreadable page leaves an empty file: bench/answers.py then prints "unreadable", not a success)
pages() {
  local f=$run/pages-${1//[^a-z0-9]/_}
  curl -fsS "http://127.0.0.1:$tm/metrics" >"$f-triton-$2" || true
  if [ -n "${metrics_port[$1]:-}" ]; then
    curl -fsS "http://127.0.0.1:${metrics_port[$1]}/metrics" >"$f-proxy-$2" || true
  fi
}
# LABEL: the turn's answers line (bench/answers.py). Up to one request cut per connection as wrk and h2load end a
# timed run, at c=1 and c=16 (the yardstick's proxy-bench.sh): 17 REST + 17 gRPC.
answers() {
  local f=$run/pages-${1//[^a-z0-9]/_} proxy=()
  if [ -n "${metrics_port[$1]:-}" ]; then proxy=("$f-proxy-before" "$f-proxy-after"); fi
  "$PY" bench/answers.py "$1" 34 "$f-triton-before" "$f-triton-after" "${proxy[@]}"
}
# LABEL COMMAND...: one turn, its answers checked by the counts read just before and after it (not while timed)
turn() {
  local label=$1; shift
  pages "$label" before; "$@"; pages "$label" after; answers "$label"
}
contestant() { if [ "$1" = nginx ]; then turn nginx nginx; else turn "$1" ours_turn "$1"; fi; }
everyone=(nginx "${labels[@]}")
{
  turn direct direct
  for round in $(seq 1 "$rounds"); do
    [ "$rounds" -gt 1 ] && echo "# round $round"
    # who goes first rotates (with nginx and one proxy: alternates), so a drifting load weighs on all alike
    n=${#everyone[@]}
    for i in $(seq 0 $((n - 1))); do contestant "${everyone[$(( (i + round - 1) % n ))]}"; done
  done
} | tee "$run/lines"
echo "tritonshare proxy RSS after load: $(( $(rss "$proxy") / 1024 )) MiB (peak $(( $(hwm "$proxy") / 1024 )) MiB)"
if [ "$rounds" -gt 1 ]; then "$PY" bench/proxy_summary.py <"$run/lines"; else "$PY" bench/proxy_summary.py --answers <"$run/lines"; fi
