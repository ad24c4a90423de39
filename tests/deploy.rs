//! The monitoring shipped in `deploy/`: the Prometheus alert rules
//! (`deploy/prometheus/alerts.yml`) pass `promtool check rules` and their unit tests
//! (`alerts_test.yml`: each rule fires on one series and stays quiet on a healthy one), the
//! Grafana dashboard (`deploy/grafana/idemproxy.json`) queries valid PromQL, and every metric,
//! label and label value the rules and the dashboard query is one the real proxy serves: the
//! `idemproxy serve` binary is driven until every metric family has samples, and its admin
//! `/metrics` is scraped.

mod common;
use common::*;

use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A file under the repository's `deploy/`.
fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn dashboard() -> Value {
    let path = deploy("grafana/idemproxy.json");
    serde_json::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whether promtool runs; a loud skip (a failure under `CI=true`) otherwise.
fn promtool_installed() -> bool {
    installed("promtool", Command::new("promtool").arg("--version"))
}

/// Runs `promtool args…` and fails the test with its output unless it succeeds.
fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run promtool {args:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

// ---------------------------------------------------------------------------------------------
// The rules file, read just enough: each rule's name, PromQL and keys.

/// One alerting rule of `alerts.yml`.
#[derive(Debug)]
struct Rule {
    name: String,
    expr: String,
    /// The rule's lines, for its labels and annotations.
    text: String,
}

/// The alerting rules of a rules file written as `deploy/prometheus/alerts.yml` is: each rule
/// starts at `- alert: NAME`; `expr:` is inline or a block scalar (`|`, `>`, with `-`/`+`)
/// whose lines are indented deeper than the key.
fn rules(yaml: &str) -> Vec<Rule> {
    let lines: Vec<&str> = yaml.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut rules: Vec<Rule> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            rules.push(Rule {
                name: name
                    .trim()
                    .trim_matches(|c| c == '"' || c == '\'')
                    .to_owned(),
                expr: String::new(),
                text: String::new(),
            });
        }
        if let Some(rule) = rules.last_mut() {
            rule.text.push_str(line);
            rule.text.push('\n');
            if let Some(value) = trimmed.strip_prefix("expr:") {
                let value = value.trim();
                if value.starts_with('|') || value.starts_with('>') {
                    let key = indent(line);
                    while i + 1 < lines.len()
                        && (lines[i + 1].trim().is_empty() || indent(lines[i + 1]) > key)
                    {
                        i += 1;
                        rule.expr.push_str(lines[i].trim());
                        rule.expr.push('\n');
                        rule.text.push_str(lines[i]);
                        rule.text.push('\n');
                    }
                } else {
                    rule.expr = value.trim_matches(|c| c == '"' || c == '\'').to_owned();
                }
            }
        }
        i += 1;
    }
    rules
}

/// Every query the dashboard makes: its panels' `expr`s and its query variables' queries.
fn dashboard_queries(dash: &Value) -> Vec<String> {
    let mut queries = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for inner in std::iter::once(panel).chain(panel["panels"].as_array().into_iter().flatten())
        {
            for target in inner["targets"].as_array().into_iter().flatten() {
                queries.push(target["expr"].as_str().expect("a target's expr").to_owned());
            }
        }
    }
    for var in dash["templating"]["list"].as_array().expect("templating") {
        if var["type"] == "query" {
            let query = match &var["query"] {
                Value::String(q) => q.clone(),
                q => q["query"].as_str().expect("a variable's query").to_owned(),
            };
            queries.push(query);
        }
    }
    queries
}

// ---------------------------------------------------------------------------------------------
// PromQL, read just enough: the `idemproxy_*` names it selects and their label matchers.

/// A label matcher of a selector: `label op "value"`.
#[derive(Debug, Clone, PartialEq)]
struct Matcher {
    label: String,
    op: String,
    value: String,
}

/// One `idemproxy_*` metric a query selects, with its `{…}` matchers.
#[derive(Debug, Clone, PartialEq)]
struct Selected {
    name: String,
    matchers: Vec<Matcher>,
}

fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// A double-quoted string starting at `chars[i]` (`"`): its value (escapes resolved) and the
/// index after its closing quote.
fn quoted(chars: &[char], mut i: usize) -> (String, usize) {
    let mut value = String::new();
    i += 1;
    while i < chars.len() && chars[i] != '"' {
        if chars[i] == '\\' && i + 1 < chars.len() {
            i += 1;
        }
        value.push(chars[i]);
        i += 1;
    }
    (value, i + 1)
}

/// The `idemproxy_*` identifiers of a PromQL expression (outside string literals), each with
/// the label matchers of its selector.
fn selected(expr: &str) -> Vec<Selected> {
    let chars: Vec<char> = expr.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            i = quoted(&chars, i).1;
            continue;
        }
        if !ident_char(c) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && ident_char(chars[i]) {
            i += 1;
        }
        let ident: String = chars[start..i].iter().collect();
        if !ident.starts_with("idemproxy_") {
            continue;
        }
        let mut matchers = Vec::new();
        let mut j = i;
        while j < chars.len() && chars[j].is_whitespace() {
            j += 1;
        }
        if j < chars.len() && chars[j] == '{' {
            j += 1;
            loop {
                while j < chars.len() && (chars[j].is_whitespace() || chars[j] == ',') {
                    j += 1;
                }
                if j >= chars.len() || chars[j] == '}' {
                    break;
                }
                let label_start = j;
                while j < chars.len() && ident_char(chars[j]) {
                    j += 1;
                }
                let label: String = chars[label_start..j].iter().collect();
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let op_start = j;
                while j < chars.len() && matches!(chars[j], '=' | '!' | '~') {
                    j += 1;
                }
                let op: String = chars[op_start..j].iter().collect();
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                assert!(
                    !label.is_empty() && j < chars.len() && chars[j] == '"',
                    "cannot read the matchers of {ident} in:\n{expr}"
                );
                let (value, next) = quoted(&chars, j);
                matchers.push(Matcher { label, op, value });
                j = next;
            }
            i = j + 1;
        }
        found.push(Selected {
            name: ident,
            matchers,
        });
    }
    found
}

