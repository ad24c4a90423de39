//! Hostile callers, part two: no cheap way to stall the listener (trickled bodies, one peer
//! holding every slot, running out of file descriptors) and nothing a request carries can forge
//! a log line or leak a secret into output.

mod common;

use common::*;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

fn config(upstream: &RecordingUpstream, server_extra: &str) -> String {
    let routes = format!("{CHARGES_ROUTE}{CONTACTS_ROUTE}");
    api_config(upstream, server_extra, "", &routes)
}

/// A head that promises a 100-byte body, and one byte of it.
const STALLED: &[u8] = b"POST /api/v1/charges HTTP/1.1\r\nhost: x\r\nidempotency-key: k-slow\r\n\
content-type: application/json\r\ncontent-length: 100\r\n\r\n{";

#[tokio::test]
async fn a_trickled_body_is_timed_out_and_never_forwarded() {
    let upstream = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(&upstream, "body_timeout = \"300ms\"\n")).await;
    // raw_request fails the test if no complete answer arrives within 10 s.
    let answer = raw_request(proxy.main_addr, STALLED).await;
    assert_eq!(raw_status(&answer), 408, "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert_eq!(upstream.count(), 0);
    let fine = post_json(
        &proxy.url("/api/v1/charges"),
        Some("k-slow"),
        &serde_json::json!({}),
        &[],
    )
    .await;
    assert_eq!(fine.replayed(), Some(false), "the key was never reserved");
}

/// A connection from `source` (any 127.0.0.0/8 address routes over loopback).
async fn connect_from(source: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::from((source, 0)))
        .expect("bind a loopback source address");
    socket.connect(to).await.expect("connect")
}

#[tokio::test]
async fn one_peer_cannot_take_every_connection_slot() {
    let upstream = RecordingUpstream::start().await;
    let limits = "max_connections = 4\nmax_connections_per_ip = 2\n";
    let proxy = TestProxy::start(&config(&upstream, limits)).await;
    // The attacker opens as many connections as the listener serves, each stalled mid-body.
    let mut attacker = Vec::new();
    for _ in 0..4 {
        let mut s = connect_from([127, 0, 0, 2], proxy.main_addr).await;
        let _ = s.write_all(STALLED).await;
        attacker.push(s);
    }
    // Another client is still served (not left in the backlog behind the stalled ones).
    let resp = tokio::time::timeout(
        WAIT,
        post_json(
            &proxy.url("/api/v1/charges"),
            Some("k-other"),
            &serde_json::json!({}),
            &[],
        ),
    )
    .await
    .expect("a client from another address is served while one peer stalls");
    resp.assert_status(200);
    // The attacker's connections over its share were closed at once — before the other
    // client's was accepted, so their end (FIN, or RST over unread data) has arrived already.
    let mut closed = 0;
    for s in &mut attacker {
        let mut buf = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            _ => {}
        }
    }
    assert_eq!(closed, 2, "two over max_connections_per_ip were refused");
}

/// Stalled uploads from one address — every client's, behind a sidecar or a NAT — take every
/// connection slot, and more keep coming: each new connection sheds the one that made the
/// least progress, so a healthy client from the same address is still served. Nothing stalled
/// is forwarded (fails when a full listener leaves new connections in its backlog: checked).
#[tokio::test]
async fn stalled_uploads_from_one_address_cannot_keep_a_client_out() {
    let upstream = RecordingUpstream::start().await;
    let proxy = TestProxy::start(&config(
        &upstream,
        "max_connections = 4
",
    ))
    .await;
    let mut stalled = Vec::new();
    for _ in 0..6 {
        let mut s = TcpStream::connect(proxy.main_addr).await.expect("connect");
        let _ = s.write_all(STALLED).await;
        stalled.push(s);
    }
    let resp = tokio::time::timeout(
        WAIT,
        post_json(
            &proxy.url("/api/v1/charges"),
            Some("k-healthy"),
            &serde_json::json!({}),
            &[],
        ),
    )
    .await
    .expect("a healthy client is served while stalled uploads hold every slot");
    resp.assert_status(200);
    assert_eq!(
        upstream.count(),
        1,
        "only the healthy request was forwarded"
    );
    // Stalled connections were closed to make room, before the healthy one had its slot, so
    // their end has arrived already.
    let mut closed = 0;
    for s in &mut stalled {
        let mut buf = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            _ => {}
        }
    }
    assert_eq!(
        closed, 3,
        "three stalled connections shed for three new ones"
    );
}

