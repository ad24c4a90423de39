#!/usr/bin/env bash
# Benchmark: idemproxy beside a plain nginx reverse proxy, both in front of the same static
# nginx upstream on loopback, in one run, on the SQLite store and (when PostgreSQL 15's
# binaries are here) on a throwaway local PostgreSQL cluster. Prints the table of the speed goals (docs/benchmark.md):
#   - nginx:        POST through a plain nginx proxy (the baseline),
#   - replay:       POSTs that all carry one key (every answer a stored replay),
#   - first write:  POSTs with a fresh key each (reserve durably, forward, store durably),
#                   at CONN connections and at 1 connection (p50 beside the upstream's own),
#   - first write with an entity per customer (adds the entity lock), on both stores.
#   - forward alone: a GET no route protects, through nginx and through the proxy: hyper's
#                   server and client with none of the proxy's own work, the ceiling of the rest.
# Each row also gives the server side's CPU per request, from /proc: the proxy's threads (and,
# on PostgreSQL, the database's processes), or for the nginx rows nginx's one worker, which
# serves both the baseline proxy and the upstream. A ratio depends on how much of the two cores
# wrk and the upstream take on the machine at hand; the CPU per request says what a workload
# itself costs.
# Usage: bench/run.sh [seconds] [connections]. Needs wrk and nginx (apt-get install wrk nginx).
# RUNS=N repeats the whole set N times (the same proxies, their stores growing) and prints each
# row's median: every ratio is still taken within one run, beside that run's nginx. This VM's
# speed drifts by 10-20% within minutes, so one run is one sample.
# WRK_SCHED=batch runs wrk under SCHED_BATCH (chrt -b), for every row alike: the load generator
# then no longer preempts the server it has just been answered by. With wrk at the default
# policy, every response the proxy writes wakes a wrk thread that takes the proxy's core at
# once (~4k times a second at 64 connections); nginx, one process serving both the baseline
# proxy and its upstream, is hit far less. In production the clients are not on the proxy's
# cores, so this shows what the co-located load generator costs; the goals' table is measured
# with the default policy (see docs/benchmark.md, "Rules").
# STORE_EXTRA adds lines to both proxies' [store] table, e.g.
#   STORE_EXTRA="encryption_key = \"$(openssl rand -base64 32)\"" bench/run.sh
# to measure with stored answers encrypted.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-8}
CONN=${2:-64}
RUNS=${RUNS:-1}
THREADS=2
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
WORK=$(mktemp -d /tmp/idemproxy-bench.XXXXXX)
chmod 755 "$WORK"
cleanup() {
  kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true
  nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true
  [ -d "$WORK/pg" ] && runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$WORK/pg" -m immediate stop >/dev/null 2>&1 || true
  # Each run leaves a store of hundreds of MB (a million keys: 1 GB): keep KEEP=1 to look.
  [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT

. bench/lib.sh
need wrk nginx
# The command that runs wrk, as words (chrt comes with util-linux).
case "${WRK_SCHED:-other}" in
  other) WRK=(wrk) ;;
  batch) WRK=(chrt -b 0 wrk) ;;
  *) echo "WRK_SCHED is other or batch" >&2; exit 2 ;;
esac
UP=$(free_port); NGX=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)
PGPORT=$(free_port); PGPROXY=$(free_port); PGADMIN=$(free_port)
# The baseline: a plain reverse proxy with pooled upstream connections.
start_nginx "$WORK" "$UP" "$(nginx_proxy "$UP" "$NGX")"

proxy_toml "$PROXY" "$ADMIN" "url = \"sqlite://$WORK/idemproxy.db\"
${STORE_EXTRA:-}" > "$WORK/proxy.toml"

cargo build --release -q
serve idemproxy "$WORK/proxy.toml" "$ADMIN"

