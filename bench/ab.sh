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
# STORE=postgres runs both on a throwaway local PostgreSQL 15 cluster (PG_BIN), each run on a
# fresh database; the CPU per request then also counts the database's (every postgres process).
set -euo pipefail
cd "$(dirname "$0")/.."
A=$(realpath "$1"); B=$(realpath "$2"); N=${3:-10}; DUR=${4:-4}; CONN=${5:-64}
SCRIPT=${6:-bench/first_write.lua}
WORK=$(mktemp -d /tmp/idemproxy-ab.XXXXXX)
chmod 755 "$WORK"
STORE=${STORE:-sqlite}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
cleanup() {
  kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true
  nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true
  [ -d "$WORK/pg" ] && runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$WORK/pg" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
. bench/lib.sh
need wrk nginx
UP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)
start_nginx "$WORK" "$UP"
if [ "$STORE" = postgres ]; then
  PGPORT=$(free_port)
  mkdir -p "$WORK/pg" && chown postgres "$WORK/pg"
  runuser -u postgres -- "$PG_BIN/initdb" -D "$WORK/pg" -A trust -U postgres >/dev/null
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$WORK/pg" -l "$WORK/pg/server.log" -w \
    -o "-p $PGPORT -k $WORK/pg -c listen_addresses=127.0.0.1" start >/dev/null
  proxy_toml "$PROXY" "$ADMIN" "url = \"postgres://postgres@127.0.0.1:$PGPORT/bench\"
scope_secret = \"bench-secret-0123456789abcdef0123456789\"" > "$WORK/proxy.toml"
else
  proxy_toml "$PROXY" "$ADMIN" "url = \"sqlite://$WORK/idemproxy.db\"" > "$WORK/proxy.toml"
fi
# STORE_EXTRA adds lines to the [store] table of both, e.g. STORE_EXTRA='answer_before_commit = true'.
if [ -n "${STORE_EXTRA:-}" ]; then
  sed -i "/^\[store\]$/a $STORE_EXTRA" "$WORK/proxy.toml"
fi
# UPSTREAM_EXTRA_B adds lines to B's [upstreams.api] only: the same binary on both sides then
# measures a setting, e.g. UPSTREAM_EXTRA_B='pace = { rate = 10000000, per = "1s" }'.
cp "$WORK/proxy.toml" "$WORK/proxy-b.toml"
if [ -n "${UPSTREAM_EXTRA_B:-}" ]; then
  sed -i "/^\[upstreams.api\]$/a $UPSTREAM_EXTRA_B" "$WORK/proxy-b.toml"
fi

# cpu_us PID: CPU time of every thread of PID so far, in µs (and of every postgres process).
cpu_us() {
  local files=("/proc/$1/stat")
  [ "$STORE" = postgres ] && for p in $(pgrep -x postgres); do files+=("/proc/$p/stat"); done
  cat "${files[@]}" 2>/dev/null | awk '{s += $14 + $15} END {print s * 1e6 / 100}'
}
# fresh: an empty store for the next run.
fresh() {
  if [ "$STORE" = postgres ]; then
    local pg=(runuser -u postgres -- "$PG_BIN/psql" -q -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres)
    "${pg[@]}" -c 'DROP DATABASE IF EXISTS bench' -c 'CREATE DATABASE bench' -c CHECKPOINT
  else
    rm -f "$WORK"/idemproxy.db*
  fi
}

measure() { # BIN CONFIG: "req/s cpu-µs-per-request" of one run on a fresh store
  fresh
  env ${PROXY_WORKERS:+TOKIO_WORKER_THREADS=$PROXY_WORKERS} RUST_LOG=warn "$1" serve --config "$2" \
    2>>"$WORK/proxy.log" &
  local pid=$!
  echo "$pid" > "$WORK/proxy.pid"
  for _ in $(seq 100); do curl -fs "http://127.0.0.1:$ADMIN/healthz" >/dev/null && break; sleep 0.1; done
  curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-replay-1' \
    -d '{"amount":100,"currency":"usd","customer":"cus_1"}' "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
  local before after out
  before=$(cpu_us "$pid")
  out=$(wrk -t"$(( CONN < 2 ? 1 : 2 ))" -c"$CONN" -d"${DUR}s" -s "$SCRIPT" "http://127.0.0.1:$PROXY/api/v1/charges")
  after=$(cpu_us "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  # p99 from the script's done() (ms), or wrk's own 99% line with --latency; 0 when neither.
  echo "$out" | awk -v cpu=$((${after%.*} - ${before%.*})) \
    '/requests in/ {n = $1} /Requests\/sec/ {r = $2} $1 == "P99" {p = $2 + 0}
     END {printf "%s %.1f %.3f\n", r, cpu / n, p}'
}

echo "A: $A"; echo "B: $B"; echo "$N pairs, $DUR s each, $CONN connections, $SCRIPT, $STORE"
for _ in $(seq "$N"); do
  echo "$(measure "$A" "$WORK/proxy.toml") $(measure "$B" "$WORK/proxy-b.toml")"
done | awk '{
    x = $4 / $1; y = $5 / $2; n++; s += x; ss += x * x; t += y; tt += y * y
    if ($3 > 0 && $6 > 0) { z = $6 / $3; q++; u += z; uu += z * z }
    printf "  A %8.0f req/s %5.1f us p99 %6.3f ms   B %8.0f req/s %5.1f us p99 %6.3f ms   B/A %.3f\n",
      $1, $2, $3, $4, $5, $6, x
  }
  END {
    if (n < 2) exit
    m = s / n; c = t / n
    printf "req/s B/A %.3f +- %.3f    CPU per request B/A %.3f +- %.3f   (mean +- standard error)\n",
      m, sqrt((ss / n - m * m) / (n - 1)), c, sqrt((tt / n - c * c) / (n - 1))
    if (q >= 2) { w = u / q
      printf "p99 B/A %.3f +- %.3f\n", w, sqrt((uu / q - w * w) / (q - 1)) }
  }'
