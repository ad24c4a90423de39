//! The `idemproxy` binary as operators run it: `--help`, `check`, `explain`, `migrate`, `keys`,
//! graceful shutdown on SIGTERM, the one-process-per-SQLite-file rule, and JSON logs.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};

use common::process::parse_listeners;
use serde_json::json;

/// `idemproxy ARGS` in `dir`, with no configuration or store coming from the environment.
fn idemproxy_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(args)
        .current_dir(dir)
        .env_remove("IDEMPROXY_CONFIG")
        .env_remove("IDEMPROXY_STORE_URL")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run idemproxy")
}

fn idemproxy(args: &[&str]) -> Output {
    idemproxy_in(&std::env::temp_dir(), args)
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// stdout then stderr.
fn all_output(out: &Output) -> String {
    format!("{}{}", stdout(out), String::from_utf8_lossy(&out.stderr))
}

#[track_caller]
fn assert_exit(out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "output:\n{}",
        all_output(out)
    );
}

/// `--config <path>` args as owned strings, for `&[&str]` slices.
fn path_str(path: &Path) -> String {
    path.display().to_string()
}

/// An upstream on the main listener with a `charges` route keyed by customer.
fn charges_config(upstream_url: &str) -> String {
    format!(
        "{}\n[upstreams.api]\nurl = \"{upstream_url}\"\nprefix = \"/api\"\n\n\
         [[routes]]\nname = \"charges\"\nupstream = \"api\"\nmethods = [\"POST\"]\n\
         path = \"/v1/charges\"\nentity = \"customer:{{body.customer}}\"\n",
        server_section()
    )
}

/// 1-based line and column of the first `needle` in `text`.
fn position(text: &str, needle: &str) -> (usize, usize) {
    let at = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle:?} not in config"));
    let line = text[..at].matches('\n').count() + 1;
    let col = at - text[..at].rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}

/// The value of an `explain` output line such as `fingerprint: abc`.
fn explain_field(output: &str, field: &str) -> String {
    output
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field}: line in\n{output}"))
        .trim()
        .to_string()
}

/// Waits (bounded) for a child to exit; kills it and panics if it does not.
async fn wait_exit(child: &mut std::process::Child, what: &str) -> ExitStatus {
    let mut status = None;
    wait_until(
        || {
            status = child.try_wait().expect("try_wait");
            status.is_some()
        },
        process::STARTUP,
        what,
    )
    .await;
    status.expect("exited")
}

#[test]
fn help_works_for_every_command() {
    let commands: [&[&str]; 9] = [
        &[],
        &["serve"],
        &["check"],
        &["explain"],
        &["keys"],
        &["keys", "show"],
        &["keys", "list"],
        &["keys", "release"],
        &["migrate"],
    ];
    for command in commands {
        let mut args = command.to_vec();
        args.push("--help");
        let out = idemproxy(&args);
        assert_exit(&out, 0);
        let text = stdout(&out);
        assert!(text.contains("Usage: idemproxy"), "{args:?}:\n{text}");
        if let Some(last) = command.last() {
            assert!(text.contains(last), "{args:?} names its command:\n{text}");
        }
    }
}

#[test]
fn check_accepts_the_shipped_config_and_lists_routes() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.toml");
    let text = std::fs::read_to_string(&shipped).expect("read proxy.toml");
    let out = idemproxy(&["check", "--config", &path_str(&shipped)]);
    assert_exit(&out, 0);
    let printed = stdout(&out);
    let route_lines: Vec<&str> = printed
        .lines()
        .filter(|l| l.starts_with("route "))
        .collect();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("name = \""))
        .map(|n| n.trim_end_matches('"'))
        .collect();
    assert_eq!(
        route_lines.len(),
        text.matches("[[routes]]").count(),
        "{printed}"
    );
    assert_eq!(route_lines.len(), names.len());
    for (line, name) in route_lines.iter().zip(&names) {
        assert!(
            line.starts_with(&format!("route {name}: upstream=")),
            "{line}"
        );
        assert!(line.contains("methods=") && line.contains("path=") && line.contains("key="));
    }
    assert!(
        printed.contains("entity=customer:{body.customer}"),
        "{printed}"
    );
}

