//! The console's rules over plain HTTP (no browser: these are rules, not looks). Without an
//! admin token, on a loopback listener, it needs no sign-in, but still wants its CSRF token on
//! every POST and answers only to loopback host names (a page whose name was rebound to
//! 127.0.0.1 gets nothing); an answer sealed with a key this process lacks shows
//! `<encrypted>`; the JSON API and the assets are served beside it.

use super::common::*;
use serde_json::json;

const SCOPE: &str = "scope_secret = \"test-scope-secret-0123456789abcdef\"\n";
const MARK: &str = "body-marker-c0n501e";

fn config(upstream: &RecordingUpstream, store: &str) -> String {
    let route = format!("{CHARGES_ROUTE}entity = \"customer:{{body.customer}}\"\n");
    let base = api_config(upstream, "", "", &route);
    format!("{base}\n[store]\n{SCOPE}{store}")
}

async fn charge(proxy: &TestProxy, key: &str) -> Resp {
    let body = json!({"customer": "cus_1", "amount": 100});
    post_json(&proxy.url("/api/v1/charges"), Some(key), &body, &[]).await
}

/// The value of the first `name="csrf"` field of a page.
fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a CSRF token")
        + 19;
    page[at..].split('"').next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn without_a_token_the_console_is_loopback_only_and_checks_its_csrf_token() {
    let upstream = RecordingUpstream::builder()
        .raw_http1()
        .handler(|rec, n| match rec.header("idempotency-key") {
            Some("lost-1") if n == 2 => Reply::drop_connection(),
            _ => Reply::json(201, &json!({"id": n, "note": MARK})),
        })
        .start()
        .await;
    // An answer stored sealed, then the proxy started again without its key.
    let key = idemproxy::store::seal::key_id(&[1; 32]);
    let sealing = format!("encryption_key = \"{}\"\n", base64_key());
    let proxy = TestProxy::start(&config(&upstream, &sealing)).await;
    charge(&proxy, "enc-1").await.assert_status(201);
    let dir = proxy.shutdown().await;
    let proxy = TestProxy::start_in(dir, &config(&upstream, "")).await;
    let lost = charge(&proxy, "lost-1").await;
    assert_eq!(
        lost.error_type(),
        Some("upstream_timeout"),
        "{}",
        lost.text()
    );

    // No sign-in: the landing page at once, with the console's headers and no cookie.
    let page = get(&proxy.admin_url("/")).await;
    page.assert_status(200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let csp = page.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.starts_with("default-src 'none'") && !csp.contains("script-src"),
        "{csp}"
    );
    assert_eq!(page.header("cache-control"), Some("no-store"));
    assert_eq!(page.header("set-cookie"), None);
    let text = page.text();
    assert!(
        text.contains("lost-1") && !text.contains("Sign out"),
        "{text}"
    );
    let login = get(&proxy.admin_url("/login")).await;
    assert_eq!((login.status, login.header("location")), (303, Some("/")));

    // Only to loopback names: a name rebound to 127.0.0.1 gets nothing.
    let rebound = [("host", "console.attacker.example")];
    let foreign = request("GET", &proxy.admin_url("/"), &rebound, "").await;
    foreign.assert_status(403);
    assert!(!foreign.text().contains("lost-1"));

    // A form without its token, or with another's, changes nothing; with it, the key is released.
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let url = proxy.admin_url("/console/release");
    let csrf = csrf_of(&text);
    for body in [
        "key=lost-1&note=forged".to_owned(),
        format!("key=lost-1&note=forged&csrf={}", "0".repeat(csrf.len())),
    ] {
        request("POST", &url, &form, body).await.assert_status(403);
    }
    let keys = get(&proxy.admin_url("/admin/keys/lost-1")).await.json();
    assert_eq!(keys["records"][0]["state"], "unknown", "{keys}");
    let note = format!("key=lost-1&note=checked&csrf={csrf}");
    let released = request("POST", &url, &form, note).await;
    assert_eq!(released.status, 303, "{}", released.text());
    let to = "/console/key?k=lost-1&done=released";
    assert_eq!(released.header("location"), Some(to));
    assert_eq!(upstream.count_method("POST"), 2);
    charge(&proxy, "lost-1").await.assert_status(201);
    assert_eq!(
        upstream.count_method("POST"),
        3,
        "the retry is sent once more"
    );

    // The sealed answer: its status, `<encrypted>` for the rest, the key it wants.
    let sealed = get(&proxy.admin_url("/console/key?k=enc-1")).await;
    sealed.assert_status(200);
    let sealed = sealed.text();
    assert!(
        sealed.contains("&lt;encrypted&gt;") && sealed.contains("201"),
        "{sealed}"
    );
    assert!(sealed.contains(&key) && !sealed.contains(MARK), "{sealed}");
    let missing = get(&proxy.admin_url("/console/key?k=never-sent")).await;
    missing.assert_status(404);

    // The JSON API as it was; the stylesheet; nothing else.
    let api = get(&proxy.admin_url("/admin/keys/enc-1")).await.json();
    assert_eq!(
        api["records"][0]["response"]["body"], "<encrypted>",
        "{api}"
    );
    let css = get(&proxy.admin_url("/assets/console.css")).await;
    assert_eq!(
        (css.status, css.header("content-type")),
        (200, Some("text/css; charset=utf-8"))
    );
    get(&proxy.admin_url("/assets/../admin/keys/enc-1"))
        .await
        .assert_status(404);
    get(&proxy.admin_url("/console/nothing"))
        .await
        .assert_status(404);
}

/// A 32-byte key of ones, base64.
fn base64_key() -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode([1u8; 32])
}

#[tokio::test]
async fn a_sign_in_form_that_trickles_is_cut_off_at_body_timeout() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = RecordingUpstream::builder().start().await;
    let server = "admin_token = \"t0ken\"\nbody_timeout = \"1s\"\n";
    let proxy = TestProxy::start(&api_config(&upstream, server, "", CHARGES_ROUTE)).await;
    let addr = proxy.admin_addr.expect("an admin listener");
    // No one is signed in yet: the sign-in form is read before anyone is known.
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /login HTTP/1.1\r\nHost: {addr}\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\ntoken="
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
            if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the form is waited for past body_timeout");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("content-security-policy: default-src 'none'"),
        "{answer}"
    );
}
