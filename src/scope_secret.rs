//! Which secret keys a store's credential scopes, and the SQLite store's generated one.
//!
//! Above `key`, `config` and `store` (it reads the config and asks the store), so none of
//! them depends on another through it.
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

use crate::config::StoreConfig;
use crate::key::ScopeKeyer;
use crate::store::{ScopeCheck, Store, StoreError, StoreResult};
use anyhow::Context;
use sqlx::sqlite::SqliteConnectOptions;
use std::str::FromStr;

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
                let secret = default_scope_secret(&store.url)?;
                vec![candidate(&secret, "the store's .secret file".into())]
            }
            (true, false) => existing_scope_secret(&store.url)
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
        if let Some(s) = existing_scope_secret(&store.url) {
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

/// The scope secret of a SQLite store whose config names none: 32 random bytes kept in
/// `<db>.secret` (`0600`), generated on first start. A file of its own, so a copy of the
/// database alone does not carry it; losing it makes every stored key look new, so back it
/// up with the database.
pub fn default_scope_secret(url: &str) -> StoreResult<Vec<u8>> {
    let path = secret_path(url)?;
    match std::fs::read_to_string(&path) {
        Ok(text) if text.trim().len() >= 32 => return Ok(text.trim().as_bytes().to_vec()),
        Ok(_) => {
            return Err(StoreError::File(format!(
                "{} holds no usable secret (delete it only if the database is new)",
                path.display()
            )))
        }
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(StoreError::File(format!(
                "cannot read {}: {e}",
                path.display()
            )))
        }
        Err(_) => {}
    }
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| StoreError::File("no system randomness for the scope secret".into()))?;
    let secret = hex::encode(bytes);
    let mut open = std::fs::OpenOptions::new();
    open.create_new(true).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let written = open.open(&path).and_then(|mut f| {
        use std::io::Write;
        f.write_all(secret.as_bytes())?;
        f.sync_all()
    });
    written.map_err(|e| StoreError::File(format!("cannot create {}: {e}", path.display())))?;
    Ok(secret.into_bytes())
}

fn secret_path(url: &str) -> StoreResult<std::path::PathBuf> {
    let opts = SqliteConnectOptions::from_str(url)?;
    let mut path = opts.get_filename().as_os_str().to_owned();
    path.push(".secret");
    Ok(path.into())
}

/// The generated scope secret, if the store has one already (never creates it): what
/// `explain` keys scopes with, to show what the proxy stores.
pub fn existing_scope_secret(url: &str) -> Option<Vec<u8>> {
    let text = std::fs::read_to_string(secret_path(url).ok()?).ok()?;
    let text = text.trim();
    (text.len() >= 32).then(|| text.as_bytes().to_vec())
}
