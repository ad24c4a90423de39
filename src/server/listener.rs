//! One listener's loop: accept (within the limits, see [`super::accept`]), deal each
//! connection to a serving thread, hand it to [`crate::connection`] after inbound TLS — or,
//! on the egress listener, to hyper whole, since its requests may take it over — and at the
//! end wait for every connection to finish.

use super::Handler;
use crate::connection::{self, drive, Http, RequestBody, HEADER_READ_TIMEOUT};
use crate::threads::ConnThreads;
use anyhow::Context;
use http::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How a listener's connections are served: behind TLS or not, and whether a request may
/// take its connection over (`CONNECT` on the egress listener).
#[derive(Clone)]
pub(super) struct Serving {
    pub tls: Option<TlsAcceptor>,
    pub upgrades: bool,
}

impl Serving {
    pub(super) fn plain(tls: Option<TlsAcceptor>) -> Serving {
        Serving {
            tls,
            upgrades: false,
        }
    }
}

/// Accepts connections until cancelled, then drains them gracefully. With `threads`, the
/// connections are dealt in turn to the runtime's workers and to those threads.
pub(super) fn serve(
    listener: TcpListener,
    serving: Serving,
    handler: Handler,
    limits: crate::server::accept::Limits,
    http: Arc<Http>,
    cancel: CancellationToken,
    threads: Option<Arc<ConnThreads>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        // Cancelled once the listener stops accepting: parked connections close, exchanges
        // under way finish first; `open` is awaited until every connection has ended.
        let closing = CancellationToken::new();
        let open = TaskTracker::new();
        let mut acceptor = crate::server::accept::Acceptor::new(listener, limits);
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
    /// Its progress, and the token that sheds it (see [`crate::server::shed`]).
    progress: Arc<crate::server::shed::Conn>,
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
        let stream = crate::server::shed::Progress::new(stream, progress);
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
    let afterwards = crate::server::egress::Afterwards::new(http, closing.clone());
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
        let number = crate::connection::number();
        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
            heard.store(true, Ordering::Relaxed);
            let mut req = req.map(|b| RequestBody::untracked(b, number));
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

pub(super) fn tls_acceptor(files: &crate::config::TlsFiles) -> anyhow::Result<TlsAcceptor> {
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
