//! `idemproxy keys release` and `keys complete`: an operator settles a key from the command
//! line (see [`crate::settle`]), beside a running proxy or without one. The audit rows go
//! straight to the store: this process has no auditor.

use crate::config::Config;
use crate::logging::escape_controls;
use crate::settle::{self, Completion, Refused, Settled, Settler};
use crate::store::Store;
use bytes::Bytes;
use std::io::Read;
use std::path::PathBuf;

/// What `keys complete` was asked to store.
#[derive(clap::Args)]
pub struct Asked {
    /// The real answer's HTTP status.
    #[arg(long)]
    pub status: u16,
    /// A file holding the real answer's body (`-`: standard input).
    #[arg(long)]
    pub body_file: Option<PathBuf>,
    /// A header of the answer, `Name: value` (repeatable).
    #[arg(long = "header", short = 'H')]
    pub headers: Vec<String>,
    /// What you checked and found (kept in the audit trail).
    #[arg(long)]
    pub note: String,
    /// Which record, when several carry the key: its upstream.
    #[arg(long)]
    pub upstream: Option<String>,
    /// Which record, when several carry the key: its credential scope (or its short id).
    #[arg(long)]
    pub scope: Option<String>,
}

fn settler<'a>(config: &'a Config, store: &'a dyn Store, owner: &'a str) -> Settler<'a> {
    Settler {
        store,
        locks: None,
        owner,
        lease: config.store.lease,
    }
}

fn owner() -> String {
    format!("cli-{}", std::process::id())
}

/// `keys release KEY [--note TEXT]`.
pub async fn release(
    config: &Config,
    store: &dyn Store,
    key: &str,
    note: Option<&str>,
) -> anyhow::Result<()> {
    let note = settle::note(note, false).map_err(explain)?;
    let owner = owner();
    let settled = settler(config, store, &owner)
        .release(key, note, settle::retention_of(config))
        .await;
    let n = match settled {
        Ok((n, settled)) => {
            record(store, settled).await?;
            n
        }
        Err(Refused::NoKey) => 0,
        Err(e) => return Err(explain(e)),
    };
    // The store tells running proxies: on SQLite a release note the proxy acknowledges
    // before this returns; on PostgreSQL a NOTIFY every replica hears within moments.
    println!(
        "released {n} record(s) of key {:?}",
        escape_controls(key, false)
    );
    match n {
        0 => Err(anyhow::anyhow!(
            "nothing to release (no such key, already released, or in flight right now)"
        )),
        _ => Ok(()),
    }
}

/// `keys complete KEY --status N [--body-file F] [-H 'Name: value'] --note TEXT`.
pub async fn complete(
    config: &Config,
    store: &dyn Store,
    key: &str,
    asked: Asked,
) -> anyhow::Result<()> {
    let note = settle::note(Some(&asked.note), true).map_err(explain)?;
    let body = match &asked.body_file {
        None => Bytes::new(),
        Some(p) if p.as_os_str() == "-" => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            Bytes::from(buf)
        }
        Some(p) => {
            Bytes::from(std::fs::read(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
        }
    };
    let headers = asked
        .headers
        .iter()
        .map(|h| match h.split_once(':') {
            Some((n, v)) => Ok((n.trim().to_owned(), v.trim().to_owned())),
            None => Err(anyhow::anyhow!("--header {h:?}: write it as 'Name: value'")),
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let completion = Completion {
        status: asked.status,
        headers,
        body,
        upstream: asked.upstream,
        scope: asked.scope,
    };
    let owner = owner();
    let settled = settler(config, store, &owner)
        .complete(key, completion, note, settle::retention_of(config))
        .await
        .map_err(explain)?;
    record(store, settled).await?;
    println!(
        "completed key {:?} with status {}: retries get this answer",
        escape_controls(key, false),
        asked.status
    );
    Ok(())
}

/// The act's audit rows, written now.
async fn record(store: &dyn Store, settled: Settled) -> anyhow::Result<()> {
    if !settled.audit.is_empty() {
        store.append_audit(settled.audit).await?;
    }
    Ok(())
}

/// A refusal in words, with the records when they explain it.
fn explain(r: Refused) -> anyhow::Error {
    let list = |rs: &[crate::store::KeyRecord]| {
        rs.iter()
            .map(|r| {
                format!(
                    "  upstream={} scope={} state={} route={}",
                    r.id.upstream,
                    crate::key::entity_scope(&r.id.scope),
                    r.effective_state(crate::store::now_ms()).as_str(),
                    r.route
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    match r {
        Refused::NoKey => anyhow::anyhow!("no record carries this key"),
        Refused::NotUnknown(rs) => anyhow::anyhow!(
            "only a key whose outcome is unknown (or whose call's lease lapsed) can be settled; it stands as:\n{}",
            list(&rs)
        ),
        Refused::Ambiguous(rs) => anyhow::anyhow!(
            "several records carry this key; pick one with --upstream and --scope:\n{}",
            list(&rs)
        ),
        Refused::Invalid(m) => anyhow::anyhow!(m),
        Refused::Busy => {
            anyhow::anyhow!("the key's entities stayed locked by requests in flight; try again")
        }
        Refused::Store(e) => e.into(),
    }
}
