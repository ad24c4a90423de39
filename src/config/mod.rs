//! `proxy.toml`, compiled: what the hot path reads, already validated.
//!
//! Two layers (as rpxy does it): [`raw`] mirrors the TOML, [`compile`] turns it into these
//! types once at load — route matchers built, templates parsed and checked against their
//! route, durations and sizes parsed, URLs parsed. Every problem is reported as
//! `file:line:col: message`, all of them at once.

pub(super) mod compile;
mod compiler;
pub mod egress;
pub mod raw;
mod routes;
mod side_reads;
mod store;
pub mod units;

pub use crate::key::FingerprintRule;
pub use crate::redact::redact_url;
use crate::rules::body::BodyPath;
use crate::rules::pattern::PathPattern;
use crate::rules::template::Template;
pub use egress::{EgressConfig, HostPattern};
use http::{HeaderName, Method};
pub use routes::intent_only;
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
    /// `Authorization: Basic ...` from credentials in the upstream URL (`http://user:pw@host`),
    /// sent when the caller sends no `Authorization`. Never printed.
    pub url_credentials: Option<http::HeaderValue>,
    /// This upstream's routes, in file order.
    pub routes: Vec<Arc<Route>>,
    /// The rule for mutating requests that match no route when `unmatched = "protect"`:
    /// the header key, else the fingerprint; no entity.
    pub unmatched_route: Arc<Route>,
}

/// What the proxy does with a protected request (SPEC "Observe mode").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Keys, locks, checks: duplicates are replayed, conflicts refused.
    #[default]
    Enforce,
    /// Everything is forwarded as is; what enforce mode would have done is recorded.
    Observe,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Observe => "observe",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "enforce" => Some(Mode::Enforce),
            "observe" => Some(Mode::Observe),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    Wait,
    Reject,
}

#[derive(Debug)]
pub struct KeyRule {
    /// `None` when `header = ""`: client keys are ignored.
    pub header: Option<HeaderName>,
    /// Tried in order: the first template whose every field the request has makes the key
    /// (a workflow engine's run id when it sends one, else the intent alone). Empty: no
    /// derivation.
    pub derive: Vec<Template>,
    pub required: bool,
    /// How long a key derived from the intent alone (a template that reads no header) stays
    /// a retry: an identical call within it gets the first answer, one after it is a new
    /// action. `None`: the route's retention. Keys from a client header or a run id keep
    /// the retention.
    pub window: Option<Duration>,
}

impl KeyRule {
    /// The `{fingerprint}` default of a route without `key.derive`.
    pub fn default_derive() -> Vec<Template> {
        Template::parse("{fingerprint}").into_iter().collect()
    }
}

#[derive(Debug)]
pub struct Precheck {
    pub method: Method,
    pub path: Template,
    pub expect_status: Vec<u16>,
    /// `body.status` = "free": a body path and the JSON value it must hold.
    pub expect: Vec<(BodyPath, serde_json::Value)>,
}

/// SPEC "Reconciling unknown outcomes": how to ask the real system whether a write whose
/// answer was lost happened, so a retry gets the object instead of `409 outcome_unknown`.
#[derive(Debug)]
pub struct Reconcile {
    pub method: Method,
    /// A template over the original request.
    pub path: Template,
    pub found: Vec<u16>,
    pub not_found: Vec<u16>,
    /// The status a found write is answered (and replayed) with, when not the read's own: a
    /// create's client may accept only `201` (@hubspot/api-client does).
    pub answer_status: Option<u16>,
    /// How long to wait before the read (and the least time between two reads of one key).
    pub after: Duration,
    /// Body fields a `found` answer must hold, else it counts as `not_found`.
    pub expect: Vec<(BodyPath, Expected)>,
    /// The body a found write is answered with, when the read's own is not what the write
    /// answers (a list read by `external_id` for a create that answers one object): JSON in
    /// which a string `"{read}"` is the read's body and `"{read.X}"` its field `X`. A field
    /// the read lacks counts as `not_found` (an empty list found nothing).
    pub answer: Option<serde_json::Value>,
    /// Body fields that, when a request has one, leave its lost answer unreconciled (it stays
    /// unknown): a ticket update that adds a comment is not "found" by reading the ticket,
    /// and sending it again would add the comment twice.
    pub unless: Vec<BodyPath>,
}

/// An expected value: as written, or a template over the original request.
#[derive(Debug)]
pub enum Expected {
    Value(serde_json::Value),
    Template(Template),
    /// Exactly one body field (`"{body.properties}"`): its JSON value, objects too, less the
    /// parts `fingerprint.ignore` leaves out (`strip`, relative to the field), so every retry
    /// of the write asks the same question.
    Field {
        path: BodyPath,
        strip: Vec<BodyPath>,
    },
}

