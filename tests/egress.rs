//! The egress listener, driven by real clients through `HTTPS_PROXY`-style settings (curl's
//! `-x`, requests, stripe-python), against recording fakes: writes once, intercepts only the
//! hosts an upstream claims, never connects anywhere else, and refuses what it must.

mod common;

use common::*;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

/// A proxy on the shipped `proxy.toml` with its egress listener on, a CA made for the test,
/// and each API at a fake. `extra` replaces text in the shipped file.
struct Egress {
    /// Kept running for the test's length.
    _proxy: TestProxy,
    ca: PathBuf,
    addr: SocketAddr,
}

async fn egress(apis: &[(&str, String)], extra: &[(&str, &str)]) -> Egress {
    let (proxy, ca) = shipped_egress(apis, extra).await;
    let addr = proxy.egress_addr.expect("the egress listener is on");
    Egress {
        _proxy: proxy,
        ca,
        addr,
    }
}

/// curl through the egress listener: status, headers (lower-case text) and body.
fn curl(e: &Egress, args: &[&str]) -> (u16, String, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--suppress-connect-headers",
            "-i",
            "--max-time",
            "20",
        ])
        .args(["-x", &format!("http://{}", e.addr), "--cacert"])
        .arg(&e.ca)
        .args(args)
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "curl {args:?}: {text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    (status, head.to_ascii_lowercase(), body.to_owned())
}

const CONTACT: &str = "https://api.hubapi.com/crm/v3/objects/contacts/9801";

fn patch_contact(version: &str) -> Vec<&str> {
    vec![
        version,
        "-X",
        "PATCH",
        "-H",
        "authorization: Bearer pat-1",
        "-H",
        "content-type: application/json",
        "--data",
        r#"{"properties":{"firstname":"Ada"}}"#,
        CONTACT,
    ]
}

#[tokio::test]
async fn curl_over_http2_and_http1_writes_once_through_the_egress_listener() {
    let api = RecordingUpstream::start().await;
    let e = egress(&[("HUBSPOT_API_URL", api.url())], &[]).await;
    let e = std::sync::Arc::new(e);
    let run = |v: &'static str| {
        let e = e.clone();
        tokio::task::spawn_blocking(move || curl(&e, &patch_contact(v)))
    };
    let (status, head, _) = run("--http2").await.expect("curl");
    assert_eq!(status, 200, "{head}");
    assert!(head.starts_with("http/2"), "{head}");
    assert!(head.contains("idempotent-replayed: false"), "{head}");
    let (status, head, _) = run("--http1.1").await.expect("curl");
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("idempotent-replayed: true"), "{head}");
    assert_eq!(api.count(), 1);
    assert_eq!(api.request(1).path(), "/crm/v3/objects/contacts/9801");
    // Reads pass through, streamed.
    let (status, _, _) = tokio::task::spawn_blocking({
        let e = e.clone();
        move || curl(&e, &["-H", "authorization: Bearer pat-1", CONTACT])
    })
    .await
    .expect("curl");
    assert_eq!(status, 200);
    assert_eq!(api.count_method("GET"), 1);
}

/// A listener that counts the connections it accepts.
async fn counting_listener() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = n.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 64];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (addr, n)
}

fn connect_to(target: &str, extra: &str) -> Vec<u8> {
    format!("CONNECT {target} HTTP/1.1\r\nhost: {target}\r\n{extra}\r\n").into_bytes()
}

#[tokio::test]
async fn hosts_no_upstream_claims_are_refused_and_never_connected() {
    let api = RecordingUpstream::start().await;
    let (far, accepted) = counting_listener().await;
    let e = egress(
        &[("HUBSPOT_API_URL", api.url())],
        &[("tunnel = []", "tunnel = [\"localhost\"]")],
    )
    .await;
    for target in [
        format!("{far}"),
        "unclaimed.example:443".into(),
        format!("localhost:{}", far.port()),
    ] {
        let answer = raw_request(e.addr, &connect_to(&target, "")).await;
        assert_eq!(raw_status(&answer), 403, "{target}: {answer}");
        assert!(answer.contains("egress_host_not_allowed"), "{answer}");
    }
    // `*.zendesk.com` names one well-formed label under the domain, nothing else: a client
    // cannot have a certificate minted for any string it likes.
    let long = format!("{}.zendesk.com:443", "a".repeat(64));
    for target in ["a.b.zendesk.com:443", "zendesk.com:443", long.as_str()] {
        let answer = raw_request(e.addr, &connect_to(target, "")).await;
        assert_eq!(raw_status(&answer), 403, "{target}: {answer}");
    }
    // An absolute-form request for an unclaimed host too.
    let get = format!("GET http://{far}/ HTTP/1.1\r\nhost: {far}\r\n\r\n");
    assert_eq!(raw_status(&raw_request(e.addr, get.as_bytes()).await), 403);
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "nothing was connected"
    );
    assert_eq!(api.count(), 0);
}

