#!/usr/bin/env bash
# Benchmark: idemproxy against a plain nginx reverse proxy, both in front of the same static
# nginx upstream on loopback. Measures
#   - nginx:        POST through a plain nginx proxy (the baseline),
#   - replay:       POSTs that all carry one key (every answer a stored replay),
#   - first write:  POSTs with a fresh key each (reserve durably, forward, store durably),
#   - first write with an entity per customer (adds the entity lock).
# Usage: bench/run.sh [seconds] [connections]. Needs wrk and nginx (apt-get install wrk nginx).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-10}
CONN=${2:-32}
THREADS=2
WORK=$(mktemp -d /tmp/idemproxy-bench.XXXXXX)
trap 'kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true; nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true' EXIT

command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk"; exit 1; }
command -v nginx >/dev/null || { echo "nginx is missing: apt-get install nginx"; exit 1; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
UP=$(free_port); NGX=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)

mkdir -p "$WORK/logs"
cat > "$WORK/nginx.conf" <<NGINX
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  upstream api { server 127.0.0.1:$UP; keepalive 64; }
  # The upstream: a fixed JSON answer to any method.
  server {
    listen 127.0.0.1:$UP;
    location / { default_type application/json; return 200 '{"id":"ch_1","status":"succeeded"}'; }
  }
  # The baseline: a plain reverse proxy with pooled upstream connections.
  server {
    listen 127.0.0.1:$NGX;
    location /api/ {
      proxy_pass http://api/;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
NGINX
nginx -p "$WORK" -c "$WORK/nginx.conf"

cat > "$WORK/proxy.toml" <<TOML
[server]
listen = "127.0.0.1:$PROXY"
admin_listen = "127.0.0.1:$ADMIN"
[store]
url = "sqlite://$WORK/idemproxy.db"
[upstreams.api]
url = "http://127.0.0.1:$UP"
prefix = "/api"
[[routes]]
name = "charges"
upstream = "api"
methods = ["POST"]
path = "/v1/charges"
[[routes]]
name = "charges-by-customer"
upstream = "api"
methods = ["POST"]
path = "/v2/charges"
entity = "customer:{body.customer}"
TOML

cargo build --release -q
RUST_LOG=warn ./target/release/idemproxy serve --config "$WORK/proxy.toml" 2>"$WORK/idemproxy.log" &
echo $! > "$WORK/idemproxy.pid"
for _ in $(seq 100); do curl -fs "http://127.0.0.1:$ADMIN/healthz" >/dev/null && break; sleep 0.1; done

run() { # id label url script
  local id=$1; shift
  local out
  out=$(wrk -t$THREADS -c"$CONN" -d"${DUR}s" --latency -s "$3" "$2")
  local rps p50 p99 errors
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  errors=$(echo "$out" | awk '/Non-2xx/ {print $5}')
  printf '%-34s %12s req/s   p50 %8s   p99 %8s   non-2xx %s\n' "$1" "$rps" "$p50" "$p99" "${errors:-0}"
  echo "$rps" > "$WORK/$id.rps"
}

sed 's#/api/v1/charges#/api/v2/charges#' bench/first_write.lua > "$WORK/first_write_entity.lua"
echo "wrk: $THREADS threads, $CONN connections, ${DUR}s each; $(nproc) cores"
run nginx "nginx proxy (POST)" "http://127.0.0.1:$NGX/api/v1/charges" bench/replay.lua
curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-replay-1' \
  -d '{"amount":100,"currency":"usd","customer":"cus_1"}' "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
run replay "idemproxy replay" "http://127.0.0.1:$PROXY/api/v1/charges" bench/replay.lua
run first "idemproxy first write" "http://127.0.0.1:$PROXY/api/v1/charges" bench/first_write.lua
run entity "idemproxy first write + entity" "http://127.0.0.1:$PROXY/api/v2/charges" "$WORK/first_write_entity.lua"

python3 - "$WORK" <<'PY'
import sys, pathlib
w = pathlib.Path(sys.argv[1])
r = lambda n: float((w / n).read_text())
base = r("nginx.rps")
print(f"\nreplay / nginx:       {r('replay.rps') / base:5.2f}x  (goal > 1)")
print(f"first write / nginx:  {r('first.rps') / base:5.2f}x  (goal >= 0.5)")
PY
curl -fs "http://127.0.0.1:$ADMIN/metrics" | grep -E '^idemproxy_(forwards|replays|store_errors|audit_dropped)_total' || true
# Memory after every workload: every first write above is a stored key, its answer cached.
KEYS=$(curl -fs "http://127.0.0.1:$ADMIN/metrics" | awk '/^idemproxy_forwards_total/ {print $2}')
echo "idemproxy RSS after ${KEYS:-?} stored keys: $(( $(ps -o rss= -p "$(cat "$WORK/idemproxy.pid")") / 1024 )) MiB"
