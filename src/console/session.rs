//! Who may use the console, and the proof a form carries that the console itself rendered it.
//!
//! The admin API's rule decides whether the console is on at all: with `admin_token` set,
//! whoever signs in with it; without one, only on a loopback admin listener (then no sign-in).
//!
//! A session is a stateless cookie, `v1.<expiry ms>.<HMAC-SHA256(admin_token, "session
//! v1.<expiry>")>`: nothing to store, valid on every replica that has the same token, and a
//! rotated token ends every session at once. It is `HttpOnly` (no script reads it),
//! `SameSite=Strict` (no other site's page sends it) and `Secure` when the console is reached
//! over TLS. Every POST carries a CSRF token, the HMAC of the session (so it dies with it);
//! without a token configured there is no session, and the CSRF token is the HMAC of a secret
//! made once per process. Tokens and MACs are compared in constant time (`ring::hmac::verify`).

use crate::store::now_ms;
use http::header::{COOKIE, HOST};
use http::{HeaderMap, Uri};
use ring::hmac::{self, Key, HMAC_SHA256};
use ring::rand::{SecureRandom, SystemRandom};
use std::sync::OnceLock;

/// The session cookie's name.
pub const COOKIE_NAME: &str = "idemproxy_console";

/// How long a sign-in lasts: a working day, after which the token is asked for again.
pub const LIFETIME_MS: i64 = 8 * 3600 * 1000;

/// What a request may do.
#[derive(Debug, PartialEq, Eq)]
pub enum Access {
    /// Signed in, or no sign-in needed: forms carry this CSRF token.
    Granted { csrf: String, signed_in: bool },
    /// A token is configured and the request has no live session.
    SignIn,
    /// No token and a listener others can reach: the console is off, as the admin API is.
    Off,
    /// No token, and the browser asked for a host name that is not loopback: a page of
    /// another site that rebound its name to 127.0.0.1 (DNS rebinding) must not get the
    /// CSRF token of an unauthenticated console.
    ForeignHost,
}

/// What `headers` may do, given the admin API's rule (`open`) and the admin token.
pub fn access(token: Option<&str>, open: bool, uri: &Uri, headers: &HeaderMap) -> Access {
    match token {
        _ if !open => Access::Off,
        Some(token) => match cookie(headers).filter(|c| live(token, c, now_ms())) {
            Some(session) => Access::Granted {
                csrf: csrf_of(&Key::new(HMAC_SHA256, token.as_bytes()), session),
                signed_in: true,
            },
            None => Access::SignIn,
        },
        None if !loopback_host(uri, headers) => Access::ForeignHost,
        None => match process_key() {
            Some(key) => Access::Granted {
                csrf: csrf_of(key, "open"),
                signed_in: false,
            },
            // No randomness for the secret: no form can be trusted, so none is served.
            None => Access::Off,
        },
    }
}

/// Whether `given` is the CSRF token of this request's access (constant time).
pub fn csrf_ok(token: Option<&str>, headers: &HeaderMap, given: &str) -> bool {
    let Ok(mac) = hex::decode(given) else {
        return false;
    };
    match token {
        Some(token) => cookie(headers).is_some_and(|session| {
            live(token, session, now_ms())
                && hmac::verify(
                    &Key::new(HMAC_SHA256, token.as_bytes()),
                    &csrf_message(session),
                    &mac,
                )
                .is_ok()
        }),
        None => {
            process_key().is_some_and(|key| hmac::verify(key, &csrf_message("open"), &mac).is_ok())
        }
    }
}

/// Whether `given` is the admin token, without its length or any prefix showing in the time
/// it takes: the MACs of both under each as key are compared, in constant time.
pub fn token_ok(token: &str, given: &str) -> bool {
    let expected = hmac::sign(&Key::new(HMAC_SHA256, token.as_bytes()), b"sign-in");
    hmac::verify(
        &Key::new(HMAC_SHA256, given.as_bytes()),
        b"sign-in",
        expected.as_ref(),
    )
    .is_ok()
}

/// A new session's cookie value, valid until `now + LIFETIME_MS`.
pub fn new_session(token: &str, now: i64) -> String {
    let body = format!("v1.{}", now + LIFETIME_MS);
    let mac = hmac::sign(
        &Key::new(HMAC_SHA256, token.as_bytes()),
        &session_message(&body),
    );
    format!("{body}.{}", hex::encode(mac.as_ref()))
}

/// The `Set-Cookie` value that starts a session (`Some`) or ends it (`None`).
pub fn set_cookie(session: Option<&str>, secure: bool) -> String {
    let (value, age) = match session {
        Some(s) => (s, LIFETIME_MS / 1000),
        None => ("", 0),
    };
    let secure = if secure { "; Secure" } else { "" };
    format!("{COOKIE_NAME}={value}; Path=/; Max-Age={age}; HttpOnly; SameSite=Strict{secure}")
}

