//! What an API's answer says of its rate limit, read from the headers the APIs this proxy
//! fronts send: HubSpot's `X-HubSpot-RateLimit-Max`, `-Remaining` and
//! `-Interval-Milliseconds`; Zendesk's `X-Rate-Limit` (a minute's) and `X-Rate-Limit-Remaining`;
//! the IETF draft's `RateLimit-Remaining` and `RateLimit-Reset`; and `Retry-After` on a `429`.

use super::lane::Rate;
use std::time::Duration;

/// An answer's header by name (lowercase), as its bytes.
pub type Header<'a> = &'a dyn Fn(&str) -> Option<&'a [u8]>;

/// What one answer said.
#[derive(Debug, Default, PartialEq)]
pub struct Heard {
    /// The limit and its window, when the API names both.
    pub rate: Option<Rate>,
    /// How many requests are left in the current window.
    pub remaining: Option<u32>,
    /// Nothing may go for this long: a `429`'s `Retry-After`, or a window with none left
    /// that resets then.
    pub pause: Option<Duration>,
}

/// A `429` that names no wait pauses its lane this long.
pub const DEFAULT_PAUSE: Duration = Duration::from_secs(1);
/// The longest pause an answer can ask for: a wrong header must not stop an account for long.
const MOST_PAUSE: Duration = Duration::from_secs(300);

fn text<'a>(headers: Header<'a>, name: &str) -> Option<&'a str> {
    std::str::from_utf8(headers(name)?).ok().map(str::trim)
}

fn number(headers: Header<'_>, name: &str) -> Option<u64> {
    text(headers, name)?.parse().ok()
}

/// The rate-limit news in an answer.
pub fn heard(status: u16, headers: Header<'_>) -> Heard {
    let mut out = Heard::default();
    let max = number(headers, "x-hubspot-ratelimit-max");
    let interval = number(headers, "x-hubspot-ratelimit-interval-milliseconds");
    if let (Some(max), Some(ms)) = (max, interval) {
        out.rate = rate(max, Duration::from_millis(ms));
    } else if let Some(per_minute) = number(headers, "x-rate-limit") {
        out.rate = rate(per_minute, Duration::from_secs(60));
    }
    out.remaining = [
        "x-hubspot-ratelimit-remaining",
        "x-rate-limit-remaining",
        "ratelimit-remaining",
    ]
    .iter()
    .find_map(|h| number(headers, h))
    .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    if out.remaining == Some(0) {
        out.pause = number(headers, "ratelimit-reset").map(Duration::from_secs);
    }
    if status == 429 {
        out.pause = Some(retry_after(headers).unwrap_or(DEFAULT_PAUSE));
    }
    out.pause = out.pause.map(|p| p.min(MOST_PAUSE));
    out
}

/// The longest window an answer can name: a day, as `pace.per` (a wrong header must not stop
/// an account, nor keep a log of every send).
const MOST_PER: Duration = Duration::from_secs(86_400);

fn rate(limit: u64, per: Duration) -> Option<Rate> {
    let limit = u32::try_from(limit).ok().filter(|&l| l > 0)?;
    (!per.is_zero() && per <= MOST_PER).then_some(Rate {
        limit,
        per,
        burst: limit,
    })
}

/// `Retry-After` in seconds (the HTTP date form is read as no hint).
pub fn retry_after(headers: Header<'_>) -> Option<Duration> {
    let secs: f64 = text(headers, "retry-after")?.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(1e6)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(status: u16, pairs: &[(&'static str, &'static str)]) -> Heard {
        let find = |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.as_bytes())
        };
        heard(status, &find)
    }

    #[test]
    fn hubspot_zendesk_and_retry_after_are_read() {
        let h = said(
            200,
            &[
                ("x-hubspot-ratelimit-max", "100"),
                ("x-hubspot-ratelimit-remaining", "42"),
                ("x-hubspot-ratelimit-interval-milliseconds", "10000"),
            ],
        );
        let hubspot = Rate {
            limit: 100,
            per: Duration::from_secs(10),
            burst: 100,
        };
        assert_eq!(h.rate, Some(hubspot));
        assert_eq!((h.remaining, h.pause), (Some(42), None));

        let zendesk = [
            ("x-rate-limit", "700"),
            ("x-rate-limit-remaining", "0"),
            ("retry-after", "7"),
        ];
        let h = said(429, &zendesk);
        let minute = Duration::from_secs(60);
        assert_eq!(h.rate.map(|r| (r.limit, r.per)), Some((700, minute)));
        assert_eq!(h.remaining, Some(0));
        assert_eq!(h.pause, Some(Duration::from_secs(7)));

        // A 429 with no hint pauses a second; a huge one is bounded; junk is no hint.
        assert_eq!(said(429, &[]).pause, Some(DEFAULT_PAUSE));
        assert_eq!(
            said(429, &[("retry-after", "99999")]).pause,
            Some(MOST_PAUSE)
        );
        let junk = [("x-rate-limit", "-5"), ("retry-after", "soon")];
        assert_eq!(said(200, &junk), Heard::default());
        let forever = [
            ("x-hubspot-ratelimit-max", "1"),
            ("x-hubspot-ratelimit-interval-milliseconds", "999999999999"),
        ];
        assert_eq!(
            said(200, &forever).rate,
            None,
            "a window past a day is no hint"
        );
        let reset = [("ratelimit-remaining", "0"), ("ratelimit-reset", "3")];
        assert_eq!(said(200, &reset).pause, Some(Duration::from_secs(3)));
    }
}
