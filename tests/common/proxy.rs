//! The proxy under test, started in-process ([`TestProxy`]) on a SQLite store in a temp dir
//! ([`TestDir`]), which also serves the process variant so a database survives restarts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use idemproxy::config::Config;
use idemproxy::metrics::Stats;
use idemproxy::server::Server;
use tempfile::TempDir;

/// A temp dir holding the SQLite database and config files; lives as long as the test keeps it,
/// independently of any proxy started on it.
pub struct TestDir {
    dir: TempDir,
}

impl Default for TestDir {
    fn default() -> Self {
        Self::new()
    }
}

impl TestDir {
    pub fn new() -> TestDir {
        TestDir {
            dir: tempfile::tempdir().expect("create test temp dir"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `<dir>/idemproxy.db`.
    pub fn db_path(&self) -> PathBuf {
        self.dir.path().join("idemproxy.db")
    }

    /// `<dir>/idemproxy.db.audit`: the audit trail's own file.
    pub fn audit_db_path(&self) -> PathBuf {
        self.dir.path().join("idemproxy.db.audit")
    }

    /// `sqlite://<dir>/idemproxy.db` (three slashes: the path is absolute).
    pub fn db_url(&self) -> String {
        format!("sqlite://{}", self.db_path().display())
    }

    /// `<dir>/proxy.toml`.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("proxy.toml")
    }

    /// `toml` with `store.url` pointed at this dir's database (see [`with_store_url`]).
    pub fn config_text(&self, toml: &str) -> String {
        with_store_url(toml, &self.db_url())
    }

    /// Writes [`config_text`](Self::config_text) to `proxy.toml` and returns its path.
    pub fn write_config(&self, toml: &str) -> PathBuf {
        self.write_config_as("proxy.toml", toml)
    }

    /// Same as [`write_config`](Self::write_config) under another file name.
    pub fn write_config_as(&self, name: &str, toml: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, self.config_text(toml))
            .unwrap_or_else(|e| panic!("write config {}: {e}", path.display()));
        path
    }

    /// Writes any file into the dir (a CA bundle, a request body) and returns its path.
    pub fn write_file(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }
}

/// Sets `url = "<url>"` in the `[store]` table of `toml`: appends the table when there is none,
/// adds the key right under the header when the table has no `url`, and leaves a table that
/// already names a `url` alone (the test chose it).
pub fn with_store_url(toml: &str, url: &str) -> String {
    let url_line = format!("url = {}", toml_string(url));
    let lines: Vec<&str> = toml.lines().collect();
    let Some(header) = lines.iter().position(|l| l.trim() == "[store]") else {
        return format!("{}\n\n[store]\n{url_line}\n", toml.trim_end());
    };
    let table_end = lines[header + 1..]
        .iter()
        .position(|l| l.trim_start().starts_with('['))
        .map_or(lines.len(), |i| header + 1 + i);
    let has_url = lines[header + 1..table_end].iter().any(|l| {
        l.split_once('=')
            .is_some_and(|(key, _)| key.trim() == "url")
    });
    if has_url {
        return toml.to_string();
    }
    let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    out.insert(header + 1, url_line);
    out.join("\n") + "\n"
}

/// A TOML basic string.
pub fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The proxy running in this process on a temp-dir SQLite store.
pub struct TestProxy {
    /// `None` only after `shutdown`.
    server: Option<Server>,
    pub main_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    /// The egress listener, when the config turns it on.
    pub egress_addr: Option<SocketAddr>,
    /// The config text as started (with `store.url`), reused by `restart`.
    pub config_text: String,
    /// Keeps the database alive for the proxy's lifetime and across `restart`.
    pub dir: TestDir,
}

impl TestProxy {
    /// Starts the proxy from `toml` (which has no `[store] url`; the harness sets it).
    pub async fn start(toml: &str) -> TestProxy {
        Self::start_in(TestDir::new(), toml).await
    }

    /// Starts the proxy on an existing dir (e.g. a database another proxy wrote).
    pub async fn start_in(dir: TestDir, toml: &str) -> TestProxy {
        let text = dir.config_text(toml);
        match Self::try_start_text(dir, text).await {
            Ok(proxy) => proxy,
            Err((e, text)) => panic!("proxy failed to start: {e:#}\n--- config ---\n{text}"),
        }
    }

    /// Starts the proxy from `toml` written to `<dir>/proxy.toml` and loaded from there, so
    /// [`reload`](Self::reload) can change the file and have the proxy read it again.
    pub async fn start_file(toml: &str) -> TestProxy {
        let dir = TestDir::new();
        let path = dir.write_config(toml);
        let config = Config::load(&path).unwrap_or_else(|e| panic!("config error:\n{e}"));
        let server = Server::start(config)
            .await
            .unwrap_or_else(|e| panic!("proxy failed to start: {e:#}"));
        TestProxy {
            main_addr: server.main_addr,
            admin_addr: server.admin_addr,
            egress_addr: server.egress_addr,
            server: Some(server),
            config_text: dir.config_text(toml),
            dir,
        }
    }

    /// Writes `toml` (same store) over the config file and asks for a reload
    /// (`POST /admin/reload`).
    pub async fn reload(&self, toml: &str) -> super::Resp {
        self.dir.write_config(toml);
        super::request("POST", &self.admin_url("/admin/reload"), &[], "").await
    }

    /// Like `start`, returning the error instead of panicking (for start-up failure tests).
    pub async fn try_start(toml: &str) -> anyhow::Result<TestProxy> {
        let dir = TestDir::new();
        let text = dir.config_text(toml);
        Self::try_start_text(dir, text).await.map_err(|(e, _)| e)
    }