HAVE_PG=0
if [ -x "$PG_BIN/initdb" ] && id postgres >/dev/null 2>&1; then
  mkdir -p "$WORK/pg" && chown postgres "$WORK/pg"
  runuser -u postgres -- "$PG_BIN/initdb" -D "$WORK/pg" -A trust -U postgres >/dev/null
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$WORK/pg" -l "$WORK/pg/server.log" -w \
    -o "-p $PGPORT -k $WORK/pg -c listen_addresses=127.0.0.1" start >/dev/null
  proxy_toml "$PGPROXY" "$PGADMIN" "url = \"postgres://postgres@127.0.0.1:$PGPORT/postgres\"
scope_secret = \"bench-secret-0123456789abcdef0123456789\"
${STORE_EXTRA:-}" > "$WORK/pg.toml"
  serve idemproxy-pg "$WORK/pg.toml" "$PGADMIN"
  HAVE_PG=1
fi

# The disk made quiet before each workload: PostgreSQL's dirty buffers written now (a
# CHECKPOINT) and the kernel's writeback drained (sync). Without it, what one workload leaves
# for later lands in another's window: PostgreSQL's checkpointer and the kernel write its
# buffers out tens of seconds after its load, in the next run's SQLite first writes (the
# second of three runs was the slowest in four of five sets; without PostgreSQL, no dip).
# Each workload still pays for its own commits and fsyncs, inside its own window.
settle() {
  if [ "$HAVE_PG" = 1 ]; then
    runuser -u postgres -- "$PG_BIN/psql" -q -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres \
      -c CHECKPOINT >/dev/null 2>&1 || true
  fi
  sync
}

# cpu_ticks PID...: CPU time (user + system, clock ticks) of every thread of each process.
cpu_ticks() {
  local p files=()
  for p in "$@"; do files+=("/proc/$p/stat"); done
  # A process may be gone by now (a PostgreSQL backend whose connection closed): not an error.
  { cat "${files[@]}" 2>/dev/null || true; } | awk '{s += $14 + $15} END {print s + 0}'
}
# The processes whose CPU a workload's row reports: the proxy that serves its URL (and, for
# PostgreSQL, every postgres process), or nginx (both the proxy and its upstream: one worker).
served_by() {
  case "$1" in
    *":$PROXY/"*) cat "$WORK/idemproxy.pid" ;;
    *":$PGPROXY/"*) cat "$WORK/idemproxy-pg.pid"; pgrep -x postgres || true ;;
    *) cat "$WORK/nginx.pid"; pgrep -P "$(cat "$WORK/nginx.pid")" || true ;;
  esac
}

run() { # id label url script
  local id=$1; shift
  local out pids before after
  settle
  pids=$(served_by "$2")
  # shellcheck disable=SC2086
  before=$(cpu_ticks $pids)
  out=$("${WRK[@]}" -t$THREADS -c"$CONN" -d"${DUR}s" --latency -s "$3" "$2")
  # shellcheck disable=SC2086
  after=$(cpu_ticks $pids)
  local rps p50 p99 p999 errors n cpu
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  # From the scripts' done(): wrk's own percentiles stop at the 99th.
  p999=$(echo "$out" | awk '$1=="P99.9" {print $2}')
  errors=$(echo "$out" | awk '/Non-2xx/ {print $5}')
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  # The server side's CPU per request (µs): what each workload costs,
  # whatever share of the two cores wrk leaves it.
  cpu=$(awk -v t=$((after - before)) -v n="$n" -v hz="$(getconf CLK_TCK)" \
    'BEGIN {printf "%.1f", (n > 0 ? t * 1e6 / hz / n : 0)}')
  printf '%-34s %12s req/s   p50 %8s   p99 %8s   p99.9 %9s   CPU %6s us/req   non-2xx %s\n' "$1" "$rps" "$p50" "$p99" "${p999:-?}" "$cpu" "${errors:-0}"
  echo "$rps" > "$WORK/$id.$RUN.rps"
  echo "$p50" > "$WORK/$id.$RUN.p50"
  echo "$p99" > "$WORK/$id.$RUN.p99"
  echo "${p999:-}" > "$WORK/$id.$RUN.p999"
  echo "$cpu" > "$WORK/$id.$RUN.cpu"
}
one() { # id label url: one connection, the p50 is what counts
  local saved=$CONN saved_t=$THREADS
  CONN=1; THREADS=1
  run "$@"
  CONN=$saved; THREADS=$saved_t
}

