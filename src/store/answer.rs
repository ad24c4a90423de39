//! Stored answers: what a completed key replays, how it becomes columns (sealed when
//! encryption is on) and how columns become an answer again — opened, or kept sealed when it
//! cannot be, so the pipeline refuses it and the operator views say `<encrypted>`.

use super::codec::{decode_headers, encode_headers};
use super::seal::{Cipher, Field};
use super::{Effects, Finish, KeyState, ScopedKey, StoreError, StoreResult};
use bytes::Bytes;
use std::sync::Arc;

/// An upstream answer as stored and replayed: status, end-to-end headers, body.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(String, Bytes)>,
    pub body: Bytes,
}

/// Marks a stored answer whose body was over `max_answer` and was not stored. A name no
/// upstream can send (`:` is not allowed in header names), so it cannot be forged.
pub const OMITTED_BODY: &str = ":omitted-body";

/// Marks a stored answer that is a reconcile read's answer, not the write's own (see
/// `pipeline::reconcile`); a name no upstream can send, like [`OMITTED_BODY`].
pub const RECONCILED: &str = ":reconciled";

/// Marks an answer an operator set by hand for a write that happened (see `crate::settle`).
pub const SET_BY_OPERATOR: &str = ":set-by-operator";

impl StoredResponse {
    /// Whether an operator set this answer by hand.
    pub fn set_by_operator(&self) -> bool {
        self.headers.iter().any(|(n, _)| n == SET_BY_OPERATOR)
    }

    /// Whether this is a reconcile read's answer, stored for a write whose own answer was lost.
    pub fn reconciled(&self) -> bool {
        self.headers.iter().any(|(n, _)| n == RECONCILED)
    }

    /// Whether the body was too large to store: such an answer is never replayed.
    pub fn body_omitted(&self) -> bool {
        self.headers.iter().any(|(n, _)| n == OMITTED_BODY)
    }

    /// This answer as stored: without `Set-Cookie` unless `keep_cookies` (a session cookie
    /// replayed to a retry would hand out the first caller's session). Shared, not copied,
    /// when there is nothing to drop.
    pub fn for_storage(self: &Arc<Self>, keep_cookies: bool) -> Arc<Self> {
        let cookie =
            |n: &str| n.eq_ignore_ascii_case("set-cookie") || n.eq_ignore_ascii_case("set-cookie2");
        if keep_cookies || !self.headers.iter().any(|(n, _)| cookie(n)) {
            return self.clone();
        }
        Arc::new(StoredResponse {
            status: self.status,
            headers: self
                .headers
                .iter()
                .filter(|(n, _)| !cookie(n))
                .cloned()
                .collect(),
            body: self.body.clone(),
        })
    }
}

/// A completed key's answer as read from the store.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredAnswer {
    /// Stored in clear, or opened with one of the configured keys.
    Open(StoredResponse),
    /// Encrypted, and it cannot be opened here (no key, another key, or a value that does not
    /// belong to this record). Never replayed and never a reason to forward again: the
    /// pipeline answers `503 store_unavailable`.
    Sealed(SealedAnswer),
}

/// What is known of an answer that cannot be opened: the status line is stored in clear.
#[derive(Debug, Clone, PartialEq)]
pub struct SealedAnswer {
    pub status: u16,
    /// Why it cannot be opened, for logs and operators (never key material).
    pub reason: String,
}

impl StoredAnswer {
    pub fn status(&self) -> u16 {
        match self {
            StoredAnswer::Open(r) => r.status,
            StoredAnswer::Sealed(s) => s.status,
        }
    }
}

/// What a finished key stores, column by column.
pub struct FinishColumns {
    pub state: KeyState,
    pub status: Option<u16>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<Bytes>,
    /// The id of the key that sealed `headers` and `body` (`None`: stored in clear).
    pub enc_key: Option<String>,
    pub expires_at: Option<i64>,
    pub effects: Effects,
}

impl Finish {
    /// The columns of record `id`, whose reservation `epoch` stores this outcome: the answer
    /// sealed with `cipher` when there is one. Every write of a stored answer goes through
    /// here, so none reaches the database in clear while encryption is on.
    pub fn into_columns(
        self,
        cipher: Option<&Cipher>,
        id: &ScopedKey,
        epoch: i64,
    ) -> StoreResult<FinishColumns> {
        let (state, response, expires_at, effects) = match self {
            Finish::Completed {
                response,
                expires_at,
                effects,
            } => (
                KeyState::Completed,
                Some(response),
                Some(expires_at),
                effects,
            ),
            Finish::Released => (KeyState::Released, None, None, Effects::default()),
            Finish::Unknown => (KeyState::Unknown, None, None, Effects::default()),
        };
        let (headers, body, enc_key) = match (&response, cipher) {
            (None, _) => (None, None, None),
            (Some(r), None) => (Some(encode_headers(&r.headers)), Some(r.body.clone()), None),
            (Some(r), Some(c)) => (
                Some(c.seal(Field::Headers, id, epoch, &encode_headers(&r.headers))?),
                Some(Bytes::from(c.seal(Field::Body, id, epoch, &r.body)?)),
                Some(c.current_id().to_owned()),
            ),
        };
        Ok(FinishColumns {
            state,
            status: response.as_ref().map(|r| r.status),
            headers,
            body,
            enc_key,
            expires_at,
            effects,
        })
    }
}

/// The answer of record `id` (stored at `epoch`) from its columns: in clear when `enc_key`
/// is `None`, else opened with `cipher` — or kept [`StoredAnswer::Sealed`] with the reason.
pub(super) fn read_answer(
    cipher: Option<&Cipher>,
    id: &ScopedKey,
    epoch: i64,
    status: u16,
    enc_key: Option<&str>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
) -> StoredAnswer {
    let (headers, body) = (headers.unwrap_or_default(), body.unwrap_or_default());
    let Some(key_id) = enc_key else {
        return StoredAnswer::Open(StoredResponse {
            status,
            headers: decode_headers(&headers),
            body: Bytes::from(body),
        });
    };
    let sealed = |reason: String| StoredAnswer::Sealed(SealedAnswer { status, reason });
    let Some(cipher) = cipher else {
        return sealed(format!(
            "it was encrypted with key {key_id} and no store.encryption_key is configured"
        ));
    };
    let headers = cipher.open(key_id, Field::Headers, id, epoch, headers);
    let body = cipher.open(key_id, Field::Body, id, epoch, body);
    match (headers, body) {
        (Ok(h), Ok(b)) => StoredAnswer::Open(StoredResponse {
            status,
            headers: decode_headers(&h),
            body: Bytes::from(b),
        }),
        (Err(e), _) | (_, Err(e)) => sealed(e),
    }
}

/// The error the request path meets for a sealed answer: `503 store_unavailable`, never a
/// forward.
pub(super) fn sealed_error(id: &ScopedKey, s: &SealedAnswer) -> StoreError {
    StoreError::Sealed(format!(
        "the stored answer of key {:?} cannot be decrypted: {}",
        id.key, s.reason
    ))
}
