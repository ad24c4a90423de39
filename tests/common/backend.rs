//! [`Backend`]: the store a test runs on, SQLite in the test's dir or a test PostgreSQL, with
//! its `[store]` table for a proxy and a raw look at what it holds — the files' bytes, every
//! column of every `idem_*` table — for tests of what reaches the disk.

use super::pg::PgServer;
use super::{api_config, RecordingUpstream, TestDir, CHARGES_ROUTE};
use sqlx::Connection;
use std::collections::BTreeMap;

/// The store under test: its `[store]` table, what it holds, and how to look at it raw.
pub enum Backend {
    Sqlite,
    Pg(PgServer),
}

impl Backend {
    /// `None`: PostgreSQL is not installed here (the harness said so loudly).
    pub async fn start(pg: bool) -> Option<Backend> {
        match pg {
            false => Some(Backend::Sqlite),
            true => PgServer::start().await.map(Backend::Pg),
        }
    }

    /// A config with one upstream `api` (the charges route) on `upstream`, and this store's
    /// `[store]` table with `store_lines`.
    pub fn config(&self, upstream: &RecordingUpstream, store_lines: &str) -> String {
        let url = match self {
            Backend::Sqlite => String::new(),
            Backend::Pg(pg) => format!("url = \"{}\"\n", pg.url),
        };
        let base = api_config(upstream, "", "", CHARGES_ROUTE);
        format!("{base}\n[store]\n{url}{store_lines}")
    }

    /// Where `needle` is found in the store's raw bytes: SQLite's files (database, WAL and
    /// the rest), or every column of every `idem_*` table (bytea as bytes, the rest as text).
    pub async fn places_holding(&self, dir: &TestDir, needle: &str) -> Vec<String> {
        let needle = needle.as_bytes();
        let holds = |b: &[u8]| b.windows(needle.len()).any(|w| w == needle);
        let mut found = Vec::new();
        match self {
            Backend::Sqlite => {
                for entry in std::fs::read_dir(dir.path()).expect("read the test dir") {
                    let path = entry.expect("dir entry").path();
                    let name = path.file_name().unwrap_or_default().to_string_lossy();
                    // Read while the proxy may be writing: a file checkpointed away meanwhile
                    // has nothing left to find.
                    if name.starts_with("idemproxy.db")
                        && std::fs::read(&path).is_ok_and(|b| holds(&b))
                    {
                        found.push(name.into_owned());
                    }
                }
            }
            Backend::Pg(pg) => {
                let mut conn = sqlx::PgConnection::connect(&pg.url).await.expect("connect");
                let columns: Vec<(String, String, String)> = sqlx::query_as(
                    "SELECT table_name::text, column_name::text, data_type::text FROM information_schema.columns \
                     WHERE table_schema = 'public' AND table_name LIKE 'idem%'",
                )
                .fetch_all(&mut conn)
                .await
                .expect("list columns");
                assert!(columns.len() > 20, "every idem_* column: {columns:?}");
                for (table, column, kind) in columns {
                    let values: Vec<Vec<u8>> = if kind == "bytea" {
                        sqlx::query_scalar::<_, Option<Vec<u8>>>(&format!(
                            "SELECT \"{column}\" FROM \"{table}\""
                        ))
                        .fetch_all(&mut conn)
                        .await
                        .expect("read bytea")
                        .into_iter()
                        .flatten()
                        .collect()
                    } else {
                        sqlx::query_scalar::<_, Option<String>>(&format!(
                            "SELECT \"{column}\"::text FROM \"{table}\""
                        ))
                        .fetch_all(&mut conn)
                        .await
                        .expect("read text")
                        .into_iter()
                        .flatten()
                        .map(String::into_bytes)
                        .collect()
                    };
                    if values.iter().any(|v| holds(v)) {
                        found.push(format!("{table}.{column}"));
                    }
                }
            }
        }
        found
    }

    /// `idem_keys.enc_key` by key.
    pub async fn enc_keys(&self, dir: &TestDir) -> BTreeMap<String, Option<String>> {
        let sql = "SELECT key, enc_key FROM idem_keys";
        let rows: Vec<(String, Option<String>)> = match self {
            Backend::Sqlite => {
                let mut conn = sqlx::SqliteConnection::connect(&dir.db_url())
                    .await
                    .expect("open");
                sqlx::query_as(sql)
                    .fetch_all(&mut conn)
                    .await
                    .expect("read")
            }
            Backend::Pg(pg) => {
                let mut conn = sqlx::PgConnection::connect(&pg.url).await.expect("connect");
                sqlx::query_as(sql)
                    .fetch_all(&mut conn)
                    .await
                    .expect("read")
            }
        };
        rows.into_iter().collect()
    }
}