#[test]
fn check_reports_each_error_at_its_line_and_column() {
    let dir = TestDir::new();
    let upstream = "[upstreams.api]\nurl = \"http://127.0.0.1:9\"\nprefix = \"/api\"\n";
    let cases = [
        ("unknown-key", format!("[server]\nlisten = \"127.0.0.1:0\"\nbogus_key = 1\n\n{upstream}"), "bogus_key", "bogus_key"),
        ("duration", format!("{upstream}timeout = \"30 parsecs\"\n"), "\"30 parsecs\"", "duration"),
        (
            "upstream",
            format!("{upstream}\n[[routes]]\nname = \"r\"\nupstream = \"nowhere\"\npath = \"/x\"\n"),
            "\"nowhere\"",
            "unknown upstream",
        ),
        (
            "capture",
            format!("{upstream}\n[[routes]]\nname = \"r\"\nupstream = \"api\"\npath = \"/things/{{id}}\"\nentity = \"thing:{{path.thing_id}}\"\n"),
            "\"thing:{path.thing_id}\"",
            "does not capture",
        ),
        (
            "env",
            format!("[server]\nadmin_token = \"${{IDEMPROXY_TEST_NEVER_SET}}\"\n\n{upstream}"),
            "\"${IDEMPROXY_TEST_NEVER_SET}\"",
            "IDEMPROXY_TEST_NEVER_SET",
        ),
    ];
    for (name, text, needle, message) in &cases {
        let path = dir.write_file(&format!("{name}.toml"), text);
        let out = idemproxy(&["check", "--config", &path_str(&path)]);
        assert_exit(&out, 1);
        let (line, col) = position(text, needle);
        let expected = format!("{}:{line}:{col}: ", path.display());
        let printed = all_output(&out);
        let error = printed
            .lines()
            .find(|l| l.starts_with(&expected))
            .unwrap_or_else(|| panic!("{name}: no line starting {expected:?} in\n{printed}"));
        assert!(error.contains(message), "{name}: {error}");
    }

    // Every error of a file is reported at once, one line each.
    let all = format!(
        "{}{}{}",
        cases[1].1,
        &cases[2].1[upstream.len()..],
        &cases[3].1[upstream.len()..].replace("name = \"r\"", "name = \"r2\"")
    );
    let path = dir.write_file("all.toml", &all);
    let out = idemproxy(&["check", "--config", &path_str(&path)]);
    assert_exit(&out, 1);
    let prefix = format!("{}:", path.display());
    let errors = all_output(&out)
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .count();
    assert_eq!(errors, 3, "{}", all_output(&out));
}

#[test]
fn config_comes_from_the_flag_the_env_then_the_working_directory() {
    let dir = TestDir::new();
    let text = charges_config("http://127.0.0.1:9");
    let named = dir.write_config_as("named.toml", &text);
    let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("check")
        .current_dir(dir.path())
        .env("IDEMPROXY_CONFIG", &named)
        .output()
        .expect("run idemproxy");
    assert_exit(&out, 0);
    assert!(
        stdout(&out).contains("named.toml: ok"),
        "{}",
        all_output(&out)
    );

    // No flag, no env, no ./proxy.toml: a clear failure naming the file.
    let out = idemproxy_in(dir.path(), &["check"]);
    assert_exit(&out, 1);
    assert!(
        all_output(&out).contains("proxy.toml"),
        "{}",
        all_output(&out)
    );
    dir.write_config(&text);
    assert_exit(&idemproxy_in(dir.path(), &["check"]), 0);
}

