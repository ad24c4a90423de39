#!/usr/bin/env bash
# The egress listener beside reverse mode, in one run: first writes and replays over kept-alive
# TLS connections, through the egress listener (CONNECT, then TLS as the API's host) and
# straight to the main listener with TLS (the same route, the same certificate authority), in
# alternated rounds on one proxy process; then how long a new host's leaf takes to mint.
# Usage: bench/egress.sh [rounds] [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}; DUR=${2:-5}; CONN=${3:-16}
. bench/lib.sh
work_dir egress
need nginx openssl
cargo build --release -q --bin idemproxy --example tls_load --example mint
UP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port); EGRESS=$(free_port)
start_nginx "$WORK" "$UP"
./target/release/idemproxy ca init --dir "$WORK/certs" >/dev/null
# The main listener's certificate, for the same name, signed by the same CA.
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=api.example.test" \
  -keyout "$WORK/certs/server.key" -out "$WORK/certs/server.csr" 2>/dev/null
printf 'subjectAltName=DNS:api.example.test\n' > "$WORK/certs/san.ext"
openssl x509 -req -in "$WORK/certs/server.csr" -CA "$WORK/certs/idemproxy-ca.pem" \
  -CAkey "$WORK/certs/idemproxy-ca.key" -CAcreateserial -days 2 -extfile "$WORK/certs/san.ext" \
  -out "$WORK/certs/server.crt" 2>/dev/null
cat > "$WORK/proxy.toml" <<TOML
[server]
listen = "127.0.0.1:$PROXY"
admin_listen = "127.0.0.1:$ADMIN"
tls = { cert = "$WORK/certs/server.crt", key = "$WORK/certs/server.key" }
[store]
url = "sqlite://$WORK/bench.db"
[egress]
listen = "127.0.0.1:$EGRESS"
ca_cert = "$WORK/certs/idemproxy-ca.pem"
ca_key = "$WORK/certs/idemproxy-ca.key"
[upstreams.api]
url = "http://127.0.0.1:$UP"
prefix = "/api"
hosts = ["api.example.test"]
[[routes]]
name = "charges"
upstream = "api"
methods = ["POST"]
path = "/v1/charges"
TOML
serve proxy "$WORK/proxy.toml" "$ADMIN"
CA="$WORK/certs/idemproxy-ca.pem"
load() { ./target/release/examples/tls_load "$@"; }
rps() { python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["rps"], d["p50_us"], d["p99_us"])'; }
echo "workload  round  reverse(req/s p50 p99 us)  egress(req/s p50 p99 us)  egress/reverse"
for workload in first replay; do
  keyed=unique; [ "$workload" = replay ] && keyed=fixed
  for r in $(seq "$ROUNDS"); do
    d=$(load direct "127.0.0.1:$PROXY" api.example.test "$CA" "$CONN" "$DUR" POST /api/v1/charges '{"amount":1}' $keyed | rps)
    e=$(load connect "127.0.0.1:$EGRESS" api.example.test "$CA" "$CONN" "$DUR" POST /v1/charges '{"amount":1}' $keyed | rps)
    ratio=$(python3 -c "print(round(${e%% *}/${d%% *}, 3))")
    echo "$workload  $r  $d  $e  $ratio"
  done
done
echo "leaf minting: $(./target/release/examples/mint 200)"
