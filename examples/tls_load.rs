//! A load generator for `bench/egress.sh`: C kept-alive HTTPS connections, each sending one
//! request after another for D seconds, either straight to a TLS listener or through a forward
//! proxy's `CONNECT` (the egress listener) — the two ways a client reaches idemproxy over TLS.
//! wrk cannot `CONNECT`, so both sides of the comparison use this one client.
//!
//! Usage: `tls_load direct|connect ADDR HOST CA_PEM CONNS SECONDS METHOD PATH BODY [KEYED]`
//! - `direct`: TLS to ADDR, SNI HOST; `connect`: `CONNECT HOST:443` to ADDR, then TLS as HOST.
//! - With `KEYED` = `unique`, each request carries a fresh `Idempotency-Key` (first writes);
//!   otherwise one fixed key (replays after the first).
//!
//! Prints one JSON line: requests, seconds, req/s, p50 and p99 latency in microseconds.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type Err = Box<dyn std::error::Error + Send + Sync>;

struct Args {
    connect: bool,
    addr: String,
    host: String,
    tls: tokio_rustls::TlsConnector,
    conns: usize,
    secs: u64,
    method: http::Method,
    path: String,
    body: Bytes,
    unique: bool,
}

fn args() -> Result<Args, Err> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 9 {
        return Err("usage: tls_load direct|connect ADDR HOST CA_PEM CONNS SECONDS METHOD PATH BODY [unique]".into());
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut std::fs::read(&a[3])?.as_slice()) {
        roots.add(cert?)?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Args {
        connect: a[0] == "connect",
        addr: a[1].clone(),
        host: a[2].clone(),
        tls: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
        conns: a[4].parse()?,
        secs: a[5].parse()?,
        method: a[6].parse()?,
        path: a[7].clone(),
        body: Bytes::from(a[8].clone()),
        unique: a.get(9).is_some_and(|k| k == "unique"),
    })
}

async fn open(a: &Args) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, Err> {
    let mut tcp = TcpStream::connect(&a.addr).await?;
    tcp.set_nodelay(true)?;
    if a.connect {
        let head = format!("CONNECT {0}:443 HTTP/1.1\r\nHost: {0}:443\r\n\r\n", a.host);
        tcp.write_all(head.as_bytes()).await?;
        let mut got = Vec::new();
        while !got.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            if tcp.read(&mut b).await? == 0 {
                return Err("the proxy closed the CONNECT".into());
            }
            got.push(b[0]);
        }
        if !got.starts_with(b"HTTP/1.1 200") {
            return Err(format!("CONNECT: {}", String::from_utf8_lossy(&got)).into());
        }
    }
    let name = rustls::pki_types::ServerName::try_from(a.host.clone())?;
    let tls = a.tls.connect(name, tcp).await?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    Ok(send)
}

#[tokio::main]
async fn main() -> Result<(), Err> {
    let a = Arc::new(args()?);
    let seq = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(a.secs);
    let mut tasks = Vec::new();
    for _ in 0..a.conns {
        let (a, seq) = (a.clone(), seq.clone());
        tasks.push(tokio::spawn(async move {
            let mut send = open(&a).await?;
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let key = match a.unique {
                    true => format!(
                        "k-{}-{}",
                        std::process::id(),
                        seq.fetch_add(1, Ordering::Relaxed)
                    ),
                    false => "k-replayed".to_owned(),
                };
                let req = http::Request::builder()
                    .method(a.method.clone())
                    .uri(&a.path)
                    .header("host", &a.host)
                    .header("content-type", "application/json")
                    .header("idempotency-key", key)
                    .body(Full::new(a.body.clone()))?;
                let started = Instant::now();
                let resp = send.send_request(req).await?;
                let status = resp.status();
                resp.into_body().collect().await?;
                if !status.is_success() {
                    return Err(format!("status {status}").into());
                }
                lat.push(started.elapsed().as_micros() as u64);
            }
            Ok::<_, Err>(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    all.sort_unstable();
    let pct = |p: f64| {
        all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "{{\"requests\": {}, \"seconds\": {}, \"rps\": {:.0}, \"p50_us\": {}, \"p99_us\": {}}}",
        all.len(),
        a.secs,
        all.len() as f64 / a.secs as f64,
        pct(0.50),
        pct(0.99)
    );
    Ok(())
}
