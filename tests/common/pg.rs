//! A real PostgreSQL for tests: `IDEMPROXY_TEST_PG_URL` when set (a fresh database per test),
//! else a private throwaway cluster per test (`initdb` + `pg_ctl` from `PATH` or
//! `/usr/lib/postgresql/*/bin`, in a temp dir, on a free port, as the `postgres` user when
//! running as root), stopped and removed on drop.
//!
//! With no PostgreSQL at all, [`PgServer::start`] says so loudly and returns `None` (the test
//! skips) — except under `CI=true`, where that is a failure.

use super::pg_bin;
use sqlx::Connection;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static DB_SEQ: AtomicU32 = AtomicU32::new(0);

/// A PostgreSQL server and one fresh database on it for this test.
pub struct PgServer {
    /// `postgres://...` of the test's own database.
    pub url: String,
    cluster: Option<Cluster>,
}

struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PgServer {
    /// A server for this test, or `None` (loudly) when there is no PostgreSQL here.
    pub async fn start() -> Option<PgServer> {
        if let Ok(base) = std::env::var("IDEMPROXY_TEST_PG_URL") {
            let url = fresh_database(&base).await;
            return Some(PgServer { url, cluster: None });
        }
        let Some(bin) = pg_bin::find(&["initdb", "pg_ctl"]) else {
            let msg = "PostgreSQL tests SKIPPED: no IDEMPROXY_TEST_PG_URL and no initdb/pg_ctl on PATH or under /usr/lib/postgresql/*/bin";
            super::skip_loudly(msg);
            return None;
        };
        let cluster = Cluster::launch(bin);
        let base = format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port);
        let url = fresh_database(&base).await;
        Some(PgServer {
            url,
            cluster: Some(cluster),
        })
    }

    /// Waits until `sql` (one boolean) holds in the test's database: a state polled for, never
    /// slept for, bounded so a test that waits in vain fails instead of hanging.
    pub async fn until(&self, sql: &str) {
        let db = &sqlx::PgPool::connect(&self.url).await.unwrap();
        let wait = std::time::Duration::from_secs(20);
        crate::common::eventually_within(wait, move || async move {
            // Each try bounded too: a query may hang where a state never comes.
            match tokio::time::timeout(wait, sqlx::query_scalar::<_, bool>(sql).fetch_one(db)).await
            {
                Ok(Ok(true)) => Ok(()),
                Ok(Ok(false)) => Err(format!("never held: {sql}")),
                Ok(Err(e)) => panic!("{sql}: {e}"),
                Err(_) => Err(format!("never answered: {sql}")),
            }
        })
        .await;
        db.close().await;
    }

    /// Sets a server-wide parameter (`ALTER SYSTEM`, written to `postgresql.auto.conf`) and
    /// reloads the configuration, as an operator's `postgresql.conf` would.
    pub async fn configure(&self, name: &str, value: &str) {
        let mut db = sqlx::PgConnection::connect(&self.url).await.unwrap();
        sqlx::query(&format!("ALTER SYSTEM SET {name} = '{value}'"))
            .execute(&mut db)
            .await
            .unwrap();
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut db)
            .await
            .unwrap();
        db.close().await.unwrap();
    }

    /// A `[store]` table for a proxy on this server (PostgreSQL needs a scope secret).
    pub fn store_toml(&self) -> String {
        format!(
            "[store]\nurl = \"{}\"\nscope_secret = \"test-scope-secret-0123456789abcdef\"\n",
            self.url
        )
    }

    /// Whether this test owns the server (and so may stop and start it).
    pub fn owned(&self) -> bool {
        self.cluster.is_some()
    }

    /// Stops the server (fast shutdown): the store becomes unreachable.
    pub fn stop(&self) {
        if let Some(c) = &self.cluster {
            c.pg_ctl(&["stop", "-m", "fast", "-w"]);
        }
    }

    /// Pauses the WAL writer (`SIGSTOP`): from then on WAL reaches the operating system only
    /// when a synchronous commit flushes it (or the WAL buffers fill), never in the
    /// background. Returns its process id, for [`PgServer::crash_via`].
    pub async fn pause_wal_writer(&self) -> u32 {
        let db = sqlx::PgPool::connect(&self.url).await.expect("connect");
        let pid: i32 =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
                .fetch_one(&db)
                .await
                .expect("the WAL writer's pid");
        db.close().await;
        signal(pid as u32, "-STOP");
        pid as u32
    }

    /// Crashes the database by killing one of its processes (`SIGKILL`): the postmaster then
    /// kills every backend and recovers from the WAL on disk, losing what was still in its
    /// buffers — a database crash. Returns once it accepts connections again.
    pub async fn crash_via(&self, pid: u32) {
        signal(pid, "-KILL");
        let url = &self.url;
        let wait = std::time::Duration::from_secs(30);
        // Each try bounded too: a connect or query to a server still recovering may hang.
        crate::common::eventually_within(wait, move || async move {
            let tried = tokio::time::timeout(wait, async {
                let mut c = sqlx::PgConnection::connect(url).await?;
                sqlx::query("SELECT 1").execute(&mut c).await.map(drop)
            })
            .await;
            match tried {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("PostgreSQL did not recover from the crash: {e}")),
                Err(_) => Err("PostgreSQL did not recover from the crash: a try hung".into()),
            }
        })
        .await;
    }

    /// Starts it again on the same port and data.
    pub fn restart(&self) {
        if let Some(c) = &self.cluster {
            c.start();
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(c) = &self.cluster {
            c.pg_ctl(&["stop", "-m", "immediate", "-w"]);
        }
    }
}

