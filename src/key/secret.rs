//! Which secret keys a store's credential scopes.
//!
//! An explicit `store.scope_secret` always does. Without one, and with `store.encryption_key`,
//! the secret is derived from an encryption key (HKDF, see
//! [`crate::store::seal::Cipher::scope_secrets`]) — but from *which* key is the store's
//! business, not the config's: a rotation makes a new key current, and if scopes moved with it
//! every retry of a stored key would look new (and entity versions and claims, qualified with
//! the scope, would be lost). So every key that could have keyed the store is a candidate —
//! the current one, each previous one, and (SQLite) a `<db>.secret` left from before encryption
//! was on — and the one whose id the store recorded (`idem_meta.scope_secret_id`) is used.
//! A store that recorded none takes the first: the current key's.

use super::ScopeKeyer;
use crate::config::StoreConfig;
use crate::store::{ScopeCheck, Store, StoreResult};
use anyhow::Context;

/// A secret that may key the store's credential scopes.
pub struct Candidate {
    pub keyer: ScopeKeyer,
    /// Where it comes from, for messages: a setting and a key id, never the secret.
    pub source: String,
}

/// Every secret that may key the store's scopes, in order of preference. `create`: with
/// neither `scope_secret` nor an encryption key, a SQLite store without a `.secret` file gets
/// one (a serving process); otherwise nothing is written.
pub fn candidates(store: &StoreConfig, create: bool) -> StoreResult<Vec<Candidate>> {
    let candidate = |secret: &[u8], source: String| Candidate {
        keyer: ScopeKeyer::new(secret),
        source,
    };
    if let Some(s) = &store.scope_secret {
        return Ok(vec![candidate(s.as_bytes(), "store.scope_secret".into())]);
    }
    let sqlite = store.is_sqlite();
    let Some(cipher) = &store.encryption else {
        return Ok(match (sqlite, create) {
            (true, true) => {
                let secret = crate::store::sqlite::default_scope_secret(&store.url)?;
                vec![candidate(&secret, "the store's .secret file".into())]
            }
            (true, false) => crate::store::sqlite::existing_scope_secret(&store.url)
                .map(|s| candidate(&s, "the store's .secret file".into()))
                .into_iter()
                .collect(),
            // The config requires one of the two settings with PostgreSQL.
            (false, _) => Vec::new(),
        });
    };
    let mut out: Vec<Candidate> = cipher
        .scope_secrets()
        .into_iter()
        .enumerate()
        .map(|(i, (id, secret))| {
            let setting = match i {
                0 => "store.encryption_key",
                _ => "store.encryption_keys_previous",
            };
            candidate(&secret, format!("{setting} (key id {id})"))
        })
        .collect();
    // A store that ran before encryption was on keyed its scopes with its generated file.
    if sqlite {
        if let Some(s) = crate::store::sqlite::existing_scope_secret(&store.url) {
            out.push(candidate(&s, "the store's .secret file".into()));
        }
    }
    Ok(out)
}

/// The keyer of a serving process: the candidate the store recorded (recording the first when
/// it recorded none), or an error that says what to do when none is it.
pub async fn for_store(
    config: &StoreConfig,
    store: &dyn Store,
) -> anyhow::Result<(ScopeKeyer, ScopeCheck, String)> {
    let mut found = candidates(config, true).context("cannot make the store's scope secret")?;
    anyhow::ensure!(
        !found.is_empty(),
        "no secret to key credential scopes: set store.scope_secret or store.encryption_key"
    );
    let check = store
        .scope_secret(&found[0].keyer.id())
        .await
        .context("cannot read the store's scope secret id")?;
    if let Some(i) = found.iter().position(|c| c.keyer.id() == check.recorded) {
        let chosen = found.swap_remove(i);
        return Ok((chosen.keyer, check, chosen.source));
    }
    let tried: Vec<String> = found
        .iter()
        .map(|c| format!("{} (id {})", c.source, c.keyer.id()))
        .collect();
    let hint = if config.scope_secret.is_some() {
        "Start with the scope_secret the store was written with"
    } else if config.encryption.is_some() {
        "List the encryption key that was current when the store was first written in \
         store.encryption_keys_previous (or set store.scope_secret to the secret it was written with)"
    } else {
        "Start with the secret the store was written with (store.scope_secret, or its .secret file)"
    };
    anyhow::bail!(
        "the store's credential scopes were keyed with another scope secret (id {}; this config offers {}): \
         with it every stored key would look new to its callers' retries. {hint}",
        check.recorded,
        tried.join(", ")
    )
}