#[test]
fn explain_shows_upstream_key_fingerprint_and_entity() {
    let dir = TestDir::new();
    let cfg = path_str(&dir.write_config(&charges_config("http://127.0.0.1:9/base")));
    let explain = |extra: &[&str]| {
        let mut args = vec!["explain", "--config", &cfg, "POST", "/api/v1/charges"];
        args.extend_from_slice(extra);
        let out = idemproxy(&args);
        assert_exit(&out, 0);
        stdout(&out)
    };

    let json_out = explain(&[
        "-H",
        "Idempotency-Key: k1",
        "-H",
        "Content-Type: application/json",
        "--body",
        r#"{"customer":"cus_1"}"#,
    ]);
    assert!(
        json_out.contains("http://127.0.0.1:9/base/v1/charges"),
        "{json_out}"
    );
    assert_eq!(
        explain_field(&json_out, "key"),
        "k1 (from the client's header)"
    );
    // Entities are scoped by the caller's credentials: `name@scope`.
    let entities = explain_field(&json_out, "entities");
    assert!(entities.starts_with("customer:cus_1@"), "{json_out}");
    let fingerprint = explain_field(&json_out, "fingerprint");
    assert!(
        fingerprint.len() == 64 && fingerprint.bytes().all(|b| b.is_ascii_hexdigit()),
        "{json_out}"
    );
    // Without a Content-Type the dry run reads the body as the proxy does: as neither JSON nor
    // a form, so a route that reads it refuses it, saying what to send.
    let untyped = explain(&[
        "-H",
        "Idempotency-Key: k1",
        "--body",
        r#"{"customer":"cus_1"}"#,
    ]);
    assert!(untyped.contains("refused: 400 body_invalid"), "{untyped}");
    assert!(
        untyped.contains("Content-Type: application/json"),
        "{untyped}"
    );

    // A form; without a header key the key is derived.
    let form_type = "Content-Type: application/x-www-form-urlencoded";
    let form = explain(&["-H", form_type, "--body", "customer=cus_2&amount=100"]);
    assert!(explain_field(&form, "entities").starts_with("customer:cus_2@"));
    assert!(explain_field(&form, "key").ends_with("(derived)"), "{form}");
    assert_ne!(explain_field(&form, "fingerprint"), fingerprint);

    let file = dir.write_file("body.json", r#"{"customer": "cus_3", "amount": 5}"#);
    let json_type = "Content-Type: application/json";
    let from_file = explain(&["-H", json_type, "--body", &format!("@{}", file.display())]);
    assert!(explain_field(&from_file, "entities").starts_with("customer:cus_3@"));

    let missing = explain(&[
        "-H",
        "Idempotency-Key: k2",
        "-H",
        json_type,
        "--body",
        r#"{"amount":1}"#,
    ]);
    assert!(missing.contains("refused: 400 entity_missing"), "{missing}");
    assert!(missing.contains("{body.customer}"), "{missing}");

    let gone = dir.path().join("no-such-body.json");
    let out = idemproxy(&[
        "explain",
        "--config",
        &cfg,
        "POST",
        "/api/v1/charges",
        "-H",
        "Content-Type: application/json",
        "--body",
        &format!("@{}", gone.display()),
    ]);
    assert_exit(&out, 1);
    assert!(
        all_output(&out).contains("no-such-body.json"),
        "{}",
        all_output(&out)
    );
}

#[test]
fn migrate_creates_the_database() {
    let dir = TestDir::new();
    let cfg = path_str(&dir.write_config(&charges_config("http://127.0.0.1:9")));
    assert!(!dir.db_path().exists());
    assert_exit(&idemproxy(&["migrate", "--config", &cfg]), 0);
    assert!(
        dir.db_path().exists(),
        "migrate created {}",
        dir.db_path().display()
    );
    assert_exit(&idemproxy(&["migrate", "--config", &cfg]), 0);
    let list = idemproxy(&["keys", "list", "--config", &cfg]);
    assert_exit(&list, 0);
    assert_eq!(stdout(&list), "", "a fresh store has no keys");
    assert_exit(&idemproxy(&["keys", "show", "nope", "--config", &cfg]), 1);
    assert_exit(
        &idemproxy(&["keys", "release", "nope", "--config", &cfg]),
        1,
    );
}

#[tokio::test]
async fn keys_show_list_and_release_a_stored_key() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let config_path = dir.write_config(&charges_config(&upstream.url()));
    let cfg = path_str(&config_path);
    let mut proxy = ProxyProcess::spawn(&config_path).await;
    let url = proxy.url("/api/v1/charges");
    let secret = [("authorization", "Bearer SECRET123")];
    let body1 = json!({"customer": "cus_1"});
    let first = post_json(&url, Some("k-secret"), &body1, &secret).await;
    assert_eq!(first.replayed(), Some(false));
    post_json(&url, Some("k-other"), &json!({"customer": "cus_2"}), &[])
        .await
        .assert_status(200);

    let show = idemproxy(&["keys", "show", "k-secret", "--config", &cfg]);
    assert_exit(&show, 0);
    assert!(
        !all_output(&show).contains("SECRET123"),
        "{}",
        all_output(&show)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&show.stdout).expect("keys show prints JSON");
    assert_eq!(report["key"], "k-secret");
    let records = &report["records"];
    let record = &records[0];
    assert_eq!(records.as_array().map(Vec::len), Some(1), "{report}");
    assert_eq!(record["key"], "k-secret");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["attempts"], 1);
    let entity = record["entities"][0]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(entity.starts_with("customer:cus_1@"), "{report}");
    // explain computes what the proxy stored.
    let explained = idemproxy(&[
        "explain",
        "--config",
        &cfg,
        "POST",
        "/api/v1/charges",
        "-H",
        "Idempotency-Key: k-secret",
        "-H",
        "Authorization: Bearer SECRET123",
        "-H",
        "Content-Type: application/json",
        "--body",
        &body1.to_string(),
    ]);
    assert_eq!(
        record["fingerprint"],
        explain_field(&stdout(&explained), "fingerprint")
    );
    assert_eq!(record["scope"], explain_field(&stdout(&explained), "scope"));
    assert_eq!(
        entity,
        explain_field(&stdout(&explained), "entities"),
        "explain scopes entities as the proxy does"
    );

    let list = |args: &[&str]| {
        let mut all = vec!["keys", "list", "--config", &cfg];
        all.extend_from_slice(args);
        let out = idemproxy(&all);
        assert_exit(&out, 0);
        stdout(&out)
    };
    let filtered = list(&["--state", "completed", "--entity", "customer:cus_1"]);
    assert_eq!(filtered.lines().count(), 1, "{filtered}");
    assert!(filtered.starts_with("k-secret\t"), "{filtered}");
    assert_eq!(list(&["--state", "completed"]).lines().count(), 2);
    assert_eq!(list(&["--state", "released"]), "");
    assert_exit(
        &idemproxy(&["keys", "list", "--state", "bogus", "--config", &cfg]),
        1,
    );

    // Replayed until released, forwarded again after.
    assert_eq!(
        post_json(&url, Some("k-secret"), &body1, &secret)
            .await
            .replayed(),
        Some(true)
    );
    // A completed key is released only on purpose.
    let refused = idemproxy(&["keys", "release", "k-secret", "--config", &cfg]);
    assert_exit(&refused, 1);
    assert!(
        all_output(&refused).contains("--force"),
        "{}",
        all_output(&refused)
    );
    let note = ["--force", "--note", "a test answer"];
    let release = idemproxy(
        &[
            &["keys", "release", "k-secret", "--config", &cfg][..],
            &note,
        ]
        .concat(),
    );
    assert_exit(&release, 0);
    assert!(list(&["--state", "released"]).starts_with("k-secret\t"));
    let again = post_json(&url, Some("k-secret"), &body1, &secret).await;
    assert_eq!(again.replayed(), Some(false));
    assert_eq!(upstream.count(), 3);

    proxy.terminate();
    assert!(proxy.wait().await.success(), "{}", proxy.stderr());
    assert!(
        !proxy.stderr().contains("SECRET123"),
        "credentials in the log"
    );
    let mut scanned = 0;
    for entry in std::fs::read_dir(dir.path()).expect("read test dir") {
        let path: PathBuf = entry.expect("dir entry").path();
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("idemproxy.db"))
        {
            let bytes = std::fs::read(&path).expect("read store file");
            assert!(
                !bytes.windows(9).any(|w| w == b"SECRET123"),
                "{} holds the credential",
                path.display()
            );
            scanned += 1;
        }
    }
    assert!(scanned >= 1 && dir.db_path().exists());
}