impl Cluster {
    fn init(bin: PathBuf) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-pg")
            .tempdir()
            .expect("temp dir for PostgreSQL");
        pg_bin::chown_to_postgres(dir.path());
        let data = dir.path().join("data");
        let port = crate::common::unused_addr().port();
        let c = Cluster {
            bin,
            data,
            port,
            _dir: dir,
        };
        pg_bin::initdb(&c.bin, &c.data);
        c
    }

    /// A new cluster, started. The port is picked free but is only taken when the server binds
    /// it, so a test starting beside others may lose it to one of them: then another port.
    fn launch(bin: PathBuf) -> Cluster {
        let mut c = Cluster::init(bin);
        let mut attempt = 1;
        loop {
            match c.try_start() {
                Ok(()) => return c,
                Err(e) if attempt < 3 => {
                    eprintln!(
                        "PostgreSQL did not start on port {}: {e}; trying another",
                        c.port
                    );
                    c.port = crate::common::unused_addr().port();
                    attempt += 1;
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    fn start(&self) {
        if let Err(e) = self.try_start() {
            panic!("{e}");
        }
    }

    fn try_start(&self) -> Result<(), String> {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            self.port,
            self.data.parent().unwrap_or(Path::new("/tmp")).display()
        );
        let log = self
            .data
            .parent()
            .unwrap_or(Path::new("/tmp"))
            .join("pg.log");
        let log_arg = log.display().to_string();
        let args = ["start", "-w", "-t", "30", "-o", &opts, "-l", &log_arg];
        pg_bin::pg_ctl(&self.bin, &self.data, &args).map_err(|e| {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(5).collect();
            format!("{e}\nserver log, last lines (newest first): {tail:?}")
        })
    }

    fn pg_ctl(&self, args: &[&str]) {
        if let Err(e) = pg_bin::pg_ctl(&self.bin, &self.data, args) {
            if !args.contains(&"immediate") {
                panic!("{e}");
            }
        }
    }
}

/// Creates a uniquely named database on `base`'s server and returns its URL.
async fn fresh_database(base: &str) -> String {
    let name = format!(
        "idemproxy_test_{}_{}",
        std::process::id(),
        DB_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let mut conn = sqlx::PgConnection::connect(base)
        .await
        .unwrap_or_else(|e| panic!("connect to PostgreSQL at {base}: {e}"));
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("create database {name}: {e}"));
    let _ = conn.close().await;
    with_database(base, &name)
}

/// `base` with its database name replaced by `name` (query parameters kept).
fn with_database(base: &str, name: &str) -> String {
    let (main, query) = match base.split_once('?') {
        Some((m, q)) => (m, format!("?{q}")),
        None => (base, String::new()),
    };
    let authority_at = main.find("://").map_or(0, |i| i + 3);
    let server = match main[authority_at..].find('/') {
        Some(i) => &main[..authority_at + i],
        None => main,
    };
    format!("{server}/{name}{query}")
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid} failed");
}
