use super::*;

fn compile_str(text: &str) -> Result<Config, ConfigError> {
    let env = |k: &str| match k {
        "TOKEN" => Some("s3cret".to_string()),
        _ => None,
    };
    compile(text, "t.toml", &env)
}

const BASE: &str = r#"
[server]
listen = "127.0.0.1:0"
admin_token = "${TOKEN}"
[store]
url = "sqlite://x.db"
[upstreams.api]
url = "http://127.0.0.1:9"
prefix = "/api"
"#;

fn with_route(route: &str) -> String {
    format!("{BASE}\n[[routes]]\n{route}")
}

fn first_error(text: &str) -> String {
    match compile_str(text) {
        Ok(_) => panic!("expected an error for:\n{text}"),
        Err(e) => e.errors[0].clone(),
    }
}

#[test]
fn a_full_route_compiles() {
    let cfg = compile_str(&with_route(
        r#"name = "r"
upstream = "api"
methods = ["PATCH"]
path = "/contacts/{id}"
entity = "contact:{path.id}"
key = { derive = "{header.x-workflow-id}:{entity}:{route}:{fingerprint}" }
fingerprint = { ignore = ["body.properties.last_synced_at"] }
version = "{header.x-entity-version}"
claim = true
claim_ttl = "24h"
precheck = { path = "/contacts/{path.id}", expect = { "body.status" = "free" } }"#,
    ))
    .unwrap();
    let r = &cfg.routes[0];
    assert_eq!(r.methods, vec![Method::PATCH]);
    assert!(r.needs_body);
    assert_eq!(cfg.server.admin_token.as_deref(), Some("s3cret"));
    assert_eq!(cfg.upstreams[0].routes.len(), 1);
    assert_eq!(r.precheck.as_ref().unwrap().expect_status, vec![200]);
}

#[test]
fn unknown_keys_report_line_and_column() {
    let e = first_error(&format!("{BASE}bogus = 1\n"));
    assert!(e.starts_with("t.toml:10:1:"), "{e}");
    assert!(e.contains("bogus"), "{e}");
}

#[test]
fn bad_values_are_located() {
    let e = first_error(&format!("{BASE}timeout = \"30 parsecs\"\n"));
    assert!(e.starts_with("t.toml:10:11:"), "{e}");
    let e = first_error(&with_route(
        r#"name = "r"
upstream = "nope"
path = "/x""#,
    ));
    assert!(
        e.contains("t.toml:13:12") && e.contains("unknown upstream"),
        "{e}"
    );
    let e = first_error(&with_route(
        r#"name = "r"
upstream = "api"
path = "/x/{id}"
entity = "c:{path.other}""#,
    ));
    assert!(
        e.contains("does not capture") && e.contains("t.toml:15:"),
        "{e}"
    );
    let e = first_error(&with_route(
        r#"name = "r"
upstream = "api"
path = "/x"
entity = "c:{cookie.a}""#,
    ));
    assert!(e.contains("unknown source"), "{e}");
    let e = first_error(&format!(
        "{BASE}[server.tls]\ncert = \"${{NOPE}}\"\nkey = \"k\"\n"
    ));
    assert!(e.contains("NOPE is not set"), "{e}");
    let e = first_error(&format!("{BASE}release_statuses = [999]\n"));
    assert!(e.contains("not an HTTP status"), "{e}");
    let e = first_error("[server]\nmax_body = \"lots\"\n");
    assert!(e.starts_with("t.toml:2:12"), "{e}");
}

#[test]
fn entity_in_derive_needs_an_entity() {
    let e = first_error(&with_route(
        r#"name = "r"
upstream = "api"
path = "/x"
key = { derive = "{entity}" }"#,
    ));
    assert!(e.contains("{entity}"), "{e}");
}

#[test]
fn several_errors_are_all_reported() {
    let text = format!("{BASE}timeout = \"x\"\nunmatched = \"maybe\"\n");
    let errs = compile_str(&text).unwrap_err().errors;
    assert_eq!(errs.len(), 2, "{errs:?}");
}

#[test]
fn store_urls_are_redacted_and_leases_bounded() {
    assert_eq!(
        redact_url("postgres://app:S3cret@db:5432/x?sslmode=require"),
        "postgres://app:***@db:5432/x?sslmode=require"
    );
    assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
    assert_eq!(redact_url("sqlite://idemproxy.db"), "sqlite://idemproxy.db");
    assert_eq!(
        redact_url("postgres://u@h/db?password=S3cret"),
        "postgres://u@h/db?password=***"
    );
    assert!(!redact_url("postgres://u:a/b?c@h/db").contains("a/b?c"));
    let e = first_error("[store]\nlease = \"100ms\"\n");
    assert!(e.contains("at least"), "{e}");
}

