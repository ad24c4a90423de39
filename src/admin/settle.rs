//! The admin API's side of settling a key by hand (`POST /admin/keys/{key}/release` and
//! `…/complete`, see [`crate::settle`]): the JSON body in, the records out, the audit rows
//! queued on the server's auditor.

use super::views::record_json;
use crate::error::{ErrorKind, ProxyError};
use crate::settle::{self, Completion, Pick, Refused, Settler};
use crate::state::AppState;
use bytes::Bytes;
use serde_json::{json, Value};

/// Settles `key` as `act` (`release` or `complete`) says, with the body's note, record pick
/// and answer.
pub async fn act(
    state: &AppState,
    key: &str,
    act: &str,
    body: &Value,
) -> Result<Value, ProxyError> {
    let settler = Settler::of(state);
    let note = settle::note(text(body, "note")?, false).map_err(refused)?;
    let pick = Pick {
        upstream: text(body, "upstream")?.map(str::to_owned),
        scope: text(body, "scope")?.map(str::to_owned),
    };
    let (released, settled) = match act {
        "release" => {
            let force = match body.get("force") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ProxyError::new(
                        ErrorKind::BodyInvalid,
                        "force must be true or false",
                    ))
                }
            };
            let settled = settler
                .release(key, &pick, note, force)
                .await
                .map_err(refused)?;
            (Some(settled.audit.len()), settled)
        }
        "complete" => {
            let completion = completion(body)?;
            let settled = settler
                .complete(key, &pick, &completion, note)
                .await
                .map_err(refused)?;
            (None, settled)
        }
        _ => {
            return Err(ProxyError::new(
                ErrorKind::NotFound,
                format!("no admin endpoint POST /admin/keys/{{key}}/{act}"),
            ))
        }
    };
    for row in settled.audit {
        state.auditor.send(row);
    }
    let records: Vec<Value> = settled.records.iter().map(record_json).collect();
    Ok(match released {
        Some(n) => json!({"key": key, "released": n, "records": records}),
        None => json!({"key": key, "completed": true, "records": records}),
    })
}

/// A text field of the body: absent (or null) is `None`; anything but text is refused rather
/// than read as absent (a `scope` sent as a number must not widen the act).
fn text<'b>(body: &'b Value, field: &str) -> Result<Option<&'b str>, ProxyError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ProxyError::new(
            ErrorKind::BodyInvalid,
            format!("`{field}` is text"),
        )),
    }
}

/// The answer of a `complete` body: `status`, `headers` (an object, or a list of
/// `[name, value]` pairs) and `body` (text).
pub fn completion(body: &Value) -> Result<Completion, ProxyError> {
    let invalid = |m: String| ProxyError::new(ErrorKind::BodyInvalid, m);
    let status = match body.get("status").map(|s| (s, s.as_u64())) {
        None | Some((Value::Null, _)) => {
            return Err(invalid(
                "`status` (the real answer's HTTP status) is required".into(),
            ))
        }
        Some((_, Some(n))) => {
            u16::try_from(n).map_err(|_| invalid(format!("`status` {n} is not an HTTP status")))?
        }
        Some((other, None)) => {
            return Err(invalid(format!("`status` {other} is not an HTTP status")))
        }
    };
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
    Ok(Completion {
        status,
        headers,
        body: Bytes::from(text),
    })
}

fn header_text(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        _ => Err("header names and values are text".into()),
    }
}

/// A refusal as the admin API's JSON error, with the records that explain it.
pub fn refused(r: Refused) -> ProxyError {
    let kind = match &r {
        Refused::Store(e) => return ProxyError::store(e),
        Refused::NoKey => ErrorKind::NotFound,
        Refused::NotUnknown(_) | Refused::Ambiguous(_) | Refused::Answered(_) => {
            ErrorKind::NotSettleable
        }
        Refused::Invalid(_) => ErrorKind::BodyInvalid,
        Refused::Busy => ErrorKind::EntityBusy,
    };
    let records: Vec<Value> = r.records().iter().map(record_json).collect();
    let message = match &r {
        Refused::Ambiguous(_) => format!("{r}: give `upstream` and `scope` in the body"),
        Refused::Answered(_) => format!("{r}: {{\"force\": true, \"note\": \"...\"}}"),
        _ => r.to_string(),
    };
    match records.is_empty() {
        true => ProxyError::new(kind, message),
        false => ProxyError::new(kind, message).details(json!({ "records": records })),
    }
}
