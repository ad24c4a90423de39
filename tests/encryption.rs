//! Stored answers encrypted at rest, end to end on SQLite and PostgreSQL: a real proxy, a real
//! recording upstream whose answers carry a marker in the body and another in a header, and
//! the raw bytes of the store searched for the markers (with a control run without encryption
//! that must find them). Then what happens without the key, with a wrong one, after a
//! rotation, with a value moved to another record, and what `keys show` prints.

mod common;
use common::backend::Backend;
use common::*;

use idemproxy::config::Config;
use idemproxy::server::Server;
use serde_json::json;
use sqlx::{Connection, Row};
use std::process::Command;

const BODY_MARK: &str = "body-marker-5d1c0e";
const HEADER_MARK: &str = "header-marker-9a7f3b";
const CREDENTIALS: (&str, &str) = ("authorization", "Bearer tok-1");

/// A key made of one repeated byte, base64.
fn key(byte: u8) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode([byte; 32])
}

/// The id the store records for [`key`]`(byte)`.
fn key_id(byte: u8) -> String {
    idemproxy::store::seal::key_id(&[byte; 32])
}

/// Answers `201` with the body marker in its body and the header marker in a header.
async fn marked_upstream() -> RecordingUpstream {
    RecordingUpstream::with_handler(|_, n| {
        Reply::json(201, &json!({"id": n, "note": BODY_MARK}))
            .header("x-customer-note", &format!("{HEADER_MARK}-{n}"))
    })
    .await
}

async fn post(proxy: &TestProxy, key: &str) -> Resp {
    let url = proxy.url("/api/v1/charges");
    post_json(&url, Some(key), &json!({"amount": 100}), &[CREDENTIALS]).await
}

/// `retry` is `first` replayed: the same status, body and headers (but the replay flag).
#[track_caller]
fn assert_replay_of(first: &Resp, retry: &Resp) {
    assert_eq!(retry.replayed(), Some(true), "{retry:?}");
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body);
    let headers = |r: &Resp| -> Vec<(String, Vec<u8>)> {
        r.headers
            .iter()
            .filter(|(n, _)| !matches!(n.as_str(), "idempotent-replayed" | "date"))
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    };
    assert_eq!(headers(retry), headers(first));
    assert!(first
        .header("x-customer-note")
        .is_some_and(|v| v.starts_with(HEADER_MARK)));
}

/// A proxy on `dir`'s store (SQLite) or the backend's (PostgreSQL) with `toml`.
async fn start(dir: TestDir, toml: &str) -> TestProxy {
    TestProxy::start_in(dir, toml).await
}

/// Why a proxy with `toml` on `dir` refuses to start.
async fn refused(dir: &TestDir, toml: &str) -> String {
    let config = Config::from_toml(&dir.config_text(toml), "t.toml").expect("config");
    match Server::start(config).await {
        Ok(_) => panic!("the proxy started"),
        Err(e) => format!("{e:#}"),
    }
}

/// (1) The markers never reach the store's bytes while encryption is on; without it (the
/// control) they do, in the same place. A restart replays from the store itself.
async fn sealed_on_disk(backend: Backend, encrypt: bool) {
    let upstream = marked_upstream().await;
    let lines = match encrypt {
        true => format!("encryption_key = \"{}\"\n", key(1)),
        false => "scope_secret = \"test-scope-secret-0123456789abcdef\"\n".into(),
    };
    let toml = backend.config(&upstream, &lines);
    let proxy = start(TestDir::new(), &toml).await;
    let first = post(&proxy, "enc-1").await;
    first.assert_status(201);
    assert_replay_of(&first, &post(&proxy, "enc-1").await);
    assert_eq!(upstream.count_method("POST"), 1);
    let mut running = Vec::new();
    // The control scans again when it found nothing: a scan that raced a checkpoint (pages
    // moved from the WAL file into the database between its two reads) sees neither copy.
    for _ in 0..if encrypt { 1 } else { 50 } {
        for mark in [BODY_MARK, HEADER_MARK] {
            running.extend(backend.places_holding(&proxy.dir, mark).await);
        }
        if !running.is_empty() {
            break;
        }
    }
    let proxy = proxy.restart().await;
    // The replay cache is gone: this one is read from the store (and opened).
    assert_replay_of(&first, &post(&proxy, "enc-1").await);
    assert_eq!(upstream.count_method("POST"), 1, "never forwarded again");
    let dir = proxy.shutdown().await;
    let mut stopped = Vec::new();
    for mark in [BODY_MARK, HEADER_MARK] {
        stopped.extend(backend.places_holding(&dir, mark).await);
    }
    if encrypt {
        assert!(
            running.is_empty(),
            "clear answer data while running in {running:?}"
        );
        assert!(
            stopped.is_empty(),
            "clear answer data after stopping in {stopped:?}"
        );
        let keys = backend.enc_keys(&dir).await;
        assert_eq!(keys["enc-1"].as_deref(), Some(key_id(1).as_str()));
        let secret = dir.path().join("idemproxy.db.secret");
        assert!(
            !secret.exists(),
            "scopes are keyed from the encryption key, no file"
        );
    } else {
        assert!(!running.is_empty(), "the control run must find its markers");
        assert!(!stopped.is_empty(), "the control run must find its markers");
    }
}