#[tokio::test]
async fn a_tunnel_that_names_an_address_is_spliced_untouched() {
    let (far, accepted) = counting_listener().await;
    let e = egress(&[], &[("tunnel = []", "tunnel = [\"127.0.0.1\"]")]).await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(e.addr)
        .await
        .expect("connect");
    s.write_all(&connect_to(&far.to_string(), ""))
        .await
        .expect("write");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(
            s.read(&mut b).await.expect("read"),
            1,
            "{}",
            String::from_utf8_lossy(&head)
        );
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s.write_all(b"ping").await.expect("write");
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).await.expect("the far end echoes");
    assert_eq!(&echo, b"ping");
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_wrong_proxy_credential_gets_407_and_the_right_one_is_served() {
    let api = RecordingUpstream::start().await;
    let token = (
        "proxy_token = \"${IDEMPROXY_EGRESS_TOKEN:-}\"",
        "proxy_token = \"s3cret\"",
    );
    let e = egress(&[("HUBSPOT_API_URL", api.url())], &[token]).await;
    let target = "api.hubapi.com:443";
    for extra in ["", "proxy-authorization: Basic dXNlcjp3cm9uZw==\r\n"] {
        let answer = raw_request(e.addr, &connect_to(target, extra)).await;
        assert_eq!(raw_status(&answer), 407, "{answer}");
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("proxy-authenticate: basic"),
            "{answer}"
        );
    }
    let e = std::sync::Arc::new(e);
    let (status, head, _) = tokio::task::spawn_blocking({
        let e = e.clone();
        move || {
            let mut args = patch_contact("--http1.1");
            args.extend(["--proxy-user", "agent:s3cret"]);
            curl(&e, &args)
        }
    })
    .await
    .expect("curl");
    assert_eq!(status, 200, "{head}");
    assert_eq!(api.count(), 1);
}

#[tokio::test]
async fn a_connect_that_never_finishes_its_handshake_is_closed() {
    let api = RecordingUpstream::start().await;
    let slow = ("tunnel = []", "tunnel = []\nhandshake_timeout = \"200ms\"");
    let e = egress(&[("HUBSPOT_API_URL", api.url())], &[slow]).await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(e.addr)
        .await
        .expect("connect");
    s.write_all(&connect_to("api.hubapi.com:443", ""))
        .await
        .expect("write");
    // The 200, then nothing from us: the proxy gives up on the handshake and closes.
    let mut all = Vec::new();
    let read = tokio::time::timeout(WAIT, s.read_to_end(&mut all)).await;
    assert!(read.is_ok(), "still open after {WAIT:?}");
    assert!(
        all.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&all)
    );
    assert_eq!(api.count(), 0);
}

#[tokio::test]
async fn a_ca_key_others_can_read_is_refused_at_start() {
    let dir = TestDir::new();
    let (ca, key) = idemproxy::ca::init(&dir.path().join("certs")).expect("ca init");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let config = format!(
        "{}\n[egress]\nlisten = \"127.0.0.1:0\"\nca_cert = {:?}\nca_key = {:?}\n",
        server_section(),
        ca.display().to_string(),
        key.display().to_string()
    );
    let err = TestProxy::try_start(&config).await.err().expect("refused");
    assert!(format!("{err:#}").contains("chmod 600"), "{err:#}");
}

const REQUESTS: &str = r#"
import json, requests
s = requests.Session()
out = []
for _ in range(2):
    r = s.put("https://acme.zendesk.com/api/v2/tickets/42.json", json={"ticket": {"status": "solved"}},
              headers={"Authorization": "Basic YWdlbnQ6dDBrZW4="})
    out.append([r.status_code, r.headers.get("Idempotent-Replayed")])
