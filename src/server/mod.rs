//! The serving wing: listeners and lifecycle — bind, accept, hand each connection to
//! [`connection`] (after inbound TLS, if any), and a graceful shutdown that lets detached
//! upstream calls finish and be stored.
//!
//! - [`accept`]: the accept loop under hostile load: connection limits per listener and per
//!   peer, back-off when file descriptors run out, rate-limited logs.
//! - [`shed`]: at the connection limit, the connection that made the least progress is
//!   closed to admit a new one.
//! - [`router`]: the main-listener router: prefix → upstream, path safety, safe methods
//!   streamed through, route matching, `unmatched` policy.
//! - [`egress`]: the egress listener, an HTTP forward proxy for clients whose API host is
//!   fixed: `CONNECT`s to the hosts an upstream claims are intercepted with a leaf from the
//!   proxy's CA and run through the router as on that upstream's listener; tunnels spliced;
//!   any other host refused.
//!
//! Below the wing, shared with the rest: [`crate::connection`] (how one connection is served),
//! [`crate::threads`], [`crate::state`], [`crate::reload`].

pub mod accept;
mod bind;
pub mod egress;
mod listener;
pub mod router;
pub mod shed;

use crate::audit::Auditor;
use crate::config::Config;
use crate::connection::{Http, RequestBody};
use crate::locks::LockTable;
use crate::metrics::Stats;
use crate::state::{AppState, Live};
use crate::threads::ConnThreads;
use crate::upstream::ProxyBody;
use anyhow::Context;
use http::{Request, Response};
use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::connection::HEADER_READ_TIMEOUT;
use listener::tls_acceptor;

pub(super) type Handler = Arc<
    dyn Fn(Request<RequestBody>) -> Pin<Box<dyn Future<Output = Response<ProxyBody>> + Send>>
        + Send
        + Sync,
>;

/// A running proxy.
pub struct Server {
    pub main_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    /// The egress listener's bound address, when it is on.
    pub egress_addr: Option<SocketAddr>,
    /// Bound addresses of dedicated per-upstream listeners, by upstream name.
    pub upstream_addrs: BTreeMap<String, SocketAddr>,
    /// The state in force (a reload swaps it; shutdown uses its shared parts).
    live: Live,
    cancel: CancellationToken,
    loops: Vec<JoinHandle<()>>,
    /// Stops the audit writer (after it flushed) and the retention task.
    background_stop: CancellationToken,
    background: Vec<JoinHandle<()>>,
    /// Serving threads beside the runtime's workers (see [`crate::threads`]).
    threads: Arc<ConnThreads>,
}

impl Server {
    /// Opens the store (applying migrations), builds the clients, binds every listener.
    pub async fn start(config: Config) -> anyhow::Result<Server> {
        let config = Arc::new(config);
        let opened = open_store(&config).await?;
        // Before the clients: each keeps a pool of upstream connections per serving thread.
        let threads = start_threads(&config)?;
        let clients = crate::state::clients(&config)?;
        let stats = Arc::new(Stats::default());
        let background_stop = CancellationToken::new();
        let (auditor, mut background) =
            start_background(&opened.store, &stats, &config, &background_stop);
        // Each account's budget; on PostgreSQL counted with every replica's sends.
        let pacer = Arc::new(crate::pace::Pacer::new(
            stats.pace.clone(),
            opened.shared.clone(),
        ));
        let state = AppState {
            config: config.clone(),
            store: opened.store,
            shared: opened.shared,
            replay: opened.replay,
            pacer,
            auditor,
            clients,
            key_locks: LockTable::new(),
            entity_locks: LockTable::new(),
            stats,
            tracker: TaskTracker::new(),
            owner: format!("pid{}-{}", std::process::id(), crate::store::now_ms()),
            scoper: Arc::new(opened.scoper),
            legacy_scopes: opened.legacy_scopes,
            host_clients: Default::default(),
        };
        let live: Live = Arc::new(arc_swap::ArcSwap::from_pointee(state));
        let state = live.load_full();
        background.push(tokio::spawn(reload_on_hangup(
            live.clone(),
            background_stop.clone(),
        )));
        let tls = match &config.server.tls {
            Some(files) => Some(tls_acceptor(files)?),
            None => None,
        };
        let limits = crate::server::accept::Limits {
            total: config.server.max_connections,
            per_ip: config.server.max_connections_per_ip,
        };
        let mut binder = bind::Binder {
            http: Arc::new(Http::new(HEADER_READ_TIMEOUT, live.load().stats.parked())),
            live: live.clone(),
            limits,
            cancel: CancellationToken::new(),
            tls,
            threads: threads.clone(),
            loops: Vec::new(),
        };
        let main_addr = binder.main(config.server.listen).await?;
        let upstream_addrs = binder.upstreams(&config, main_addr).await?;
        let egress_addr = binder.egress(&config).await?;
        let admin_addr = binder.admin(&config, &state).await?;
        let (cancel, loops) = (binder.cancel, binder.loops);
        tracing::info!(
            store = state.store.backend(),
            upstreams = config.upstreams.len(),
            routes = config.routes.len(),
            "idemproxy ready"
        );
        Ok(Server {
            main_addr,
            admin_addr,
            egress_addr,
            upstream_addrs,
            live,
            cancel,
            loops,
            background_stop,
            background,
            threads,
        })
    }