sed 's#/api/v1/charges#/api/v2/charges#' bench/first_write.lua > "$WORK/first_write_entity.lua"
echo "wrk: $THREADS threads, $CONN connections, ${DUR}s each, scheduling policy ${WRK_SCHED:-other}; $(nproc) cores; nginx: 1 worker; idemproxy: ${PROXY_WORKERS:-its default number of} workers (PROXY_WORKERS)"
curl -fs -X POST -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-replay-1' \
  -d '{"amount":100,"currency":"usd","customer":"cus_1"}' "http://127.0.0.1:$PROXY/api/v1/charges" >/dev/null
for RUN in $(seq "$RUNS"); do
  [ "$RUNS" = 1 ] || echo "-- run $RUN of $RUNS"
  run nginx "nginx proxy (POST)" "http://127.0.0.1:$NGX/api/v1/charges" bench/replay.lua
  run replay "idemproxy replay" "http://127.0.0.1:$PROXY/api/v1/charges" bench/replay.lua
  run nginxget "nginx proxy (GET)" "http://127.0.0.1:$NGX/api/v1/charges" bench/get.lua
  run forward "idemproxy forward (GET, unprotected)" "http://127.0.0.1:$PROXY/api/v1/charges" bench/get.lua
  run first "idemproxy first write" "http://127.0.0.1:$PROXY/api/v1/charges" bench/first_write.lua
  run entity "idemproxy first write + entity" "http://127.0.0.1:$PROXY/api/v2/charges" "$WORK/first_write_entity.lua"
  one direct1 "upstream direct, 1 conn" "http://127.0.0.1:$UP/api/v1/charges" bench/first_write.lua
  one first1 "idemproxy first write, 1 conn" "http://127.0.0.1:$PROXY/api/v1/charges" bench/first_write.lua
  if [ "$HAVE_PG" = 1 ]; then
    run pgfirst "idemproxy first write (PostgreSQL)" "http://127.0.0.1:$PGPROXY/api/v1/charges" bench/first_write.lua
    run pgentity "  ... + entity lock (PostgreSQL)" "http://127.0.0.1:$PGPROXY/api/v2/charges" "$WORK/first_write_entity.lua"
    one pgfirst1 "  ... 1 conn (PostgreSQL)" "http://127.0.0.1:$PGPROXY/api/v1/charges" bench/first_write.lua
  fi
done

python3 - "$WORK" "$CONN" "$RUNS" <<'PY'
import sys, pathlib, statistics
w, conn, runs = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def r(n, i):
    p = w / f"{n}.{i}.rps"
    return float(p.read_text()) if p.exists() else None
def ms(n, i, pct="p50"):
    p = w / f"{n}.{i}.{pct}"
    if not p.exists():
        return None
    t = p.read_text().strip()
    for unit, f in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * f
    return None
def cpu(n, i):
    p = w / f"{n}.{i}.cpu"
    return float(p.read_text()) if p.exists() else None
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
each = range(1, runs + 1)
bases = [r("nginx", i) for i in each]
label = "" if runs == 1 else f" (median of {runs} runs)"
print(f"\n| workload{label} | nginx proxy_pass | idemproxy | goal |\n|---|---|---|---|")
for name, key, goal in ((f"replay, {conn} connections", "replay", ">= 1.5x nginx"),
                        (f"first write, {conn} connections, SQLite", "first", ">= 0.5x nginx"),
                        (f"first write + entity lock, {conn} connections, SQLite", "entity", "(none)"),
                        (f"first write, {conn} connections, PostgreSQL", "pgfirst", ">= 0.3x nginx"),
                        (f"first write + entity lock, {conn} connections, PostgreSQL", "pgentity", "(none)")):
    vals = [r(key, i) for i in each]
    ratios = [v / b if v is not None else None for v, b in zip(vals, bases)]
    m = med(ratios)
    cell = "not run" if m is None else f"{med(vals):,.0f} ({m:.2f}x nginx, {med([cpu(key, i) for i in each]):.0f} us CPU)"
    if runs > 1 and m is not None:
        cell += " — runs " + ", ".join(f"{x:.2f}x" for x in ratios)
    print(f"| {name} | {med(bases):,.0f} req/s, {med([cpu('nginx', i) for i in each]):.0f} us CPU | {cell} | {goal} |")