r = s.put("https://globex.zendesk.com/api/v2/tickets/42.json", json={"ticket": {"status": "solved"}},
          headers={"Authorization": "Basic YWdlbnQ6dDBrZW4="})
out.append([r.status_code, r.headers.get("Idempotent-Replayed")])
print(json.dumps(out))
"#;

#[tokio::test]
async fn requests_with_https_proxy_writes_once_per_zendesk_account() {
    if !installed(
        "python3 with requests",
        Command::new("python3").args(["-c", "import requests"]),
    ) {
        return;
    }
    let api = RecordingUpstream::start().await;
    let e = egress(&[("ZENDESK_API_URL", api.url())], &[]).await;
    let env = vec![
        ("HTTPS_PROXY", format!("http://{}", e.addr)),
        ("REQUESTS_CA_BUNDLE", e.ca.display().to_string()),
        ("NO_PROXY", String::new()),
    ];
    let out = tokio::task::spawn_blocking(move || {
        run_json(std::path::Path::new("python3"), &["-c", REQUESTS], &env)
    })
    .await
    .expect("python");
    // acme's retry replays; globex's ticket 42 is another account's: its own write.
    assert_eq!(
        out,
        serde_json::json!([[200, "false"], [200, "true"], [200, "false"]])
    );
    assert_eq!(api.count_method("PUT"), 2);
}

const STRIPE: &str = r#"
import json, os, stripe
stripe.api_key = "sk_test_123"
stripe.proxy = os.environ["PROXY"]
stripe.ca_bundle_path = os.environ["CA"]
stripe.max_network_retries = 0
ids = [stripe.Customer.create(email="ada@example.com").id for _ in range(2)]
print(json.dumps(ids))
"#;

#[tokio::test]
async fn stripe_python_with_its_proxy_setting_creates_one_customer() {
    if !installed(
        "stripe-python",
        Command::new("python3").args(["-c", "import stripe"]),
    ) {
        return;
    }
    let api = RecordingUpstream::with_handler(|_, n| {
        Reply::json(
            200,
            &serde_json::json!({"id": format!("cus_{n}"), "object": "customer"}),
        )
    })
    .await;
    let e = egress(&[("STRIPE_API_URL", api.url())], &[]).await;
    let env = vec![
        ("PROXY", format!("http://{}", e.addr)),
        ("CA", e.ca.display().to_string()),
    ];
    let out = tokio::task::spawn_blocking(move || {
        run_json(std::path::Path::new("python3"), &["-c", STRIPE], &env)
    })
    .await
    .expect("python");
    assert_eq!(out, serde_json::json!(["cus_1", "cus_1"]));
    assert_eq!(api.count_method("POST"), 1);
    // Stripe gets the proxy's key, so it dedupes a re-forward itself.
    let sent = api.request(1);
    let key = sent
        .header("idempotency-key")
        .expect("a key sent to Stripe");
    assert!(key.starts_with("stripe-customer-create:"), "{key}");
}

/// An upstream that names a host exactly takes it from one that claims it by `*.domain`.
#[tokio::test]
async fn an_exact_host_wins_over_a_wildcard() {
    let (zendesk, acme) = (
        RecordingUpstream::start().await,
        RecordingUpstream::start().await,
    );
    let own = format!(
        "[upstreams.acme]\nurl = \"{}\"\nhosts = [\"acme.zendesk.com\"]\n\n[upstreams.zendesk]",
        acme.url()
    );
    let e = egress(
        &[("ZENDESK_API_URL", zendesk.url())],
        &[("[upstreams.zendesk]", own.as_str())],
    )
    .await;
    let e = std::sync::Arc::new(e);
    for account in ["acme", "globex"] {
        let url = format!("https://{account}.zendesk.com/api/v2/tickets/42.json");
        let (status, head, _) = tokio::task::spawn_blocking({
            let e = e.clone();
            move || {
                curl(
                    &e,
                    &[
                        "-X",
                        "PUT",
                        "-H",
                        "content-type: application/json",
                        "--data",
                        r#"{"ticket":{"status":"open"}}"#,
                        &url,
                    ],
                )
            }
        })
        .await
        .expect("curl");
        assert_eq!(status, 200, "{account}: {head}");
    }
    assert_eq!((acme.count(), zendesk.count()), (1, 1));
}
