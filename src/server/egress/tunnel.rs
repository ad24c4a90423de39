//! `egress.tunnel`: hosts passed through untouched. The client's TLS runs end to end with the
//! far server (it sees that server's own certificate); the proxy only copies bytes.
//!
//! The SSRF lesson (stripe/smokescreen): the name is resolved here and every address checked
//! before connecting, so a tunnel entry cannot be pointed at the proxy's own network by DNS.
//! A destination on a loopback, private, link-local or unspecified address is refused unless
//! the entry names that address itself.

use crate::config::HostPattern;
use crate::error::{ErrorKind, ProxyError};
use hyper_util::rt::TokioIo;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::net::TcpStream;

/// How long resolving and connecting to a tunnel's destination may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `host:port` for a tunnel `entry`, after checking where it resolves.
pub(super) async fn connect(
    host: &str,
    port: u16,
    entry: &HostPattern,
) -> Result<TcpStream, ProxyError> {
    let unreachable = |why: String| ProxyError::new(ErrorKind::UpstreamUnreachable, why);
    let work = async {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| unreachable(format!("cannot resolve {host}: {e}")))?
            .collect();
        let named = |ip: IpAddr| matches!(entry, HostPattern::Address(a) if *a == ip);
        if let Some(inner) = addrs.iter().find(|a| internal(a.ip()) && !named(a.ip())) {
            return Err(ProxyError::new(
                ErrorKind::EgressHostNotAllowed,
                format!(
                    "{host} resolves to {}, an internal address: a tunnel reaches it only when egress.tunnel names that address",
                    inner.ip()
                ),
            ));
        }
        let mut last = None;
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(unreachable(match last {
            Some(e) => format!("cannot connect to {host}:{port}: {e}"),
            None => format!("{host} has no address"),
        }))
    };
    tokio::time::timeout(CONNECT_TIMEOUT, work)
        .await
        .map_err(|_| {
            unreachable(format!(
                "no connection to {host}:{port} within {CONNECT_TIMEOUT:?}"
            ))
        })?
}

/// Copies bytes both ways between the upgraded client connection and `far`, to the end.
pub(super) async fn splice(upgrade: hyper::upgrade::OnUpgrade, mut far: TcpStream) {
    let upgraded = match upgrade.await {
        Ok(u) => u,
        Err(e) => return tracing::debug!(error = %e, "CONNECT upgrade failed"),
    };
    let mut near = TokioIo::new(upgraded);
    if let Err(e) = crate::connection::splice::splice(&mut near, &mut far).await {
        tracing::debug!(error = %e, "tunnel ended with an error");
    }
}

/// Loopback, private, link-local, shared (CGNAT), unspecified or multicast: not the internet.
fn internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || (o[0] == 100 && (64..128).contains(&o[1]))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return internal(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
        }
    }
}

#[cfg(test)]
mod tests {
    use super::internal;

    #[test]
    fn internal_addresses() {
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(internal(a.parse().unwrap()), "{a}");
        }
        for a in ["93.184.216.34", "2606:2800:220:1::1", "172.32.0.1"] {
            assert!(!internal(a.parse().unwrap()), "{a}");
        }
    }
}