#[test]
fn key_defaults_follow_the_spec() {
    let cfg = compile_str(&with_route(
        "name = \"r\"\nupstream = \"api\"\npath = \"/x\"",
    ))
    .unwrap();
    let k = &cfg.routes[0].key;
    assert_eq!(
        k.header.as_ref().map(|h| h.as_str()),
        Some("idempotency-key")
    );
    assert_eq!(k.derive.first().map(|d| d.text()), Some("{fingerprint}"));
    assert!(k.required);
    let cfg = compile_str(&with_route("name = \"r\"\nupstream = \"api\"\npath = \"/x\"\nkey = { header = \"\", derive = \"{body.id}\" }")).unwrap();
    assert!(cfg.routes[0].key.header.is_none());
    assert!(cfg.routes[0].needs_body);
}

#[test]
fn upstream_listen_collides_only_on_a_fixed_port() {
    let fixed = "[server]\nlisten = \"127.0.0.1:8080\"\n[upstreams.a]\nurl = \"http://x\"\nlisten = \"127.0.0.1:8080\"\n";
    assert!(first_error(fixed).contains("already used by [server]"));
    // Port 0 is "any free port" for both: never the same socket.
    let ephemeral = "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[upstreams.a]\nurl = \"http://x\"\nlisten = \"127.0.0.1:0\"\n";
    assert!(compile_str(ephemeral).is_ok());
}

#[test]
fn reconcile_compiles_with_defaults_and_templates() {
    let cfg = compile_str(&with_route(
        r#"name = "r"
upstream = "api"
methods = ["POST"]
path = "/contacts"
entity = "email:{body.email}"
reconcile = { path = "/contacts/{body.email}?idProperty=email", expect = { "body.properties" = "{body.properties}", "body.n" = 5 } }"#,
    ))
    .unwrap();
    let r = &cfg.routes[0];
    let rc = r.reconcile.as_ref().unwrap();
    assert_eq!(
        (rc.found.clone(), rc.not_found.clone()),
        (vec![200], vec![404])
    );
    assert_eq!(rc.method, Method::GET);
    assert_eq!(rc.after, Duration::from_secs(1));
    assert!(r.needs_body);
    // In field order: `body.n` (a value as written), `body.properties` (one body field).
    assert!(matches!(rc.expect[0].1, Expected::Value(_)));
    assert!(matches!(rc.expect[1].1, Expected::Field { .. }));
}

