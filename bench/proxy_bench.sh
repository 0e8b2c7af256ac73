#!/usr/bin/env bash
# The proxy yardstick in one run: real Triton, then the same REST (wrk) and gRPC (h2load) load direct to
# Triton, through nginx (the baseline), and through `tritonshare proxy`; CPU µs per request of each proxy
# process, rps, latency; and the proxy's RSS idle and after load.
# usage: bench/proxy_bench.sh [SECONDS]      (needs scripts/setup.sh; uses ../shared/bench)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
yard=${TRITONSHARE_YARDSTICK:-$(cd ../shared/bench && pwd)}
root=$(pwd)
run=$(mktemp -d /tmp/tritonshare-bench.XXXXXX)
mkdir -p "$run/models" "$run/staging"
cp -r "$yard/models/identity" "$run/models/"
# as the loader does: keep the Python backend from writing __pycache__ into the model (POLL would reload it)
touch "$run/models/identity/1/__pycache__"
port() { "$root/.venv/bin/python" -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
th=$(port) tg=$(port) tm=$(port) nh=$(port) ng=$(port) ph=$(port) pg=$(port) pm=$(port)
pids=()
cleanup() {
  [ -f "$run/nginx/nginx.pid" ] && kill -QUIT "$(cat "$run/nginx/nginx.pid")" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -n "${triton:-}" ] && kill -- "-$triton" 2>/dev/null || true
  sleep 0.5; rm -rf "$run"
}
trap cleanup EXIT
triton=$(bash "$yard/triton-up.sh" "$root/.venv-triton" "$run/models" "$th" "$tg" "$tm" "$run/triton.log")
for _ in $(seq 1 120); do
  curl -fs "http://127.0.0.1:$th/v2/models/identity/ready" >/dev/null 2>&1 && break; sleep 0.25
done
nginx_pids=$(bash "$yard/nginx-up.sh" "$run/nginx" identity "$th" "$tg" "$nh" "$ng")
"$root/.venv/bin/tritonshare" --log-level warning proxy --name identity --host 127.0.0.1 \
  --triton-url "http://127.0.0.1:$th" --triton-grpc "127.0.0.1:$tg" \
  --http-port "$ph" --grpc-port "$pg" --metrics-port "$pm" --no-unload \
  --repository "$run/models" --staging "$run/staging" 2>"$run/proxy.log" &
proxy=$!; pids+=("$proxy")
for _ in $(seq 1 60); do curl -fs "http://127.0.0.1:$ph/v2/health/live" >/dev/null 2>&1 && break; sleep 0.1; done
rss() { awk '/^VmRSS/{print $2}' "/proc/$1/status"; }
hwm() { awk '/^VmHWM/{print $2}' "/proc/$1/status"; }
echo "# $(date -u +%FT%TZ) $(nproc) cores, ${secs}s per point; CPU = utime+stime of the proxy process(es)"
echo "tritonshare proxy idle RSS: $(( $(rss "$proxy") / 1024 )) MiB"
export PY="$root/.venv/bin/python"
bash "$yard/proxy-bench.sh" direct identity "$th" "$tg" "$secs"
bash "$yard/proxy-bench.sh" nginx identity "$nh" "$ng" "$secs" $nginx_pids
bash "$yard/proxy-bench.sh" ours identity "$ph" "$pg" "$secs" "$proxy"
echo "tritonshare proxy RSS after load: $(( $(rss "$proxy") / 1024 )) MiB (peak $(( $(hwm "$proxy") / 1024 )) MiB)"
