#!/usr/bin/env bash
# Pacing against a limit-enforcing API: nginx's limit_req stands for the API (RATE requests a
# second, a burst of RATE, 429 past it), and wrk drives first writes through the proxy, paced
# at the same limit (pace = { rate = RATE, per = "1s" }), for SECONDS at CONNECTIONS. Prints
# what the API accepted a second (over the whole run, and less the first burst)
# against its limit, how many it refused, and what the callers got.
# Usage: bench/pace.sh [rate=100] [seconds=20] [connections=32]
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-100}; DUR=${2:-20}; CONN=${3:-32}
. bench/lib.sh
work_dir pace
need wrk nginx python3
cargo build --release -q --bin idemproxy
API=$(free_port); APP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port)
# limit_req runs before the content phase: the limited server passes what it accepts to the
# one start_nginx makes, which answers (a `return` would answer before limit_req is asked).
start_nginx "$WORK" "$APP" "  log_format api '\$msec \$status';
  limit_req_zone \$server_name zone=api:1m rate=${RATE}r/s;
  server {
    listen 127.0.0.1:$API;
    access_log $WORK/logs/api.log api;
    location / {
      limit_req zone=api burst=$RATE nodelay;
      limit_req_status 429;
      proxy_pass http://127.0.0.1:$APP;
    }
  }"
UP=$API
proxy_toml "$PROXY" "$ADMIN" "url = \"sqlite://$WORK/idemproxy.db\"" > "$WORK/proxy.toml"
sed -i "/^\[upstreams.api\]$/a pace = { rate = $RATE, per = \"1s\", max_wait = \"30s\" }" "$WORK/proxy.toml"
serve proxy "$WORK/proxy.toml" "$ADMIN"
out=$(wrk -t2 -c"$CONN" -d"${DUR}s" --timeout 30s -s bench/first_write.lua "http://127.0.0.1:$PROXY/api/v1/charges")
echo "$out" | grep -E "Requests/sec|Non-2xx|requests in|Socket errors" || true
awk -v rate="$RATE" '
  { t[NR] = $1; s[NR] = $2 }
  END {
    span = t[NR] - t[1]
    for (i = 1; i <= NR; i++) {
      if (s[i] == 200) ok++
      else if (s[i] == 429) refused++
    }
    # The first burst (up to the limit at once) is not a rate: the steady rate leaves it out.
    steady = (ok - rate) / span
    printf "API: %d accepted, %d refused (429) in %.1f s: %.1f/s overall, %.1f/s less the first burst; limit %d/s: %.1f%%\n",
      ok, refused, span, ok / span, steady, rate, 100 * steady / rate
  }' "$WORK/logs/api.log"