    async fn try_start_text(
        dir: TestDir,
        text: String,
    ) -> Result<TestProxy, (anyhow::Error, String)> {
        let config = match Config::from_toml(&text, "test.toml") {
            Ok(config) => config,
            Err(e) => return Err((anyhow::anyhow!("config error:\n{e}"), text)),
        };
        let server = match Server::start(config).await {
            Ok(server) => server,
            Err(e) => return Err((e, text)),
        };
        Ok(TestProxy {
            main_addr: server.main_addr,
            admin_addr: server.admin_addr,
            egress_addr: server.egress_addr,
            server: Some(server),
            config_text: text,
            dir,
        })
    }

    fn server(&self) -> &Server {
        self.server.as_ref().expect("the proxy was shut down")
    }

    /// `http://<main_addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.main_addr)
    }

    /// `http://<admin_addr><path>`; panics when the config has no admin listener.
    pub fn admin_url(&self, path: &str) -> String {
        let addr = self
            .admin_addr
            .expect("admin_url: the config has no admin_listen");
        format!("http://{addr}{path}")
    }

    /// The dedicated listener of upstream `name`.
    pub fn upstream_addr(&self, name: &str) -> SocketAddr {
        *self
            .server()
            .upstream_addrs
            .get(name)
            .unwrap_or_else(|| panic!("upstream {name:?} has no dedicated listener"))
    }

    /// `http://<dedicated listener of upstream name><path>`.
    pub fn upstream_url(&self, name: &str, path: &str) -> String {
        format!("http://{}{path}", self.upstream_addr(name))
    }

    /// Live counters (`waiting()`, `protected()`).
    pub fn stats(&self) -> Arc<Stats> {
        self.server().stats()
    }

    /// Waits until `n` requests are waiting on a key or entity lock (panics after 10 s).
    pub async fn wait_for_waiting(&self, n: u64) {
        let stats = self.stats();
        super::wait_until(
            || stats.waiting() >= n,
            super::WAIT,
            &format!("{n} requests waiting on a key or entity lock at the proxy"),
        )
        .await;
    }

    /// Graceful shutdown; returns the dir so a later proxy can reuse the database.
    pub async fn shutdown(mut self) -> TestDir {
        if let Some(server) = self.server.take() {
            // Works whether `shutdown` takes `self`, `&self` or `&mut self`, and returns `()`
            // or a `Result` (a failed graceful shutdown is not what these tests check).
            #[allow(unused_mut)]
            let mut server = server;
            #[allow(clippy::let_unit_value)]
            let _ = server.shutdown().await;
        }
        self.dir
    }

    /// Graceful shutdown, then a fresh proxy on the same config and database (new ports).
    pub async fn restart(self) -> TestProxy {
        let text = self.config_text.clone();
        let dir = self.shutdown().await;
        match Self::try_start_text(dir, text).await {
            Ok(proxy) => proxy,
            Err((e, text)) => panic!("proxy failed to restart: {e:#}\n--- config ---\n{text}"),
        }
    }
}

/// The shipped `proxy.toml` as text, its store left to the harness (the test's directory),
/// each `${VAR:-default}` named in `vars` set to the value given, then each `(from, to)` of
/// `extra` replaced once. For [`TestProxy::start`] on the shipped rules.
pub fn shipped_text(vars: &[(&str, String)], extra: &[(&str, &str)]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.toml");
    let shipped = std::fs::read_to_string(path).expect("read the shipped proxy.toml");
    let store = "url = \"sqlite://idemproxy.db\"\n";
    assert!(shipped.contains(store), "the shipped store url");
    let mut text = shipped.replacen(store, "", 1);
    for (var, value) in vars {
        let open = format!("${{{var}:-");
        let start = text
            .find(&open)
            .unwrap_or_else(|| panic!("{var} in proxy.toml"));
        // The brace that closes `${`, past any in the default (`https://{host}`).
        let mut depth = 0usize;
        let close = text[start + 2..].char_indices().find(|&(_, c)| match c {
            '{' => {
                depth += 1;
                false
            }
            '}' if depth == 0 => true,
            '}' => {
                depth -= 1;
                false
            }
            _ => false,
        });
        let end = start + 2 + close.expect("a closing brace").0;
        text.replace_range(start..=end, value);
    }
    for (from, to) in extra {
        assert!(text.contains(from), "{from:?} in proxy.toml");
        text = text.replacen(from, to, 1);
    }
    text
}

/// The shipped `proxy.toml` with its listeners and its egress listener on `127.0.0.1:0`, a CA
/// made for the test, each `${VAR}` of `apis` set (an API at its fake), `extra` replaced; the
/// proxy and the CA certificate its clients must trust.
pub async fn shipped_egress(
    apis: &[(&str, String)],
    extra: &[(&str, &str)],
) -> (TestProxy, PathBuf) {
    let dir = TestDir::new();
    let (ca, key) = idemproxy::ca::init(&dir.path().join("certs")).expect("ca init");
    let mut vars: Vec<(&str, String)> = apis.to_vec();
    vars.extend([
        ("IDEMPROXY_LISTEN", "127.0.0.1:0".into()),
        ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0".into()),
        ("IDEMPROXY_EGRESS_LISTEN", "127.0.0.1:0".into()),
        ("IDEMPROXY_CA_CERT", ca.display().to_string()),
        ("IDEMPROXY_CA_KEY", key.display().to_string()),
    ]);
    (
        TestProxy::start_in(dir, &shipped_text(&vars, extra)).await,
        ca,
    )
}
