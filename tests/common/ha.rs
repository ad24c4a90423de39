//! A highly available PostgreSQL for the failover test (`tests/failover.rs`): a primary and a
//! streaming standby made from it with `pg_basebackup -R`, each a private throwaway cluster in
//! a temp dir on a free port (run as the `postgres` user when root, like [`super::pg`]), and
//! HAProxy (`mode tcp`) in front of them: the primary as its `server`, the standby as its
//! `backup`, health-checked every 100 ms, so that once the primary is down every new
//! connection goes to the standby.
//!
//! The primary runs with `synchronous_standby_names = 'standby1'` (or empty: an asynchronous
//! standby) given on its command line only, so the promoted standby does not inherit it and
//! wait forever for a standby of its own; the standby connects as `application_name =
//! standby1`.
//!
//! With no PostgreSQL binaries or no `haproxy`, [`PgPair::start`] and [`HaProxy::start`] say so
//! loudly and return `None` (the test skips) — except under `CI=true`, where that is a failure.

use super::pg_bin;
use sqlx::Connection;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server, HAProxy or the replication may take to come up.
const STARTUP: Duration = Duration::from_secs(30);

/// Whether both PostgreSQL (with `pg_basebackup`) and `haproxy` are here; says so loudly when
/// not (a failure under `CI=true`).
pub fn available() -> bool {
    if pg_bin::find(&["initdb", "pg_ctl", "pg_basebackup"]).is_none() {
        super::skip_loudly("failover test SKIPPED: no initdb/pg_ctl/pg_basebackup on PATH or under /usr/lib/postgresql/*/bin");
        return false;
    }
    if find_haproxy().is_none() {
        super::skip_loudly(
            "failover test SKIPPED: no haproxy on PATH or in /usr/sbin (apt-get install haproxy)",
        );
        return false;
    }
    true
}

/// One PostgreSQL server: its data directory in a temp dir of its own, its port.
pub struct Server {
    bin: PathBuf,
    data: PathBuf,
    pub port: u16,
    opts: String,
    /// Killed by [`PgPair::kill_primary`]: nothing to stop, and its `postmaster.pid` names a
    /// process id that may be another's by now.
    killed: std::sync::atomic::AtomicBool,
    dir: tempfile::TempDir,
}

/// A primary and its streaming standby.
pub struct PgPair {
    pub primary: Server,
    pub standby: Server,
}

impl PgPair {
    /// Starts the primary, makes the standby from it and starts it, and waits until the standby
    /// streams (and, when `synchronous`, is the primary's synchronous standby). `None` (loudly)
    /// without PostgreSQL binaries.
    pub async fn start(synchronous: bool) -> Option<PgPair> {
        let Some(bin) = pg_bin::find(&["initdb", "pg_ctl", "pg_basebackup"]) else {
            super::skip_loudly("failover test SKIPPED: no initdb/pg_ctl/pg_basebackup on PATH or under /usr/lib/postgresql/*/bin");
            return None;
        };
        let mut primary = Server::new(bin.clone());
        primary.initdb();
        // initdb's pg_hba.conf already trusts replication from 127.0.0.1 (`-A trust`); said
        // again here, as a primary for a standby needs it.
        primary.append("pg_hba.conf", "host replication all 127.0.0.1/32 trust\n");
        primary.opts = "-c wal_level=replica -c max_wal_senders=5".to_string();
        if synchronous {
            primary.opts += " -c synchronous_standby_names=standby1";
        }
        primary.launch();

        let mut standby = Server::new(bin);
        let out = pg_bin::command(&standby.bin, "pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", "postgres", "-R", "-X", "stream", "-c", "fast", "-D"])
            .arg(&standby.data)
            .output()
            .expect("run pg_basebackup");
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Last wins: this overrides the primary_conninfo `-R` wrote, naming the standby.
        standby.append(
            "postgresql.auto.conf",
            &format!(
                "primary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name=standby1'\n",
                primary.port
            ),
        );
        // A promotion asked for just as the WAL receiver lost the primary waited out this
        // interval (default 5 s) before ending recovery, in about one run in five.
        standby.opts = "-c hot_standby=on -c wal_retrieve_retry_interval=100ms".to_string();
        standby.launch();