/// The label values a matcher's value stands for, when it names them plainly (`"unknown"`,
/// `"replayed|forwarded"`); `None` for a pattern or a dashboard variable (`".*"`, `"$route"`).
fn plain_values(m: &Matcher) -> Option<Vec<&str>> {
    if !matches!(m.op.as_str(), "=" | "=~") {
        return None;
    }
    let plain = |v: &str| {
        !v.is_empty()
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | ':'))
    };
    match m.op.as_str() {
        "=" => plain(&m.value).then(|| vec![m.value.as_str()]),
        _ => {
            let alternatives: Vec<&str> = m.value.split('|').collect();
            alternatives
                .iter()
                .all(|a| plain(a))
                .then_some(alternatives)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The exposition, read just enough: families, their types and their samples.

/// What `/metrics` served.
#[derive(Debug, Default)]
struct Exposition {
    /// Family name → type (`counter`, `gauge`, `histogram`, …), from the `# TYPE` lines.
    families: BTreeMap<String, String>,
    /// Sample name (`idemproxy_requests_total`, `idemproxy_lock_wait_seconds_bucket`) → the
    /// label sets it was served with.
    samples: BTreeMap<String, Vec<BTreeMap<String, String>>>,
}

/// The labels Prometheus adds to every scraped series (target labels), which a query may
/// match on though the proxy never serves them.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

impl Exposition {
    fn parse(text: &str) -> Exposition {
        let mut e = Exposition::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                    panic!("a TYPE line without a name and a type: {line:?}");
                };
                e.families.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let chars: Vec<char> = line.chars().collect();
            let end = chars.iter().position(|&c| c == '{' || c == ' ');
            let name: String = chars[..end.unwrap_or(chars.len())].iter().collect();
            let mut labels = BTreeMap::new();
            if let Some(mut i) = end.filter(|&i| chars[i] == '{') {
                i += 1;
                while i < chars.len() && chars[i] != '}' {
                    let start = i;
                    while chars[i] != '=' {
                        i += 1;
                    }
                    let label: String = chars[start..i].iter().collect();
                    let (value, next) = quoted(&chars, i + 1);
                    labels.insert(label.trim_start_matches(',').to_owned(), value);
                    i = next;
                    if i < chars.len() && chars[i] == ',' {
                        i += 1;
                    }
                }
            }
            e.samples.entry(name).or_default().push(labels);
        }
        e
    }

    /// The sample names a family of this type is served as, by the OpenMetrics suffix rules: a
    /// counter `F` as `F_total`, a histogram as `F_bucket`, `F_sum` and `F_count`, a gauge
    /// (or anything else) as `F`.
    fn series_of(family: &str, kind: &str) -> Vec<String> {
        match kind {
            "counter" => vec![format!("{family}_total")],
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|s| format!("{family}{s}"))
                .collect(),
            _ => vec![family.to_owned()],
        }
    }

    /// Every name a query may select: family → the sample names it is served as.
    fn queryable(&self) -> BTreeMap<String, String> {
        let mut names = BTreeMap::new();
        for (family, kind) in &self.families {
            for series in Self::series_of(family, kind) {
                names.insert(series, family.clone());
            }
        }
        names
    }

    /// Why `sel` is not something the proxy serves, if it is not: a name no family is served
    /// as (a family name without its suffix, a suffix its type does not take, a misspelling),
    /// a label none of its samples has, or a plain label value none of its samples has.
    fn check(&self, sel: &Selected) -> Result<(), String> {
        let queryable = self.queryable();
        let Some(family) = queryable.get(&sel.name) else {
            let hint = match self.families.get(&sel.name) {
                Some(kind) => format!(
                    "; {} is a {kind}, served as {}",
                    sel.name,
                    Self::series_of(&sel.name, kind).join(", ")
                ),
                None => String::new(),
            };
            return Err(format!(
                "{} is not a metric the proxy serves{hint} (it serves {})",
                sel.name,
                queryable.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        };
        let kind = &self.families[family];
        let samples = self
            .samples
            .get(&sel.name)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        for m in &sel.matchers {
            if TARGET_LABELS.contains(&m.label.as_str()) {
                continue;
            }
            let values: BTreeSet<&str> = samples
                .iter()
                .filter_map(|labels| labels.get(&m.label).map(String::as_str))
                .collect();
            if values.is_empty() {
                return Err(format!(
                    "{}{{{}{}\"{}\"}}: the {kind} {family} has no label {:?}",
                    sel.name, m.label, m.op, m.value, m.label
                ));
            }
            for value in plain_values(m).unwrap_or_default() {
                if !values.contains(value) {
                    return Err(format!(
                        "{}{{{}{}\"{}\"}}: {} = {value:?} never appeared (it had {values:?})",
                        sel.name, m.label, m.op, m.value, m.label
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Checks every `idemproxy_*` selection of `queries` (named by where they come from) against
/// what the proxy served; the list of failures.
fn unserved<'a>(
    served: &Exposition,
    queries: impl IntoIterator<Item = (String, &'a str)>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (from, query) in queries {
        let selections = selected(query);
        if selections.is_empty() {
            failures.push(format!("{from}: queries no idemproxy_ metric:\n{query}"));
        }
        for sel in selections {
            if let Err(why) = served.check(&sel) {
                failures.push(format!("{from}: {why}"));
            }
        }
    }
    failures
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// `promtool check rules` and the unit tests of `alerts_test.yml`.
#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    if !promtool_installed() {
        return;
    }
    let rules_file = deploy("prometheus/alerts.yml");
    let tests_file = deploy("prometheus/alerts_test.yml");
    let checked = promtool(&["check", "rules", rules_file.to_str().unwrap()]);
    let count = rules(&read(&rules_file)).len();
    assert!(
        checked.contains(&format!("SUCCESS: {count} rules found")),
        "{checked}"
    );
    let tested = promtool(&["test", "rules", tests_file.to_str().unwrap()]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Each rule says what it means and what to do, has a severity and a runbook, is listed in
/// docs/operations.md's alerts, and `alerts_test.yml` has a case where it fires and one where
/// it stays quiet.
#[test]
fn every_rule_is_documented_and_tested_both_ways() {
    let rules = rules(&read(&deploy("prometheus/alerts.yml")));
    assert!(rules.len() >= 8, "{rules:#?}");
    let docs = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"));
    let alerts_section = docs
        .split_once("\n### Alerts\n")
        .map(|(_, rest)| rest.split("\n## ").next().unwrap_or(rest))
        .expect("docs/operations.md has a ### Alerts section");
    let tests = read(&deploy("prometheus/alerts_test.yml"));
    // (alertname, exp_alerts is empty) for each alert_rule_test of the unit tests.
    let mut cases = Vec::new();
    let mut current = None;
    for line in tests.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname:") {
            current = Some(name.trim().to_owned());
        } else if let Some(exp) = line.strip_prefix("exp_alerts:") {
            let name = current.take().expect("exp_alerts after an alertname");
            cases.push((name, exp.trim() == "[]"));
        }
    }
    let mut names = BTreeSet::new();
    for rule in &rules {
        assert!(names.insert(&rule.name), "{} twice", rule.name);
        assert!(!rule.expr.trim().is_empty(), "{}: no expr", rule.name);
        for key in [
            "severity:",
            "summary:",
            "description:",
            "runbook: docs/operations.md#running-it-day-to-day",
        ] {
            assert!(
                rule.text.contains(key),
                "{}: no {key}\n{}",
                rule.name,
                rule.text
            );
        }
        assert!(
            alerts_section.contains(&format!("`{}`", rule.name)),
            "{} is not listed under ### Alerts in docs/operations.md",
            rule.name
        );
        for quiet in [false, true] {
            assert!(
                cases.contains(&(rule.name.clone(), quiet)),
                "alerts_test.yml has no case where {} {}",
                rule.name,
                if quiet { "stays quiet" } else { "fires" }
            );
        }
    }
    for (name, _) in &cases {
        assert!(
            names.contains(name),
            "alerts_test.yml tests {name}, no rule"
        );
    }
}

/// The dashboard's shape: a `DS_PROMETHEUS` datasource variable every panel and query uses, a
/// `route` variable, unique panel ids, panels inside the 24-column grid. And every query is
/// PromQL promtool accepts, with the dashboard's variables filled in.
#[test]
fn the_dashboard_is_wired_to_its_variables_and_queries_valid_promql() {
    let dash = dashboard();
    let vars = dash["templating"]["list"].as_array().expect("templating");
    let var = |name: &str| vars.iter().find(|v| v["name"] == name);
    let ds = var("DS_PROMETHEUS").expect("a DS_PROMETHEUS variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let route = var("route").expect("a route variable");
    assert!(
        route["query"]
            .as_str()
            .is_some_and(|q| q.starts_with("label_values(") && q.ends_with(", route)")),
        "{route}"
    );
    let uses_ds =
        |v: &Value| v["datasource"] == json!({"type": "prometheus", "uid": "${DS_PROMETHEUS}"});
    let mut ids = BTreeSet::new();
    for panel in dash["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "a panel without a title: {panel}");
        assert!(
            ids.insert(panel["id"].as_u64().expect("a panel id")),
            "id twice: {title}"
        );
        let grid = &panel["gridPos"];
        let (x, w) = (grid["x"].as_u64().unwrap(), grid["w"].as_u64().unwrap());
        assert!(x + w <= 24, "{title} runs past the grid");
        if panel["type"] == "row" {
            continue;
        }
        assert!(
            uses_ds(panel),
            "{title}: datasource {}",
            panel["datasource"]
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert!(uses_ds(t), "{title}: target datasource {}", t["datasource"]);
        }
    }
    for v in vars.iter().filter(|v| v["type"] == "query") {
        assert!(
            uses_ds(v),
            "variable {}: datasource {}",
            v["name"],
            v["datasource"]
        );
    }

    if !promtool_installed() {
        return;
    }
    // Each panel query as a recording rule, Grafana's variables replaced by what they stand
    // for; `promtool check rules` parses them all. (Variable queries are `label_values(…)`,
    // Grafana's, not PromQL: their selectors are checked against the proxy instead.)
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let queries = dashboard_queries(&dash);
    let panel_queries: Vec<&String> = queries
        .iter()
        .filter(|q| !q.starts_with("label_values("))
        .collect();
    for (n, q) in panel_queries.iter().enumerate() {
        let expr = q
            .replace("$__rate_interval", "5m")
            .replace("$__range", "1h")
            .replace("$instance", ".*")
            .replace("$route", ".*");
        file.push_str(&format!(
            "      - record: dashboard_query_{n}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let dir = TestDir::new();
    let path = dir.write_file("dashboard_rules.yml", &file);
    let checked = promtool(&["check", "rules", path.to_str().unwrap()]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", panel_queries.len())),
        "{checked}"
    );
}

/// The checker itself: the suffix rules and the label checks, on a served page with one
/// family of each type. (So that the test below can fail.)
#[test]
fn the_checker_knows_the_suffix_rules() {
    let page = "\
# HELP idemproxy_requests Protected requests by route and decision.
# TYPE idemproxy_requests counter
idemproxy_requests_total{route=\"charges\",decision=\"forwarded\"} 2
# TYPE idemproxy_in_flight gauge
idemproxy_in_flight 0
# TYPE idemproxy_lock_wait_seconds histogram
idemproxy_lock_wait_seconds_sum{route=\"charges\"} 0.0
idemproxy_lock_wait_seconds_count{route=\"charges\"} 2
idemproxy_lock_wait_seconds_bucket{le=\"0.001\",route=\"charges\"} 2
idemproxy_lock_wait_seconds_bucket{le=\"+Inf\",route=\"charges\"} 2
# EOF
";
    let served = Exposition::parse(page);
    let check = |q: &str| unserved(&served, [("q".to_owned(), q)]);
    for good in [
        "sum by (route) (rate(idemproxy_requests_total{decision=~\"forwarded\", route=~\"$route\"}[5m]))",
        "idemproxy_in_flight{instance=\"a\"} > 0",
        "histogram_quantile(0.99, sum by (le) (rate(idemproxy_lock_wait_seconds_bucket{route=\"charges\"}[5m])))",
        "idemproxy_lock_wait_seconds_sum / idemproxy_lock_wait_seconds_count",
        "label_values(idemproxy_requests_total, route)",
        // A name in a string is a label value, not a selection.
        "idemproxy_in_flight * on () group_left count(up{job=\"idemproxy_x\"})",
    ] {
        assert_eq!(check(good), Vec::<String>::new(), "{good}");
    }
    for bad in [
        "rate(idemproxy_requests[5m])", // a counter family without _total
        "idemproxy_in_flight_total",    // a gauge takes no suffix
        "idemproxy_lock_wait_seconds",  // a histogram family without a suffix
        "rate(idemproxy_lock_wait_seconds_total[5m])",
        "idemproxy_request_total",                         // misspelled
        "idemproxy_requests_total{decison=\"forwarded\"}", // a label it does not have
        "idemproxy_requests_total{decision=~\"forwarded|replyed\"}", // a value it never had
        "up",                                              // nothing of the proxy's at all
    ] {
        assert_eq!(check(bad).len(), 1, "{bad}: {:?}", check(bad));
    }
    assert_eq!(
        selected("a{x=\"1\"} + idemproxy_in_flight{instance!=\"b\", job=~\"c|d\"} offset 5m"),
        vec![Selected {
            name: "idemproxy_in_flight".into(),
            matchers: vec![
                Matcher {
                    label: "instance".into(),
                    op: "!=".into(),
                    value: "b".into()
                },
                Matcher {
                    label: "job".into(),
                    op: "=~".into(),
                    value: "c|d".into()
                },
            ],
        }]
    );
}

// ---------------------------------------------------------------------------------------------
// The real proxy, driven until every family it serves has samples.

/// Base64 of 32 bytes of 1, and of 7: two encryption keys.
const KEY_1: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const KEY_7: &str = "BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=";

/// The proxy's config on `upstream`, sealing answers with `key`: a plain keyed route, a route
/// whose answers are lost (no reconcile), one whose answers are lost and whose reconcile read
/// fails, one that rejects a second request with an in-flight key and gives up on a busy
/// entity quickly, and one in observe mode.
fn proxy_config(upstream: &RecordingUpstream, key: &str) -> String {
    format!(
        r#"{server}
[store]
scope_secret = "deploy-test-scope-secret-0123456789abcdef"
encryption_key = "{key}"

[upstreams.api]
url = "{url}"
prefix = "/api"

[[routes]]
name = "charges"
upstream = "api"
methods = ["POST"]
path = "/v1/charges"

[[routes]]
name = "lost"
upstream = "api"
methods = ["POST"]
path = "/lost"

[[routes]]
name = "items"
upstream = "api"
methods = ["POST"]
path = "/items/{{id}}"
entity = "item:{{path.id}}"
reconcile = {{ path = "/items/{{path.id}}", after = "0s" }}

[[routes]]
name = "slots"
upstream = "api"
methods = ["POST"]
path = "/slots/{{id}}"
entity = "slot:{{path.id}}"
in_flight = "reject"
lock_timeout = "300ms"

[[routes]]
name = "observed"
upstream = "api"
methods = ["POST"]
path = "/observed"
mode = "observe"

[upstreams.paced]
url = "{url}"
prefix = "/paced"
pace = {{ rate = 1, per = "2s", max_wait = "3s" }}

[[routes]]
name = "paced"
upstream = "paced"
methods = ["POST"]
path = "/things"
"#,
        server = server_section(),
        url = upstream.url(),
    )
}

async fn post(proxy: &ProxyProcess, path: &str, key: &str) -> Resp {
    post_json(&proxy.url(path), Some(key), &json!({"amount": 100}), &[]).await
}

/// Runs the real binary, drives one request of each kind the alerts and the dashboard watch,
/// and returns what its `/metrics` served then.
async fn drive_the_proxy() -> Exposition {
    let upstream = RecordingUpstream::builder()
        .raw_http1()
        .handler(|rec, n| {
            let path = rec.path();
            match (rec.method.as_str(), path) {
                ("POST", "/lost") => Reply::drop_connection(),
                ("POST", p) if p.starts_with("/items/") => Reply::drop_connection(),
                ("GET", p) if p.starts_with("/items/") => {
                    Reply::json(500, &json!({"error": "read failed"}))
                }
                ("POST", p) if p.starts_with("/slots/") => Reply::echo(rec, n).held(),
                ("POST", "/observed") if rec.header("idempotency-key") == Some("o-2") => {
                    Reply::echo(rec, n).held()
                }
                ("GET", "/limited") => {
                    Reply::json(429, &json!({"error": "slow down"})).header("retry-after", "30")
                }
                _ => Reply::echo(rec, n),
            }
        })
        .start()
        .await;
    let dir = TestDir::new();

    // A first process stores an answer sealed with one key...
    let path = dir.write_config(&proxy_config(&upstream, KEY_1));
    let mut first = ProxyProcess::spawn(&path).await;
    post(&first, "/api/v1/charges", "sealed-1")
        .await
        .assert_status(200);
    first.terminate();
    assert!(first.wait().await.success(), "{}", first.stderr());

    // ...that the next one, on another key, cannot decrypt: 503 store_unavailable.
    dir.write_config(&proxy_config(&upstream, KEY_7));
    let proxy = ProxyProcess::spawn(&path).await;
    let sealed = post(&proxy, "/api/v1/charges", "sealed-1").await;
    sealed.assert_status(503);
    assert_eq!(sealed.error_type(), Some("store_unavailable"));

    // Forwarded, then replayed.
    post(&proxy, "/api/v1/charges", "c-1")
        .await
        .assert_status(200);
    let replay = post(&proxy, "/api/v1/charges", "c-1").await;
    assert_eq!(replay.replayed(), Some(true));

    // An answer lost: unknown; its retry is refused with outcome_unknown.
    let lost = post(&proxy, "/api/lost", "l-1").await;
    assert!(lost.status >= 500, "{lost:?}");
    let retry = post(&proxy, "/api/lost", "l-1").await;
    assert_eq!(retry.error_type(), Some("outcome_unknown"), "{retry:?}");

    // An answer lost on a route that reconciles, whose read fails.
    let item = post(&proxy, "/api/items/a", "i-1").await;
    assert!(item.status >= 500, "{item:?}");

    // Observe mode: a duplicate enforce mode would have replayed, forwarded again.
    for _ in 0..2 {
        post(&proxy, "/api/observed", "o-1")
            .await
            .assert_status(200);
    }

    // Writes held at the upstream. On the slot: the same key again is request_in_progress,
    // another key on the same entity waits lock_timeout and is entity_busy. In observe mode: a
    // duplicate of a write still in flight is forwarded too (would = in_flight).
    let spawn_post = |path: &str, key: &'static str| {
        let url = proxy.url(path);
        tokio::spawn(async move { post_json(&url, Some(key), &json!({"amount": 100}), &[]).await })
    };
    let slot = spawn_post("/api/slots/s1", "s-1");
    let observed = spawn_post("/api/observed", "o-2");
    upstream.wait_for_held(2).await;
    let observed_dup = spawn_post("/api/observed", "o-2");
    upstream.wait_for_held(3).await;
    let dup = post(&proxy, "/api/slots/s1", "s-1").await;
    assert_eq!(dup.error_type(), Some("request_in_progress"), "{dup:?}");
    let busy = post(&proxy, "/api/slots/s1", "s-2").await;
    assert_eq!(busy.error_type(), Some("entity_busy"), "{busy:?}");
    upstream.release_all();
    for held in [slot, observed, observed_dup] {
        held.await.unwrap().assert_status(200);
    }

    // Three writes at once to an API paced at one every two seconds: the first goes,
    // the second waits its turn, the third's would come past max_wait (refused, nothing
    // sent). Then the API answers a read 429 itself: the account pauses.
    let paced: Vec<_> = ["p-1", "p-2", "p-3"]
        .into_iter()
        .map(|key| spawn_post("/paced/things", key))
        .collect();
    let mut statuses = Vec::new();
    for p in paced {
        statuses.push(p.await.unwrap().status);
    }
    statuses.sort();
    assert_eq!(statuses, [200, 200, 429], "paced writes");
    get(&proxy.url("/paced/limited")).await.assert_status(429);

    // A reload that applies, and one that is refused.
    let reload = || async { request("POST", &proxy.admin_url("/admin/reload"), &[], "").await };
    reload().await.assert_status(200);
    std::fs::write(&path, "[server\nthis is not TOML").unwrap();
    reload().await.assert_status(400);

    let text = get(&proxy.admin_url("/metrics"))
        .await
        .assert_status(200)
        .text();
    Exposition::parse(&text)
}

/// Every metric, label and plain label value that the alert rules and the dashboard query is
/// one the real proxy served, and the dashboard shows every family it serves.
#[tokio::test]
async fn every_queried_metric_is_one_the_proxy_serves() {
    let served = drive_the_proxy().await;
    let families: Vec<&String> = served
        .families
        .keys()
        .filter(|f| f.starts_with("idemproxy_"))
        .collect();
    assert!(families.len() >= 14, "{:?}", served.families);
    for family in &families {
        for series in Exposition::series_of(family, &served.families[*family]) {
            assert!(
                served.samples.contains_key(&series),
                "the driven proxy served no {series} sample (family {family}): {:?}",
                served.samples.keys()
            );
        }
    }

    let rules = rules(&read(&deploy("prometheus/alerts.yml")));
    let dash = dashboard();
    let queries = dashboard_queries(&dash);
    let mut failures = unserved(
        &served,
        rules
            .iter()
            .map(|r| (format!("alert {}", r.name), r.expr.as_str())),
    );
    failures.extend(unserved(
        &served,
        queries.iter().map(|q| ("dashboard".to_owned(), q.as_str())),
    ));
    assert!(failures.is_empty(), "\n{}\n", failures.join("\n"));

    let shown: BTreeSet<String> = queries
        .iter()
        .flat_map(|q| selected(q))
        .map(|s| served.queryable()[&s.name].clone())
        .collect();
    for family in families {
        assert!(
            shown.contains(family),
            "the dashboard does not show {family}"
        );
    }
}