    /// Request statistics (also served on `/metrics`).
    pub fn stats(&self) -> Arc<Stats> {
        self.live.load().stats.clone()
    }

    /// Stops accepting, lets open connections and detached upstream calls finish and be
    /// stored, then closes the store.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        for l in self.loops {
            let _ = l.await;
        }
        let state = self.live.load_full();
        state.tracker.close();
        state.tracker.wait().await;
        self.background_stop.cancel();
        for task in self.background {
            let _ = task.await;
        }
        state.store.close().await;
        // Their connections are over; what is left on them (idle upstream connections) goes.
        let threads = self.threads.clone();
        let _ = tokio::task::spawn_blocking(move || threads.stop()).await;
        tracing::info!("stopped");
    }
}

/// `SIGHUP` reloads the configuration file (see [`crate::reload`]).
async fn reload_on_hangup(live: Live, stop: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hangups) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot listen for SIGHUP; reload with POST /admin/reload");
            return;
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                got = hangups.recv() => {
                    if got.is_none() {
                        return;
                    }
                    tracing::info!("SIGHUP: reloading the configuration");
                    let _ = crate::reload::reload(&live).await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    stop.cancelled().await;
}

/// The store a serving process opened, with what sits beside it.
struct OpenedStore {
    store: Arc<dyn crate::store::Store>,
    shared: Option<Arc<dyn crate::store::Shared>>,
    /// A serving process replays hot keys from memory; a CLI process reads the store itself.
    replay: Arc<crate::store::replay::ReplayCache>,
    scoper: crate::key::ScopeKeyer,
    legacy_scopes: bool,
}

/// Opens the store (applying migrations), the replay cache beside it, and the secret that keys
/// its scopes, saying where that secret came from.
async fn open_store(config: &Config) -> anyhow::Result<OpenedStore> {
    let cipher = config.store.encryption.clone();
    let opened = crate::store::open(&config.store.url, config.store.lease, true, cipher)
        .await
        .with_context(|| format!("cannot open the store {}", config.store.display_url()))?;
    let replay = crate::store::replay::ReplayCache::beside(opened.store.as_ref());
    let (scoper, check, source) =
        crate::scope_secret::for_store(&config.store, opened.store.as_ref()).await?;
    tracing::info!(
        scopes_keyed_by = %source,
        "{}",
        config.store.encryption_summary()
    );
    if check.legacy_keys {
        tracing::info!(
            "keys stored before scopes were keyed remain: look-ups also try their unkeyed scopes"
        );
    }
    Ok(OpenedStore {
        store: opened.store,
        shared: opened.shared,
        replay,
        scoper,
        legacy_scopes: check.legacy_keys,
    })
}

/// The serving threads beside the runtime's workers (none on a small machine).
fn start_threads(config: &Config) -> anyhow::Result<Arc<ConnThreads>> {
    let threads = Arc::new(
        ConnThreads::start(crate::threads::for_config(config))
            .context("cannot start the connection threads")?,
    );
    if !threads.is_empty() {
        tracing::info!(
            threads = threads.len(),
            "connection threads beside the runtime's workers"
        );
    }
    Ok(threads)
}

/// The auditor and the retention purge, both stopped by `stop`.
fn start_background(
    store: &Arc<dyn crate::store::Store>,
    stats: &Arc<Stats>,
    config: &Config,
    stop: &CancellationToken,
) -> (Auditor, Vec<JoinHandle<()>>) {
    let (auditor, audit_task) = Auditor::start(store.clone(), stats.clone(), stop.clone());
    // Purge often enough that nothing outlives its retention by more than a quarter of it.
    let purge_every =
        (config.store.retention / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    let retention_task = tokio::spawn(crate::audit::retention(
        store.clone(),
        config.store.retention,
        purge_every,
        stop.clone(),
    ));
    (auditor, vec![audit_task, retention_task])
}