/// Open file descriptors of a process.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn running_out_of_descriptors_backs_off_instead_of_spinning() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let path = dir.write_config(&config(&upstream, ""));
    let proxy = ProxyProcess::spawn(&path).await;
    let pid = proxy.pid();
    // Leave room for a handful of connections only.
    let limit = (open_fds(pid) + 4) as u64;
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: prlimit only reads `rlimit`; the old-limit pointer is null (not wanted).
    let set = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &rlimit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(set, 0, "prlimit: {}", std::io::Error::last_os_error());
    let mut held = Vec::new();
    for _ in 0..40 {
        held.push(TcpStream::connect(proxy.main_addr).await.expect("connect"));
    }
    let lines = || {
        proxy
            .stderr()
            .lines()
            .filter(|l| l.contains("accept failed"))
            .count()
    };
    wait_until(|| lines() >= 1, WAIT, "the proxy reports accept failures").await;
    // Some real work while descriptors stay exhausted: a spinning loop logs thousands of
    // lines meanwhile.
    for _ in 0..20 {
        let _ = tokio::time::timeout(
            Duration::from_millis(50),
            TcpStream::connect(proxy.main_addr),
        )
        .await;
    }
    drop(held);
    // It recovers: the admin listener answers again.
    let admin = proxy.admin_url("/healthz");
    let mut served = false;
    for _ in 0..200 {
        if let Ok(r) = try_request("GET", &admin, &[], "").await {
            served = r.status == 200;
            if served {
                break;
            }
        }
    }
    assert!(served, "the proxy serves again once descriptors are free");
    let n = lines();
    assert!(n <= 10, "{n} 'accept failed' lines: the accept loop spins");
    let stderr = proxy.stderr();
    assert!(stderr.len() < 100_000, "log size {}", stderr.len());
}

#[tokio::test]
async fn control_characters_in_requests_never_reach_logs_or_cli_output_raw() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let path = dir.write_config(&config(&upstream, ""));
    let proxy = ProxyProcess::spawn(&path).await;
    let url = proxy.url("/api/contacts/a%0aFORGED%20line%1b%5b31m");
    let send = |id: &'static str| {
        let url = url.clone();
        async move {
            common::request(
                "PATCH",
                &url,
                &[
                    ("content-type", "application/json"),
                    ("x-request-id", id),
                    ("x-entity-version", "1"),
                ],
                "{}",
            )
            .await
        }
    };
    send("r1").await.assert_status(200);
    // A stale write: refused, and its error (naming the entity) is logged.
    send("r2").await.assert_status(409);
    wait_until(
        || proxy.stderr().contains("stale_version"),
        WAIT,
        "the refusal is logged",
    )
    .await;
    let log = proxy.stderr();
    assert!(!log.contains('\x1b'), "a raw ESC in the log:\n{log}");
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "a forged line:\n{log}"
    );
    assert!(log.contains("FORGED"), "the entity is in the log, escaped");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["keys", "list", "--config"])
        .arg(&path)
        .output()
        .expect("run keys list");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("FORGED"), "{text}");
    assert!(!text.contains('\x1b'), "{text:?}");
    assert!(!text.lines().any(|l| l.starts_with("FORGED")), "{text}");
}