        let pair = PgPair { primary, standby };
        let want = if synchronous { "sync" } else { "async" };
        pair.primary
            .until(&format!(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_replication \
                 WHERE application_name = 'standby1' AND state = 'streaming' AND sync_state = '{want}')"
            ))
            .await;
        Some(pair)
    }

    /// The primary's machine lost: SIGKILL to its postmaster and every process it started
    /// (backends, the WAL sender) at once. Nothing more leaves it. Returns when the first
    /// signal was sent.
    pub fn kill_primary(&self) -> Instant {
        let pid = self.primary.postmaster_pid();
        let mut pids = vec![pid];
        pids.extend(children_of(pid));
        self.primary
            .killed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let at = Instant::now();
        for p in &pids {
            // SAFETY: plain kill(2) on pids we read just now from the server's own files.
            unsafe { libc::kill(*p as libc::pid_t, libc::SIGKILL) };
        }
        at
    }

    /// `pg_ctl promote -w`: the standby ends recovery and accepts writes.
    pub fn promote_standby(&self) {
        self.standby.pg_ctl(&["promote", "-w", "-t", "30"]);
    }
}

impl Server {
    fn new(bin: PathBuf) -> Server {
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-ha")
            .tempdir()
            .expect("temp dir for PostgreSQL");
        pg_bin::chown_to_postgres(dir.path());
        Server {
            bin,
            data: dir.path().join("data"),
            port: 0,
            opts: String::new(),
            killed: Default::default(),
            dir,
        }
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn initdb(&self) {
        pg_bin::initdb(&self.bin, &self.data);
    }

    fn append(&self, file: &str, text: &str) {
        use std::io::Write;
        let path = self.data.join(file);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        f.write_all(text.as_bytes())
            .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
    }

    /// Starts it on a free port; another port if a concurrent test took that one first.
    fn launch(&mut self) {
        for attempt in 1..=3 {
            self.port = super::unused_addr().port();
            let opts = format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 {}",
                self.port,
                self.dir.path().display(),
                self.opts
            );
            let log = self.log_path().display().to_string();
            match pg_bin::pg_ctl(
                &self.bin,
                &self.data,
                &["start", "-w", "-t", "30", "-o", &opts, "-l", &log],
            ) {
                Ok(()) => return,
                Err(e) if attempt < 3 => {
                    eprintln!("PostgreSQL did not start on port {}: {e}", self.port)
                }
                Err(e) => panic!("{e}\nserver log:\n{}", self.log()),
            }
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("pg.log")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Waits until `sql` (one boolean) holds on this server: polled, bounded.
    pub async fn until(&self, sql: &str) {
        let url = &self.url();
        super::eventually_within(STARTUP, move || async move {
            if let Ok(mut c) = sqlx::PgConnection::connect(url).await {
                let held = sqlx::query_scalar::<_, bool>(sql).fetch_one(&mut c).await;
                let _ = c.close().await;
                if let Ok(true) = held {
                    return Ok(());
                }
            }
            Err(format!(
                "never held on port {}: {sql}\nserver log:\n{}",
                self.port,
                self.log()
            ))
        })
        .await
    }

    fn postmaster_pid(&self) -> u32 {
        let text =
            std::fs::read_to_string(self.data.join("postmaster.pid")).expect("read postmaster.pid");
        text.lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .expect("the postmaster's pid on the first line of postmaster.pid")
    }

    fn pg_ctl(&self, args: &[&str]) {
        if let Err(e) = pg_bin::pg_ctl(&self.bin, &self.data, args) {
            panic!("{e}\nserver log:\n{}", self.log());
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let killed = self.killed.load(std::sync::atomic::Ordering::SeqCst);
        if !killed && self.data.join("postmaster.pid").exists() {
            let _ = pg_bin::pg_ctl(&self.bin, &self.data, &["stop", "-m", "immediate", "-w"]);
        }
    }
}

/// HAProxy in the foreground, a child of the test, killed when dropped.
pub struct HaProxy {
    child: Child,
    /// The frontend: `127.0.0.1:<port>` reaches whichever server is up.
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl HaProxy {
    /// HAProxy with `primary` as the server and `backup` as the backup, both checked every
    /// 100 ms with a PostgreSQL start-up (`option pgsql-check`); one failed check marks a
    /// server down and closes its sessions. A connection the dead primary refuses before its
    /// check fails is retried every 200 ms (`timeout connect`), each retry redispatched, so to
    /// the backup once the primary is down (with `retries 2` and a 1 s connect timeout,
    /// HAProxy's turn-around of a second per retry held connections for 2 s, and so the
    /// writes). Returns once a connection through it reaches the primary. `None` (loudly)
    /// without `haproxy`.
    pub async fn start(primary: &Server, backup: &Server) -> Option<HaProxy> {
        let Some(exe) = find_haproxy() else {
            super::skip_loudly("failover test SKIPPED: no haproxy on PATH or in /usr/sbin (apt-get install haproxy)");
            return None;
        };
        let dir = tempfile::tempdir().expect("temp dir for HAProxy");
        let port = super::unused_addr().port();
        let cfg = format!(
            "global\n\
             \x20   maxconn 2000\n\
             defaults\n\
             \x20   mode tcp\n\
             \x20   timeout connect 200ms\n\
             \x20   timeout client 1h\n\
             \x20   timeout server 1h\n\
             \x20   timeout check 1s\n\
             \x20   retries 3\n\
             \x20   option redispatch 1\n\
             frontend pg\n\
             \x20   bind 127.0.0.1:{port}\n\
             \x20   default_backend pg\n\
             backend pg\n\
             \x20   option pgsql-check user postgres\n\
             \x20   default-server inter 100ms fall 1 rise 1 on-marked-down shutdown-sessions\n\
             \x20   server primary 127.0.0.1:{} check\n\
             \x20   server standby 127.0.0.1:{} check backup\n",
            primary.port, backup.port
        );
        let cfg_path = dir.path().join("haproxy.cfg");
        std::fs::write(&cfg_path, cfg).expect("write haproxy.cfg");
        let log = std::fs::File::create(dir.path().join("haproxy.log")).expect("haproxy.log");
        let child = Command::new(exe)
            .arg("-db")
            .arg("-f")
            .arg(&cfg_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone haproxy.log"))
            .stderr(log)
            .spawn()
            .expect("spawn haproxy");
        let mut h = HaProxy {
            child,
            port,
            _dir: dir,
        };
        let (url, log) = (h.url(), h._dir.path().join("haproxy.log"));
        let read = |log: &std::path::Path| std::fs::read_to_string(log).unwrap_or_default();
        super::eventually_within(STARTUP, || {
            let (url, log, child) = (url.clone(), log.clone(), &mut h.child);
            if let Ok(Some(status)) = child.try_wait() {
                panic!("haproxy exited with {status}:\n{}", read(&log));
            }
            async move {
                if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                    let recovery: Result<bool, _> =
                        sqlx::query_scalar("SELECT pg_is_in_recovery()")
                            .fetch_one(&mut c)
                            .await;
                    let _ = c.close().await;
                    if let Ok(false) = recovery {
                        return Ok(());
                    }
                }
                Err(format!(
                    "no connection through haproxy reached the primary:\n{}",
                    read(&log)
                ))
            }
        })
        .await;
        Some(h)
    }

    /// `postgres://postgres@127.0.0.1:<frontend port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// What HAProxy printed (warnings, servers going down).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("haproxy.log")).unwrap_or_default()
    }
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find_haproxy() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/local/sbin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file())
}

/// The processes whose parent is `pid` (from `/proc/*/stat`).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`: comm may hold spaces, so split after its `)`.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                == Some(pid)
        })
        .collect()
}
