//! The floor under a replay: hyper serving one fixed JSON answer the way idemproxy's listener
//! serves (hyper-util's auto builder, keep-alive, `TCP_NODELAY`, the request body read to its
//! end, mimalloc, a multi-thread runtime), with none of the proxy's work — no route, key,
//! fingerprint, cache, audit row or metric. `bench/floor.sh` runs it beside nginx: no replay
//! can be faster than this on the same machine, so it says how much of a replay's cost is
//! the proxy's own and how much is hyper's and the kernel's.
//!
//! Usage: `cargo run --release --example floor -- 127.0.0.1:8080` (TOKIO_WORKER_THREADS sets
//! the workers; default 1, as the proxy's default on SQLite on two cores).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use std::convert::Infallible;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ANSWER: &[u8] = br#"{"id":"ch_1","status":"succeeded"}"#;

fn main() -> anyhow::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8080".into());
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        rt.worker_threads(1);
    }
    rt.enable_all().build()?.block_on(serve(addr))
}

async fn serve(addr: String) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(answer);
            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

/// Reads the body (a replay must, to fingerprint it) and answers the fixed JSON.
async fn answer(req: Request<hyper::body::Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let _ = req.into_body().collect().await;
    let mut resp = Response::new(Full::new(Bytes::from_static(ANSWER)));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}
