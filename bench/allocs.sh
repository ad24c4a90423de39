#!/usr/bin/env bash
# Allocations per request: the proxy built as examples/allocs.rs (every alloc and realloc of the
# process counted, then passed to mimalloc) in front of a static nginx upstream, driven by wrk
# for each workload; the count before and after, over the requests wrk completed. Workloads: a
# POST passthrough (no route: hyper's server and client alone), a GET forward, a replay, and
# first writes (SQLite), with and without an entity. The serving threads, the writer and the
# auditor are all counted: what one request costs the whole process.
# Usage: bench/allocs.sh [seconds=4] [connections=16]. Needs wrk and nginx.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-4}
CONN=${2:-16}
WORK=$(mktemp -d /tmp/idemproxy-allocs.XXXXXX)
chmod 755 "$WORK"
cleanup() {
  kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true
  nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true
  rm -rf "$WORK" 2>/dev/null || true
}
trap cleanup EXIT
. bench/lib.sh
need wrk nginx
cargo build --release -q --example allocs
UP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)
start_nginx "$WORK" "$UP"
{ proxy_toml "$PROXY" "$ADMIN" "url = \"sqlite://$WORK/allocs.db\""
  printf '[upstreams.raw]\nurl = "http://127.0.0.1:%s"\nprefix = "/raw"\nunmatched = "passthrough"\n' "$UP"
} > "$WORK/proxy.toml"
IDEMPROXY_ALLOC_FILE="$WORK/count" RUST_LOG=warn ./target/release/examples/allocs serve --config "$WORK/proxy.toml" 2>>"$WORK/proxy.log" &
echo $! > "$WORK/proxy.pid"
for _ in $(seq 100); do curl -fs "http://127.0.0.1:$ADMIN/healthz" >/dev/null && break; sleep 0.1; done
curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-replay-1' \
  -d '{"amount":100,"currency":"usd","customer":"cus_1"}' "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
sed 's#/api/v1/charges#/api/v2/charges#' bench/first_write.lua > "$WORK/first_write_entity.lua"
sed 's#/api/v1/charges#/raw/v1/charges#' bench/replay.lua > "$WORK/passthrough.lua"
count() { sleep 0.2; cut -d' ' -f1 "$WORK/count"; }
measure() { # label url script
  local before after n
  before=$(count)
  n=$(wrk -t2 -c"$CONN" -d"${DUR}s" -s "$3" "$2" | awk '/requests in/ {print $1}')
  after=$(count)
  awk -v a="$after" -v b="$before" -v n="$n" -v l="$1" \
    'BEGIN {printf "%-40s %9d requests   %6.1f allocations a request\n", l, n, (a - b) / n}'
}
echo "wrk: 2 threads, $CONN connections, ${DUR}s each"
measure "POST passthrough (no route)" "http://127.0.0.1:$PROXY/raw/v1/charges" "$WORK/passthrough.lua"
measure "GET forward (unprotected)" "http://127.0.0.1:$PROXY/api/v1/charges" bench/get.lua
measure "replay" "http://127.0.0.1:$PROXY/api/v1/charges" bench/replay.lua
measure "first write (SQLite)" "http://127.0.0.1:$PROXY/api/v1/charges" bench/first_write.lua
measure "first write + entity (SQLite)" "http://127.0.0.1:$PROXY/api/v2/charges" "$WORK/first_write_entity.lua"
