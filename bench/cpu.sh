#!/usr/bin/env bash
# Where a workload's CPU goes, per request: every process on the machine (the ones started
# during the run too: PostgreSQL backends, wrk), each thread of one process with its
# voluntary and involuntary context switches, and the machine's user/system/idle split, with
# the time the hypervisor took the vCPUs away (steal: near zero on this VM even in its slow
# phases). The proxy, nginx or PostgreSQL must already be running: this only drives them and
# reads /proc.
# Usage: bench/cpu.sh PID URL [script] [seconds] [connections]
#   e.g. bench/cpu.sh "$(pgrep -f 'idemproxy serve')" http://127.0.0.1:8080/api/v1/charges
# Figures are µs of CPU (or switches) per completed request; one run is one sample of a
# drifting VM (see docs/benchmark.md), so compare runs taken minutes apart with care.
set -euo pipefail
PID=$1; URL=$2; SCRIPT=${3:-$(dirname "$0")/first_write.lua}; DUR=${4:-8}; CONN=${5:-64}
procs() { # pid name utime+stime (ticks), every process
  for p in /proc/[0-9]*; do
    awk -v p="${p#/proc/}" '{n = $0; sub(/^[^(]*\(/, "", n); sub(/\).*$/, "", n); gsub(/ /, "_", n)
      c = $0; sub(/^.*\) /, "", c); split(c, a, " "); print p, n, a[12] + a[13]}' "$p/stat" 2>/dev/null || true
  done
}
threads() { # tid name utime stime voluntary involuntary, every thread of PID
  for t in /proc/"$PID"/task/*; do
    printf '%s %s %s %s\n' "${t##*/}" "$(tr ' ' _ < "$t/comm")" \
      "$(awk '{c = $0; sub(/^.*\) /, "", c); split(c, a, " "); print a[12], a[13]}' "$t/stat")" \
      "$(awk '/^(non)?voluntary_ctxt/ {printf "%s ", $2}' "$t/status")"
  done
}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
procs > "$T/p0"; threads > "$T/t0"; head -1 /proc/stat > "$T/s0"; awk '/^ctxt/ {print $2}' /proc/stat > "$T/c0"
# Read the processes before wrk exits, so wrk itself is counted.
wrk -t"$(( CONN < 2 ? 1 : 2 ))" -c"$CONN" -d"${DUR}s" -s "$SCRIPT" "$URL" > "$T/wrk" &
WRK=$!; sleep $((DUR - 1)); procs > "$T/p1"; wait "$WRK"
threads > "$T/t1"; head -1 /proc/stat > "$T/s1"; awk '/^ctxt/ {print $2}' /proc/stat > "$T/c1"
n=$(awk '/requests in/ {print $1}' "$T/wrk")
grep 'Requests/sec' "$T/wrk"
tick=$(getconf CLK_TCK)
echo "-- processes (µs per request; read 1 s before the end, so scaled by $DUR/$((DUR - 1)))"
awk 'NR == FNR {a[$1] = $3; next} {d = $3 - ($1 in a ? a[$1] : 0); if (d > 0) c[$2] += d} END {for (k in c) print k, c[k]}' \
  "$T/p0" "$T/p1" | awk -v n="$n" -v t="$tick" -v f="$(echo "$DUR / ($DUR - 1)" | bc -l)" \
  '{printf "%-28s %8.2f\n", $1, $2 * 1e6 / t / n * f}' | sort -k2 -nr | head -12
echo "-- threads of $PID (µs user, µs system, voluntary and involuntary switches per request)"
join <(sort "$T/t0") <(sort "$T/t1") | awk -v n="$n" -v t="$tick" '{u[$2] += $8 - $3; s[$2] += $9 - $4; v[$2] += $10 - $5; i[$2] += $11 - $6}
  END {for (k in u) if (u[k] + s[k] + v[k] > 0) printf "%-20s %7.2f %7.2f %6.2f %6.2f\n", k, u[k] * 1e6 / t / n, s[k] * 1e6 / t / n, v[k] / n, i[k] / n}' | sort
paste "$T/s0" "$T/s1" | awk -v n="$n" -v t="$tick" '{k = 1e6 / t / n
  printf "-- machine (µs per request): user %.1f, system %.1f, softirq %.1f, idle %.1f, iowait %.1f, steal %.1f\n",
    ($13 - $2) * k, ($15 - $4) * k, ($19 - $8) * k, ($16 - $5) * k, ($17 - $6) * k, ($20 - $9) * k}'
echo "-- context switches per request, whole machine: $(echo "scale=2; ($(cat "$T/c1") - $(cat "$T/c0")) / $n" | bc)"