#[tokio::test]
async fn credentials_in_upstream_urls_go_upstream_and_are_never_printed() {
    let upstream = RecordingUpstream::start().await;
    let text = format!(
        "{}\n[upstreams.api]\nurl = \"http://robot:s3cr3tpw@{}\"\nprefix = \"/api\"\n{CHARGES_ROUTE}\n\
         [[routes]]\nname = \"leaky\"\nupstream = \"api\"\nmethods = [\"POST\"]\npath = \"/leaky\"\n\
         key = {{ header = \"\", derive = \"{{header.authorization}}:{{fingerprint}}\" }}\n",
        server_section(),
        upstream.addr()
    );
    let dir = TestDir::new();
    let path = dir.write_config(&text);
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check", "--config"])
        .arg(&path)
        .env("RUST_LOG", "trace")
        .output()
        .expect("run check");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(check.status.success(), "{all}");
    assert!(!all.contains("s3cr3tpw"), "{all}");
    assert!(
        all.contains("route leaky: key.derive reads {header.authorization}"),
        "{all}"
    );
    // An invalid URL with a password: the error does not print it either.
    let bad = dir.write_config_as("bad.toml", &text.replace("http://robot", "ftp://robot"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .expect("run check");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success() && !err.contains("s3cr3tpw"), "{err}");

    let proxy = ProxyProcess::spawn_with_env(&path, &[("RUST_LOG", "debug")]).await;
    let resp = post_json(
        &proxy.url("/api/v1/charges"),
        Some("k-url"),
        &serde_json::json!({}),
        &[],
    )
    .await;
    resp.assert_status(200);
    let rec = upstream.request(1);
    // robot:s3cr3tpw, as Basic credentials; Host carries no userinfo.
    assert_eq!(
        rec.header("authorization"),
        Some("Basic cm9ib3Q6czNjcjN0cHc=")
    );
    assert!(!rec.authority.unwrap_or_default().contains('@'));
    assert!(!proxy.stderr().contains("s3cr3tpw"), "{}", proxy.stderr());
}

/// An entity named by request data with a NUL (which PostgreSQL refuses in text
/// and JSONB) is stored under its hash: the write goes through once, and on PostgreSQL the
/// reservations batched with it are not failed by it.
async fn an_entity_with_a_nul_is_stored_by_its_hash(store: &str) {
    let upstream = RecordingUpstream::holding().await;
    let route = r#"
[[routes]]
name = "by-customer"
upstream = "api"
methods = ["POST"]
path = "/v2/charges"
entity = "customer:{body.customer}"
"#;
    let text = format!("{}\n{store}", api_config(&upstream, "", "", route));
    let proxy = TestProxy::start(&text).await;
    let url = proxy.url("/api/v2/charges");
    let calls: Vec<_> = ["cus\u{0}x", "cus_2", "cus_3"]
        .into_iter()
        .enumerate()
        .map(|(i, customer)| {
            let url = url.clone();
            tokio::spawn(async move {
                let body = serde_json::json!({ "customer": customer });
                post_json(&url, Some(&format!("k-nul-{i}")), &body, &[]).await
            })
        })
        .collect();
    upstream.wait_for_held(3).await;
    upstream.release_all();
    for c in calls {
        c.await.unwrap().assert_status(200);
    }
    assert_eq!(upstream.count(), 3, "each forwarded once");
    let retry = post_json(
        &url,
        Some("k-nul-0"),
        &serde_json::json!({ "customer": "cus\u{0}x" }),
        &[],
    )
    .await;
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(upstream.count(), 3);
}

#[tokio::test]
async fn an_entity_with_a_nul_is_stored_by_its_hash_on_sqlite() {
    an_entity_with_a_nul_is_stored_by_its_hash("").await;
}

#[tokio::test]
async fn an_entity_with_a_nul_is_stored_by_its_hash_on_postgres() {
    let Some(pg) = common::pg::PgServer::start().await else {
        return;
    };
    let store = pg.store_toml();
    an_entity_with_a_nul_is_stored_by_its_hash(&store).await;
}
