# Shared by the bench scripts (sourced): tools, free ports, and the static nginx upstream that
# every workload is proxied to.

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
