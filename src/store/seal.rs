//! Stored answers encrypted at rest (SPEC "Stored answers encrypted at rest").
//!
//! With `store.encryption_key` set, every stored answer's headers and body are sealed with
//! AES-256-GCM (ring) before they reach the database, each value under a fresh random 96-bit
//! nonce. A sealed value is `nonce ‖ ciphertext ‖ tag`; the record's `enc_key` column names the
//! key that sealed it (its [`key_id`]), so `encryption_keys_previous` can still open what an old
//! key wrote while only the current key writes.
//!
//! The associated data binds each value to its place: the field (`headers` or `body`), the
//! record's scoped key (upstream, credential scope, key) and the reservation epoch that stored
//! it. A value copied onto another record, swapped between the headers and the body, or put
//! back from an earlier attempt of the same key does not open, and such an answer is refused
//! (`503 store_unavailable`), never forwarded again.
//!
//! The same key material also keys credential scopes when no `scope_secret` is set
//! ([`Cipher::scope_secrets`]): a secret derived with HKDF, never the key itself.

use super::{ScopedKey, StoreError, StoreResult};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

/// Bytes of an encryption key.
pub const KEY_LEN: usize = 32;

/// What [`Cipher::open`] returns when a value cannot be opened, for the record's views.
pub const ENCRYPTED: &str = "<encrypted>";

/// Which part of a stored answer a sealed value is: part of its associated data, so the two
/// cannot be swapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Headers,
    Body,
}

impl Field {
    fn label(self) -> &'static [u8] {
        match self {
            Field::Headers => b"headers",
            Field::Body => b"body",
        }
    }
}

/// One key: its id and the AEAD key made from it. The raw bytes are kept only to derive the
/// scope secret ([`Cipher::scope_secrets`]) and are never printed.
struct SealKey {
    id: String,
    aead: LessSafeKey,
    raw: [u8; KEY_LEN],
}

impl SealKey {
    fn new(raw: [u8; KEY_LEN]) -> SealKey {
        let aead = UnboundKey::new(&AES_256_GCM, &raw)
            .map(LessSafeKey::new)
            .unwrap_or_else(|_| unreachable!("AES-256-GCM takes any {KEY_LEN}-byte key"));
        SealKey {
            id: key_id(&raw),
            aead,
            raw,
        }
    }
}

/// The keys of `store.encryption_key` (writes and reads) and `store.encryption_keys_previous`
/// (reads only). Built once at config load; shared by the store backends.
pub struct Cipher {
    current: SealKey,
    previous: Vec<SealKey>,
    rng: SystemRandom,
}

impl std::fmt::Debug for Cipher {
    /// Key ids only: key material never reaches a log or `Debug` output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cipher")
            .field("current", &self.current.id)
            .field(
                "previous",
                &self.previous.iter().map(|k| &k.id).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A short public name for a key (not the key): hex of the first 8 bytes of
/// HMAC-SHA256(key, "idemproxy encryption key id"). Stored with every sealed record, shown by
/// `check` and in logs.
pub fn key_id(raw: &[u8; KEY_LEN]) -> String {
    let mac = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, raw);
    let tag = ring::hmac::sign(&mac, b"idemproxy encryption key id");
    hex::encode(&tag.as_ref()[..8])
}

/// The 32 bytes of a key as written in the config: base64, standard or URL-safe alphabet,
/// padded or not, surrounding whitespace ignored. The error never repeats the value.
pub fn decode_key(text: &str) -> Result<[u8; KEY_LEN], String> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    use base64::Engine as _;
    let text = text.trim();
    let bytes = [STANDARD, URL_SAFE, STANDARD_NO_PAD, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text).ok())
        .ok_or_else(|| "is not base64 (make a key with `openssl rand -base64 32`)".to_owned())?;
    <[u8; KEY_LEN]>::try_from(bytes.as_slice()).map_err(|_| {
        format!(
            "must be {KEY_LEN} bytes of base64, this one decodes to {} (make a key with `openssl rand -base64 32`)",
            bytes.len()
        )
    })
}

