# Shared by the bench scripts (sourced): tools, free ports, and the static nginx upstream that
# every workload is proxied to.

# work_dir NAME: a fresh work directory in $WORK (readable by the postgres user), removed on
# exit with every process whose pid file is in it and the nginx it runs.
work_dir() {
  WORK=$(mktemp -d "/tmp/idemproxy-$1.XXXXXX")
  chmod 755 "$WORK"
  trap 'kill $(cat "$WORK"/*.pid 2>/dev/null) 2>/dev/null || true; nginx -p "$WORK" -c "$WORK/nginx.conf" -s stop 2>/dev/null || true; rm -rf "$WORK"' EXIT
}

# Exits with an install hint unless every tool named is on PATH.
need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "$tool is missing: apt-get install $tool"; exit 1; }
  done
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_nginx WORK UP [more]: nginx, its files in WORK, answering any method on port UP with a
# fixed JSON body; `more` is added to its http block (another server, an upstream pool).
start_nginx() {
  local work=$1 up=$2 more=${3:-}
  mkdir -p "$work/logs"
  cat > "$work/nginx.conf" <<NGINX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  # The upstream: a fixed JSON answer to any method.
  server {
    listen 127.0.0.1:$up;
    location / { default_type application/json; return 200 '{"id":"ch_1","status":"succeeded"}'; }
  }
$more
}
NGINX
  nginx -p "$work" -c "$work/nginx.conf"
}

# nginx_proxy UP PORT: the baseline, a plain nginx reverse proxy on PORT in front of the
# upstream on UP with pooled upstream connections (for start_nginx's `more`).
nginx_proxy() {
  cat <<NGINX
  upstream api { server 127.0.0.1:$1; keepalive 64; }
  server {
    listen 127.0.0.1:$2;
    location /api/ {
      proxy_pass http://api/;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
NGINX
}

# proxy_toml LISTEN ADMIN STORE-LINES: the proxy's config, upstream `api` on $UP with two
# routes: /v1/charges (key only) and /v2/charges (key and a customer entity).
proxy_toml() {
cat <<TOML
[server]
listen = "127.0.0.1:$1"
admin_listen = "127.0.0.1:$2"
[store]
$3
[upstreams.api]
url = "http://127.0.0.1:$UP"
prefix = "/api"
[[routes]]
name = "charges"
upstream = "api"
methods = ["POST"]
path = "/v1/charges"
[[routes]]
name = "charges-by-customer"
upstream = "api"
methods = ["POST"]
path = "/v2/charges"
entity = "customer:{body.customer}"
TOML
}

# serve NAME CONFIG ADMIN-PORT: starts the release binary (pid in $WORK/NAME.pid, stderr
# appended to $WORK/NAME.log) and waits until it answers /healthz. PROXY_WORKERS sets its
# worker threads (TOKIO_WORKER_THREADS); unset, the proxy's default (`server.workers`: one per
# core, less one on SQLite).
serve() {
  env ${PROXY_WORKERS:+TOKIO_WORKER_THREADS=$PROXY_WORKERS} RUST_LOG=warn ./target/release/idemproxy serve --config "$2" 2>>"$WORK/$1.log" &
  echo $! > "$WORK/$1.pid"
  for _ in $(seq 100); do curl -fs "http://127.0.0.1:$3/healthz" >/dev/null && break; sleep 0.1; done
}
