//! Reload without a restart (SPEC "Reload without a restart"): `SIGHUP` or
//! `POST /admin/reload` reads the configuration file again.
//!
//! A valid file becomes the state in force ([`Live`]) for requests that start afterwards;
//! requests already running keep the state they started with (their `Arc<AppState>`), and no
//! listener or connection is touched. An invalid file changes nothing and every error comes
//! back as `file:line:col: message`. Settings bound at start (listener addresses, inbound TLS,
//! connection limits, the store) are reported and kept.

use crate::config::{Config, ServerConfig, StoreConfig};
use crate::state::Live;
use std::sync::Arc;

/// What a reload did: applied (with the settings it kept), or refused (with every error).
pub type Reloaded = Result<Vec<String>, Vec<String>>;

/// Reads the file again and, when it is valid, puts it in force. Reading the file and the
/// system's trust roots for the new upstream clients is blocking work: it runs off the
/// request threads.
pub async fn reload(live: &Live) -> Reloaded {
    let live = live.clone();
    tokio::task::spawn_blocking(move || reload_now(&live))
        .await
        .unwrap_or_else(|e| Err(vec![format!("the reload failed: {e}")]))
}

fn reload_now(live: &Live) -> Reloaded {
    let old = live.load_full();
    let result = apply(live, &old);
    old.stats.on_reload(result.is_ok());
    match &result {
        Ok(kept) => {
            for k in kept {
                tracing::warn!("reload: {k}");
            }
            tracing::info!(
                upstreams = old.config.upstreams.len(),
                "configuration reloaded; requests that start now use it"
            );
        }
        Err(errors) => {
            for e in errors {
                tracing::error!("reload refused: {e}");
            }
        }
    }
    result
}

fn apply(live: &Live, old: &crate::state::AppState) -> Reloaded {
    let Some(path) = old.config.source.clone() else {
        return Err(vec![format!(
            "{}: the configuration was not loaded from a file; there is nothing to read again",
            old.config.origin
        )]);
    };
    let mut new = Config::load(&path).map_err(|e| e.errors)?;
    let kept = keep_fixed(&old.config, &mut new);
    let state = old
        .reconfigured(Arc::new(new))
        .map_err(|e| vec![format!("{}: {e:#}", path.display())])?;
    live.store(Arc::new(state));
    Ok(kept)
}

/// Puts back the settings that cannot change while running, saying which ones the file
/// changed.
fn keep_fixed(old: &Config, new: &mut Config) -> Vec<String> {
    let mut kept = Vec::new();
    keep_server(&old.server, &mut new.server, &mut kept);
    keep_store(&old.store, &mut new.store, &mut kept);
    note_listeners(old, new, &mut kept);
    kept
}

/// Notes a setting the file changed and the running process keeps.
fn note(kept: &mut Vec<String>, name: &str, was: String, wants: String) {
    if was != wants {
        kept.push(format!(
            "{name} cannot change while running (restart to apply): kept {was}, the file says {wants}"
        ));
    }
}

/// The listeners, their TLS, their limits and the threads serving them are bound at start.
fn keep_server(o: &ServerConfig, n: &mut ServerConfig, kept: &mut Vec<String>) {
    note(
        kept,
        "server.listen",
        o.listen.to_string(),
        n.listen.to_string(),
    );
    n.listen = o.listen;
    note(
        kept,
        "server.admin_listen",
        format!("{:?}", o.admin_listen),
        format!("{:?}", n.admin_listen),
    );
    n.admin_listen = o.admin_listen;
    note(
        kept,
        "server.tls",
        format!("{:?}", o.tls),
        format!("{:?}", n.tls),
    );
    n.tls = o.tls.clone();
    note(
        kept,
        "server.max_connections",
        o.max_connections.to_string(),
        n.max_connections.to_string(),
    );
    n.max_connections = o.max_connections;
    note(
        kept,
        "server.max_connections_per_ip",
        o.max_connections_per_ip.to_string(),
        n.max_connections_per_ip.to_string(),
    );
    n.max_connections_per_ip = o.max_connections_per_ip;
    note(
        kept,
        "server.workers",
        format!("{:?}", o.workers),
        format!("{:?}", n.workers),
    );
    n.workers = o.workers;
}

/// The store is opened once, with its keys and lease; retention's purge is scheduled at start.
fn keep_store(o: &StoreConfig, n: &mut StoreConfig, kept: &mut Vec<String>) {
    note(kept, "store.url", o.display_url(), n.display_url());
    n.url = o.url.clone();
    let secret = |s: &Option<String>| if s.is_some() { "set" } else { "unset" }.to_owned();
    if o.scope_secret != n.scope_secret {
        note(
            kept,
            "store.scope_secret",
            secret(&o.scope_secret),
            format!("{} (changed)", secret(&n.scope_secret)),
        );
    }
    n.scope_secret = o.scope_secret.clone();
    // The store seals and opens with the keys it was opened with; key ids, never keys.
    note(
        kept,
        "store.encryption_key / encryption_keys_previous",
        o.encryption_summary(),
        n.encryption_summary(),
    );
    n.encryption = o.encryption.clone();
    note(
        kept,
        "store.lease",
        format!("{:?}", o.lease),
        format!("{:?}", n.lease),
    );
    n.lease = o.lease;
    note(
        kept,
        "store.retention (the purge schedule)",
        format!("{:?}", o.retention),
        format!("{:?}", n.retention),
    );
}

/// A dedicated upstream listener is bound at start: added, moved or removed, it waits for a
/// restart.
fn note_listeners(old: &Config, new: &Config, kept: &mut Vec<String>) {
    for u in &new.upstreams {
        let was = old.upstream(&u.name).and_then(|o| o.listen);
        if u.listen != was {
            note(
                kept,
                &format!("upstreams.{}.listen", u.name),
                format!("{was:?}"),
                format!("{:?}", u.listen),
            );
        }
    }
    for u in old.upstreams.iter().filter(|u| u.listen.is_some()) {
        if new.upstream(&u.name).is_none() {
            kept.push(format!(
                "upstreams.{}: removed, but its dedicated listener stays open (restart to close it) and keeps its old rules",
                u.name
            ));
        }
    }
}