impl Cipher {
    /// A cipher writing with `current` and reading `current` and `previous`.
    pub fn new(current: [u8; KEY_LEN], previous: &[[u8; KEY_LEN]]) -> Cipher {
        Cipher {
            current: SealKey::new(current),
            previous: previous.iter().copied().map(SealKey::new).collect(),
            rng: SystemRandom::new(),
        }
    }

    /// The id of the key that writes.
    pub fn current_id(&self) -> &str {
        &self.current.id
    }

    /// The ids of the keys only read.
    pub fn previous_ids(&self) -> impl Iterator<Item = &str> {
        self.previous.iter().map(|k| k.id.as_str())
    }

    fn key(&self, id: &str) -> Option<&SealKey> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|k| k.id == id)
    }

    /// `plain` sealed with the current key for `field` of record `id` stored at `epoch`.
    pub fn seal(
        &self,
        field: Field,
        id: &ScopedKey,
        epoch: i64,
        plain: &[u8],
    ) -> StoreResult<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| StoreError::Unavailable("no system randomness for a nonce".into()))?;
        let mut out = Vec::with_capacity(NONCE_LEN + plain.len() + AES_256_GCM.tag_len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let aad = associated_data(field, id, epoch);
        let tag = self
            .current
            .aead
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&aad),
                &mut out[NONCE_LEN..],
            )
            .map_err(|_| StoreError::Unavailable("cannot encrypt the answer".into()))?;
        out.extend_from_slice(tag.as_ref());
        Ok(out)
    }

    /// Opens a value sealed by key `key_id` for `field` of record `id` at `epoch`; the error
    /// says why it cannot be (an unknown key, or a value that does not belong here).
    pub fn open(
        &self,
        key_id: &str,
        field: Field,
        id: &ScopedKey,
        epoch: i64,
        mut sealed: Vec<u8>,
    ) -> Result<Vec<u8>, String> {
        let key = self.key(key_id).ok_or_else(|| {
            format!(
                "it was encrypted with key {key_id}, which is neither store.encryption_key nor in store.encryption_keys_previous"
            )
        })?;
        let broken = || {
            let what = match field {
                Field::Headers => "headers do",
                Field::Body => "body does",
            };
            format!(
                "its {what} not decrypt with key {key_id} (altered, or copied from another record)"
            )
        };
        let nonce = sealed
            .get(..NONCE_LEN)
            .and_then(|n| Nonce::try_assume_unique_for_key(n).ok())
            .ok_or_else(broken)?;
        let aad = associated_data(field, id, epoch);
        let len = key
            .aead
            .open_within(nonce, Aad::from(&aad), &mut sealed, NONCE_LEN..)
            .map_err(|_| broken())?
            .len();
        sealed.truncate(len);
        Ok(sealed)
    }

    /// Scope secrets derived from each key, current first: `(key id, secret)`. HKDF-SHA256
    /// with its own label, so the secret that keys credential hashes is never the encryption
    /// key itself.
    pub fn scope_secrets(&self) -> Vec<(String, Vec<u8>)> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .map(|k| (k.id.clone(), derive_scope_secret(&k.raw)))
            .collect()
    }
}

/// The label, the field, and the record's identity, each length-prefixed so no two
/// different records can make the same bytes.
fn associated_data(field: Field, id: &ScopedKey, epoch: i64) -> Vec<u8> {
    let parts: [&[u8]; 5] = [
        b"idemproxy answer v1",
        field.label(),
        id.upstream.as_bytes(),
        id.scope.as_bytes(),
        id.key.as_bytes(),
    ];
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum::<usize>() + 8);
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_be_bytes());
        out.extend_from_slice(p);
    }
    out.extend_from_slice(&epoch.to_be_bytes());
    out
}

