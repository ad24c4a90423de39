# syntax=docker/dockerfile:1
#
# idemproxy container image.
#
#   docker build -t idemproxy .
#   docker run --rm -p 8080:8080 -p 127.0.0.1:9090:9090 -v idemproxy-data:/data \
#     -e IDEMPROXY_ADMIN_TOKEN=change-me idemproxy
#
# The SQLite store is created in /data (the working directory): keep it on a volume, it holds
# the stored answers. One container per SQLite file (see README.md, "SQLite: one process").

# ---- build ------------------------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /build

COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations

# The cache mounts keep the crate registry and compiled dependencies between builds; the
# binary is copied out of the cached target directory before the mount goes away.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/build/target \
    cargo build --release --locked \
    && cp target/release/idemproxy /usr/local/bin/idemproxy

# ---- runtime ----------------------------------------------------------------------------------
FROM debian:bookworm-slim

# ca-certificates: system trust roots for HTTPS upstreams.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# A fixed, unprivileged user that owns only /data.
RUN groupadd --system --gid 10001 idemproxy \
    && useradd --system --uid 10001 --gid idemproxy --home-dir /data --no-create-home \
        --shell /usr/sbin/nologin idemproxy \
    && mkdir -p /data /etc/idemproxy \
    && chown idemproxy:idemproxy /data

COPY --from=builder /usr/local/bin/idemproxy /usr/local/bin/idemproxy
COPY proxy.toml /etc/idemproxy/proxy.toml

ENV IDEMPROXY_CONFIG=/etc/idemproxy/proxy.toml
# Inside a container the listeners must bind 0.0.0.0: a loopback address is unreachable from
# outside it. The shipped proxy.toml reads these two variables
# (listen = "${IDEMPROXY_LISTEN:-127.0.0.1:8080}", admin_listen = "${IDEMPROXY_ADMIN_LISTEN:-...}").
# The admin listener is then reachable too. Without IDEMPROXY_ADMIN_TOKEN it serves only
# /healthz, /readyz and /metrics (for probes): /admin/* answers 403 until a token is set.
# Publish 9090 on loopback only (-p 127.0.0.1:9090:9090) or not at all. See docs/security.md.
ENV IDEMPROXY_LISTEN=0.0.0.0:8080 \
    IDEMPROXY_ADMIN_LISTEN=0.0.0.0:9090

USER idemproxy:idemproxy
WORKDIR /data
VOLUME ["/data"]

EXPOSE 8080 9090

ENTRYPOINT ["idemproxy"]
CMD ["serve"]
