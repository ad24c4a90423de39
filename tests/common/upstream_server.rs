//! The serving side of a [`RecordingUpstream`](super::RecordingUpstream): state shared with the
//! test's handle, the accept loop (plain or TLS), and the hyper service. Every request goes
//! through [`Shared::admit`], which records it, counts it in flight per entity, runs the
//! handler and holds it at the gate when asked.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::message::{Action, EntityFn, Handler, Recorded, Reply};
use super::raw_upstream;

/// Everything the serving tasks and the test's handle share.
pub(crate) struct Shared {
    handler: Handler,
    entities: EntityFn,
    /// Hold every request, whatever the handler says.
    hold_all: bool,
    /// Std mutex: only short critical sections, never held across an `.await`.
    state: Mutex<State>,
    /// Held requests wait for a permit here; `release_all` closes it, which lets every present
    /// and future waiter through.
    pub(crate) gate: Semaphore,
    /// Bumped after every state change; the `wait_for_*` helpers await it instead of polling.
    pub(crate) changed: watch::Sender<u64>,
}

/// What the upstream saw, read by the test's handle.
#[derive(Default)]
pub(crate) struct State {
    pub(crate) requests: Vec<Recorded>,
    pub(crate) in_flight: HashMap<String, usize>,
    pub(crate) max_in_flight: HashMap<String, usize>,
    pub(crate) in_flight_total: usize,
    pub(crate) max_in_flight_total: usize,
    pub(crate) held: usize,
    pub(crate) connections: usize,
}

impl Shared {
    pub(crate) fn new(handler: Handler, entities: EntityFn, hold_all: bool) -> Shared {
        Shared {
            handler,
            entities,
            hold_all,
            state: Mutex::new(State::default()),
            gate: Semaphore::new(0),
            changed: watch::channel(0).0,
        }
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        // A panicking handler must not turn every later assertion into a poison error.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    pub(crate) fn connection_opened(&self) {
        self.state().connections += 1;
        self.bump();
    }

    /// Records a request, counts it in flight, runs the handler and, if asked, holds the
    /// request until released. The returned guard keeps the request counted in flight.
    pub(crate) async fn admit(self: &Arc<Self>, mut rec: Recorded) -> (Reply, u64, InFlight) {
        let entities: Vec<String> = {
            let set: BTreeSet<String> = (self.entities)(&rec).into_iter().collect();
            set.into_iter().collect()
        };
        let seq = {
            let mut state = self.state();
            let seq = state.requests.len() as u64 + 1;
            rec.seq = seq;
            for entity in &entities {
                let now = state.in_flight.entry(entity.clone()).or_default();
                *now += 1;
                let now = *now;
                let max = state.max_in_flight.entry(entity.clone()).or_default();
                *max = (*max).max(now);
            }
            state.in_flight_total += 1;
            state.max_in_flight_total = state.max_in_flight_total.max(state.in_flight_total);
            state.requests.push(rec.clone());
            seq
        };
        let guard = InFlight {
            shared: self.clone(),
            entities,
        };
        self.bump();

        let reply = (self.handler)(&rec, seq);
        if reply.hold || self.hold_all {
            let _held = Held::new(self);
            match self.gate.acquire().await {
                Ok(permit) => permit.forget(),
                Err(_closed) => {} // release_all: the gate is open for good
            }
        }
        (reply, seq, guard)
    }
}

/// Counts a request in flight until dropped (answered, dropped, or its connection closed).
pub(crate) struct InFlight {
    shared: Arc<Shared>,
    entities: Vec<String>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        {
            let mut state = self.shared.state();
            for entity in &self.entities {
                if let Some(n) = state.in_flight.get_mut(entity) {
                    *n -= 1;
                }
            }
            state.in_flight_total -= 1;
        }
        self.shared.bump();
    }
}

/// Counts a request as held while it waits at the gate.
struct Held {
    shared: Arc<Shared>,
}

impl Held {
    fn new(shared: &Arc<Shared>) -> Held {
        shared.state().held += 1;
        shared.bump();
        Held {
            shared: shared.clone(),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.shared.state().held -= 1;
        self.shared.bump();
    }
}

pub(crate) async fn accept_loop(
    listener: TcpListener,
    acceptor: Option<TlsAcceptor>,
    raw: bool,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) {
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(_) => continue,
            },
            _ = cancel.cancelled() => return,
        };
        shared.connection_opened();
        let shared = shared.clone();
        let acceptor = acceptor.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let conn = async move {
                match acceptor {
                    Some(acceptor) => {
                        if let Ok(tls) = acceptor.accept(tcp).await {
                            serve(tls, raw, shared).await;
                        }
                    }
                    None => serve(tcp, raw, shared).await,
                }
            };
            tokio::select! {
                _ = conn => {}
                _ = cancel.cancelled() => {}
            }
        });
    }
}

async fn serve<S>(stream: S, raw: bool, shared: Arc<Shared>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if raw {
        raw_upstream::serve(stream, shared).await;
        return;
    }
    let service = service_fn(move |req| handle(shared.clone(), req));
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // A connection error (client reset, scripted drop) only ends this connection.
    let _ = builder
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, BoxError> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let path_and_query = parts.uri.path_and_query().map_or_else(
        || parts.uri.path().to_string(),
        |pq| pq.as_str().to_string(),
    );
    let authority = parts
        .uri
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| {
            parts
                .headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        });
    let rec = Recorded {
        seq: 0,
        method: parts.method,
        path_and_query,
        authority,
        headers: parts.headers,
        body,
        version: parts.version,
    };
    let (reply, seq, in_flight) = shared.admit(rec).await;
    match reply.action {
        Action::Respond => {
            let mut response = Response::new(Full::new(reply.body.clone()));
            *response.status_mut() = http::StatusCode::from_u16(reply.status)
                .unwrap_or_else(|e| panic!("scripted status {}: {e}", reply.status));
            *response.headers_mut() = reply.header_map(seq);
            drop(in_flight);
            Ok(response)
        }
        Action::Drop => {
            drop(in_flight);
            // hyper closes an HTTP/1 connection (and resets an HTTP/2 stream) on a service error.
            Err("scripted drop: closing without an answer".into())
        }
        Action::Hang => {
            let _in_flight = in_flight;
            std::future::pending().await
        }
    }
}