#[tokio::test]
async fn sigterm_lets_the_in_flight_forward_finish_and_be_stored() {
    let upstream = RecordingUpstream::holding().await;
    let dir = TestDir::new();
    let config_path = dir.write_config(&charges_config(&upstream.url()));
    let mut proxy = ProxyProcess::spawn(&config_path).await;
    let body = json!({"customer": "cus_1"});
    let url = proxy.url("/api/v1/charges");
    let pending = {
        let body = body.clone();
        tokio::spawn(async move { post_json(&url, Some("k-term"), &body, &[]).await })
    };
    upstream.wait_for_held(1).await;
    proxy.terminate();
    wait_until(
        || proxy.stderr().contains("shutting down"),
        WAIT,
        "the proxy logs its shutdown",
    )
    .await;
    assert!(
        proxy.try_wait().is_none(),
        "exited with a forward in flight"
    );
    upstream.release_all();

    let answer = pending.await.expect("client task");
    answer.assert_status(200);
    assert_eq!(
        (answer.replayed(), answer.upstream_seq()),
        (Some(false), Some(1))
    );
    let status = proxy.wait().await;
    assert!(status.success(), "exit {status}\n{}", proxy.stderr());

    let proxy = ProxyProcess::spawn(&config_path).await;
    let retry = post_json(&proxy.url("/api/v1/charges"), Some("k-term"), &body, &[]).await;
    assert_eq!(retry.replayed(), Some(true));
    assert_eq!(retry.body, answer.body);
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn a_second_serve_on_the_same_sqlite_file_refuses_to_start() {
    let upstream = RecordingUpstream::start().await;
    let dir = TestDir::new();
    let config_path = dir.write_config(&charges_config(&upstream.url()));
    let first = ProxyProcess::spawn(&config_path).await;
    let stderr_path = dir.path().join("second.log");
    let mut second = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["serve", "--config", &path_str(&config_path)])
        .env_remove("IDEMPROXY_STORE_URL")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).expect("create log"))
        .spawn()
        .expect("spawn second serve");
    let status = wait_exit(&mut second, "the second serve exits").await;
    let log = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(!status.success(), "{log}");
    assert!(log.contains("in use"), "{log}");

    // The first one is unaffected.
    let resp = post_json(
        &first.url("/api/v1/charges"),
        Some("k1"),
        &json!({"customer": "c"}),
        &[],
    )
    .await;
    resp.assert_status(200);
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn log_format_json_writes_json_lines() {
    let dir = TestDir::new();
    let config_path = dir.write_config(&charges_config("http://127.0.0.1:9"));
    let stderr_path = dir.path().join("json.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args([
            "--log-format",
            "json",
            "serve",
            "--config",
            &path_str(&config_path),
        ])
        .env_remove("IDEMPROXY_STORE_URL")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).expect("create log"))
        .spawn()
        .expect("spawn serve");
    let read = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
    wait_until(
        || parse_listeners(&read()).main.is_some(),
        process::STARTUP,
        "serve logs its listener",
    )
    .await;
    let main = parse_listeners(&read()).main.expect("main listener");
    // A refused request logs a line too.
    let resp = get(&format!("http://{main}/nowhere")).await;
    resp.assert_status(404);
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(kill.success());
    let status = wait_exit(&mut child, "serve exits on SIGTERM").await;
    assert!(status.success(), "{}", read());

    let log = read();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 3, "{log}");
    for line in &lines {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(
            value["level"].is_string() && value["fields"].is_object(),
            "{line}"
        );
    }
    assert!(log.contains("/nowhere"), "the refusal was logged: {log}");
}

