//! Path patterns of routes (`/crm/v3/objects/contacts/{contact_id}`, `/webhook/{*rest}`) and
//! the path safety check that keeps `..` and encoded slashes away from upstreams.

use percent_encoding::percent_decode_str;

#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Lit(String),
    /// `{id}`, or `{id}.json`: a capture and the literal suffix the segment ends with (Zendesk
    /// paths end in `.json`; the entity is the id without it).
    Capture(String, String),
    Tail(String),
}

/// A compiled route path.
#[derive(Debug, Clone, PartialEq)]
pub struct PathPattern {
    segs: Vec<Seg>,
}

impl PathPattern {
    pub fn parse(pattern: &str) -> Result<PathPattern, String> {
        if !pattern.starts_with('/') {
            return Err(format!("path {pattern:?} must start with '/'"));
        }
        let raw: Vec<&str> = pattern[1..].split('/').collect();
        let mut segs = Vec::with_capacity(raw.len());
        for (i, s) in raw.iter().enumerate() {
            let capture = s.strip_prefix('{').and_then(|s| s.split_once('}'));
            if let Some((inner, suffix)) = capture.filter(|(_, x)| !x.contains(['{', '}'])) {
                if let Some(name) = inner.strip_prefix('*') {
                    if i + 1 != raw.len() || !suffix.is_empty() {
                        return Err(format!("path {pattern:?}: {{*{name}}} must be last"));
                    }
                    check_name(pattern, name)?;
                    segs.push(Seg::Tail(name.to_owned()));
                } else {
                    check_name(pattern, inner)?;
                    segs.push(Seg::Capture(inner.to_owned(), suffix.to_owned()));
                }
            } else if s.contains('{') || s.contains('}') {
                return Err(format!(
                    "path {pattern:?}: a capture must be a whole segment, like /{{id}} or /{{id}}.json"
                ));
            } else {
                segs.push(Seg::Lit((*s).to_owned()));
            }
        }
        Ok(PathPattern { segs })
    }

    /// Names this pattern captures (for checking `{path.X}` templates at load).
    pub fn captures(&self) -> impl Iterator<Item = &str> {
        self.segs.iter().filter_map(|s| match s {
            Seg::Capture(n, _) | Seg::Tail(n) => Some(n.as_str()),
            Seg::Lit(_) => None,
        })
    }

    /// Matches an upstream-relative path (no query); captures are percent-decoded.
    pub fn matches(&self, path: &str) -> Option<Vec<(String, String)>> {
        self.matches_with(path, |a, b| a == b)
    }

    /// Whether `path` would match if the case of literal segments were ignored: such a path
    /// is refused, never forwarded past the route's locks and checks to an upstream whose
    /// routing ignores case.
    pub fn matches_ignoring_case(&self, path: &str) -> bool {
        self.matches_with(path, |a, b| a.eq_ignore_ascii_case(b))
            .is_some()
    }

    fn matches_with(
        &self,
        path: &str,
        same: impl Fn(&str, &str) -> bool,
    ) -> Option<Vec<(String, String)>> {
        let rest = path.strip_prefix('/')?;
        let mut params = Vec::new();
        let mut parts = rest.split('/');
        let mut consumed = 0usize;
        for seg in &self.segs {
            match seg {
                Seg::Tail(name) => {
                    let tail = &rest[consumed.min(rest.len())..];
                    params.push((name.clone(), decode(tail)));
                    return Some(params);
                }
                Seg::Lit(l) => {
                    let p = parts.next()?;
                    if !same(p, l) {
                        return None;
                    }
                    consumed += p.len() + 1;
                }
                Seg::Capture(name, suffix) => {
                    let p = parts.next()?;
                    let cut = p.len().checked_sub(suffix.len())?;
                    let value = p.get(..cut).filter(|v| !v.is_empty())?;
                    if !same(&p[cut..], suffix) {
                        return None;
                    }
                    params.push((name.clone(), decode(value)));
                    consumed += p.len() + 1;
                }
            }
        }
        parts.next().is_none().then_some(params)
    }
}

fn check_name(pattern: &str, name: &str) -> Result<(), String> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("path {pattern:?}: bad capture name {name:?}"));
    }
    Ok(())
}

fn decode(s: &str) -> String {
    percent_decode_str(s).decode_utf8_lossy().into_owned()
}

