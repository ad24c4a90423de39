//! The TOML as written: serde structs that mirror `proxy.toml`, with spans for `file:line:col`.
//!
//! Nothing here is validated beyond shape; [`super::compile`] turns these into the compiled
//! types the hot path uses. `deny_unknown_fields` everywhere: a typo is an error, not a no-op.

use serde::Deserialize;
use std::collections::BTreeMap;
use toml::Spanned;

pub type Str = Spanned<String>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub upstreams: BTreeMap<String, Spanned<RawUpstream>>,
    #[serde(default)]
    pub routes: Vec<Spanned<RawRoute>>,
    pub egress: Option<RawEgress>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEgress {
    pub listen: Option<Str>,
    pub ca_cert: Option<Str>,
    pub ca_key: Option<Str>,
    pub tunnel: Option<Vec<Str>>,
    pub proxy_token: Option<Str>,
    pub handshake_timeout: Option<Str>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<Str>,
    pub admin_listen: Option<Str>,
    pub admin_token: Option<Str>,
    pub max_body: Option<Str>,
    pub body_timeout: Option<Str>,
    pub max_answer: Option<Str>,
    pub max_connections: Option<Spanned<i64>>,
    pub max_connections_per_ip: Option<Spanned<i64>>,
    pub workers: Option<Spanned<i64>>,
    pub workflow_header: Option<Str>,
    pub tls: Option<Spanned<RawTls>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub cert: Str,
    pub key: Str,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub url: Option<Str>,
    pub retention: Option<Str>,
    pub lease: Option<Str>,
    pub scope_secret: Option<Str>,
    pub encryption_key: Option<Str>,
    pub encryption_keys_previous: Option<Vec<Str>>,
    pub answer_before_commit: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub url: Str,
    pub prefix: Option<Str>,
    pub listen: Option<Str>,
    pub timeout: Option<Str>,
    pub native_idempotency_header: Option<Str>,
    pub release_statuses: Option<Spanned<Vec<Spanned<i64>>>>,
    pub unmatched: Option<Str>,
    pub ca_file: Option<Str>,
    pub scope_headers: Option<Vec<Str>>,
    pub credential_headers: Option<Vec<Str>>,
    pub hosts: Option<Vec<Str>>,
    pub share_entities: Option<bool>,
    pub error_format: Option<Str>,
    pub mode: Option<Str>,
    pub sdk_keys: Option<Vec<Str>>,
    pub store_set_cookie: Option<bool>,
    pub max_answer: Option<Str>,
    pub pace: Option<Spanned<RawPace>>,
}

/// `pace = { rate = 100, per = "10s", burst = 100, max_wait = "30s" }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPace {
    pub rate: Spanned<i64>,
    pub per: Option<Str>,
    pub burst: Option<Spanned<i64>>,
    pub max_wait: Option<Str>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Str,
    pub upstream: Str,
    pub methods: Option<Vec<Str>>,
    pub path: Str,
    pub entity: Option<Str>,
    pub key: Option<Spanned<RawKey>>,
    pub in_flight: Option<Str>,
    pub mode: Option<Str>,
    pub lock_timeout: Option<Str>,
    pub fingerprint: Option<RawFingerprint>,
    pub version: Option<Str>,
    pub claim: Option<bool>,
    pub claim_ttl: Option<Str>,
    pub release_claim: Option<bool>,
    pub precheck: Option<Spanned<RawPrecheck>>,
    pub reconcile: Option<Spanned<RawReconcile>>,
    pub retention: Option<Str>,
    pub read_only: Option<bool>,
    pub stamp: Option<Str>,
    pub resend_unknown: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    pub header: Option<Str>,
    /// `"…"`, or a list tried in order (see `KeyRule::derive`).
    pub derive: Option<Spanned<toml::Value>>,
    pub required: Option<bool>,
    pub window: Option<Str>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFingerprint {
    #[serde(default)]
    pub ignore: Vec<Str>,
    #[serde(default)]
    pub headers: Vec<Str>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrecheck {
    pub method: Option<Str>,
    pub path: Str,
    pub expect_status: Option<Vec<Spanned<i64>>>,
    #[serde(default)]
    pub expect: BTreeMap<String, Spanned<toml::Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReconcile {
    pub method: Option<Str>,
    pub path: Str,
    pub found: Option<Vec<Spanned<i64>>>,
    pub not_found: Option<Vec<Spanned<i64>>>,
    pub answer_status: Option<Spanned<i64>>,
    pub after: Option<Str>,
    #[serde(default)]
    pub expect: BTreeMap<String, Spanned<toml::Value>>,
    pub answer: Option<Spanned<toml::Value>>,
    pub answer_path: Option<Str>,
    pub unless: Option<Vec<Str>>,
}
