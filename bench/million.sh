#!/usr/bin/env bash
# The "a million keys" figures, on the SQLite store:
#   - first-write latency (p99 and max over a window that spans a retention purge) with 10k
#     and with 1M stored keys (and as many versioned entities, 5% of keys past retention so
#     the purge has work), at a light load of 4 connections;
#   - replays that miss the replay cache (random keys among the million) beside replays that
#     hit it (one key): req/s and the proxy's CPU per replay (utime+stime from /proc);
#   - replays of keys drawn uniformly from the 10k and from all (8 connections): p50, p99, p99.9;
#   - the proxy's RSS after each phase, beside the replay cache's limit.
# The keys are written straight into the database (a bulk INSERT while the proxy is stopped),
# with the scope and fingerprint of a probe request, so they replay like keys the proxy stored.
# Usage: bench/million.sh [keys] [window seconds]. Needs wrk, nginx, sqlite3.
set -euo pipefail
cd "$(dirname "$0")/.."
KEYS=${1:-1000000}
WINDOW=${2:-75}
WORK=$(mktemp -d /tmp/idemproxy-million.XXXXXX)
cleanup() {
  kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true
  nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true
  # Each run leaves a store of hundreds of MB (a million keys: 1 GB): keep KEEP=1 to look.
  [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT
. bench/lib.sh
need wrk nginx sqlite3
UP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)
start_nginx "$WORK" "$UP"
DB="$WORK/idemproxy.db"
proxy_toml "$PROXY" "$ADMIN" "url = \"sqlite://$DB\"
retention = \"24h\"" > "$WORK/proxy.toml"
cargo build --release -q
BODY='{"amount":100,"currency":"usd","customer":"cus_1"}'
stop() { kill "$(cat "$WORK/proxy.pid")"; while kill -0 "$(cat "$WORK/proxy.pid")" 2>/dev/null; do sleep 0.1; done; rm "$WORK/proxy.pid"; }
rss() { awk '/VmRSS/ {printf "%.0f MiB", $2/1024}' "/proc/$(cat "$WORK/proxy.pid")/status"; }
cpu_ticks() { awk '{print $14+$15}' "/proc/$(cat "$WORK/proxy.pid")/stat"; }
# Adds keys pre-<from>..pre-<to> (5% past retention) and versioned entities, as the probe's.
fill() { # from to
  stop
  sqlite3 "$DB" >/dev/null <<SQL
PRAGMA journal_mode=WAL;
BEGIN;
WITH RECURSIVE n(i) AS (SELECT $1 UNION ALL SELECT i + 1 FROM n WHERE i < $2),
probe AS (SELECT scope, fingerprint, headers, body FROM idem_keys WHERE key = 'probe')
INSERT INTO idem_keys (upstream, scope, key, fingerprint, route, entities, state, lease_until, epoch,
  attempts, status, headers, body, created_at, updated_at, expires_at)
SELECT 'api', probe.scope, 'pre-' || i, probe.fingerprint, 'charges', '[]', 'completed', 0, 1, 1, 200,
  probe.headers, probe.body, 0, 0,
  CASE WHEN i % 20 = 0 THEN ${EXPIRED_AT:-1} ELSE 9999999999999 END FROM n, probe;
WITH RECURSIVE n(i) AS (SELECT $1 UNION ALL SELECT i + 1 FROM n WHERE i < $2)
INSERT INTO idem_entities (entity, version, updated_at) SELECT 'customer:' || i || '@0123456789abcdef', i, 0 FROM n;
COMMIT;
PRAGMA wal_checkpoint(TRUNCATE);
SQL
  serve proxy "$WORK/proxy.toml" "$ADMIN"
}
window() { # label: first writes at 4 connections for WINDOW seconds (a purge runs every 60 s)
  local out
  # A short warm-up first (connection pools, prepared statements), not counted.
  wrk -t2 -c4 -d3s -s bench/first_write.lua "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
  out=$(wrk -t2 -c4 -d"${WINDOW}s" --latency -s bench/first_write.lua "http://127.0.0.1:$PROXY/api/v1/charges")
  printf '%-28s %9s req/s   p99 %9s   max %9s   RSS %s\n' "$1" \
    "$(echo "$out" | awk '/Requests\/sec/ {print $2}')" "$(echo "$out" | awk '$1=="99%" {print $2}')" \
    "$(echo "$out" | awk '/Latency/ {print $4; exit}')" "$(rss)"
}
replays() { # label script
  local before after out rps
  before=$(cpu_ticks)
  out=$(wrk -t2 -c32 -d10s -s "$2" "http://127.0.0.1:$PROXY/api/v1/charges")
  after=$(cpu_ticks)
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  local n; n=$(echo "$out" | awk '/requests in/ {print $1}')
  printf '%-28s %9s req/s   CPU %6.0f us/replay   RSS %s\n' "$1" "$rps" \
    "$(echo "($after - $before) * 10000 / $n" | bc -l)" "$(rss)"
}
cat > "$WORK/miss.lua" <<LUA
-- Replays of random pre-filled keys: almost every one misses the replay cache.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '$BODY'
math.randomseed(os.time())
function request()
  wrk.headers["Idempotency-Key"] = "pre-" .. math.random(1, $KEYS)
  return wrk.format()
end
LUA

# Replays of keys drawn uniformly from pre-1..pre-N (the 5% past retention skipped: those would
# be first writes), as a new user's test would: at 8 connections, with the tail.
uniform_lua() { # n
  cat <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '$BODY'
function request()
  local k = math.random(1, $1)
  if k % 20 == 0 then k = k - 1 end
  wrk.headers["Idempotency-Key"] = "pre-" .. k
  return wrk.format()
end
function done(summary, latency, requests)
  for _, p in ipairs({50, 99, 99.9}) do
    io.write(string.format("P%s %.3fms\n", p, latency:percentile(p) / 1000))
  end
end
LUA
}
uniform() { # label n
  uniform_lua "$2" > "$WORK/uniform.lua"
  wrk -t2 -c8 -d3s -s "$WORK/uniform.lua" "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
  local out
  out=$(wrk -t2 -c8 -d10s -s "$WORK/uniform.lua" "http://127.0.0.1:$PROXY/api/v1/charges")
  printf '%-28s %9s req/s   p50 %9s   p99 %9s   p99.9 %9s\n' "$1" \
    "$(echo "$out" | awk '/Requests\/sec/ {print $2}')" "$(echo "$out" | awk '$1=="P50" {print $2}')" \
    "$(echo "$out" | awk '$1=="P99" {print $2}')" "$(echo "$out" | awk '$1=="P99.9" {print $2}')"
}

serve proxy "$WORK/proxy.toml" "$ADMIN"
curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: probe' -d "$BODY" \
  "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
echo "$(nproc) cores; first writes at 4 connections for ${WINDOW}s per line (spans a purge)"
printf '%-28s RSS %s\n' "started" "$(rss)"
fill 1 10000
window "10k stored keys"
uniform "replay, uniform over 10k" 10000
fill 10001 "$KEYS"
window "$KEYS stored keys"
uniform "replay, uniform over $KEYS" "$KEYS"
curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: probe' -d "$BODY" \
  "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
replays "replay, cache hit" bench/replay.lua
replays "replay, cache miss" "$WORK/miss.lua"
replays "replay, cache miss (again)" "$WORK/miss.lua"
echo "replay cache limit: 64 MiB; store: $(du -h "$DB" | cut -f1) + WAL $(du -h "$DB-wal" 2>/dev/null | cut -f1)"
