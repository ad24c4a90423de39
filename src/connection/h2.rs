//! HTTP/2 connections (told by their preface): served whole by hyper, which multiplexes
//! their streams; there is no idle socket to park between requests.

use super::{drive, Http, RequestBody, Rewind};
use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::fmt::Display;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;

/// An HTTP/2 connection, served whole by hyper; closed if it begins no request in time.
pub(super) async fn serve<I, H, F, B>(
    io: Rewind<I>,
    http: &Http,
    handler: H,
    closing: &CancellationToken,
    peer: &(dyn Display + Sync),
    conn: u64,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<RequestBody>) -> F + Clone + Send + Sync + Unpin + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let spoke = Arc::new(AtomicBool::new(false));
    let heard = spoke.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        heard.store(true, Ordering::Relaxed);
        let answer = handler(req.map(|b| RequestBody::untracked(b, conn)));
        async move { Ok::<_, Infallible>(answer.await) }
    });
    // Boxed: an HTTP/2 connection is large, and the task of every HTTP/1 one would be as large.
    let mut conn = Box::pin(http.h2.serve_connection(TokioIo::new(io), svc));
    let served = async move {
        tokio::select! {
            done = conn.as_mut() => done,
            _ = closing.cancelled() => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        }
    };
    drive(served, &spoke, peer).await;
}
