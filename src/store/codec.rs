//! Compact encodings for what the store keeps as blobs/text: headers and entity lists.

use bytes::Bytes;

/// Headers as `name: value\r\n` lines (header values cannot contain CR or LF).
pub fn encode_headers(headers: &[(String, Bytes)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(headers.iter().map(|(n, v)| n.len() + v.len() + 4).sum());
    for (n, v) in headers {
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v);
        out.extend_from_slice(b"\r\n");
    }
    out
}

pub fn decode_headers(raw: &[u8]) -> Vec<(String, Bytes)> {
    raw.split(|&b| b == b'\n')
        .filter_map(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let pos = line.windows(2).position(|w| w == b": ")?;
            let name = std::str::from_utf8(&line[..pos]).ok()?.to_owned();
            Some((name, Bytes::copy_from_slice(&line[pos + 2..])))
        })
        .collect()
}

/// Entities as a JSON array, so SQL can search them (`json_each` / `jsonb`). Most routes name
/// none: their `[]` costs no allocation (a reservation and an audit row each encode one).
pub fn encode_entities(entities: &[String]) -> std::borrow::Cow<'static, str> {
    if entities.is_empty() {
        return "[]".into();
    }
    serde_json::to_string(entities)
        .unwrap_or_else(|_| "[]".into())
        .into()
}

pub fn decode_entities(raw: &str) -> Vec<String> {
    serde_json::from_str(raw).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = vec![
            (
                "content-type".to_string(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-a".to_string(), Bytes::from_static(b"b: c")),
            ("x-empty".to_string(), Bytes::new()),
        ];
        assert_eq!(decode_headers(&encode_headers(&h)), h);
        let e = vec!["a:1".to_string(), "b\"2".to_string()];
        assert_eq!(decode_entities(&encode_entities(&e)), e);
    }
}
