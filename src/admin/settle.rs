//! The admin API's side of settling a key by hand (`POST /admin/keys/{key}/release` and
//! `…/complete`, see [`crate::settle`]): the JSON body in, the records out, the audit rows
//! queued on the server's auditor.

use super::views::record_json;
use crate::error::{ErrorKind, ProxyError};
use crate::settle::{self, Completion, Refused, Settler};
use crate::state::AppState;
use bytes::Bytes;
use serde_json::{json, Value};

/// Settles `key` as `act` (`release` or `complete`) says, with the body's note and answer.
pub async fn act(
    state: &AppState,
    key: &str,
    act: &str,
    body: &Value,
) -> Result<Value, ProxyError> {
    let settler = Settler {
        store: state.store.as_ref(),
        locks: Some(&state.entity_locks),
        owner: &state.owner,
        lease: state.config.store.lease,
    };
    let retention = settle::retention_of(&state.config);
    let text = |field: &str| body.get(field).and_then(Value::as_str);
    let settled = match act {
        // With `upstream` or `scope`: that one record, only while its outcome is unknown.
        "release" if text("upstream").is_some() || text("scope").is_some() => {
            let note = settle::note(text("note"), false).map_err(refused)?;
            let settled = settler
                .release_one(key, text("upstream"), text("scope"), note, retention)
                .await
                .map_err(refused)?;
            tracing::info!(key, "one record of a key released by an operator");
            (Some(1), settled)
        }
        "release" => {
            let note = settle::note(text("note"), false).map_err(refused)?;
            let (n, settled) = settler
                .release(key, note, retention)
                .await
                .map_err(refused)?;
            tracing::info!(key, released = n, "key released by an operator");
            (Some(n), settled)
        }
        "complete" => {
            let note = settle::note(text("note"), false).map_err(refused)?;
            let completion = completion(body)?;
            let settled = settler
                .complete(key, completion, note, retention)
                .await
                .map_err(refused)?;
            tracing::info!(key, "key completed by an operator");
            (None, settled)
        }
        _ => {
            return Err(ProxyError::new(
                ErrorKind::NotFound,
                format!("no admin endpoint POST /admin/keys/{{key}}/{act}"),
            ))
        }
    };
    let (released, settled) = settled;
    for row in settled.audit {
        state.auditor.send(row);
    }
    let records: Vec<Value> = settled.records.iter().map(record_json).collect();
    Ok(match released {
        Some(n) => json!({"key": key, "released": n, "records": records}),
        None => json!({"key": key, "completed": true, "records": records}),
    })
}

/// The answer of a `complete` body: `status`, `headers` (an object, or a list of
/// `[name, value]` pairs), `body` (text), and `upstream` / `scope` to pick a record.
pub fn completion(body: &Value) -> Result<Completion, ProxyError> {
    let invalid = |m: String| ProxyError::new(ErrorKind::BodyInvalid, m);
    let status = body
        .get("status")
        .and_then(Value::as_u64)
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| invalid("`status` (the real answer's HTTP status) is required".into()))?;
    let headers = match body.get("headers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(n, v)| Ok((n.clone(), header_text(v)?)))
            .collect::<Result<_, String>>()
            .map_err(invalid)?,
        Some(Value::Array(pairs)) => pairs
            .iter()
            .map(|p| match p.as_array().map(Vec::as_slice) {
                Some([n, v]) => Ok((header_text(n)?, header_text(v)?)),
                _ => Err("each header is a [name, value] pair".to_owned()),
            })
            .collect::<Result<_, String>>()
            .map_err(invalid)?,
        Some(_) => return Err(invalid("`headers` is an object of names and values".into())),
    };
    let text = match body.get("body") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        // An object pasted as JSON rather than as text: stored as its JSON text.
        Some(other) => other.to_string(),
    };
    let field = |f: &str| body.get(f).and_then(Value::as_str).map(str::to_owned);
    Ok(Completion {
        status,
        headers,
        body: Bytes::from(text),
        upstream: field("upstream"),
        scope: field("scope"),
    })
}

fn header_text(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        _ => Err("header names and values are text".into()),
    }
}

/// A refusal as the admin API's JSON error.
pub fn refused(r: Refused) -> ProxyError {
    let records = |rs: &[crate::store::KeyRecord]| json!({"records": rs.iter().map(record_json).collect::<Vec<_>>()});
    match r {
        Refused::NoKey => ProxyError::new(ErrorKind::NotFound, "no record carries this key"),
        Refused::NotUnknown(rs) => ProxyError::new(
            ErrorKind::NotSettleable,
            "only a key whose outcome is unknown (or whose call's lease lapsed) can be settled",
        )
        .details(records(&rs)),
        Refused::Ambiguous(rs) => ProxyError::new(
            ErrorKind::NotSettleable,
            "several records carry this key: give `upstream` and `scope` to pick one",
        )
        .details(records(&rs)),
        Refused::Invalid(m) => ProxyError::new(ErrorKind::BodyInvalid, m),
        Refused::Busy => ProxyError::new(
            ErrorKind::EntityBusy,
            "the key's entities stayed locked by requests in flight; try again",
        ),
        Refused::Store(e) => ProxyError::store(e),
    }
}
