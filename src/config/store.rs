//! `[store]`, compiled: the URL, retention and lease, the scope secret, and the encryption
//! keys (decoded once into a [`Cipher`]; their text is never repeated in an error).

use super::compiler::Compiler;
use super::raw::{RawStore, Str};
use super::*;
use crate::store::seal::{self, Cipher, KEY_LEN};

/// Shortest `store.lease` accepted.
const MIN_LEASE: Duration = Duration::from_millis(500);

pub(super) fn store(cx: &mut Compiler, raw: &RawStore) -> StoreConfig {
    let url = match (cx.env)("IDEMPROXY_STORE_URL").filter(|s| !s.is_empty()) {
        Some(url) => url,
        None => raw
            .url
            .as_ref()
            .and_then(|u| cx.s(u))
            .unwrap_or_else(|| "sqlite://idemproxy.db".into()),
    };
    if !(url.starts_with("sqlite:")
        || url.starts_with("postgres://")
        || url.starts_with("postgresql://"))
    {
        let span = raw.url.as_ref().map(|u| u.span()).unwrap_or(0..0);
        cx.err(
            span,
            format!(
                "store.url {}: use sqlite://FILE or postgres://...",
                redact_url(&url)
            ),
        );
    }
    let lease = cx.dur(&raw.lease, Duration::from_secs(30));
    if lease < MIN_LEASE {
        // Leases are renewed every third of their length: a shorter one cannot be kept alive.
        let span = raw.lease.as_ref().map(|l| l.span()).unwrap_or(0..0);
        cx.err(span, format!("store.lease must be at least {MIN_LEASE:?}"));
    }
    let encryption = encryption(cx, raw);
    let scope_secret = raw
        .scope_secret
        .as_ref()
        .and_then(|s| cx.s(s))
        .filter(|s| !s.is_empty());
    match &scope_secret {
        Some(s) if s.len() < 16 => {
            let span = raw.scope_secret.as_ref().map(|s| s.span()).unwrap_or(0..0);
            cx.err(span, "store.scope_secret must be at least 16 characters (e.g. `openssl rand -base64 32`)");
        }
        // With an encryption key, the scope secret is derived from it (see `server`).
        None if !url.starts_with("sqlite:") && encryption.is_none() => {
            let span = raw.url.as_ref().map(|u| u.span()).unwrap_or(0..0);
            cx.err(
                span,
                "store.scope_secret (or store.encryption_key) is required with PostgreSQL: it keys \
                 the credential hashes, must be the same on every replica and must not be kept in \
                 the database (e.g. scope_secret = \"${IDEMPROXY_SCOPE_SECRET}\")",
            );
        }
        _ => {}
    }
    StoreConfig {
        url,
        retention: cx.dur(&raw.retention, Duration::from_secs(86_400)),
        lease,
        scope_secret,
        encryption,
        answer_before_commit: raw.answer_before_commit.unwrap_or(false),
    }
}

/// `encryption_key` and `encryption_keys_previous` as a [`Cipher`]; `None` when the current
/// key is absent or empty (`"${IDEMPROXY_ENCRYPTION_KEY:-}"` unset). Empty previous entries
/// are skipped, so an unset `"${OLD_KEY:-}"` is no error.
fn encryption(cx: &mut Compiler, raw: &RawStore) -> Option<Arc<Cipher>> {
    let current = raw
        .encryption_key
        .as_ref()
        .and_then(|v| key(cx, v, "store.encryption_key"));
    let mut previous: Vec<[u8; KEY_LEN]> = Vec::new();
    for v in raw.encryption_keys_previous.iter().flatten() {
        let Some(Some(k)) = key(cx, v, "store.encryption_keys_previous entry") else {
            continue;
        };
        if current.as_ref().is_some_and(|c| c.as_ref() == Some(&k)) || previous.contains(&k) {
            cx.err(
                v.span(),
                format!(
                    "store.encryption_keys_previous lists key {} twice (or the current key again)",
                    seal::key_id(&k)
                ),
            );
            continue;
        }
        previous.push(k);
    }
    let current = current.flatten();
    if current.is_none() && !previous.is_empty() {
        let span = raw
            .encryption_keys_previous
            .as_ref()
            .and_then(|l| l.first())
            .map(|v| v.span())
            .unwrap_or(0..0);
        cx.err(
            span,
            "store.encryption_keys_previous needs store.encryption_key: previous keys are only \
             read, a current key must write",
        );
        return None;
    }
    Some(Arc::new(Cipher::new(current?, &previous)))
}