#[derive(Debug)]
pub struct Route {
    pub name: String,
    pub upstream: String,
    pub methods: Vec<Method>,
    pub path_text: String,
    pub path: PathPattern,
    pub entity: Option<Template>,
    pub key: KeyRule,
    pub in_flight: InFlight,
    /// The route's own `mode`, else its upstream's, else enforce.
    pub mode: Mode,
    pub lock_timeout: Duration,
    pub fingerprint: FingerprintRule,
    pub version: Option<Template>,
    /// Claim-first: the first key to succeed owns the entities for this long.
    pub claim: Option<Duration>,
    pub release_claim: bool,
    pub precheck: Option<Precheck>,
    pub reconcile: Option<Reconcile>,
    /// How long a completed key stays replayable: the route's, else `store.retention`
    /// (resolved at load).
    pub retention: Duration,
    /// Some template or rule reads the body: it must parse.
    pub needs_body: bool,
    /// A read sent as POST (a search, a batch read): never keyed, locked or recorded;
    /// streamed through like a GET.
    pub read_only: bool,
    /// The body field this route writes its stamp into before forwarding (`stamp =
    /// "body.ticket.external_id"`): a value made from the scoped key and its action, so a
    /// reconcile read can find the object by it (`{stamp}` in `reconcile.path`) where the API
    /// has no other consistent read for a create.
    pub stamp: Option<BodyPath>,
    /// The upstream applies this write idempotently (the same association created twice is
    /// one; an upsert by email sets the same values): after an unknown outcome a retry is
    /// sent again with the same key, as to an upstream that dedupes by its own header.
    pub resend_unknown: bool,
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

impl Route {
    /// The implicit route of `unmatched = "protect"`.
    pub fn unmatched(upstream: &str, retention: Duration, mode: Mode) -> Route {
        Route {
            name: format!("{upstream}:unmatched"),
            upstream: upstream.to_owned(),
            methods: Config::DEFAULT_METHODS.to_vec(),
            path_text: "/{*path}".into(),
            path: PathPattern::parse("/{*path}")
                .unwrap_or_else(|_| unreachable!("constant pattern")),
            entity: None,
            key: KeyRule {
                header: Some(HeaderName::from_static("idempotency-key")),
                derive: KeyRule::default_derive(),
                required: true,
                window: None,
            },
            in_flight: InFlight::Wait,
            mode,
            lock_timeout: Duration::from_secs(30),
            fingerprint: FingerprintRule::default(),
            version: None,
            claim: None,
            release_claim: false,
            precheck: None,
            reconcile: None,
            retention,
            needs_body: false,
            read_only: false,
            stamp: None,
            resend_unknown: false,
        }
    }

    /// One line for `idemproxy check`.
    pub fn summary(&self) -> String {
        let methods: Vec<&str> = self.methods.iter().map(|m| m.as_str()).collect();
        if self.read_only {
            return format!(
                "{}: upstream={} methods={} path={} key=none read_only (streamed; never keyed, locked or replayed)",
                self.name,
                self.upstream,
                methods.join(","),
                self.path_text
            );
        }
        let derive: Vec<&str> = self.key.derive.iter().map(|d| d.text()).collect();
        let derive = derive.join(", else ");
        let mut key = match (&self.key.header, derive.is_empty()) {
            (Some(h), false) => format!("header {h}, else derive {derive}"),
            (Some(h), true) => format!("header {h}"),
            (None, false) => format!("derive {derive}"),
            (None, true) => "none".into(),
        };
        if let Some(w) = self.key.window {
            let w = units::show_duration(w);
            key.push_str(&format!("; intent-only keys a retry within {w}"));
        }
        let required = if self.key.required {
            "required"
        } else {
            "optional"
        };
        let mut reconcile = match &self.reconcile {
            Some(rc) => format!(" reconcile={} {}", rc.method, rc.path.text()),
            None => String::new(),
        };
        if let Some(rc) = self.reconcile.as_ref().filter(|rc| !rc.unless.is_empty()) {
            let unless: Vec<String> = rc.unless.iter().map(|p| format!("body.{p}")).collect();
            reconcile.push_str(&format!(" unless {}", unless.join(",")));
        }
        if let Some(field) = &self.stamp {
            reconcile.push_str(&format!(" stamp=body.{field}"));
        }
        if self.resend_unknown {
            reconcile.push_str(" resend_unknown");
        }
        format!(
            "{}: upstream={} methods={} path={} entity={} key=[{key}] ({required}) in_flight={} mode={}{reconcile}",
            self.name,
            self.upstream,
            methods.join(","),
            self.path_text,
            self.entity.as_ref().map(|t| t.text()).unwrap_or("-"),
            self.in_flight.as_str(),
            self.mode.as_str()
        )
    }
}
