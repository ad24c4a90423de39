//! [`RecordingUpstream`]: the fake upstream API every behaviour test asserts against.
//!
//! It records every request it receives (the side effects a test counts), tracks how many
//! requests per entity are in flight at once (the proxy's entity locks must keep that at one),
//! and answers as the test scripts it: a JSON echo by default, or any [`Reply`] a handler
//! returns, including holding a request until the test releases it, hanging forever, or closing
//! the connection without an answer.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

pub use super::message::{Action, EntityFn, Handler, Recorded, Reply};
use super::tls::TestCa;
use super::upstream_server::{accept_loop, Shared, State};
use super::WAIT;

/// Configures a [`RecordingUpstream`] before it starts.
pub struct UpstreamBuilder {
    handler: Handler,
    entities: EntityFn,
    hold_all: bool,
    tls: bool,
    raw: bool,
}

impl Default for UpstreamBuilder {
    fn default() -> Self {
        UpstreamBuilder {
            handler: Arc::new(Reply::echo),
            entities: Arc::new(|rec: &Recorded| vec![rec.path().to_string()]),
            hold_all: false,
            tls: false,
            raw: false,
        }
    }
}

impl UpstreamBuilder {
    /// Scripts every answer: `(request, seq) -> Reply` (seq starts at 1).
    pub fn handler(
        mut self,
        handler: impl Fn(&Recorded, u64) -> Reply + Send + Sync + 'static,
    ) -> Self {
        self.handler = Arc::new(handler);
        self
    }

    /// Answers every request with this reply.
    pub fn reply(self, reply: Reply) -> Self {
        self.handler(move |_, _| reply.clone())
    }

    /// The entity of a request, for concurrency tracking (default: the request path).
    pub fn entity(mut self, f: impl Fn(&Recorded) -> String + Send + Sync + 'static) -> Self {
        self.entities = Arc::new(move |rec: &Recorded| vec![f(rec)]);
        self
    }

    /// Several entities per request (e.g. a batch update); each is tracked.
    pub fn entities(
        mut self,
        f: impl Fn(&Recorded) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.entities = Arc::new(f);
        self
    }

    /// The entity is the JSON body's value at this JSON pointer (e.g. `/customer`), as text;
    /// `<missing>` when absent or the body is not JSON.
    pub fn entity_json(self, pointer: &str) -> Self {
        let pointer = pointer.to_string();
        self.entity(move |rec: &Recorded| {
            serde_json::from_slice::<serde_json::Value>(&rec.body)
                .ok()
                .and_then(|v| v.pointer(&pointer).cloned())
                .map(|v| match v {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                })
                .unwrap_or_else(|| "<missing>".to_string())
        })
    }

    /// Holds every request until the test releases it.
    pub fn hold(mut self) -> Self {
        self.hold_all = true;
        self
    }

    /// Serves HTTPS with a test CA (see [`RecordingUpstream::ca_pem_path`]).
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Serves with a hand-written HTTP/1.1 server instead of hyper: no HTTP/2, but
    /// [`Action::Drop`] is a plain socket close right after the body was read.
    pub fn raw_http1(mut self) -> Self {
        self.raw = true;
        self
    }

    /// Binds `127.0.0.1:0` and starts serving.
    pub async fn start(self) -> RecordingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream on 127.0.0.1:0");
        let addr = listener.local_addr().expect("upstream local_addr");
        let ca = self.tls.then(TestCa::generate);
        let acceptor = ca.as_ref().map(|ca| TlsAcceptor::from(ca.server_config()));
        let shared = Arc::new(Shared::new(self.handler, self.entities, self.hold_all));
        let cancel = CancellationToken::new();
        tokio::spawn(accept_loop(
            listener,
            acceptor,
            self.raw,
            shared.clone(),
            cancel.clone(),
        ));
        RecordingUpstream {
            addr,
            shared,
            cancel,
            ca,
        }
    }
}

/// A real upstream on `127.0.0.1:0` that records requests; stops when dropped.
pub struct RecordingUpstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    ca: Option<TestCa>,
}

impl Drop for RecordingUpstream {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl RecordingUpstream {
    /// Starts configuring an upstream.
    pub fn builder() -> UpstreamBuilder {
        UpstreamBuilder::default()
    }

    /// Plain HTTP (HTTP/1.1 and h2c), default echo answers, entity = path.
    pub async fn start() -> RecordingUpstream {
        Self::builder().start().await
    }

    /// Answers with a scripted handler.
    pub async fn with_handler(
        handler: impl Fn(&Recorded, u64) -> Reply + Send + Sync + 'static,
    ) -> RecordingUpstream {
        Self::builder().handler(handler).start().await
    }

    /// Always answers `status` with `body` (JSON content type if the body parses as JSON).
    pub async fn fixed(status: u16, body: &str) -> RecordingUpstream {
        let reply = match serde_json::from_str::<serde_json::Value>(body) {
            Ok(_) => Reply::new(status)
                .header("content-type", "application/json")
                .body(body.to_string()),
            Err(_) => Reply::text(status, body),
        };
        Self::builder().reply(reply).start().await
    }

    /// Holds every request until released; then the default echo answer.
    pub async fn holding() -> RecordingUpstream {
        Self::builder().hold().start().await
    }

