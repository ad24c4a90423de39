#!/usr/bin/env bash
# Paired A/B of two proxy binaries on one workload: A then B, each on a fresh SQLite store in
# front of the same nginx upstream, N times; prints each pair and the mean of the paired ratios
# (B/A) of req/s and of the proxy's CPU per request (utime+stime of all its threads, from
# /proc), with their standard errors. On this shared VM a single run's speed drifts by 10-20%
# within minutes; pairing run by run cancels most of the drift, so a few percent can be told
# from noise with N of 10-20.
# Usage: bench/ab.sh BIN_A BIN_B [N] [seconds] [connections] [script]
#   e.g. git worktree add /tmp/base HEAD~1 && (cd /tmp/base && cargo build --release)
#        bench/ab.sh /tmp/base/target/release/idemproxy target/release/idemproxy 12
# The script defaults to bench/first_write.lua (bench/replay.lua: replays of one key).
set -euo pipefail
cd "$(dirname "$0")/.."
A=$(realpath "$1"); B=$(realpath "$2"); N=${3:-10}; DUR=${4:-4}; CONN=${5:-64}
SCRIPT=${6:-bench/first_write.lua}
WORK=$(mktemp -d /tmp/idemproxy-ab.XXXXXX)
chmod 755 "$WORK"
cleanup() {
  kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true
  nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
. bench/lib.sh
need wrk nginx
UP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)
start_nginx "$WORK" "$UP"
proxy_toml "$PROXY" "$ADMIN" "url = \"sqlite://$WORK/idemproxy.db\"" > "$WORK/proxy.toml"

# cpu_us PID: CPU time of every thread of PID so far, in µs.
cpu_us() { awk '{print ($14 + $15) * 1e6 / 100}' "/proc/$1/stat"; }

measure() { # BIN: "req/s cpu-µs-per-request" of one run on a fresh store
  rm -f "$WORK"/idemproxy.db*
  TOKIO_WORKER_THREADS=${PROXY_WORKERS:-$(nproc)} RUST_LOG=warn "$1" serve --config "$WORK/proxy.toml" \
    2>>"$WORK/proxy.log" &
  local pid=$!
  echo "$pid" > "$WORK/proxy.pid"
  for _ in $(seq 100); do curl -fs "http://127.0.0.1:$ADMIN/healthz" >/dev/null && break; sleep 0.1; done
  curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-replay-1' \
    -d '{"amount":100,"currency":"usd","customer":"cus_1"}' "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
  local before after out
  before=$(cpu_us "$pid")
  out=$(wrk -t2 -c"$CONN" -d"${DUR}s" -s "$SCRIPT" "http://127.0.0.1:$PROXY/api/v1/charges")
  after=$(cpu_us "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$out" | awk -v cpu=$((${after%.*} - ${before%.*})) \
    '/requests in/ {n = $1} /Requests\/sec/ {r = $2} END {printf "%s %.1f\n", r, cpu / n}'
}

echo "A: $A"; echo "B: $B"; echo "$N pairs, $DUR s each, $CONN connections, $SCRIPT"
for _ in $(seq "$N"); do
  echo "$(measure "$A") $(measure "$B")"
done | awk '{
    x = $3 / $1; y = $4 / $2; n++; s += x; ss += x * x; t += y; tt += y * y
    printf "  A %8.0f req/s %5.1f us   B %8.0f req/s %5.1f us   B/A %.3f\n", $1, $2, $3, $4, x
  }
  END {
    if (n < 2) exit
    m = s / n; c = t / n
    printf "req/s B/A %.3f +- %.3f    CPU per request B/A %.3f +- %.3f   (mean +- standard error)\n",
      m, sqrt((ss / n - m * m) / (n - 1)), c, sqrt((tt / n - c * c) / (n - 1))
  }'
