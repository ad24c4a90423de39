//! `proxy.toml`, compiled: what the hot path reads, already validated.
//!
//! Two layers (as rpxy does it): [`raw`] mirrors the TOML, [`compile`] turns it into these
//! types once at load — route matchers built, templates parsed and checked against their
//! route, durations and sizes parsed, URLs parsed. Every problem is reported as
//! `file:line:col: message`, all of them at once.

pub(super) mod compile;
mod compiler;
pub mod egress;
pub mod pace;
pub mod raw;
mod route_parts;
mod route_types;
mod routes;
mod side_reads;
mod store;
pub mod units;
mod upstreams;

pub use crate::key::FingerprintRule;
pub use crate::redact::redact_url;
use crate::rules::body::BodyPath;
use crate::rules::pattern::PathPattern;
use crate::rules::template::Template;
pub use egress::{EgressConfig, HostPattern};
use http::{HeaderName, Method};
pub use route_parts::intent_only;
pub use route_types::{Expected, InFlight, KeyRule, Mode, Precheck, Reconcile, Route};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The validated configuration.
#[derive(Debug)]
pub struct Config {
    /// Where it came from (file name), for messages.
    pub origin: String,
    /// The file it was loaded from: what a reload reads again (`None`: built from text).
    pub source: Option<std::path::PathBuf>,
    pub server: ServerConfig,
    pub store: StoreConfig,
    /// The egress listener (off unless `egress.listen` is set).
    pub egress: EgressConfig,
    /// In file order... of the TOML table (alphabetical).
    pub upstreams: Vec<Arc<Upstream>>,
    /// Every route in file order.
    pub routes: Vec<Arc<Route>>,
}

#[derive(Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: Option<SocketAddr>,
    /// `None` when empty: the admin API is then open to whoever reaches `admin_listen`.
    pub admin_token: Option<String>,
    pub max_body: usize,
    /// How long a client may take to send a buffered request body, from its head on: a
    /// client that trickles bytes must not hold a connection (and a request slot) forever.
    pub body_timeout: Duration,
    /// Default largest upstream answer that is buffered and stored (see [`Upstream::max_answer`]).
    pub max_answer: usize,
    /// Most connections served at once per listener.
    pub max_connections: usize,
    /// Most connections one peer address may hold per listener (0: no per-peer limit), so
    /// one client cannot take every slot of [`ServerConfig::max_connections`].
    pub max_connections_per_ip: usize,
    /// Threads serving requests (the async runtime's worker and the connection threads beside
    /// it); `None`: one per core. See [`ServerConfig::connection_threads_for`].
    pub workers: Option<usize>,
    /// The request header whose value the audit trail keeps as the workflow (run) id, so an
    /// entity's timeline says which run sent each write (`None`: kept nowhere).
    pub workflow_header: Option<http::HeaderName>,
    pub tls: Option<TlsFiles>,
}

impl ServerConfig {
    /// The connection threads beside the async runtime's one worker ([`crate::threads`]): the
    /// serving threads ([`ServerConfig::workers`], by default one per core) but that worker.
    /// A store's reply to a request then wakes the thread that request runs on. With two
    /// runtime workers it woke the other one, and a lone first write on SQLite took 60–90 µs
    /// longer; connection threads beside one worker served 15% more concurrent first writes on
    /// SQLite and 10% more on PostgreSQL, and a lone client's on PostgreSQL 8% faster
    /// (docs/design-notes.md, "Serving threads and the request path").
    pub fn connection_threads_for(&self, cores: usize) -> usize {
        self.serving(cores) - 1
    }

    fn serving(&self, cores: usize) -> usize {
        self.workers.unwrap_or(cores).max(1)
    }
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug)]
pub struct StoreConfig {
    pub url: String,
    pub retention: Duration,
    pub lease: Duration,
    /// The secret that keys credential-scope hashes, so a copy of the database alone cannot
    /// be used to test guesses at credentials. `None`: SQLite keeps a generated one in a
    /// file of its own beside the database (see [`crate::key::ScopeKeyer`]) — unless
    /// `encryption` is set: then it is derived from an encryption key (see `server`).
    pub scope_secret: Option<String>,
    /// `encryption_key` and `encryption_keys_previous`: stored answers are sealed with the
    /// first and opened with any (see [`crate::store::seal`]). `None`: stored in clear.
    pub encryption: Option<Arc<crate::store::seal::Cipher>>,
    /// `answer_before_commit` (default off): on, a first write's answer goes to its caller
    /// before its completion commits (see `pipeline::store`), and a crash in between leaves
    /// an answer the caller saw unknown to its retries; off, after the completion is durable,
    /// so every answer a caller saw is replayed.
    pub answer_before_commit: bool,
}

/// What to do with a mutating request that matches no route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmatched {
    /// Protected with the header key, else the fingerprint; no entity.
    Protect,
    Passthrough,
    /// `404 no_route`.
    Reject,
}

