//! Shared integration-test harness for idemproxy.
//!
//! Every piece runs on real sockets bound to `127.0.0.1:0`; nothing uses a fixed port, and
//! nothing sleeps to synchronise: tests wait for a condition (a `watch` channel, a semaphore, or
//! the bounded [`wait_until`] poll) and assert on the side effects an upstream recorded.
//!
//! * [`upstream`] — [`RecordingUpstream`]: a scriptable HTTP/1.1 + HTTP/2 server (optionally
//!   TLS, optionally a raw HTTP/1.1 server that can drop connections) that records every request
//!   and tracks concurrency per entity.
//! * [`tls`] — a CA and a `localhost`/`127.0.0.1` leaf generated at test time, and rustls configs.
//! * [`client`] — a small HTTP client (`send`, `request`, `post_json`, h2c, raw TCP).
//! * [`proxy`] — [`TestDir`] and [`TestProxy`]: the proxy started in-process on a temp SQLite store.
//! * [`backend`] — [`backend::Backend`]: SQLite or PostgreSQL for one test, and a raw look at
//!   the bytes it holds.
//! * [`pg`] — [`pg::PgServer`]: a real PostgreSQL (private throwaway cluster or `IDEMPROXY_TEST_PG_URL`).
//! * [`process`] — [`ProxyProcess`]: the real `idemproxy serve` binary, for kill/restart tests.
#![allow(dead_code)]

pub mod audits;
pub mod backend;
pub mod client;
pub mod ha;
mod message;
pub mod pg;
pub mod pg_bin;
pub mod process;
pub mod proxy;
mod raw_upstream;
pub mod retries;
pub mod tls;
pub mod upstream;
mod upstream_server;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test file uses its own subset
pub use client::{
    build, build_bytes, get, post_json, raw_request, raw_status, request, send, send_h2,
    try_request, try_send, Resp,
};
#[allow(unused_imports)]
pub use process::{cli, faults_binary, run_json, shipped_proxy, ProxyProcess};
#[allow(unused_imports)]
pub use proxy::{shipped_egress, shipped_text, TestDir, TestProxy};
#[allow(unused_imports)]
pub use tls::TestCa;
#[allow(unused_imports)]
pub use upstream::{Action, Recorded, RecordingUpstream, Reply, UpstreamBuilder};

/// Default deadline for the harness's waits: long enough for a loaded CI machine, short enough
/// that a broken test fails instead of hanging the suite.
pub const WAIT: Duration = Duration::from_secs(10);

/// One series of the `/metrics` page under `admin` (`http://host:port`): `series` is the name
/// with its labels as rendered, e.g. `idemproxy_config_reloads_total{result="ok"}`; `0` when
/// absent (a counter never incremented).
pub async fn metric(admin: &str, series: &str) -> u64 {
    let text = get(&format!("{admin}/metrics")).await.text();
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Polls the async `probe` until it gives `Ok`, and returns its value; once [`WAIT`] has
/// passed, panics with the last `Err` it gave (what was seen instead). For conditions with no
/// notification to await (a gauge, an audit row written off the request path): a bounded wait
/// for a condition, never a sleep used as synchronisation.
pub async fn eventually<T, F, Fut>(probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    eventually_within(WAIT, probe).await
}

/// [`eventually`] with another bound (a cluster's restart, a slow client).
pub async fn eventually_within<T, F, Fut>(timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(seen) if Instant::now() >= deadline => {
                panic!("timed out after {timeout:?}: {seen}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Polls `cond` until it holds, panicking with `what` once `timeout` has passed.
///
/// For conditions with no notification to await (a proxy gauge, a file appearing). This is a
/// bounded wait for a condition, not a sleep used as synchronisation: it returns as soon as the
/// condition holds, and the assertion a test makes afterwards never depends on timing.
pub async fn wait_until(mut cond: impl FnMut() -> bool, timeout: Duration, what: &str) {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An address on 127.0.0.1 where, almost certainly, nothing listens: bound, read, released.
/// For "upstream unreachable" tests (connection refused).
pub fn unused_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener
        .local_addr()
        .expect("local_addr of a bound listener")
}

/// The `[server]` table every test config starts with: main and admin listeners on
/// `127.0.0.1:0`. Append upstreams and routes after it.
pub fn server_section() -> &'static str {
    "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n"
}

/// A whole test config: [`server_section`] plus `server_extra` (more `[server]` keys), one
/// upstream `api` at `/api` on `upstream` with `upstream_extra` keys, then `routes`.
pub fn api_config(
    upstream: &RecordingUpstream,
    server_extra: &str,
    upstream_extra: &str,
    routes: &str,
) -> String {
    format!(
        "{}{server_extra}\n[upstreams.api]\nurl = \"{}\"\nprefix = \"/api\"\n{upstream_extra}\n{routes}",
        server_section(),
        upstream.url()
    )
}

/// A plain keyed route: `POST /v1/charges` on upstream `api`, the default key rule.
pub const CHARGES_ROUTE: &str = r#"
[[routes]]
name = "charges"
upstream = "api"
methods = ["POST"]
path = "/v1/charges"
"#;

/// A versioned route: `PATCH /contacts/{id}`, entity `contact:{id}`, key from
/// `X-Request-Id`, version from `X-Entity-Version`.
pub const CONTACTS_ROUTE: &str = r#"
[[routes]]
name = "contact-update"
upstream = "api"
methods = ["PATCH"]
path = "/contacts/{id}"
entity = "contact:{path.id}"
key = { header = "", derive = "{header.x-request-id}" }
version = "{header.x-entity-version}"
"#;

/// Says that a test skips because something it needs is missing, loudly; under `CI=true`,
/// where `.ci/run` installs everything, that is a failure.
pub fn skip_loudly(msg: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{msg} (CI=true: this is a failure)"
    );
    eprintln!("\n!!!!!!!! {msg} !!!!!!!!\n");
}

/// Whether `probe` runs and succeeds (a client, SDK or tool is installed); a loud skip naming
/// `what` otherwise.
pub fn installed(what: &str, probe: &mut std::process::Command) -> bool {
    let ok = probe.output().is_ok_and(|o| o.status.success());
    if !ok {
        skip_loudly(&format!("SKIPPED: {what} is not installed"));
    }
    ok
}