#[tokio::test]
async fn sqlite_stores_no_answer_in_clear() {
    sealed_on_disk(Backend::Sqlite, true).await;
    sealed_on_disk(Backend::Sqlite, false).await;
}

#[tokio::test]
async fn postgres_stores_no_answer_in_clear() {
    let Some(backend) = Backend::start(true).await else {
        return;
    };
    sealed_on_disk(backend, true).await;
    let Some(backend) = Backend::start(true).await else {
        return;
    };
    sealed_on_disk(backend, false).await;
}

/// (2) Without the key, or with a wrong one, a stored answer is `503 store_unavailable` and
/// nothing reaches the upstream; with the key back it replays. (`scope_secret` is explicit
/// here, so the proxy can start without the key at all.)
async fn missing_key_refuses(pg: bool) {
    let Some(backend) = Backend::start(pg).await else {
        return;
    };
    let upstream = marked_upstream().await;
    let scope = "scope_secret = \"test-scope-secret-0123456789abcdef\"\n";
    let with = |k: Option<String>| {
        let enc = k
            .map(|k| format!("encryption_key = \"{k}\"\n"))
            .unwrap_or_default();
        backend.config(&upstream, &format!("{scope}{enc}"))
    };
    let proxy = start(TestDir::new(), &with(Some(key(1)))).await;
    let first = post(&proxy, "enc-2").await;
    first.assert_status(201);
    let mut dir = proxy.shutdown().await;
    for wrong in [None, Some(key(7))] {
        let proxy = start(dir, &with(wrong)).await;
        for _ in 0..2 {
            let retry = post(&proxy, "enc-2").await;
            retry.assert_status(503);
            assert_eq!(retry.error_type(), Some("store_unavailable"));
            assert!(
                retry.text().contains("cannot be decrypted"),
                "{}",
                retry.text()
            );
            // Which key it wants is for the operator's log, not the caller.
            assert!(!retry.text().contains(&key_id(1)), "{}", retry.text());
        }
        let admin = format!("http://{}", proxy.admin_addr.expect("admin listener"));
        assert_eq!(metric(&admin, "idemproxy_decrypt_failures_total").await, 2);
        assert_eq!(upstream.count_method("POST"), 1, "never forwarded again");
        dir = proxy.shutdown().await;
    }
    let proxy = start(dir, &with(Some(key(1)))).await;
    assert_replay_of(&first, &post(&proxy, "enc-2").await);
    assert_eq!(upstream.count_method("POST"), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn sqlite_without_the_key_answers_503() {
    missing_key_refuses(false).await;
}

#[tokio::test]
async fn postgres_without_the_key_answers_503() {
    missing_key_refuses(true).await;
}

/// (3) Rotation: a new current key, the old one listed as previous. Old answers still replay
/// (their scope did not move: the scopes stay keyed by the key the store was first written
/// with), new ones are sealed with the new key; dropping the old key from the list is refused
/// at start, since the store's scopes can no longer be computed.
async fn rotation(pg: bool) {
    let Some(backend) = Backend::start(pg).await else {
        return;
    };
    let upstream = marked_upstream().await;
    let old = backend.config(&upstream, &format!("encryption_key = \"{}\"\n", key(1)));
    let proxy = start(TestDir::new(), &old).await;
    let first = post(&proxy, "enc-old").await;
    first.assert_status(201);
    let dir = proxy.shutdown().await;

    let rotated = backend.config(
        &upstream,
        &format!(
            "encryption_key = \"{}\"\nencryption_keys_previous = [\"{}\"]\n",
            key(2),
            key(1)
        ),
    );
    let proxy = start(dir, &rotated).await;
    assert_replay_of(&first, &post(&proxy, "enc-old").await);
    assert_eq!(
        upstream.count_method("POST"),
        1,
        "the old key's retry is not new"
    );
    post(&proxy, "enc-new").await.assert_status(201);
    assert_eq!(upstream.count_method("POST"), 2);
    let dir = proxy.shutdown().await;
    let keys = backend.enc_keys(&dir).await;
    assert_eq!(keys["enc-old"].as_deref(), Some(key_id(1).as_str()));
    assert_eq!(keys["enc-new"].as_deref(), Some(key_id(2).as_str()));

    let forgotten = backend.config(&upstream, &format!("encryption_key = \"{}\"\n", key(2)));
    let err = refused(&dir, &forgotten).await;
    assert!(
        err.contains("another scope secret") && err.contains("encryption_keys_previous"),
        "{err}"
    );
    assert!(
        !err.contains(&key(1)) && !err.contains(&key(2)),
        "no key material: {err}"
    );
    assert_eq!(upstream.count_method("POST"), 2);
}

#[tokio::test]
async fn sqlite_rotation_keeps_answers_and_scopes() {
    rotation(false).await;
}

#[tokio::test]
async fn postgres_rotation_keeps_answers_and_scopes() {
    rotation(true).await;
}

/// Turning encryption on for a SQLite store that ran without it: its scopes stay keyed by its
/// `.secret` file (a retry of an old key replays, the old answer still in clear), and new
/// answers are sealed.
#[tokio::test]
async fn sqlite_turns_encryption_on_later() {
    let upstream = marked_upstream().await;
    let plain = Backend::Sqlite.config(&upstream, "");
    let proxy = start(TestDir::new(), &plain).await;
    let before = post(&proxy, "enc-before").await;
    before.assert_status(201);
    let dir = proxy.shutdown().await;
    assert!(dir.path().join("idemproxy.db.secret").exists());
    let encrypted =
        Backend::Sqlite.config(&upstream, &format!("encryption_key = \"{}\"\n", key(5)));
    let proxy = start(dir, &encrypted).await;
    assert_replay_of(&before, &post(&proxy, "enc-before").await);
    assert_eq!(upstream.count_method("POST"), 1, "the scope did not move");
    post(&proxy, "enc-after").await.assert_status(201);
    let dir = proxy.shutdown().await;
    let keys = Backend::Sqlite.enc_keys(&dir).await;
    assert_eq!(keys["enc-before"], None, "stored in clear, before");
    assert_eq!(keys["enc-after"].as_deref(), Some(key_id(5).as_str()));
}

/// (4) A sealed value moved to another record, or the headers swapped with the body, does not
/// open: `503`, nothing forwarded. The untouched record still replays.
#[tokio::test]
async fn a_moved_value_does_not_decrypt() {
    let upstream = marked_upstream().await;
    let toml = Backend::Sqlite.config(&upstream, &format!("encryption_key = \"{}\"\n", key(1)));
    let proxy = start(TestDir::new(), &toml).await;
    let a = post(&proxy, "enc-a").await;
    for k in ["enc-b", "enc-c"] {
        post(&proxy, k).await.assert_status(201);
    }
    let dir = proxy.shutdown().await;
    {
        let mut conn = sqlx::SqliteConnection::connect(&dir.db_url())
            .await
            .expect("open");
        let moved = sqlx::query(
            "UPDATE idem_keys SET body = (SELECT body FROM idem_keys WHERE key = 'enc-a') WHERE key = 'enc-b'",
        )
        .execute(&mut conn)
        .await
        .expect("move a body");
        assert_eq!(moved.rows_affected(), 1);
        let swapped =
            sqlx::query("UPDATE idem_keys SET body = headers, headers = body WHERE key = 'enc-c'")
                .execute(&mut conn)
                .await
                .expect("swap");
        assert_eq!(swapped.rows_affected(), 1);
        let row = sqlx::query("SELECT count(*) AS n FROM idem_keys")
            .fetch_one(&mut conn)
            .await
            .expect("count");
        assert_eq!(row.get::<i64, _>("n"), 3);
        conn.close().await.expect("close");
    }
    let proxy = start(dir, &toml).await;
    for k in ["enc-b", "enc-c"] {
        let retry = post(&proxy, k).await;
        retry.assert_status(503);
        assert_eq!(retry.error_type(), Some("store_unavailable"), "{k}");
    }
    assert_replay_of(&a, &post(&proxy, "enc-a").await);
    assert_eq!(upstream.count_method("POST"), 3, "nothing forwarded again");
    proxy.shutdown().await;
}

/// `idemproxy ARGS` (the real binary) in `dir`.
fn idemproxy(dir: &TestDir, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(args)
        .current_dir(dir.path())
        .env_remove("IDEMPROXY_CONFIG")
        .env_remove("IDEMPROXY_STORE_URL")
        .env("NO_COLOR", "1")
        .output()
        .expect("run idemproxy")
}

/// (5) `keys show` without the key prints the record's metadata and `<encrypted>`; with the
/// key, the answer.
#[tokio::test]
async fn keys_show_without_the_key_prints_encrypted() {
    let upstream = marked_upstream().await;
    let with_key = Backend::Sqlite.config(&upstream, &format!("encryption_key = \"{}\"\n", key(1)));
    let proxy = start(TestDir::new(), &with_key).await;
    post(&proxy, "enc-show").await.assert_status(201);
    let dir = proxy.shutdown().await;
    let show = |name: &str, toml: &str| {
        let path = dir.write_config_as(name, toml);
        let out = idemproxy(
            &dir,
            &[
                "keys",
                "show",
                "enc-show",
                "--config",
                &path.display().to_string(),
            ],
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        (text, report)
    };
    let (text, report) = show("no-key.toml", &Backend::Sqlite.config(&upstream, ""));
    let record = &report["records"][0];
    assert_eq!(record["key"], "enc-show", "{report}");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["encrypted_with"], key_id(1).as_str());
    assert_eq!(record["response"]["status"], 201);
    assert_eq!(record["response"]["body"], "<encrypted>");
    assert_eq!(record["response"]["headers"], "<encrypted>");
    assert!(
        !text.contains(BODY_MARK) && !text.contains(HEADER_MARK),
        "{text}"
    );
    let (text, report) = show("with-key.toml", &with_key);
    let body = report["records"][0]["response"]["body"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(body.contains(BODY_MARK), "{report}");
    assert!(text.contains(HEADER_MARK), "{text}");
    assert!(!text.contains(&key(1)), "no key material in the output");
}

/// (6) Bad keys are config errors at `file:line:col`, and never repeated; `check` names a
/// good key by its id only.
#[tokio::test]
async fn bad_keys_are_config_errors() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let check = |lines: &str| {
        let path = dir.write_config(&Backend::Sqlite.config(&upstream, lines));
        let out = idemproxy(&dir, &["check", "--config", &path.display().to_string()]);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (
            out.status.code(),
            text,
            std::fs::read_to_string(&path).expect("config"),
        )
    };
    let (code, text, _) = check(&format!("encryption_key = \"{}\"\n", key(3)));
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains(&format!("encryption=on (key id {})", key_id(3))),
        "{text}"
    );
    assert!(!text.contains(&key(3)), "{text}");
    let short = "c2VjcmV0LXRvby1zaG9ydA==";
    let (k4, bad) = (format!("\"{}\"", key(4)), "\"!!not-base64-value!!\"");
    // (the [store] lines, the quoted value the error must point at, whether it is the last
    // occurrence, what the message says)
    let cases = [
        (
            format!("encryption_key = \"{short}\"\n"),
            format!("\"{short}\""),
            false,
            "decodes to 16",
        ),
        (
            format!("encryption_key = {bad}\n"),
            bad.to_owned(),
            false,
            "not base64",
        ),
        (
            format!("encryption_keys_previous = [{k4}]\n"),
            k4.clone(),
            false,
            "needs store.encryption_key",
        ),
        (
            format!("encryption_key = {k4}\nencryption_keys_previous = [{k4}]\n"),
            k4.clone(),
            true,
            "twice",
        ),
    ];
    for (lines, value, last, what) in cases {
        let (code, text, written) = check(&lines);
        assert_eq!(code, Some(1), "{text}");
        let at = match last {
            true => written.rfind(&value),
            false => written.find(&value),
        }
        .expect("the value is in the file");
        let line = written[..at].matches('\n').count() + 1;
        let col = at - written[..at].rfind('\n').map_or(0, |i| i + 1) + 1;
        assert!(
            text.contains(&format!(":{line}:{col}: ")),
            "{line}:{col} in {text}"
        );
        assert!(text.contains(what), "{what} in {text}");
        let raw = value.trim_matches('"');
        assert!(!text.contains(raw), "the value is not repeated: {text}");
    }
}