#[test]
fn reconcile_mistakes_are_located() {
    let route = |rc: &str| {
        with_route(&format!(
            "name = \"r\"\nupstream = \"api\"\nmethods = [\"POST\"]\npath = \"/c/{{id}}\"\nreconcile = {rc}"
        ))
    };
    let cases = [
        (
            r#"{ path = "/c/{path.id}", found = [200], not_found = [200] }"#,
            "both found and not_found",
        ),
        (
            r#"{ method = "POST", path = "/c/{path.id}" }"#,
            "must be GET or HEAD",
        ),
        (r#"{ path = "/c/{path.other}" }"#, "does not capture"),
        (
            r#"{ path = "/c/{path.id}", answer_status = 404 }"#,
            "not a 2xx",
        ),
        (
            r#"{ path = "/c/{path.id}", expect = { "status" = "x" } }"#,
            "body.* fields",
        ),
        (r#"{ path = "/c/{path.id}", after = "soon" }"#, "soon"),
        (r#"{ path = "/c/{path.id}", bogus = 1 }"#, "bogus"),
        (r#"{ path = "/c/{path.id}", found = [] }"#, "found is empty"),
        (r#"{ path = "/c/{path.id}", after = "2h" }"#, "at most"),
        (
            r#"{ method = "OPTIONS", path = "/c/{path.id}" }"#,
            "GET or HEAD",
        ),
        (
            r#"{ method = "HEAD", path = "/c/{path.id}", expect = { "body.a" = 1 } }"#,
            "use GET",
        ),
    ];
    for (rc, want) in cases {
        let e = first_error(&route(rc));
        assert!(e.starts_with("t.toml:"), "{e}");
        assert!(e.contains(want), "{rc}: {e}");
    }
    let e = first_error(&with_route(
        "name = \"r\"\nupstream = \"api\"\nmethods = [\"POST\"]\npath = \"/s\"\nread_only = true\nreconcile = { path = \"/s\" }",
    ));
    assert!(e.contains("reconcile"), "{e}");
}

#[test]
fn reconcile_expectations_never_read_what_the_fingerprint_ignores() {
    let route = |expect: &str| {
        with_route(&format!(
            "name = \"r\"\nupstream = \"api\"\nmethods = [\"PATCH\"]\npath = \"/c/{{id}}\"\n\
             fingerprint = {{ ignore = [\"body.properties.synced_at\"] }}\n\
             reconcile = {{ path = \"/c/{{path.id}}\", not_found = [], expect = {{ {expect} }} }}"
        ))
    };
    let e = first_error(&route(r#""body.s" = "{body.properties.synced_at}""#));
    assert!(e.contains("fingerprint.ignore"), "{e}");
    let cfg = compile_str(&route(r#""body.properties" = "{body.properties}""#)).unwrap();
    let rc = cfg.routes[0].reconcile.as_ref().unwrap();
    assert!(
        rc.not_found.is_empty(),
        "not_found = [] releases on no answer"
    );
    match &rc.expect[0].1 {
        Expected::Field { path, strip } => {
            assert_eq!(path.to_string(), "properties");
            assert_eq!(strip.len(), 1);
            assert_eq!(strip[0].to_string(), "synced_at");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn serving_threads_default_to_the_cores_and_can_be_set() {
    let cfg = compile_str(BASE).unwrap();
    assert_eq!(cfg.server.workers, None);
    // One runtime worker; the other serving threads connection threads.
    assert_eq!(cfg.server.connection_threads_for(2), 1);
    assert_eq!(cfg.server.connection_threads_for(8), 7);
    assert_eq!(cfg.server.connection_threads_for(1), 0);
    let set = compile_str(&BASE.replace("[server]\n", "[server]\nworkers = 3\n")).unwrap();
    assert_eq!(set.server.connection_threads_for(2), 2);
    for bad in ["0", "-1", "5000"] {
        let e = first_error(&BASE.replace("[server]\n", &format!("[server]\nworkers = {bad}\n")));
        assert!(e.contains("workers") || e.contains("1 to 1024"), "{e}");
    }
}

#[test]
fn derive_lists_windows_and_stamps() {
    let route = |extra: &str| {
        with_route(&format!(
            "name = \"r\"\nupstream = \"api\"\npath = \"/t\"\nentity = \"t:{{body.id}}\"\n{extra}"
        ))
    };
    let cfg = compile_str(&route(
        "key = { header = \"\", derive = [\"{header.x-run}:{fingerprint}\", \"{entity}:{fingerprint}\"], window = \"10m\" }\nstamp = \"body.ticket.external_id\"\nreconcile = { path = \"/t?external_id={stamp}\", answer = { ticket = \"{read.tickets[0]}\" } }",
    ))
    .unwrap();
    let r = &cfg.routes[0];
    assert_eq!(r.key.derive.len(), 2);
    assert!(!intent_only(&r.key.derive[0]) && intent_only(&r.key.derive[1]));
    assert_eq!(r.key.window, Some(Duration::from_secs(600)));
    assert!(r.stamp.is_some() && r.needs_body);
    assert!(r.reconcile.as_ref().is_some_and(|rc| rc.answer.is_some()));

    let only_headers = route("key = { derive = \"{header.x-run}\", window = \"1m\" }");
    assert!(first_error(&only_headers).contains("intent alone"));
    assert!(first_error(&route("key = { derive = 7 }")).contains("list of templates"));
    let stray = route("key = { derive = \"{stamp}\" }");
    assert!(first_error(&stray).contains("cannot use {stamp}"));
    let unstamped = route("reconcile = { path = \"/t?e={stamp}\" }");
    assert!(first_error(&unstamped).contains("cannot use {stamp}"));
    // An update stamped into its audit's metadata: found by the stamp among the audits,
    // answered with a second read.
    let audits = compile_str(&route(
        "stamp = \"body.ticket.metadata.custom.s\"\nreconcile = { path = \"/t/audits\", expect = { \"body.audits[*].metadata.custom.s\" = \"{stamp}\" }, answer_path = \"/t/{body.id}\" }",
    ))
    .unwrap();
    let rc = audits.routes[0].reconcile.as_ref().unwrap();
    assert!(rc.uses_stamp() && rc.reads_body() && rc.answer_path.is_some());
    let expect_unstamped =
        route("reconcile = { path = \"/t\", expect = { \"body.a\" = \"{stamp}\" } }");
    assert!(first_error(&expect_unstamped).contains("cannot use {stamp}"));
    assert!(first_error(&route("stamp = \"body.a[*].b\"")).contains("not [*]"));
    assert!(first_error(&route("stamp = \"header.x\"")).contains("a body field"));
    let answer = route("reconcile = { path = \"/t\", answer = { a = \"{reads}\" } }");
    assert!(first_error(&answer).contains("reconcile.answer"));
    let native = format!(
        "{}\nnative_idempotency_header = \"Idempotency-Key\"\n[[routes]]\nname = \"r\"\nupstream = \"api\"\npath = \"/t\"\nkey = {{ derive = \"{{fingerprint}}\", window = \"1m\" }}",
        BASE
    );
    assert!(first_error(&native).contains("native_idempotency_header"));
}

#[test]
fn pace_budgets_are_checked() {
    let up = |pace: &str| {
        format!("[server]\nlisten = \"127.0.0.1:0\"\n[upstreams.api]\nurl = \"http://127.0.0.1:9\"\nprefix = \"/api\"\npace = {pace}\n")
    };
    let cfg = compile_str(&up(r#"{ rate = 100, per = "10s" }"#)).unwrap();
    let b = cfg.upstreams[0].pace.expect("a budget");
    assert_eq!((b.rate.limit, b.rate.burst), (100, 100));
    assert_eq!(
        (b.rate.per, b.max_wait),
        (Duration::from_secs(10), Duration::from_secs(30))
    );
    assert!(first_error(&up("{ rate = 0 }")).contains("1 or more"));
    assert!(first_error(&up(r#"{ rate = 5, per = "2d" }"#)).contains("to a day"));
    assert!(first_error(&up(r#"{ rate = 5, max_wait = "1h" }"#)).contains("at most"));
    assert!(first_error(&up("{ rate = 5, burst = -1 }")).contains("pace.burst"));
}