/// Whether the browser reached the console over TLS: an `https` URI, or a TLS-terminating
/// proxy in front that says so (`X-Forwarded-Proto: https`). Only decides the cookie's
/// `Secure` flag, so a forged header costs its sender nothing but a cookie over plain HTTP.
pub fn over_tls(uri: &Uri, headers: &HeaderMap) -> bool {
    uri.scheme_str() == Some("https")
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("https"))
}

/// Whether `session` is ours and not expired at `now`.
fn live(token: &str, session: &str, now: i64) -> bool {
    let Some((body, mac)) = session.rsplit_once('.') else {
        return false;
    };
    let expiry = body.strip_prefix("v1.").and_then(|e| e.parse::<i64>().ok());
    let Ok(mac) = hex::decode(mac) else {
        return false;
    };
    expiry.is_some_and(|e| e > now)
        && hmac::verify(
            &Key::new(HMAC_SHA256, token.as_bytes()),
            &session_message(body),
            &mac,
        )
        .is_ok()
}

fn session_message(body: &str) -> Vec<u8> {
    format!("session {body}").into_bytes()
}

fn csrf_message(session: &str) -> Vec<u8> {
    format!("csrf {session}").into_bytes()
}

fn csrf_of(key: &Key, session: &str) -> String {
    hex::encode(hmac::sign(key, &csrf_message(session)).as_ref())
}

/// The session cookie's value, if the request sent one.
fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE_NAME).then_some(value)
        })
}

/// The secret behind the CSRF token when no admin token is set: random, made once per
/// process (`None` if the system has no randomness to give).
fn process_key() -> Option<&'static Key> {
    static KEY: OnceLock<Option<Key>> = OnceLock::new();
    KEY.get_or_init(|| {
        let mut secret = [0u8; 32];
        SystemRandom::new().fill(&mut secret).ok()?;
        Some(Key::new(HMAC_SHA256, &secret))
    })
    .as_ref()
}

/// Whether the host the browser asked for is a loopback name or address (or none was given:
/// not a browser). Also the admin API's guard without a token (`crate::admin`).
pub fn loopback_host(uri: &Uri, headers: &HeaderMap) -> bool {
    let host = match uri.host() {
        Some(h) => h.to_owned(),
        None => match headers.get(HOST).and_then(|v| v.to_str().ok()) {
            Some(h) => h.to_owned(),
            None => return true,
        },
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host.as_str(), |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with_cookie(session: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let v = format!("other=1; {COOKIE_NAME}={session}");
        h.insert(COOKIE, HeaderValue::from_str(&v).unwrap());
        h
    }

    #[test]
    fn a_session_is_the_token_s_and_expires() {
        let s = new_session("t0ken", now_ms());
        assert!(live("t0ken", &s, now_ms()));
        assert!(!live("rotated", &s, now_ms()), "a new token ends it");
        assert!(!live("t0ken", &s, now_ms() + LIFETIME_MS + 1), "expired");
        let forged = s.replacen("v1.", "v1.9", 1);
        assert!(
            !live("t0ken", &forged, now_ms()),
            "a longer expiry breaks the MAC"
        );
    }

    #[test]
    fn csrf_belongs_to_the_session() {
        let uri = Uri::from_static("/");
        let s = new_session("t0ken", now_ms());
        let headers = with_cookie(&s);
        let Access::Granted { csrf, .. } = access(Some("t0ken"), true, &uri, &headers) else {
            panic!("signed in");
        };
        assert!(csrf_ok(Some("t0ken"), &headers, &csrf));
        let other = with_cookie(&new_session("t0ken", now_ms() - 60_000));
        assert!(!csrf_ok(Some("t0ken"), &other, &csrf), "another session's");
        assert!(
            !csrf_ok(Some("t0ken"), &HeaderMap::new(), &csrf),
            "no session"
        );
        assert!(!csrf_ok(Some("t0ken"), &headers, ""));
        assert!(!csrf_ok(Some("t0ken"), &headers, "zz"));
        assert_eq!(
            access(Some("t0ken"), true, &uri, &HeaderMap::new()),
            Access::SignIn
        );
        assert_eq!(access(None, false, &uri, &HeaderMap::new()), Access::Off);
    }

    #[test]
    fn without_a_token_only_loopback_names() {
        let uri = Uri::from_static("/");
        let host = |h: &'static str| {
            let mut m = HeaderMap::new();
            m.insert(HOST, HeaderValue::from_static(h));
            m
        };
        for ok in [
            "127.0.0.1:9090",
            "localhost:9090",
            "[::1]:9090",
            "LOCALHOST",
        ] {
            let Access::Granted { csrf, .. } = access(None, true, &uri, &host(ok)) else {
                panic!("{ok} is loopback");
            };
            assert!(csrf_ok(None, &HeaderMap::new(), &csrf));
        }
        for bad in [
            "evil.example:9090",
            "10.0.0.1:9090",
            "localhost.evil.example",
        ] {
            assert_eq!(
                access(None, true, &uri, &host(bad)),
                Access::ForeignHost,
                "{bad}"
            );
        }
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(token_ok("secret", "secret"));
        assert!(!token_ok("secret", "secre"));
        assert!(!token_ok("secret", "secret "));
        assert!(!token_ok("secret", ""));
    }
}