/// The path routes are matched against (the fingerprint takes the path as forwarded): empty segments dropped,
/// percent-encoded unreserved characters decoded, a stray `%` written `%25`, `;params` of a
/// segment left out (servers such as Tomcat and Spring ignore them) and no trailing slash — so
/// `/a//b/`, `/a/%62`, `/a/b;v=1` and `/a/b` meet the same route, lock and rules. The path
/// forwarded is left as sent.
pub fn canonical(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let segments = path
        .split('/')
        .map(|s| s.split(';').next().unwrap_or_default());
    for seg in segments.filter(|s| !s.is_empty()) {
        out.push('/');
        let bytes = seg.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            // Two ASCII hex digits after '%' (checked as bytes first: slicing `seg` there is
            // then on char boundaries).
            let escaped = (bytes[i] == b'%'
                && i + 2 < bytes.len()
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit())
            .then(|| u8::from_str_radix(&seg[i + 1..i + 3], 16).ok())
            .flatten();
            match escaped {
                Some(b) if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => {
                    out.push(b as char);
                    i += 3;
                }
                Some(_) => {
                    out.push('%');
                    out.push_str(&seg[i + 1..i + 3].to_ascii_uppercase());
                    i += 3;
                }
                None if bytes[i] == b'%' => {
                    // Not an escape: written as one, so no later decoding can complete it.
                    out.push_str("%25");
                    i += 1;
                }
                None => {
                    // A char boundary: multi-byte characters are copied whole.
                    let ch = seg[i..].chars().next().unwrap_or('\u{fffd}');
                    out.push(ch);
                    i += ch.len_utf8();
                }
            }
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Rejects a (canonical) path whose escapes decode to bytes that are not UTF-8: a capture
/// read from it would be a guess (`%FF` and `%FE` both read as U+FFFD), and two paths the
/// upstream tells apart would name one entity and one key.
pub fn check_text(path: &str) -> Result<(), &'static str> {
    if !path.contains('%') || percent_decode_str(path).decode_utf8().is_ok() {
        return Ok(());
    }
    Err("the path's escapes decode to bytes that are not UTF-8 text ('%FF'); a route cannot name an entity or a key from it")
}

/// Rejects paths an upstream could resolve to somewhere else: `.`/`..` segments (plain or
/// percent-encoded), encoded `/` or `\`, backslashes and NUL. Returns the reason.
pub fn check_path(path: &str) -> Result<(), &'static str> {
    if !path.starts_with('/') {
        return Err("the path must start with '/'");
    }
    for seg in path.split('/') {
        if seg.contains('\\') {
            return Err("backslashes are not allowed in paths");
        }
        if !seg.contains('%') && !seg.starts_with('.') {
            continue;
        }
        let decoded = percent_decode_str(seg).collect::<Vec<u8>>();
        // Some servers (Tomcat, Jetty, Spring) read `..;x` as `..`: the parameter part does
        // not save a dot segment.
        let before_params = decoded.split(|&b| b == b';').next().unwrap_or_default();
        if before_params == b".." || before_params == b"." {
            return Err("dot segments ('..', '%2e%2e') are not allowed");
        }
        if decoded.iter().any(|&b| b == b'/' || b == b'\\' || b == 0) {
            return Err("encoded '/', '\\' or NUL ('%2f', '%5c', '%00') are not allowed");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching() {
        let p = PathPattern::parse("/crm/v3/objects/contacts/{contact_id}").unwrap();
        assert_eq!(
            p.matches("/crm/v3/objects/contacts/12%20a"),
            Some(vec![("contact_id".into(), "12 a".into())])
        );
        assert_eq!(p.matches("/crm/v3/objects/contacts/"), None);
        assert_eq!(p.matches("/crm/v3/objects/contacts/1/x"), None);
        let t = PathPattern::parse("/webhook/{*rest}").unwrap();
        assert_eq!(
            t.matches("/webhook/a/b"),
            Some(vec![("rest".into(), "a/b".into())])
        );
        let lit = PathPattern::parse("/v1/charges").unwrap();
        assert!(lit.matches("/v1/charges").is_some());
        assert!(lit.matches("/v1/charges/x").is_none());
        assert!(PathPattern::parse("v1").is_err());
        assert!(PathPattern::parse("/{*a}/b").is_err());
        assert!(PathPattern::parse("/a{b}").is_err());
        let json = PathPattern::parse("/api/v2/tickets/{ticket_id}.json").unwrap();
        assert_eq!(
            json.matches("/api/v2/tickets/42.json"),
            Some(vec![("ticket_id".into(), "42".into())])
        );
        assert_eq!(json.matches("/api/v2/tickets/.json"), None);
        assert_eq!(json.matches("/api/v2/tickets/42"), None);
        assert!(json.matches_ignoring_case("/API/v2/tickets/42.JSON"));
        assert!(PathPattern::parse("/{*a}.json").is_err());
        assert!(PathPattern::parse("/{a}.{b}").is_err());
    }

    #[test]
    fn canonical_paths() {
        assert_eq!(canonical("/crm//contacts/123/"), "/crm/contacts/123");
        assert_eq!(canonical("/crm/%63ontacts/%2a"), "/crm/contacts/%2A");
        assert_eq!(canonical("/"), "/");
        assert_eq!(canonical("//"), "/");
        assert_eq!(canonical("/a/%"), "/a/%25");
        assert_eq!(canonical("/a/%4"), "/a/%254");
        // A stray % never joins a decoded digit: both spellings of "%25" meet as one.
        assert_eq!(canonical("/x/%2%35"), "/x/%2525");
        assert_eq!(canonical("/x/%2525"), "/x/%2525");
        assert_eq!(canonical("/v1/charges;x=1"), "/v1/charges");
        assert_eq!(canonical("/a;p/b"), "/a/b");
        assert_eq!(canonical("/é/x"), "/é/x");
        assert_eq!(canonical("/a/%é%"), "/a/%25é%25");
    }

    #[test]
    fn unsafe_paths() {
        for bad in [
            "/a/../b",
            "/a/%2e%2e/b",
            "/a/%2E%2e",
            "/a/.%2e/b",
            "/a%2fb",
            "/a%2Fb",
            "/a%5cb",
            "/up/..;/admin",
            "/up/.;x/a",
            "/a\\b",
            "/./a",
        ] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
        for good in ["/", "/v1/charges", "/a/..b", "/a/%20", "/a/.well-known"] {
            assert!(check_path(good).is_ok(), "{good}");
        }
    }
}
