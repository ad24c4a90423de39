#!/usr/bin/env bash
# The floor under a replay, beside nginx, in one run: the same POST (bench/replay.lua) through
#   - nginx proxy_pass to the static nginx upstream (the baseline of bench/run.sh),
#   - idemproxy, every answer a replay of one key (SQLite store, its default workers),
#   - examples/floor.rs: hyper answering a fixed JSON with none of the proxy's work, on 1 and
#     on 2 tokio workers,
# alternating N rounds, each row with its server side's CPU per request (from /proc). What the
# floor costs is hyper's and the kernel's; a replay's cost above it is the proxy's own.
# Usage: bench/floor.sh [rounds] [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-3}; DUR=${2:-6}; CONN=${3:-64}
WORK=$(mktemp -d /tmp/idemproxy-floor.XXXXXX)
chmod 755 "$WORK"
cleanup() {
  kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true
  nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
. bench/lib.sh
need wrk nginx
UP=$(free_port); NGX=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)
FLOOR1=$(free_port); FLOOR2=$(free_port)
start_nginx "$WORK" "$UP" "$(nginx_proxy "$UP" "$NGX")"
cargo build --release -q --bin idemproxy --example floor
proxy_toml "$PROXY" "$ADMIN" "url = \"sqlite://$WORK/idemproxy.db\"" > "$WORK/proxy.toml"
serve idemproxy "$WORK/proxy.toml" "$ADMIN"
TOKIO_WORKER_THREADS=1 ./target/release/examples/floor "127.0.0.1:$FLOOR1" & echo $! > "$WORK/floor1.pid"
TOKIO_WORKER_THREADS=2 ./target/release/examples/floor "127.0.0.1:$FLOOR2" & echo $! > "$WORK/floor2.pid"
for port in $FLOOR1 $FLOOR2; do
  for _ in $(seq 100); do curl -fs -X POST "http://127.0.0.1:$port/" >/dev/null && break; sleep 0.1; done
done
curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-replay-1' \
  -d '{"amount":100,"currency":"usd","customer":"cus_1"}' "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null

ticks() { cat "/proc/$1/stat" | awk '{print $14 + $15}'; }
# row NAME PID PORT: one wrk run; "NAME req/s cpu-µs-per-request"
row() {
  local before after out
  before=$(ticks "$2")
  out=$(wrk -t2 -c"$CONN" -d"${DUR}s" -s bench/replay.lua "http://127.0.0.1:$3/api/v1/charges")
  after=$(ticks "$2")
  echo "$out" | awk -v name="$1" -v cpu=$(( (after - before) * 1000000 / $(getconf CLK_TCK) )) \
    '/requests in/ {n = $1} /Requests\/sec/ {r = $2} END {printf "%s %.0f %.1f\n", name, r, cpu / n}'
}
NGINX_PID=$(pgrep -f "nginx: worker process" -P "$(cat "$WORK/nginx.pid")" | head -1)
echo "$N rounds, $DUR s each, $CONN connections, bench/replay.lua"
for _ in $(seq "$N"); do
  row nginx "$NGINX_PID" "$NGX"
  row replay "$(cat "$WORK/idemproxy.pid")" "$PROXY"
  row floor-1 "$(cat "$WORK/floor1.pid")" "$FLOOR1"
  row floor-2 "$(cat "$WORK/floor2.pid")" "$FLOOR2"
done | awk '{r[$1] = r[$1] " " $2; c[$1] = c[$1] " " $3; if ($1 == "nginx") base = $2; else x[$1] = x[$1] sprintf(" %.2f", $2 / base)}
  END {
    for (k in r) printf "%-8s req/s%s   CPU us/req%s   x nginx%s\n", k, r[k], c[k], x[k]
  }' | sort