# The ceiling: a forward alone (no key, no store), beside nginx forwarding the same GET.
fw = [r("forward", i) for i in each]
gb = [r("nginxget", i) for i in each]
fr = [v / b if v is not None and b else None for v, b in zip(fw, gb)]
if med(fr) is not None:
    cell = f"{med(fw):,.0f} ({med(fr):.2f}x nginx, {med([cpu('forward', i) for i in each]):.0f} us CPU)"
    if runs > 1:
        cell += " — runs " + ", ".join(f"{x:.2f}x" for x in fr if x is not None)
    print(f"| forward alone (GET, unprotected), {conn} connections | {med(gb):,.0f} req/s, {med([cpu('nginxget', i) for i in each]):.0f} us CPU | {cell} | (the ceiling of the rows above) |")
d = med([ms("direct1", i) for i in each])
for name, key, goal in (("SQLite", "first1", "<= direct + 0.3 ms"), ("PostgreSQL", "pgfirst1", "<= 0.8 ms")):
    vs = [ms(key, i) for i in each]
    v = med(vs)
    cell = "not run" if v is None else f"{v:.2f} ms"
    if runs > 1 and v is not None:
        cell += " — runs " + ", ".join(f"{x:.2f}" for x in vs if x is not None)
    print(f"| first write, 1 connection, {name}, p50 | direct {d:.3f} ms | {cell} | {goal} |")
# The tail: each workload's p50, p99 and p99.9 beside nginx's in the same run (the POST baseline,
# or nginx's GET for the forward alone); the goal is a p99 within 2x of nginx's.
print(f"\n| latency{label}, {conn} connections | p50 | p99 | p99.9 | p99 / nginx's p99 |\n|---|---|---|---|---|")
def pcts(key):
    return [med([ms(key, i, p) for i in each]) for p in ("p50", "p99", "p999")]
for name, key, base in (("nginx proxy (POST)", "nginx", None), ("idemproxy replay", "replay", "nginx"),
                        ("nginx proxy (GET)", "nginxget", None), ("idemproxy forward (GET)", "forward", "nginxget"),
                        ("idemproxy first write, SQLite", "first", "nginx"),
                        ("idemproxy first write + entity, SQLite", "entity", "nginx"),
                        ("idemproxy first write, PostgreSQL", "pgfirst", "nginx"),
                        ("idemproxy first write + entity, PostgreSQL", "pgentity", "nginx")):
    p = pcts(key)
    if p[0] is None:
        continue
    ratio = "" if base is None or pcts(base)[1] in (None, 0) else f"{p[1] / pcts(base)[1]:.2f}x"
    cells = " | ".join("?" if x is None else f"{x:.3f} ms" for x in p)
    print(f"| {name} | {cells} | {ratio} |")
PY
curl -fs "http://127.0.0.1:$ADMIN/metrics" | grep -E '^idemproxy_(forwards|replays|store_errors|audit_dropped)_total' || true
# Memory after every workload: every first write above is a stored key, its answer cached.
KEYS=$(curl -fs "http://127.0.0.1:$ADMIN/metrics" | awk '/^idemproxy_forwards_total/ {print $2}')
echo "idemproxy RSS after ${KEYS:-?} stored keys: $(( $(ps -o rss= -p "$(cat "$WORK/idemproxy.pid")") / 1024 )) MiB"
