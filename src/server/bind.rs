//! Binding a server's listeners, each with its accept loop: the main listener, each upstream's
//! own, the egress listener and the admin listener. They share the connection limits, the
//! HTTP settings, the cancel token that stops accepting, and (but the egress and admin
//! listeners) the connection threads.

use super::listener::{serve, Serving};
use super::router::{self, Listener};
use super::Handler;
use crate::admin;
use crate::config::Config;
use crate::connection::Http;
use crate::state::{AppState, Live};
use crate::threads::ConnThreads;
use anyhow::Context;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

pub(super) struct Binder {
    pub live: Live,
    pub limits: crate::server::accept::Limits,
    pub http: Arc<Http>,
    pub cancel: CancellationToken,
    /// Inbound TLS of the main and upstream listeners, when configured.
    pub tls: Option<TlsAcceptor>,
    pub threads: Arc<ConnThreads>,
    /// The accept loops started so far.
    pub loops: Vec<JoinHandle<()>>,
}

impl Binder {
    fn start(&mut self, l: TcpListener, serving: Serving, handler: Handler, threads: bool) {
        let threads = threads.then(|| self.threads.clone());
        self.loops.push(serve(
            l,
            serving,
            handler,
            self.limits,
            self.http.clone(),
            self.cancel.clone(),
            threads,
        ));
    }

    /// The main listener, where each upstream is reached by its prefix.
    pub async fn main(&mut self, addr: SocketAddr) -> anyhow::Result<SocketAddr> {
        let l = bind(addr).await?;
        let addr = l.local_addr()?;
        tracing::info!(addr = %addr, tls = self.tls.is_some(), "listening on main listener");
        crate::fault::serving();
        let handler = proxy_handler(&self.live, Listener::Main);
        self.start(l, Serving::plain(self.tls.clone()), handler, true);
        Ok(addr)
    }

    /// Each upstream's own listener, where every path goes to it as is.
    pub async fn upstreams(
        &mut self,
        config: &Config,
        main: SocketAddr,
    ) -> anyhow::Result<BTreeMap<String, SocketAddr>> {
        let mut addrs = BTreeMap::new();
        for u in config.upstreams.iter().filter(|u| u.listen.is_some()) {
            let l = bind(u.listen.unwrap_or(main)).await?;
            let addr = l.local_addr()?;
            tracing::info!(upstream = %u.name, addr = %addr, "listening on upstream listener");
            addrs.insert(u.name.clone(), addr);
            let handler = proxy_handler(&self.live, Listener::Upstream(u.clone()));
            self.start(l, Serving::plain(self.tls.clone()), handler, true);
        }
        Ok(addrs)
    }

    /// The egress listener, when it is on (its CA loaded first: a missing one stops the start).
    pub async fn egress(&mut self, config: &Config) -> anyhow::Result<Option<SocketAddr>> {
        let Some(a) = config.egress.listen else {
            return Ok(None);
        };
        for w in crate::config::egress::warnings(&config.upstreams) {
            tracing::warn!("{w}");
        }
        let ca = crate::ca::Authority::load(&config.egress.ca_cert, &config.egress.ca_key)?;
        let egress = Arc::new(crate::server::egress::Egress { ca });
        let l = bind(a).await?;
        let addr = l.local_addr()?;
        tracing::info!(addr = %addr, "listening on egress listener");
        let live = self.live.clone();
        let handler: Handler = Arc::new(move |req| {
            let (live, egress) = (live.clone(), egress.clone());
            Box::pin(async move { crate::server::egress::handle(live, egress, req).await })
        });
        let serving = Serving {
            tls: None,
            upgrades: true,
        };
        self.start(l, serving, handler, false);
        Ok(Some(addr))
    }

    /// The admin listener, when it is on.
    pub async fn admin(
        &mut self,
        config: &Config,
        state: &AppState,
    ) -> anyhow::Result<Option<SocketAddr>> {
        let Some(a) = config.server.admin_listen else {
            return Ok(None);
        };
        let l = bind(a).await?;
        let addr = l.local_addr()?;
        tracing::info!(addr = %addr, "listening on admin listener");
        if !admin::admin_open(state) {
            tracing::warn!(addr = %addr, "the admin listener is not on loopback and no admin_token is set: /admin/* is refused (403); /healthz, /readyz and /metrics are served. Set server.admin_token to use the admin API");
        }
        let live = self.live.clone();
        let handler: Handler = Arc::new(move |req| {
            let live = live.clone();
            Box::pin(async move { admin::handle(live, req).await })
        });
        self.start(l, Serving::plain(None), handler, false);
        Ok(Some(addr))
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