    /// Records every request and never answers.
    pub async fn hanging() -> RecordingUpstream {
        Self::builder().reply(Reply::hang()).start().await
    }

    /// A raw HTTP/1.1 server that reads each request (head and body), records it, then closes
    /// the connection without answering.
    pub async fn dropping() -> RecordingUpstream {
        Self::builder()
            .raw_http1()
            .reply(Reply::drop_connection())
            .start()
            .await
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT` (or `https://` for a TLS upstream), for a config's `url`.
    pub fn url(&self) -> String {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// `https://localhost:PORT` — the DNS-name SAN of the TLS leaf.
    pub fn localhost_url(&self) -> String {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        format!("{scheme}://localhost:{}", self.addr.port())
    }

    /// The test CA of a TLS upstream.
    pub fn ca(&self) -> &TestCa {
        self.ca
            .as_ref()
            .expect("ca(): this upstream was not built with .tls()")
    }

    /// Path of the PEM of the CA that signed a TLS upstream's certificate (for `ca_file`).
    pub fn ca_pem_path(&self) -> PathBuf {
        self.ca().ca_pem_path()
    }

    /// Every request recorded so far, in arrival order.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.state().requests.clone()
    }

    /// The `n`th request (1-based seq); panics if it has not arrived.
    pub fn request(&self, seq: u64) -> Recorded {
        let requests = self.requests();
        requests.get(seq as usize - 1).cloned().unwrap_or_else(|| {
            panic!(
                "upstream has no request #{seq}: it recorded {}",
                requests.len()
            )
        })
    }

    /// Number of requests recorded.
    pub fn count(&self) -> usize {
        self.shared.state().requests.len()
    }

    /// Number of requests with this method (case-sensitive, e.g. `"POST"`).
    pub fn count_method(&self, method: &str) -> usize {
        self.shared
            .state()
            .requests
            .iter()
            .filter(|r| r.method.as_str() == method)
            .count()
    }

    /// Number of requests whose path (without query) is `path`.
    pub fn count_path(&self, path: &str) -> usize {
        self.shared
            .state()
            .requests
            .iter()
            .filter(|r| r.path() == path)
            .count()
    }

    /// The most requests for `entity` that were ever in flight at once (0 if never seen).
    pub fn max_concurrent(&self, entity: &str) -> usize {
        self.shared
            .state()
            .max_in_flight
            .get(entity)
            .copied()
            .unwrap_or(0)
    }

    /// The most requests that were ever in flight at once, all entities together.
    pub fn max_concurrent_total(&self) -> usize {
        self.shared.state().max_in_flight_total
    }

    /// Requests in flight now (recorded, not yet answered or dropped).
    pub fn in_flight(&self) -> usize {
        self.shared.state().in_flight_total
    }

    /// Requests in flight now for `entity`.
    pub fn in_flight_for(&self, entity: &str) -> usize {
        self.shared
            .state()
            .in_flight
            .get(entity)
            .copied()
            .unwrap_or(0)
    }

    /// Requests waiting to be released now.
    pub fn held(&self) -> usize {
        self.shared.state().held
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.state().connections
    }

    /// Lets one held request (present or future) through.
    pub fn release_one(&self) {
        self.release(1);
    }

    /// Lets `n` held requests (present or future) through.
    pub fn release(&self, n: usize) {
        self.shared.gate.add_permits(n);
    }

    /// Opens the gate for good: every held request and every later one goes through.
    pub fn release_all(&self) {
        self.shared.gate.close();
    }

    /// Waits until at least `n` requests were recorded (panics after 10 s).
    pub async fn wait_for_requests(&self, n: usize) {
        self.wait_for_requests_within(n, WAIT).await;
    }

    /// Waits until at least `n` requests were recorded (panics after `timeout`).
    pub async fn wait_for_requests_within(&self, n: usize, timeout: Duration) {
        self.wait_state(
            |s| s.requests.len() >= n,
            &format!("{n} upstream requests"),
            timeout,
        )
        .await;
    }

    /// Waits until at least `n` requests are held at the gate (panics after 10 s).
    pub async fn wait_for_held(&self, n: usize) {
        self.wait_state(
            |s| s.held >= n,
            &format!("{n} held upstream requests"),
            WAIT,
        )
        .await;
    }

    /// Waits until no request is in flight (panics after 10 s).
    pub async fn wait_idle(&self) {
        self.wait_state(
            |s| s.in_flight_total == 0,
            "no upstream request in flight",
            WAIT,
        )
        .await;
    }

    /// Stops accepting and closes every connection (later connects are refused).
    pub fn stop(&self) {
        self.cancel.cancel();
    }

    async fn wait_state(&self, pred: impl Fn(&State) -> bool, what: &str, timeout: Duration) {
        let mut changed = self.shared.changed.subscribe();
        let shared = self.shared.clone();
        let reached = tokio::time::timeout(timeout, async {
            // The sender lives in `shared`, so `wait_for` cannot fail with a closed channel.
            let _ = changed.wait_for(|_| pred(&shared.state())).await;
        })
        .await;
        if reached.is_err() {
            let state = self.shared.state();
            panic!(
                "timed out after {timeout:?} waiting for {what}: upstream {} recorded {} requests, \
                 {} in flight, {} held",
                self.addr,
                state.requests.len(),
                state.in_flight_total,
                state.held
            );
        }
    }
}
