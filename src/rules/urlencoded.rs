//! `application/x-www-form-urlencoded` pairs (form bodies, query strings) decoded without
//! loss: each name and value as the bytes its escapes spell, never a lossy string. `%FF` and
//! `%FE` are different bytes to the upstream; read as text both would be U+FFFD, and two
//! requests the upstream tells apart would share a fingerprint, an entity and a key.

use percent_encoding::percent_decode;
use std::borrow::Cow;

/// One decoded pair: name and value as bytes.
pub type Pair = (Vec<u8>, Vec<u8>);

/// The pairs of `raw` in order (`a=1&b=2`), decoded as a form is: `+` is a space, `%XX` a
/// byte, a `%` not followed by two hex digits itself; empty pieces (`a=1&&b=2`) skipped, a
/// piece without `=` a name with an empty value. The same rules as the `form_urlencoded`
/// crate's, on bytes.
pub fn pairs(raw: &[u8]) -> impl Iterator<Item = Pair> + '_ {
    raw.split(|&b| b == b'&')
        .filter(|piece| !piece.is_empty())
        .map(|piece| {
            let (name, value) = match piece.iter().position(|&b| b == b'=') {
                Some(i) => (&piece[..i], &piece[i + 1..]),
                None => (piece, &[][..]),
            };
            (decode(name), decode(value))
        })
}

fn decode(raw: &[u8]) -> Vec<u8> {
    let plus_free: Cow<[u8]> = if raw.contains(&b'+') {
        Cow::Owned(
            raw.iter()
                .map(|&b| if b == b'+' { b' ' } else { b })
                .collect(),
        )
    } else {
        Cow::Borrowed(raw)
    };
    percent_decode(&plus_free).collect()
}

/// The pairs of `raw` as text, or the first name or value that is not UTF-8 once decoded
/// (named, escaped, for the refusal).
pub fn text_pairs(raw: &[u8]) -> Result<Vec<(String, String)>, String> {
    pairs(raw)
        .map(|(name, value)| {
            let name = String::from_utf8(name)
                .map_err(|e| format!("the field name {} is not UTF-8 text", shown(e.as_bytes())))?;
            let value = String::from_utf8(value).map_err(|e| {
                format!(
                    "the value of {name:?} ({}) is not UTF-8 text",
                    shown(e.as_bytes())
                )
            })?;
            Ok((name, value))
        })
        .collect()
}

/// Pairs decoded once (for the fingerprint's bytes) as text for the templates, or the first
/// name or value that is not UTF-8 (see [`text_pairs`]).
pub fn as_text(pairs: &[Pair]) -> Result<Vec<(String, String)>, String> {
    pairs
        .iter()
        .map(|(name, value)| {
            let name = std::str::from_utf8(name)
                .map_err(|_| format!("the field name {} is not UTF-8 text", shown(name)))?;
            let value = std::str::from_utf8(value).map_err(|_| {
                format!("the value of {name:?} ({}) is not UTF-8 text", shown(value))
            })?;
            Ok((name.to_owned(), value.to_owned()))
        })
        .collect()
}

/// Bytes as a reader can see them: printable ASCII as is, anything else as `%XX`.
pub fn shown(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes.iter().take(64) {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if bytes.len() > 64 {
        out.push_str("...");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_as_form_urlencoded_does_on_text() {
        let cases: [&[u8]; 7] = [
            b"a=1&b=two+words&c=%41%42",
            b"&&a&=x&b==c",
            b"pct=50%&bad=%ZZ&half=%4",
            b"metadata%5Border_id%5D=7",
            b"x=%E2%82%AC",
            b"",
            b"=",
        ];
        for raw in cases {
            let ours: Vec<(String, String)> = text_pairs(raw).unwrap();
            let theirs: Vec<(String, String)> = form_urlencoded::parse(raw).into_owned().collect();
            assert_eq!(ours, theirs, "{}", String::from_utf8_lossy(raw));
        }
    }

    #[test]
    fn bytes_that_are_not_text_stay_apart() {
        let a: Vec<Pair> = pairs(b"customer=cus_%FF").collect();
        let b: Vec<Pair> = pairs(b"customer=cus_%FE").collect();
        assert_ne!(a, b);
        let e = text_pairs(b"customer=cus_%FF&amount=7").unwrap_err();
        assert!(e.contains("customer") && e.contains("cus_%FF"), "{e}");
    }
}
