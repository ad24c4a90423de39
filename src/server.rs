//! Listeners and lifecycle: bind, accept, hand each connection to [`crate::connection`]
//! (after inbound TLS, if any), and a graceful shutdown that lets detached upstream calls
//! finish and be stored.

use crate::admin;
use crate::audit::Auditor;
use crate::config::Config;
use crate::connection::{self, Http, RequestBody};
use crate::locks::LockTable;
use crate::metrics::Stats;
use crate::router::{self, Listener};
use crate::state::{AppState, Live};
use crate::threads::ConnThreads;
use crate::upstream::ProxyBody;
use anyhow::Context;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a client may take to send a request head (and how long a connection may idle).
use crate::accept::{drive, HEADER_READ_TIMEOUT};
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

type Handler = Arc<
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
        let cipher = config.store.encryption.clone();
        let store = crate::store::open(&config.store.url, config.store.lease, true, cipher)
            .await
            .with_context(|| format!("cannot open the store {}", config.store.display_url()))?;
        let (scoper, check, source) =
            crate::scope_secret::for_store(&config.store, store.as_ref()).await?;
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
        // Before the clients: each keeps a pool of upstream connections per serving thread.
        let threads = Arc::new(
            ConnThreads::start(crate::threads::for_config(&config))
                .context("cannot start the connection threads")?,
        );
        if !threads.is_empty() {
            tracing::info!(
                threads = threads.len(),
                "connection threads beside the runtime's workers"
            );
        }
        let clients = crate::state::clients(&config)?;
        let stats = Arc::new(Stats::default());
        let background_stop = CancellationToken::new();
        let (auditor, audit_task) =
            Auditor::start(store.clone(), stats.clone(), background_stop.clone());
        // Purge often enough that nothing outlives its retention by more than a quarter of it.
        let purge_every =
            (config.store.retention / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
        let retention_task = tokio::spawn(crate::audit::retention(
            store.clone(),
            config.store.retention,
            purge_every,
            background_stop.clone(),
        ));
        let state = AppState {
            config: config.clone(),
            store,
            auditor,
            clients,
            key_locks: LockTable::new(),
            entity_locks: LockTable::new(),
            stats,
            tracker: TaskTracker::new(),
            owner: format!("pid{}-{}", std::process::id(), crate::store::now_ms()),
            scoper: Arc::new(scoper),
            legacy_scopes: check.legacy_keys,
            host_clients: Default::default(),
        };
        let live: Live = Arc::new(arc_swap::ArcSwap::from_pointee(state));
        let state = live.load_full();
        let hangup = tokio::spawn(reload_on_hangup(live.clone(), background_stop.clone()));
        let tls = match &config.server.tls {
            Some(files) => Some(tls_acceptor(files)?),
            None => None,
        };
        let cancel = CancellationToken::new();
        let mut loops = Vec::new();
        let http = Arc::new(Http::new(HEADER_READ_TIMEOUT, live.load().stats.parked()));

        let main = bind(config.server.listen).await?;
        let main_addr = main.local_addr()?;
        tracing::info!(addr = %main_addr, tls = tls.is_some(), "listening on main listener");
        crate::fault::serving();
        let limits = crate::accept::Limits {
            total: config.server.max_connections,
            per_ip: config.server.max_connections_per_ip,
        };
        loops.push(serve(
            main,
            Serving::plain(tls.clone()),
            proxy_handler(&live, Listener::Main),
            limits,
            http.clone(),
            cancel.clone(),
            Some(threads.clone()),
        ));

        let mut upstream_addrs = BTreeMap::new();
        for u in config.upstreams.iter().filter(|u| u.listen.is_some()) {
            let l = bind(u.listen.unwrap_or(main_addr)).await?;
            let addr = l.local_addr()?;
            tracing::info!(upstream = %u.name, addr = %addr, "listening on upstream listener");
            upstream_addrs.insert(u.name.clone(), addr);
            loops.push(serve(
                l,
                Serving::plain(tls.clone()),
                proxy_handler(&live, Listener::Upstream(u.clone())),
                limits,
                http.clone(),
                cancel.clone(),
                Some(threads.clone()),
            ));
        }

        let egress_addr = match config.egress.listen {
            Some(a) => {
                for w in crate::config::egress::warnings(&config.upstreams) {
                    tracing::warn!("{w}");
                }
                let ca = crate::egress::ca::Authority::load(
                    &config.egress.ca_cert,
                    &config.egress.ca_key,
                )?;
                let egress = Arc::new(crate::egress::Egress { ca });
                let l = bind(a).await?;
                let addr = l.local_addr()?;
                tracing::info!(addr = %addr, "listening on egress listener");
                let live = live.clone();
                let handler: Handler = Arc::new(move |req| {
                    let (live, egress) = (live.clone(), egress.clone());
                    Box::pin(async move { crate::egress::handle(live, egress, req).await })
                });
                let serving = Serving {
                    tls: None,
                    upgrades: true,
                };
                loops.push(serve(
                    l,
                    serving,
                    handler,
                    limits,
                    http.clone(),
                    cancel.clone(),
                    None,
                ));
                Some(addr)
            }
            None => None,
        };

        let admin_addr = match config.server.admin_listen {
            Some(a) => {
                let l = bind(a).await?;
                let addr = l.local_addr()?;
                tracing::info!(addr = %addr, "listening on admin listener");
                if !admin::admin_open(&state) {
                    tracing::warn!(addr = %addr, "the admin listener is not on loopback and no admin_token is set: /admin/* is refused (403); /healthz, /readyz and /metrics are served. Set server.admin_token to use the admin API");
                }
                let live = live.clone();
                let handler: Handler = Arc::new(move |req| {
                    let live = live.clone();
                    Box::pin(async move { admin::handle(live, req).await })
                });
                loops.push(serve(
                    l,
                    Serving::plain(None),
                    handler,
                    limits,
                    http.clone(),
                    cancel.clone(),
                    None,
                ));
                Some(addr)
            }
            None => None,
        };
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
            background: vec![audit_task, retention_task, hangup],
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

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// Each request takes the state in force when it starts (see [`Live`]).
fn proxy_handler(live: &Live, listener: Listener) -> Handler {
    let live = live.clone();
    Arc::new(move |req| {
        let (state, listener) = (live.load_full(), listener.clone());
        Box::pin(async move { router::handle(state, listener, req).await })
    })
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

/// Accepts connections until cancelled, then drains them gracefully. With `threads`, the
/// connections are dealt in turn to the runtime's workers and to those threads.
/// How a listener's connections are served: behind TLS or not, and whether a request may
/// take its connection over (`CONNECT` on the egress listener).
#[derive(Clone)]
struct Serving {
    tls: Option<TlsAcceptor>,
    upgrades: bool,
}

impl Serving {
    fn plain(tls: Option<TlsAcceptor>) -> Serving {
        Serving {
            tls,
            upgrades: false,
        }
    }
}

fn serve(
    listener: TcpListener,
    serving: Serving,
    handler: Handler,
    limits: crate::accept::Limits,
    http: Arc<Http>,
    cancel: CancellationToken,
    threads: Option<Arc<ConnThreads>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        // Cancelled once the listener stops accepting: parked connections close, exchanges
        // under way finish first; `open` is awaited until every connection has ended.
        let closing = CancellationToken::new();
        let open = TaskTracker::new();
        let mut acceptor = crate::accept::Acceptor::new(listener, limits);
        loop {
            let (stream, peer, permit) = tokio::select! {
                _ = cancel.cancelled() => break,
                accepted = acceptor.next() => accepted,
            };
            let _ = stream.set_nodelay(true);
            let conn = Connection {
                serving: serving.clone(),
                http: http.clone(),
                // A token of its own: waiting on the listener's one would take that token's
                // lock on every request of every connection.
                closing: closing.child_token(),
                handler: handler.clone(),
                peer,
                progress: permit.conn(),
            };
            match threads.as_ref().and_then(|t| t.next()) {
                None => {
                    tokio::spawn(open.track_future(async move {
                        conn.serve(stream).await;
                        drop(permit);
                    }));
                }
                // Moved to the thread's own I/O driver, so its readiness wakes that thread.
                Some(thread) => match stream.into_std() {
                    Ok(stream) => {
                        thread.spawn(open.track_future(async move {
                            match TcpStream::from_std(stream) {
                                Ok(stream) => conn.serve(stream).await,
                                Err(e) => tracing::debug!(%peer, error = %e, "cannot register the connection on its thread"),
                            }
                            drop(permit);
                        }));
                    }
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "cannot hand the connection to its thread")
                    }
                },
            }
        }
        drop(acceptor);
        closing.cancel();
        open.close();
        open.wait().await;
    })
}