#[test]
fn check_and_explain_show_each_routes_mode() {
    let dir = TestDir::new();
    let observed = charges_config("http://127.0.0.1:9")
        .replace("[upstreams.api]\n", "[upstreams.api]\nmode = \"observe\"\n");
    let cfg = path_str(&dir.write_config(&observed));
    let out = idemproxy(&["check", "--config", &cfg]);
    assert_exit(&out, 0);
    let printed = stdout(&out);
    assert!(
        printed.contains("route charges: ") && printed.contains("mode=observe"),
        "{printed}"
    );
    let out = idemproxy(&[
        "explain",
        "--config",
        &cfg,
        "POST",
        "/api/v1/charges",
        "-H",
        "Idempotency-Key: k1",
        "-H",
        "Content-Type: application/json",
        "--body",
        r#"{"customer":"cus_1"}"#,
    ]);
    assert_exit(&out, 0);
    assert!(
        explain_field(&stdout(&out), "outcome").starts_with("observed"),
        "{}",
        stdout(&out)
    );
    // The route's own mode wins over its upstream's.
    let enforced = observed.replace(
        "path = \"/v1/charges\"",
        "path = \"/v1/charges\"\nmode = \"enforce\"",
    );
    let cfg = path_str(&dir.write_config(&enforced));
    let printed = stdout(&idemproxy(&["check", "--config", &cfg]));
    assert!(printed.contains("mode=enforce"), "{printed}");
}

