//! [`ProxyProcess`]: the real `idemproxy serve` binary, for tests that kill or restart the
//! process. Its stderr goes to a file in the config's directory; the bound addresses are read
//! from the `listening ... addr=...` log lines.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How long a starting binary may take to log its listeners (it applies migrations first).
pub const STARTUP: Duration = Duration::from_secs(30);

/// Distinguishes the stderr files of successive processes in one dir.
static SPAWNED: AtomicUsize = AtomicUsize::new(0);

/// A running `idemproxy serve`; killed (SIGKILL) when dropped if still running.
pub struct ProxyProcess {
    child: Child,
    pub main_addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    stderr_path: PathBuf,
    exit: Option<ExitStatus>,
}

/// Listener addresses found in the log so far.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Listeners {
    pub main: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    /// `listening` lines that are neither main nor admin (dedicated upstream listeners).
    pub other: Vec<(String, SocketAddr)>,
}

/// Reads the listener addresses out of log text: lines containing `listening` and
/// `addr=IP:PORT` (or JSON `"addr":"IP:PORT"`). `admin` in the line marks the admin listener;
/// `main` the main one; other lines naming an `upstream` are dedicated upstream listeners, and
/// the first unlabelled one is taken as main. ANSI colour codes are ignored.
pub fn parse_listeners(log: &str) -> Listeners {
    let mut found = Listeners::default();
    for line in log.lines() {
        let line = strip_ansi(line);
        if !line.contains("listening") {
            continue;
        }
        let Some(addr) = find_addr(&line) else {
            continue;
        };
        if line.contains("admin") {
            found.admin.get_or_insert(addr);
        } else if line.contains("main") || (!line.contains("upstream") && found.main.is_none()) {
            found.main.get_or_insert(addr);
        } else {
            found.other.push((line.clone(), addr));
        }
    }
    found
}

fn find_addr(line: &str) -> Option<SocketAddr> {
    for marker in ["addr=", "\"addr\":\"", "\"addr\": \""] {
        if let Some(start) = line.find(marker) {
            let rest = &line[start + marker.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '[' | ']')))
                .unwrap_or(rest.len());
            if let Ok(addr) = rest[..end].parse() {
                return Some(addr);
            }
        }
    }
    None
}

