#!/usr/bin/env bash
# Memory per idle connection: N keep-alive connections that each made one request and then
# sit idle, on the main listener (a GET passthrough, a protected POST, a GET over TLS), as
# intercepted egress connections and as egress tunnels, beside nginx proxying the same GET.
# Prints the RSS growth per connection in KiB.
# Usage: bench/idle.sh [connections=1000]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
. bench/lib.sh
work_dir idle
need nginx python3
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
cargo build --release -q --bin idemproxy
UP=$(free_port); PROXY=$(free_port); ADMIN=$(free_port); EGRESS=$(free_port); NGX=$(free_port)
start_nginx "$WORK" "$UP" "$(nginx_proxy "$UP" "$NGX")"
./target/release/idemproxy ca init --dir "$WORK/certs" >/dev/null
# The TLS main listener's certificate, signed by the same CA.
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=api.example.test \
  -keyout "$WORK/certs/server.key" -out "$WORK/certs/server.csr" 2>/dev/null
printf 'subjectAltName=DNS:api.example.test\n' > "$WORK/certs/san.ext"
openssl x509 -req -in "$WORK/certs/server.csr" -CA "$WORK/certs/idemproxy-ca.pem" \
  -CAkey "$WORK/certs/idemproxy-ca.key" -CAcreateserial -days 2 -extfile "$WORK/certs/san.ext" \
  -out "$WORK/certs/server.crt" 2>/dev/null
config() { # TLS-LINE
cat <<TOML
[server]
listen = "127.0.0.1:$PROXY"
admin_listen = "127.0.0.1:$ADMIN"
$1
[store]
url = "sqlite://$WORK/idle.db"
[egress]
listen = "127.0.0.1:$EGRESS"
ca_cert = "$WORK/certs/idemproxy-ca.pem"
ca_key = "$WORK/certs/idemproxy-ca.key"
tunnel = ["127.0.0.1"]
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
}
config "" > "$WORK/proxy.toml"
config "tls = { cert = \"$WORK/certs/server.crt\", key = \"$WORK/certs/server.key\" }" > "$WORK/proxy-tls.toml"
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
# Opens N connections to 127.0.0.1:PORT, sends each the request, reads its answer head, and
# holds them all open until stdin closes. Prints "ready" once every one has its answer.
cat > "$WORK/hold.py" <<'PY'
import socket, ssl, sys
port, n, kind, ca = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
tls = ssl.create_default_context(cafile=ca)
socks = []
def head(s):
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(4096)
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    if kind == "intercept":
        s.sendall(b"CONNECT api.example.test:443 HTTP/1.1\r\nhost: api.example.test:443\r\n\r\n")
        head(s)
    if kind in ("tls", "intercept"):
        s = tls.wrap_socket(s, server_hostname="api.example.test")
        s.sendall(b"GET /api/x HTTP/1.1\r\nhost: a\r\n\r\n" if kind == "tls" else b"GET /x HTTP/1.1\r\nhost: api.example.test\r\n\r\n")
    if kind == "get":
        s.sendall(b"GET /api/x HTTP/1.1\r\nhost: a\r\n\r\n")
    elif kind == "post":
        body = b'{"amount":1}'
        s.sendall(b"POST /api/v1/charges HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\nidempotency-key: idle-%d\r\ncontent-length: %d\r\n\r\n" % (i % 50, len(body)) + body)
    elif kind.startswith("connect:"):
        s.sendall(b"CONNECT 127.0.0.1:%s HTTP/1.1\r\nhost: x\r\n\r\n" % kind.split(":")[1].encode())
    head(s)
    if kind.startswith("connect:"):
        s.sendall(b"GET /api/x HTTP/1.1\r\nhost: a\r\n\r\n")
        head(s)
    socks.append(s)
print("ready", flush=True)
sys.stdin.read()
PY
# A fresh process for each measurement: memory freed by the last one's connections would
# otherwise be reused (and hide what a connection costs).
fresh() { # [CONFIG]
  [ -f "$WORK/proxy.pid" ] && kill "$(cat "$WORK/proxy.pid")" 2>/dev/null && sleep 0.5
  rm -f "$WORK"/idle.db*
  serve proxy "${1:-$WORK/proxy.toml}" "$ADMIN" >/dev/null
  cat "$WORK/proxy.pid"
}
measure() { # PID PORT KIND LABEL
  local before after
  before=$(rss "$1")
  coproc HOLD { python3 "$WORK/hold.py" "$2" "$N" "$3" "$WORK/certs/idemproxy-ca.pem"; }
  read -r _ <&"${HOLD[0]}"
  # A connection idle for a whole tick (src/connection/turn.rs, 1 s) frees its hyper state,
  # and the allocator hands freed pages back within a second (src/main.rs).
  sleep 4
  after=$(rss "$1")
  # How many of them idemproxy has parked (nginx has no such gauge).
  parked=$(curl -s "http://127.0.0.1:$ADMIN/metrics" | awk '/^idemproxy_connections_parked / {print $2}')
  exec {HOLD[1]}>&-
  wait "$HOLD_PID" 2>/dev/null || true
  python3 -c "print('%-22s %8.1f KiB a connection (RSS %d -> %d KiB)%s' % ('$4', ($after-$before)/$N, $before, $after, ', %s parked' % '$parked' if '$4'.startswith('idemproxy') else ''))"
}
echo "$N idle keep-alive connections, each after one request:"
measure "$(fresh)" "$PROXY" get "idemproxy GET"
measure "$(fresh)" "$PROXY" post "idemproxy POST"
measure "$(fresh "$WORK/proxy-tls.toml")" "$PROXY" tls "idemproxy TLS GET"
measure "$(fresh)" "$EGRESS" intercept "idemproxy intercepted"
measure "$(fresh)" "$EGRESS" "connect:$UP" "idemproxy tunnel"
# nginx's worker holds the connections, not its master.
measure "$(pgrep -P "$(cat "$WORK/nginx.pid")" | head -1)" "$NGX" get "nginx GET"