/// An accepted connection and what serving it takes, wherever it is served.
struct Connection {
    serving: Serving,
    http: Arc<Http>,
    closing: CancellationToken,
    handler: Handler,
    peer: SocketAddr,
    /// Its progress, and the token that sheds it (see [`crate::shed`]).
    progress: Arc<crate::shed::Conn>,
}

impl Connection {
    /// Serves the connection to its end, or until it is shed to admit another.
    async fn serve(self, stream: TcpStream) {
        let (peer, progress) = (self.peer, self.progress.clone());
        tokio::select! {
            _ = self.serve_inner(stream) => {}
            _ = progress.shed().cancelled() => {
                tracing::debug!(%peer, "shed: every slot taken, and this connection made the least progress");
            }
        }
    }

    /// Serves the connection (after its TLS handshake, if any) to its end.
    async fn serve_inner(self, stream: TcpStream) {
        let Connection {
            serving: Serving { tls, upgrades },
            http,
            closing,
            handler,
            peer,
            progress,
        } = self;
        let stream = crate::shed::Progress::new(stream, progress);
        // What only some connections need is boxed: a task is as large as its largest state,
        // and every plain connection would pay for TLS's.
        if upgrades {
            return serve_upgrading(stream, handler, http, &closing, peer).await;
        }
        let handle = move |req| handler(req);
        let Some(acceptor) = tls else {
            return connection::serve(stream, &http, handle, &closing, &peer).await;
        };
        // The handshake runs in the connection's task, never in the accept loop.
        let handshake = Box::pin(acceptor.accept(stream));
        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, handshake).await {
            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            Ok(Ok(tls)) => Box::pin(connection::serve(tls, &http, handle, &closing, &peer)).await,
            Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
        }
    }
}

