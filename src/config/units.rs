//! Durations, sizes and `${ENV}` expansion: the little languages inside config strings; store
//! URLs with their passwords masked, for logs and errors; and an upstream URL's credentials
//! moved into a header.

use std::time::Duration;

/// A duration as the config would write it: the largest unit it is a whole number of
/// (`"15m"`, `"24h"`, `"250ms"`).
pub fn show_duration(d: Duration) -> String {
    let ms = d.as_millis();
    let units: [(u128, &str); 4] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ];
    for (size, unit) in units {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Parses `"250ms"`, `"30s"`, `"10m"`, `"24h"`, `"7d"` (one number, one unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {s:?} has no unit (use ms, s, m, h or d)"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("duration {s:?} must start with a whole number"))?;
    let ms = match unit {
        "ms" => n,
        "s" => n.saturating_mul(1000),
        "m" => n.saturating_mul(60_000),
        "h" => n.saturating_mul(3_600_000),
        "d" => n.saturating_mul(86_400_000),
        _ => {
            return Err(format!(
                "duration {s:?}: unknown unit {unit:?} (use ms, s, m, h or d)"
            ))
        }
    };
    Ok(Duration::from_millis(ms))
}

/// Parses `"512"`, `"64KiB"`, `"1MiB"`, `"1GiB"`, `"10kB"`, `"1MB"` into bytes.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("size {s:?} must start with a whole number"))?;
    let mult: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "kB" | "KB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "size {s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Expands `${VAR}` and `${VAR:-default}`; an unset `${VAR}` without default is an error.
/// `$$` is a literal `$` so a value can still contain `${` when it must.
/// The name in `known` nearest to `name` (at most a third of its letters off), if any.
pub fn closest<'a>(name: &str, known: &[&'a str]) -> Option<&'a str> {
    let limit = (name.chars().count() / 3).max(1);
    known
        .iter()
        .map(|k| (distance(name, k), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// ` (did you mean `x`?)` for serde's "unknown field `y`, expected one of `x`, …", else empty.
pub fn did_you_mean(message: &str) -> String {
    let Some(rest) = message.strip_prefix("unknown field `") else {
        return String::new();
    };
    let Some((name, expected)) = rest.split_once("`, expected") else {
        return String::new();
    };
    let known: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    closest(name, &known).map_or(String::new(), |k| format!(" (did you mean `{k}`?)"))
}

/// Levenshtein distance, by characters.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1)
                .min(row[j] + 1)
                .min(diag + usize::from(ca != *cb));
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The index of the `}` that closes a brace already open at the start of `s`.
fn closing(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return Some(i),
            '}' => depth -= 1,
            _ => {}
        }
    }
    None
}

pub fn expand_env(s: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    if !s.contains('$') {
        return Ok(s.to_owned());
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(inner) = after.strip_prefix('{') {
            // The closing brace of this `${`: a default may hold braces of its own
            // (`${ZENDESK_API_URL:-https://{host}}`).
            let end = closing(inner).ok_or_else(|| format!("unterminated ${{...}} in {s:?}"))?;
            let expr = &inner[..end];
            let (name, default) = match expr.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (expr, None),
            };
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!("bad environment variable name {name:?}"));
            }
            // Shell semantics: `:-` also applies the default to a set but empty variable.
            match (lookup(name).filter(|v| !(v.is_empty() && default.is_some())), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    return Err(format!(
                        "environment variable {name} is not set (use ${{{name}:-default}} for a default)"
                    ))
                }
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Moves `user:password@` out of an upstream authority into a Basic `Authorization` value, so
/// the password is never sent as part of `Host`, printed by `check` or logged.
pub(super) fn split_credentials(
    authority: http::uri::Authority,
) -> (http::uri::Authority, Option<http::HeaderValue>) {
    let Some((userinfo, host)) = authority.as_str().rsplit_once('@') else {
        return (authority, None);
    };
    let Ok(bare) = host.parse::<http::uri::Authority>() else {
        return (authority, None);
    };
    let decode = |s: &str| percent_encoding::percent_decode_str(s).collect::<Vec<u8>>();
    let (user, pass) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let mut plain = decode(user);
    plain.push(b':');
    plain.extend(decode(pass));
    use base64::Engine as _;
    let value = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(&plain)
    );
    let mut header = http::HeaderValue::from_str(&value).ok();
    if let Some(h) = header.as_mut() {
        h.set_sensitive(true);
    }
    (bare, header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_shown_as_written() {
        assert_eq!(show_duration(Duration::from_secs(900)), "15m");
        assert_eq!(show_duration(Duration::from_secs(86_400)), "1d");
        assert_eq!(show_duration(Duration::from_millis(1_500)), "1500ms");
        assert_eq!(show_duration(Duration::from_secs(90)), "90s");
        assert_eq!(
            parse_duration(&show_duration(Duration::from_secs(7_200))).unwrap(),
            Duration::from_secs(7_200)
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("24h").unwrap(), Duration::from_secs(86400));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("3x").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("1 parsec").is_err());
        assert!(parse_size("MiB").is_err());
    }

    #[test]
    fn env_expansion() {
        let env = |k: &str| (k == "A").then(|| "x".to_string());
        assert_eq!(expand_env("a${A}b", &env).unwrap(), "axb");
        assert_eq!(expand_env("${B:-dflt}", &env).unwrap(), "dflt");
        assert_eq!(expand_env("${B:-}", &env).unwrap(), "");
        assert_eq!(expand_env("$$x", &env).unwrap(), "$x");
        assert!(expand_env("${B}", &env).is_err());
        assert!(expand_env("${A", &env).is_err());
        assert_eq!(
            super::did_you_mean("unknown field `lisen`, expected one of `listen`, `admin_listen`"),
            " (did you mean `listen`?)"
        );
        assert_eq!(
            super::did_you_mean("unknown field `zzz`, expected `listen`"),
            ""
        );
        assert_eq!(
            super::closest("stripe", &["hubspot", "strip"]),
            Some("strip")
        );
        // A default may hold braces of its own.
        assert_eq!(
            expand_env("${B:-https://{host}}", &env).unwrap(),
            "https://{host}"
        );
        assert_eq!(expand_env("${A:-https://{host}}/x", &env).unwrap(), "x/x");
    }
}
