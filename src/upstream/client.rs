//! Pooled upstream clients and header hygiene.
//!
//! One hyper-util client per upstream, over rustls with the system roots plus the webpki
//! roots, plus the upstream's own `ca_file`. Connections are pooled and reused (HTTP/1.1
//! keep-alive, or HTTP/2 when the upstream offers it by ALPN).

use crate::config::Upstream;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::Duration;

/// Boxed error of bodies in both directions.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type the proxy sends and answers with: streamed or buffered.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// A buffered body.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A client for one upstream.
pub struct UpstreamClient {
    pub upstream: Arc<Upstream>,
    /// The `Host` of a plain-HTTP upstream, made once: hyper-util would format it for every
    /// request. (Over TLS the connection may turn out HTTP/2, which takes `:authority`
    /// instead, so hyper-util still decides there.)
    host: Option<http::HeaderValue>,
    /// One pool per serving thread (see [`crate::threads`]): a pooled connection's task runs
    /// on the thread that opened it, and a request on another thread would wake it there.
    pools: Box<[Pool]>,
}

type Pool = Client<BoundedConnect<HttpsConnector<HttpConnector>>, ProxyBody>;

/// A connector whose whole connect (name lookup, TCP, TLS handshake) has a deadline. Its
/// errors are connect errors to the client, which is how a forward knows nothing was sent.
#[derive(Clone)]
pub struct BoundedConnect<C> {
    inner: C,
    limit: Duration,
}

impl<C> tower_service::Service<Uri> for BoundedConnect<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (connect, limit) = (self.inner.call(uri), self.limit);
        Box::pin(async move {
            match tokio::time::timeout(limit, connect).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(format!("no connection within {limit:?}").into()),
            }
        })
    }
}

impl UpstreamClient {
    /// The client of `upstream`, with a pool for the runtime's workers and one for each of
    /// `threads` connection threads.
    pub fn new(
        upstream: Arc<Upstream>,
        system_roots: &rustls::RootCertStore,
        threads: usize,
    ) -> anyhow::Result<Self> {
        let mut roots = system_roots.clone();
        if let Some(ca) = &upstream.ca_file {
            let pem = std::fs::read(ca).map_err(|e| {
                anyhow::anyhow!(
                    "upstream {}: cannot read ca_file {}: {e}",
                    upstream.name,
                    ca.display()
                )
            })?;
            let mut added = 0;
            for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
                let cert = cert.map_err(|e| anyhow::anyhow!("{}: {e}", ca.display()))?;
                roots.add(cert)?;
                added += 1;
            }
            anyhow::ensure!(added > 0, "{}: no certificates found", ca.display());
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        // Connecting (DNS, TCP and TLS together) is bounded well inside the whole-call timeout:
        // a connection that is not made in time was never sent anything, so it is a 502 and a
        // released key, not an unknown outcome.
        let https = BoundedConnect {
            inner: https,
            limit: (upstream.timeout / 2).min(Duration::from_secs(10)),
        };
        let pools = (0..=threads)
            .map(|_| {
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(60))
                    .build(https.clone())
            })
            .collect();
        Ok(UpstreamClient {
            host: plain_http_host(&upstream.scheme, &upstream.authority),
            upstream,
            pools,
        })
    }

    /// The absolute upstream URI for an upstream-relative path and query.
    pub fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        let u = &self.upstream;
        let pq = format!("{}{}", u.base_path, path_and_query);
        Uri::builder()
            .scheme(u.scheme.clone())
            .authority(u.authority.clone())
            .path_and_query(pq)
            .build()
    }

    /// Sends a request; credentials from the upstream URL go along when the caller sent none.
    pub async fn send(
        &self,
        mut req: Request<ProxyBody>,
    ) -> Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error> {
        if let Some(auth) = &self.upstream.url_credentials {
            req.headers_mut()
                .entry(header::AUTHORIZATION)
                .or_insert_with(|| auth.clone());
        }
        if let Some(host) = &self.host {
            req.headers_mut()
                .entry(header::HOST)
                .or_insert_with(|| host.clone());
        }
        let pool = crate::threads::index().min(self.pools.len() - 1);
        self.pools[pool].request(req).await
    }
}

/// What hyper-util sends as `Host` to a plain-HTTP upstream: its host, and its port unless 80.
fn plain_http_host(
    scheme: &http::uri::Scheme,
    authority: &http::uri::Authority,
) -> Option<http::HeaderValue> {
    if *scheme != http::uri::Scheme::HTTP {
        return None;
    }
    let host = match authority.port_u16() {
        Some(port) if port != 80 => format!("{}:{port}", authority.host()),
        _ => authority.host().to_owned(),
    };
    http::HeaderValue::from_str(&host).ok()
}

/// [`default_roots`], read once for the process: clients made while serving (one per host an
/// egress request was intercepted for) must not read the system's certificates again.
pub fn shared_roots() -> &'static rustls::RootCertStore {
    static ROOTS: std::sync::LazyLock<rustls::RootCertStore> =
        std::sync::LazyLock::new(default_roots);
    &ROOTS
}

/// The system's trust roots plus the webpki roots, loaded once per process.
pub fn default_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        // A broken system certificate must not stop the proxy; webpki roots still apply.
        let _ = roots.add(cert);
    }
    roots
}

const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers (RFC 9110 §7.6.1), including those named by `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most requests carry none: one pass over the few names present, not ten look-ups.
    if !headers
        .keys()
        .any(|n| n == header::UPGRADE || HOP_BY_HOP.contains(n))
    {
        return;
    }
    let named: Vec<HeaderName> = crate::connection::connection_tokens(headers)
        .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove(header::UPGRADE);
}

/// Headers for the upstream request: hop-by-hop removed and `Host` left to the client, which
/// sets the upstream's authority.
pub fn request_headers(mut headers: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-secret-hop".parse().unwrap(),
        );
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::HOST, "proxy".parse().unwrap());
        h.insert("x-end-to-end", "1".parse().unwrap());
        let h = request_headers(h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-end-to-end"));
    }

    /// The `Host` made once is what hyper-util would have sent: the host, its port unless 80,
    /// never the URL's credentials; nothing over TLS, where hyper-util still decides.
    #[test]
    fn a_plain_http_upstream_gets_its_host_and_port() {
        let cases = [
            ("http://127.0.0.1:8080/", Some("127.0.0.1:8080")),
            ("http://api.example.com/", Some("api.example.com")),
            ("http://api.example.com:80/", Some("api.example.com")),
            (
                "http://user:pw@api.example.com:81/",
                Some("api.example.com:81"),
            ),
            ("http://[::1]:9000/", Some("[::1]:9000")),
            ("https://api.example.com/", None),
        ];
        for (url, want) in cases {
            let uri: Uri = url.parse().unwrap();
            let got = plain_http_host(uri.scheme().unwrap(), uri.authority().unwrap());
            assert_eq!(got.as_ref().map(|v| v.to_str().unwrap()), want, "{url}");
        }
    }
}
