//! The state every request shares: configuration, store, upstream clients, locks, stats,
//! the replay cache and the auditor. One `Arc<AppState>`, cloned per connection.

use crate::config::{Config, Upstream};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::locks::LockTable;
use crate::metrics::Stats;
use crate::store::replay::ReplayCache;
use crate::store::{Shared, Store};
use crate::upstream::UpstreamClient;
use std::collections::HashMap;
use std::sync::Arc;
use tokio_util::task::TaskTracker;

/// Everything a request needs, shared by all connections (cheap `Arc` clones).
pub struct AppState {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    /// The store's cross-process part (entity leases, watching another's key), when several
    /// processes share it (PostgreSQL).
    pub shared: Option<Arc<dyn Shared>>,
    /// Completed answers kept in memory, beside the store (see [`ReplayCache`]).
    pub replay: Arc<ReplayCache>,
    /// Each account's rate-limit budget at each API (see [`crate::pace`]); kept across
    /// reloads, as the API's own count is.
    pub pacer: Arc<crate::pace::Pacer>,
    pub clients: HashMap<String, Arc<UpstreamClient>>,
    /// Local waiters for a scoped key queue here instead of hammering the store.
    pub key_locks: LockTable,
    /// One protected request per entity at the upstream (in this process).
    pub entity_locks: LockTable,
    pub stats: Arc<Stats>,
    /// Detached upstream calls: shutdown waits for them to finish and be stored.
    pub tracker: TaskTracker,
    /// This process's identity as the owner of reservations.
    pub owner: String,
    /// Where requests' audit rows go (written in batches off the request path).
    pub auditor: crate::audit::Auditor,
    /// Keys credential scopes with the store's scope secret.
    pub scoper: Arc<crate::key::ScopeKeyer>,
    /// Keys stored before scopes were keyed (unkeyed scopes) may still be in the store: a look-up
    /// that finds nothing under the keyed scope also tries the old one.
    pub legacy_scopes: bool,
    /// Clients of upstreams whose URL is `https://{host}`, one per intercepted host, made on
    /// first use. A std `Mutex`: held to look up or insert, never across an await.
    pub host_clients: std::sync::Mutex<HashMap<(String, String), Arc<UpstreamClient>>>,
}

/// The state in force: a request takes the current one when it starts and keeps it to its
/// end, so a reload changes the rules for requests that start after it, never mid-request.
pub type Live = Arc<arc_swap::ArcSwap<AppState>>;

/// A client for every upstream of `config` (each with its own connection pool).
pub fn clients(config: &Config) -> anyhow::Result<HashMap<String, Arc<UpstreamClient>>> {
    let roots = crate::upstream::default_roots();
    let threads = crate::threads::for_config(config);
    let mut clients = HashMap::new();
    for u in &config.upstreams {
        clients.insert(
            u.name.clone(),
            Arc::new(UpstreamClient::new(u.clone(), &roots, threads)?),
        );
    }
    Ok(clients)
}

impl AppState {
    /// The same process under another configuration: the store, locks, stats, tracker,
    /// auditor and scope keyer are shared (a key's slot and an entity's lock are the same
    /// before and after a reload); the upstream clients are `config`'s.
    pub fn reconfigured(&self, config: Arc<Config>) -> anyhow::Result<AppState> {
        Ok(AppState {
            clients: clients(&config)?,
            config,
            store: self.store.clone(),
            shared: self.shared.clone(),
            replay: self.replay.clone(),
            pacer: self.pacer.clone(),
            key_locks: self.key_locks.clone(),
            entity_locks: self.entity_locks.clone(),
            stats: self.stats.clone(),
            tracker: self.tracker.clone(),
            owner: self.owner.clone(),
            auditor: self.auditor.clone(),
            scoper: self.scoper.clone(),
            legacy_scopes: self.legacy_scopes,
            host_clients: Default::default(),
        })
    }

    /// The store as an operator reads and acts on it: after every answer already given has
    /// committed, so what it shows never lags what a caller was told (an answer given before
    /// its commit is in the replay cache, not yet in the store).
    pub async fn operator(&self) -> &dyn Store {
        self.replay.settled().await;
        self.store.as_ref()
    }

    /// The client a request is sent with: its upstream's, or, for an upstream whose URL is
    /// `https://{host}`, the client of the host the request was intercepted for.
    pub fn client_for(
        &self,
        target: &crate::upstream::Target<'_>,
    ) -> ProxyResult<Arc<UpstreamClient>> {
        let upstream = target.upstream;
        if !upstream.url_host {
            return self.client(upstream).cloned();
        }
        let Some(host) = target.host else {
            return Err(ProxyError::new(
                ErrorKind::UpstreamUnreachable,
                format!(
                    "upstream {} sends each request to the host it was intercepted for (url https://{{host}}); a request on its prefix or listener has none: give the upstream a fixed url to use them",
                    upstream.name
                ),
            ));
        };
        let key = (upstream.name.clone(), host.to_owned());
        // A std `Mutex`, held to look up and to insert, never while a client is built.
        let found = {
            let clients = self.host_clients.lock().unwrap_or_else(|e| e.into_inner());
            clients.get(&key).cloned()
        };
        if let Some(c) = found {
            return Ok(c);
        }
        let unreachable = |e: String| ProxyError::new(ErrorKind::UpstreamUnreachable, e);
        let authority: http::uri::Authority = host
            .parse()
            .map_err(|_| unreachable(format!("{host:?} is not a host name")))?;
        let mut at_host = upstream.as_ref().clone();
        at_host.authority = authority;
        let threads = crate::threads::for_config(&self.config);
        let roots = crate::upstream::shared_roots();
        let client = UpstreamClient::new(Arc::new(at_host), roots, threads)
            .map_err(|e| unreachable(format!("no client for {host}: {e}")))?;
        let mut clients = self.host_clients.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded like the leaves (hosts come only from the upstreams' `hosts`): one out.
        if clients.len() >= 1024 {
            if let Some(old) = clients.keys().next().cloned() {
                clients.remove(&old);
            }
        }
        Ok(clients
            .entry(key)
            .or_insert_with(|| Arc::new(client))
            .clone())
    }

    /// The client of an upstream (always present: built for every upstream at start).
    pub fn client(&self, upstream: &Upstream) -> ProxyResult<&Arc<UpstreamClient>> {
        self.clients.get(&upstream.name).ok_or_else(|| {
            ProxyError::new(
                ErrorKind::UpstreamUnreachable,
                format!("no client for upstream {}", upstream.name),
            )
        })
    }
}