#[test]
fn explain_shows_the_reconcile_read_and_check_lists_it() {
    let shipped = path_str(&Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.toml"));
    let out = idemproxy(&[
        "explain",
        "--config",
        &shipped,
        "POST",
        "/hubspot/crm/v3/objects/contacts",
        "-H",
        "Content-Type: application/json",
        "--body",
        r#"{"properties":{"email":"ada@example.com","firstname":"Ada"}}"#,
    ]);
    assert_exit(&out, 0);
    let line = explain_field(&stdout(&out), "reconcile");
    assert!(
        line.contains("GET /crm/v3/objects/contacts/ada%40example.com?idProperty=email"),
        "{line}"
    );
    assert!(line.contains("found [200], not_found [404]"), "{line}");
    let out = idemproxy(&[
        "explain",
        "--config",
        &shipped,
        "PATCH",
        "/hubspot/crm/v3/objects/contacts/42",
        "-H",
        "X-Workflow-Id: wf-1",
        "-H",
        "Content-Type: application/json",
        "--body",
        r#"{"properties":{"firstname":"Ada"}}"#,
    ]);
    assert_exit(&out, 0);
    let line = explain_field(&stdout(&out), "reconcile");
    assert!(line.contains("GET /crm/v3/objects/contacts/42"), "{line}");
    assert!(
        line.contains(r#"body.properties = {"firstname":"Ada"}"#),
        "{line}"
    );
    let out = idemproxy(&["check", "--config", &shipped]);
    assert!(stdout(&out).contains(
        "reconcile=GET /crm/v3/objects/contacts/{body.properties.email}?idProperty=email"
    ));
}

/// `check` and `explain` print settings as the config spells them (`in_flight=reject`,
/// `unmatched=passthrough`, `error_format=zendesk`), never Rust's spelling of them
/// (`Reject`, `Passthrough`, `Zendesk`): what an operator reads is what they can paste back.
#[test]
fn check_and_explain_print_settings_in_the_configs_own_spelling() {
    let dir = TestDir::new();
    let config = charges_config("http://127.0.0.1:9")
        .replace(
            "[upstreams.api]\n",
            "[upstreams.api]\nunmatched = \"passthrough\"\nerror_format = \"zendesk\"\nmode = \"observe\"\n",
        )
        .replace(
            "path = \"/v1/charges\"",
            "path = \"/v1/charges\"\nin_flight = \"reject\"\nretention = \"90m\"",
        );
    let cfg = path_str(&dir.write_config(&config));
    let out = idemproxy(&["check", "--config", &cfg]);
    assert_exit(&out, 0);
    let checked = stdout(&out);
    let out = idemproxy(&[
        "explain",
        "--config",
        &cfg,
        "POST",
        "/api/v1/charges",
        "-H",
        "Idempotency-Key: k1",
        "-H",
        "Content-Type: application/json",
        "--body",
        r#"{"customer":"cus_1"}"#,
    ]);
    assert_exit(&out, 0);
    let explained = stdout(&out);
    for want in [
        "unmatched=passthrough",
        "error_format=zendesk",
        "in_flight=reject",
        "mode=observe",
    ] {
        assert!(checked.contains(want), "check lacks {want}:\n{checked}");
    }
    assert!(
        explained.contains("in_flight=reject") && explained.contains("mode=observe"),
        "{explained}"
    );
    // No `setting=Value` in Rust's spelling anywhere (an all-caps method list is the config's).
    for printed in [&checked, &explained] {
        let debug = printed.split_whitespace().find(|word| {
            word.split_once('=').is_some_and(|(_, v)| {
                let mut c = v.chars();
                c.next().is_some_and(|f| f.is_ascii_uppercase())
                    && c.next().is_some_and(|s| s.is_ascii_lowercase())
            })
        });
        assert_eq!(debug, None, "{printed}");
    }
}
