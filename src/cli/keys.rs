//! `idemproxy keys release` and `keys complete`: an operator settles a key from the command
//! line (see [`crate::settle`]), beside a running proxy or without one. The audit rows go
//! straight to the store: this process has no auditor.

use crate::config::Config;
use crate::logging::escape_controls;
use crate::settle::{self, Completion, Pick, Refused, Settled, Settler};
use crate::store::{Opened, Store};
use bytes::Bytes;
use std::io::Read;
use std::path::PathBuf;

/// Which record of the key, when several carry it (other upstreams or credential scopes).
#[derive(clap::Args)]
pub struct Which {
    /// Which record, when several carry the key: its upstream.
    #[arg(long)]
    pub upstream: Option<String>,
    /// Which record, when several carry the key: its credential scope (or its short id).
    #[arg(long)]
    pub scope: Option<String>,
}

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
    #[command(flatten)]
    pub which: Which,
}

impl Which {
    fn pick(self) -> Pick {
        Pick {
            upstream: self.upstream,
            scope: self.scope,
        }
    }
}

fn settler<'a>(config: &'a Config, opened: &Opened) -> Settler<'a> {
    Settler {
        store: opened.store.clone(),
        shared: opened.shared.clone(),
        replay: None,
        locks: None,
        owner: format!("cli-{}", std::process::id()),
        config,
    }
}

/// `keys release KEY [--note TEXT] [--force] [--upstream U] [--scope S]`.
pub async fn release(
    config: &Config,
    opened: &Opened,
    key: &str,
    (note, force): (Option<&str>, bool),
    which: Which,
) -> anyhow::Result<()> {
    let note = settle::note(note, false).map_err(explain)?;
    let settled = settler(config, opened)
        .release(key, &which.pick(), note, force)
        .await
        .map_err(explain)?;
    let n = settled.audit.len();
    record(opened.store.as_ref(), settled).await?;
    // The store tells running proxies: on SQLite a release note the proxy acknowledges
    // before this returns; on PostgreSQL a NOTIFY every replica hears within moments.
    println!(
        "released {n} record(s) of key {:?}",
        escape_controls(key, false)
    );
    match n {
        0 => Err(anyhow::anyhow!(
            "nothing to release: the key is released already"
        )),
        _ => Ok(()),
    }
}

/// `keys complete KEY --status N [--body-file F] [-H 'Name: value'] --note TEXT`.
pub async fn complete(
    config: &Config,
    opened: &Opened,
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
    };
    let settled = settler(config, opened)
        .complete(key, &asked.which.pick(), &completion, note)
        .await
        .map_err(explain)?;
    record(opened.store.as_ref(), settled).await?;
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
    let now = crate::store::now_ms();
    let list: Vec<String> = r
        .records()
        .iter()
        .map(|r| {
            format!(
                "  --upstream {} --scope {}  (state {}, route {})",
                r.id.upstream,
                crate::key::entity_scope(&r.id.scope),
                r.effective_state(now).as_str(),
                r.route
            )
        })
        .collect();
    match (&r, list.is_empty()) {
        (Refused::Answered(_), _) => anyhow::anyhow!("{r}: --force --note TEXT"),
        (Refused::Store(_), _) | (_, true) => anyhow::anyhow!("{r}"),
        (_, false) => anyhow::anyhow!("{r}:\n{}", list.join("\n")),
    }
}