/// One key: `Some(None)` when empty (off), `Some(Some(key))` when valid, `None` after an
/// error was recorded (which names the setting, never the value).
fn key(cx: &mut Compiler, v: &Str, what: &str) -> Option<Option<[u8; KEY_LEN]>> {
    let text = cx.s(v)?;
    if text.trim().is_empty() {
        return Some(None);
    }
    match seal::decode_key(&text) {
        Ok(k) => Some(Some(k)),
        Err(e) => {
            cx.err(v.span(), format!("{what} {e}"));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::compile::compile;
    use crate::config::{Config, ConfigError};

    /// A key made of one repeated byte, standard base64.
    fn key(byte: u8) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode([byte; 32])
    }

    fn store(lines: &str) -> Result<Config, ConfigError> {
        let env = |k: &str| match k {
            "ENC" => Some(key(1)),
            _ => None,
        };
        compile(&format!("[store]\n{lines}"), "t.toml", &env)
    }

    fn error(lines: &str) -> String {
        match store(lines) {
            Ok(_) => panic!("expected an error for:\n{lines}"),
            Err(e) => e.errors.join("\n"),
        }
    }

    #[test]
    fn keys_turn_encryption_on_and_empty_keeps_it_off() {
        let on = store("encryption_key = \"${ENC}\"\n").unwrap();
        let cipher = on.store.encryption.clone().expect("on");
        assert_eq!(
            cipher.current_id(),
            crate::store::seal::key_id(&[1; 32]).as_str()
        );
        let summary = on.store.encryption_summary();
        assert!(summary.starts_with("encryption=on (key id "), "{summary}");
        assert!(!summary.contains(&key(1)), "never the key itself");
        let off = store("encryption_key = \"${UNSET:-}\"\n").unwrap();
        assert!(off.store.encryption.is_none());
        let rotated = store(&format!(
            "encryption_key = \"{}\"\nencryption_keys_previous = [\"{}\", \"${{UNSET:-}}\"]\n",
            key(2),
            key(1)
        ))
        .unwrap();
        let ids: Vec<String> = rotated
            .store
            .encryption
            .expect("on")
            .previous_ids()
            .map(str::to_owned)
            .collect();
        assert_eq!(ids, [crate::store::seal::key_id(&[1; 32])]);
        // PostgreSQL needs no scope_secret when a key can derive one.
        store(&format!(
            "url = \"postgres://u@h/db\"\nencryption_key = \"{}\"\n",
            key(1)
        ))
        .unwrap();
        let e = error("url = \"postgres://u@h/db\"\n");
        assert!(e.contains("scope_secret (or store.encryption_key)"), "{e}");
    }

    #[test]
    fn bad_keys_are_located_and_never_repeated() {
        let e = error("encryption_key = \"c2hvcnQ=\"\n");
        assert!(e.starts_with("t.toml:2:18:"), "{e}");
        assert!(e.contains("decodes to 5") && !e.contains("c2hvcnQ"), "{e}");
        let e = error("encryption_key = \"not base64 at all!\"\n");
        assert!(
            e.starts_with("t.toml:2:18:") && e.contains("not base64"),
            "{e}"
        );
        assert!(!e.contains("at all!"), "{e}");
        let e = error(&format!("encryption_keys_previous = [\"{}\"]\n", key(1)));
        assert!(e.starts_with("t.toml:2:29:"), "{e}");
        assert!(e.contains("needs store.encryption_key"), "{e}");
        let e = error(&format!(
            "encryption_key = \"{}\"\nencryption_keys_previous = [\"{}\", \"{}\"]\n",
            key(1),
            key(2),
            key(2)
        ));
        assert!(e.starts_with("t.toml:3:"), "{e}");
        assert!(e.contains("twice"), "{e}");
        let e = error(&format!(
            "encryption_key = \"{}\"\nencryption_keys_previous = [\"{}\"]\n",
            key(1),
            key(1)
        ));
        assert!(e.contains("twice (or the current key again)"), "{e}");
        let e = error("encryption_key = \"${MISSING}\"\n");
        assert!(e.contains("MISSING"), "{e}");
    }
}