/// A connection whose requests may take it over (`CONNECT` on the egress listener), served
/// whole by hyper; the tunnels it leaves are awaited so they keep the connection's slot.
async fn serve_upgrading<I>(
    io: I,
    handler: Handler,
    http: Arc<Http>,
    closing: &CancellationToken,
    peer: SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let afterwards = crate::egress::Afterwards::new(http, closing.clone());
    let slot = afterwards.clone();
    // Boxed, so what serving the requests took is freed while the tunnels they left run.
    Box::pin(async move {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT);
        // Set by the first request: a connection that sends none in time is closed.
        let spoke = Arc::new(AtomicBool::new(false));
        let heard = spoke.clone();
        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
            heard.store(true, Ordering::Relaxed);
            let mut req = req.map(RequestBody::untracked);
            req.extensions_mut().insert(slot.clone());
            let answer = handler(req);
            async move { Ok::<_, Infallible>(answer.await) }
        });
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), svc);
        let served = async move {
            tokio::pin!(conn);
            tokio::select! {
                done = conn.as_mut() => done,
                _ = closing.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            }
        };
        drive(served, &spoke, peer).await;
    })
    .await;
    for tunnel in afterwards.take() {
        let _ = tunnel.await;
    }
}

fn tls_acceptor(files: &crate::config::TlsFiles) -> anyhow::Result<TlsAcceptor> {
    let cert_pem = std::fs::read(&files.cert)
        .with_context(|| format!("cannot read {}", files.cert.display()))?;
    let key_pem = std::fs::read(&files.key)
        .with_context(|| format!("cannot read {}", files.key.display()))?;
    let certs = rustls_pemfile::certs(&mut cert_pem.as_slice()).collect::<Result<Vec<_>, _>>()?;
    let key = rustls_pemfile::private_key(&mut key_pem.as_slice())?
        .with_context(|| format!("no private key in {}", files.key.display()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}