/// HKDF output length for the scope secret.
struct ScopeLen;

impl ring::hkdf::KeyType for ScopeLen {
    fn len(&self) -> usize {
        32
    }
}

fn derive_scope_secret(raw: &[u8; KEY_LEN]) -> Vec<u8> {
    let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"idemproxy");
    let mut out = vec![0u8; 32];
    salt.extract(raw)
        .expand(&[b"idemproxy scope v1"], ScopeLen)
        .and_then(|okm| okm.fill(&mut out))
        .unwrap_or_else(|_| unreachable!("32 bytes is a valid HKDF-SHA256 output length"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> ScopedKey {
        ScopedKey::new("api", "k1:abc", key)
    }

    #[test]
    fn seals_and_opens_only_in_place() {
        let c = Cipher::new([7; KEY_LEN], &[]);
        let sealed = c.seal(Field::Body, &id("a"), 3, b"secret body").unwrap();
        assert!(!sealed.windows(6).any(|w| w == b"secret"));
        let open = |f, k: &str, e| c.open(c.current_id(), f, &id(k), e, sealed.clone());
        assert_eq!(open(Field::Body, "a", 3).unwrap(), b"secret body");
        assert!(open(Field::Headers, "a", 3).is_err(), "another field");
        assert!(open(Field::Body, "b", 3).is_err(), "another record");
        assert!(open(Field::Body, "a", 4).is_err(), "another attempt");
        // A fresh nonce per value: the same plaintext seals differently.
        assert_ne!(
            sealed,
            c.seal(Field::Body, &id("a"), 3, b"secret body").unwrap()
        );
        let mut flipped = sealed.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(c
            .open(c.current_id(), Field::Body, &id("a"), 3, flipped)
            .is_err());
    }

    #[test]
    fn previous_keys_read_but_do_not_write() {
        let old = Cipher::new([1; KEY_LEN], &[]);
        let sealed = old.seal(Field::Headers, &id("a"), 1, b"h: v\r\n").unwrap();
        let new = Cipher::new([2; KEY_LEN], &[[1; KEY_LEN]]);
        assert_ne!(new.current_id(), old.current_id());
        let opened = new.open(
            old.current_id(),
            Field::Headers,
            &id("a"),
            1,
            sealed.clone(),
        );
        assert_eq!(opened.unwrap(), b"h: v\r\n");
        let without = Cipher::new([2; KEY_LEN], &[]);
        let err = without
            .open(old.current_id(), Field::Headers, &id("a"), 1, sealed)
            .unwrap_err();
        assert!(err.contains(old.current_id()), "{err}");
        // Scope secrets: one per key, current first, none equal to a key.
        let secrets = new.scope_secrets();
        assert_eq!(secrets[0].0, new.current_id());
        assert_eq!(secrets[1].0, old.current_id());
        assert_eq!(secrets[1].1, old.scope_secrets()[0].1);
        assert_ne!(secrets[1].1, vec![1u8; KEY_LEN]);
        assert!(!format!("{new:?}").contains("[2, 2"));
    }

    #[test]
    fn keys_decode_from_either_base64_alphabet() {
        // 0xfb bytes encode as `+/v7…` in the standard alphabet, `-_v7…` in the URL-safe one.
        let raw = [0xfb; KEY_LEN];
        use base64::Engine as _;
        let std_text = base64::engine::general_purpose::STANDARD.encode(raw);
        let url_text = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
        assert!(std_text.starts_with("+/") && url_text.starts_with("-_"));
        assert_eq!(decode_key(&format!(" {std_text}\n")).unwrap(), raw);
        assert_eq!(decode_key(&url_text).unwrap(), raw);
        assert!(decode_key("not base64!")
            .unwrap_err()
            .contains("not base64"));
        let short = base64::engine::general_purpose::STANDARD.encode([0u8; 16]);
        assert!(decode_key(&short).unwrap_err().contains("decodes to 16"));
    }
}
