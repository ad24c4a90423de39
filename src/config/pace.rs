//! `upstreams.X.pace`: the API's rate limit per account, kept by the proxy (see
//! [`crate::pace`]).

use super::compiler::Compiler;
use super::raw::RawPace;
use std::time::Duration;
use toml::Spanned;

/// A rate: `limit` requests per `per`, at most `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub limit: u32,
    pub per: Duration,
    pub burst: u32,
}

/// An upstream's budget per account, as configured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub rate: Rate,
    /// The longest a request waits for its turn before it is refused.
    pub max_wait: Duration,
}

/// Longest `per`: a day (HubSpot's daily limit); the shared store drops sends older than that.
const MOST_PER: Duration = Duration::from_secs(86_400);

/// Longest `max_wait`: a request waits with its key's slot held, and its client waits too.
const MOST_WAIT: Duration = Duration::from_secs(300);

pub(super) fn budget(
    cx: &mut Compiler,
    name: &str,
    raw: &Option<Spanned<RawPace>>,
) -> Option<Budget> {
    let sp = raw.as_ref()?;
    let p = sp.get_ref();
    let count = |cx: &mut Compiler, v: &Spanned<i64>, what: &str| {
        let n = u32::try_from(*v.get_ref()).ok().filter(|&n| n > 0);
        if n.is_none() {
            cx.err(
                v.span(),
                format!("upstream {name:?}: pace.{what} is a count of requests, 1 or more"),
            );
        }
        n
    };
    let limit = count(cx, &p.rate, "rate")?;
    let per = cx.dur(&p.per, Duration::from_secs(1));
    if per.is_zero() || per > MOST_PER {
        let why = "is a window from a millisecond to a day, e.g. \"10s\"";
        cx.err(sp.span(), format!("upstream {name:?}: pace.per {why}"));
        return None;
    }
    let burst = match &p.burst {
        Some(b) => count(cx, b, "burst")?,
        None => limit,
    };
    let max_wait = cx.dur(&p.max_wait, Duration::from_secs(30));
    if max_wait > MOST_WAIT {
        cx.err(sp.span(), format!("upstream {name:?}: pace.max_wait is at most {MOST_WAIT:?}: a request waits for its turn holding its key, and its client waits with it"));
    }
    Some(Budget {
        rate: Rate { limit, per, burst },
        max_wait,
    })
}