impl Unmatched {
    /// As the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Unmatched::Protect => "protect",
            Unmatched::Passthrough => "passthrough",
            Unmatched::Reject => "reject",
        }
    }
}

impl InFlight {
    /// As the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            InFlight::Wait => "wait",
            InFlight::Reject => "reject",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    /// Hosts whose `CONNECT`s the egress listener intercepts for this upstream.
    pub hosts: Vec<HostPattern>,
    /// The URL's host is `{host}`: an intercepted request goes to the host it was for.
    pub url_host: bool,
    /// Scheme and authority of the upstream.
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// The upstream URL's path, without trailing `/` (usually empty). The authority never
    /// holds credentials: they are moved to [`Upstream::url_credentials`].
    pub base_path: String,
    /// Main-listener prefix without trailing `/`, e.g. `/stripe`.
    pub prefix: Option<String>,
    pub listen: Option<SocketAddr>,
    pub timeout: Duration,
    pub native_idempotency_header: Option<HeaderName>,
    pub release_statuses: Vec<u16>,
    pub unmatched: Unmatched,
    pub ca_file: Option<PathBuf>,
    /// Headers that scope keys besides the credential headers (an account header such as
    /// `Stripe-Account`).
    pub scope_headers: Vec<HeaderName>,
    /// Every header that scopes this upstream's keys and entities, in the order they are
    /// hashed ([`crate::key::credential_list`]): `credential_headers` (what the API
    /// authenticates with) or, unset, every common credential header; then `scope_headers`.
    /// A precheck or reconcile read sends these on the caller's behalf.
    pub credentials: Vec<HeaderName>,
    /// Entity locks, versions and claims shared by every credential (one account, several
    /// tokens); by default each credential scope has its own.
    pub share_entities: bool,
    /// Store (and replay) `Set-Cookie` headers of answers; by default they reach only the
    /// first caller.
    pub store_set_cookie: bool,
    /// The shape of the proxy's own errors on this upstream (its API's, for its SDKs).
    pub error_format: crate::error::ErrorFormat,
    /// Client keys an SDK generates for every call (`stripe-node-retry-*`, `{uuid}`): they
    /// only dedupe the SDK's own transport retries, so the route derives the key from the
    /// intent instead, and a workflow-level retry (a new SDK call) meets the first answer.
    pub sdk_keys: Vec<crate::key::KeyPattern>,
    /// Largest answer buffered and stored; a larger one streams to its first caller and its
    /// key is kept as completed without a body (retries get `409 answer_too_large`).
    pub max_answer: usize,
    /// The API's rate limit per account, kept by the proxy (`pace`): `None`, every request
    /// goes at once.
    pub pace: Option<pace::Budget>,
    /// `Authorization: Basic ...` from credentials in the upstream URL (`http://user:pw@host`),
    /// sent when the caller sends no `Authorization`. Never printed.
    pub url_credentials: Option<http::HeaderValue>,
    /// This upstream's routes, in file order.
    pub routes: Vec<Arc<Route>>,
    /// The rule for mutating requests that match no route when `unmatched = "protect"`:
    /// the header key, else the fingerprint; no entity.
    pub unmatched_route: Arc<Route>,
}

/// Every problem found in a config file, each as `file:line:col: message`.
#[derive(Debug)]
pub struct ConfigError {
    pub errors: Vec<String>,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.errors.join("\n"))
    }
}

impl std::error::Error for ConfigError {}

impl StoreConfig {
    /// The embedded store (one process, its own writer thread), not PostgreSQL.
    pub fn is_sqlite(&self) -> bool {
        self.url.starts_with("sqlite:")
    }

    /// The URL with its password masked, for logs and errors.
    pub fn display_url(&self) -> String {
        redact_url(&self.url)
    }

    /// `encryption=off`, or `encryption=on (key id …, previous …)`: key ids, never keys.
    pub fn encryption_summary(&self) -> String {
        let Some(c) = &self.encryption else {
            return "encryption=off".into();
        };
        let previous: Vec<&str> = c.previous_ids().collect();
        if previous.is_empty() {
            format!("encryption=on (key id {})", c.current_id())
        } else {
            format!(
                "encryption=on (key id {}, previous {})",
                c.current_id(),
                previous.join(",")
            )
        }
    }
}

impl Config {
    /// Loads and validates a file; `IDEMPROXY_STORE_URL` overrides `store.url`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            errors: vec![format!("{}: cannot read: {e}", path.display())],
        })?;
        let mut config = Config::from_toml(&text, &path.display().to_string())?;
        config.source = Some(path.to_owned());
        Ok(config)
    }

    /// Parses and validates config text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let env = |k: &str| std::env::var(k).ok();
        compile::compile(text, origin, &env)
    }

    /// Defaults applied when the route or upstream says nothing.
    pub const DEFAULT_METHODS: [Method; 4] =
        [Method::POST, Method::PUT, Method::PATCH, Method::DELETE];

    pub fn upstream(&self, name: &str) -> Option<&Arc<Upstream>> {
        self.upstreams.iter().find(|u| u.name == name)
    }
}