/// Removes `ESC [ ... letter` sequences.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl ProxyProcess {
    /// Runs `idemproxy serve --config <config_path>` and waits until it logs its main (and, if
    /// configured, admin) listener. Stderr goes to `stderr-<n>.log` beside the config.
    pub async fn spawn(config_path: &Path) -> ProxyProcess {
        Self::spawn_with_env(config_path, &[]).await
    }

    /// Same as [`spawn`](Self::spawn) with extra environment variables.
    pub async fn spawn_with_env(config_path: &Path, env: &[(&str, &str)]) -> ProxyProcess {
        let bin = Path::new(env!("CARGO_BIN_EXE_idemproxy"));
        Self::spawn_binary(bin, config_path, env).await
    }

    /// Same as [`spawn_with_env`](Self::spawn_with_env), running the binary at `bin` (the build
    /// with fault points, see `tests/fault_points.rs`).
    pub async fn spawn_binary(
        bin: &Path,
        config_path: &Path,
        env: &[(&str, &str)],
    ) -> ProxyProcess {
        let dir = config_path
            .parent()
            .expect("config path has a parent directory");
        let n = SPAWNED.fetch_add(1, Ordering::Relaxed);
        let stderr_path = dir.join(format!("stderr-{n}.log"));
        let stderr = std::fs::File::create(&stderr_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", stderr_path.display()));
        let config_text = std::fs::read_to_string(config_path).unwrap_or_default();
        let mut command = Command::new(bin);
        command
            .arg("serve")
            .arg("--config")
            .arg(config_path)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            // The harness reads `info` lines; colours and a store override would get in the way.
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("IDEMPROXY_STORE_URL")
            .env_remove("IDEMPROXY_CONFIG");
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let mut process = ProxyProcess {
            child,
            main_addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            admin_addr: None,
            stderr_path,
            exit: None,
        };
        let wants_admin = config_text
            .lines()
            .any(|l| l.trim_start().starts_with("admin_listen"));

        let (main, admin) = super::eventually_within(STARTUP, || {
            std::future::ready(process.listening(wants_admin))
        })
        .await;
        process.main_addr = main;
        process.admin_addr = admin;
        process
    }

    /// The main (and, when `wants_admin`, admin) address the process logged, or what it logged
    /// instead; a process that exited first fails the test at once.
    fn listening(&mut self, wants_admin: bool) -> Result<(SocketAddr, Option<SocketAddr>), String> {
        let found = parse_listeners(&self.stderr());
        if let Some(main) = found.main {
            if !wants_admin || found.admin.is_some() {
                return Ok((main, found.admin));
            }
        }
        if let Some(status) = self.try_wait() {
            panic!(
                "idemproxy exited with {status} before listening\n--- stderr ---\n{}",
                self.stderr()
            );
        }
        Err(format!(
            "idemproxy did not log its listeners\n--- stderr ---\n{}",
            self.stderr()
        ))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `http://<main_addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.main_addr)
    }

    /// `http://<admin_addr><path>`; panics when no admin listener was logged.
    pub fn admin_url(&self, path: &str) -> String {
        let addr = self
            .admin_addr
            .expect("admin_url: the process logged no admin listener");
        format!("http://{addr}{path}")
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn stderr_path(&self) -> &Path {
        &self.stderr_path
    }

    /// Listener lines beyond main and admin (dedicated upstream listeners) logged so far.
    pub fn listeners(&self) -> Listeners {
        parse_listeners(&self.stderr())
    }

    /// SIGKILL: the process dies mid-flight, leases and all. Waits for it to be reaped.
    pub async fn kill(&mut self) -> ExitStatus {
        if self.try_wait().is_none() {
            // An error here means it exited meanwhile; `wait` reports how.
            let _ = self.child.kill();
        }
        self.wait().await
    }

    /// SIGTERM: asks for a graceful shutdown. Does not wait; call [`wait`](Self::wait).
    pub fn terminate(&mut self) {
        if self.try_wait().is_some() {
            return;
        }
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status()
            .expect("run kill -TERM");
        assert!(
            status.success(),
            "kill -TERM {} failed: {status}",
            self.pid()
        );
    }

    /// Waits (at most 30 s, then panics) for the process to exit.
    pub async fn wait(&mut self) -> ExitStatus {
        super::eventually_within(STARTUP, || {
            std::future::ready(self.try_wait().ok_or_else(|| {
                format!(
                    "idemproxy (pid {}) did not exit\n--- stderr ---\n{}",
                    self.pid(),
                    self.stderr()
                )
            }))
        })
        .await
    }

    /// The exit status if the process has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("try_wait on idemproxy: {e}"));
        }
        self.exit
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        if self.try_wait().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The build with fault points (`src/fault.rs`): `IDEMPROXY_FAULTS_BIN`, else
/// `target/idemproxy-faults`, which `.ci/run` builds; a loud skip when there is none.
pub fn faults_binary() -> Option<PathBuf> {
    let bin = std::env::var_os("IDEMPROXY_FAULTS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/idemproxy-faults"));
    if bin.is_file() {
        return Some(bin);
    }
    super::skip_loudly(&format!(
        "FAULT TESTS SKIPPED: no {} (cargo build --features faults && cp target/debug/idemproxy target/idemproxy-faults)",
        bin.display()
    ));
    None
}

/// Runs `idemproxy <args> --config <config>` off the runtime; returns (success, stdout, stderr).
pub async fn cli(config: std::path::PathBuf, args: &[&str]) -> (bool, String, String) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args(&args)
            .arg("--config")
            .arg(&config)
            .env_remove("IDEMPROXY_STORE_URL")
            .env_remove("IDEMPROXY_CONFIG")
            .output()
            .expect("run the idemproxy binary");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .expect("cli task")
}

/// `idemproxy serve` on the shipped proxy.toml (copied into `dir`), its APIs at these URLs
/// (`("HUBSPOT_API_URL", url)`), on a store in `dir`, listeners on `127.0.0.1:0`.
pub async fn shipped_proxy(dir: &super::TestDir, apis: &[(&str, String)]) -> ProxyProcess {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("proxy.toml");
    let config = dir.path().join("shipped.toml");
    std::fs::copy(&shipped, &config).expect("copy the shipped proxy.toml");
    let store = dir.db_url();
    let mut env: Vec<(&str, &str)> = apis.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.extend([
        ("IDEMPROXY_STORE_URL", store.as_str()),
        ("IDEMPROXY_LISTEN", "127.0.0.1:0"),
        ("IDEMPROXY_ADMIN_LISTEN", "127.0.0.1:0"),
    ]);
    ProxyProcess::spawn_with_env(&config, &env).await
}

/// Runs `program args…` (a client script) with `env` added to its environment, to its end:
/// panics unless it succeeds; its last line that is JSON is its result (a client's own logs may
/// come before).
pub fn run_json(program: &Path, args: &[&str], env: &[(&str, String)]) -> serde_json::Value {
    let out = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{') || l.starts_with('['))
        .unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}
