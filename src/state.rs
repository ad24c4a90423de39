//! The state every request shares: configuration, store, upstream clients, locks, stats,
//! the replay cache and the auditor. One `Arc<AppState>`, cloned per connection.

use crate::config::{Config, Upstream};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::locks::LockTable;
use crate::metrics::Stats;
use crate::store::Store;
use crate::upstream::UpstreamClient;
use std::collections::HashMap;
use std::sync::Arc;
use tokio_util::task::TaskTracker;

/// Everything a request needs, shared by all connections (cheap `Arc` clones).
pub struct AppState {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
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
    pub scoper: crate::key::ScopeKeyer,
    /// Keys stored by the first release (unkeyed scopes) may still be in the store: a look-up
    /// that finds nothing under the keyed scope also tries the old one.
    pub legacy_scopes: bool,
}

impl AppState {
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
