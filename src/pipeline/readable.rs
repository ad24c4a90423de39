//! Step 1's reading of the parts of a request a route's templates use, before any is read:
//! each must be read exactly as the upstream will receive it, or the request is refused —
//! never read as absent (a key would fall back to another template) nor as U+FFFD (two
//! requests the upstream tells apart would be one key).

use crate::config::{Route, Upstream};
use crate::error::{ErrorKind, ProxyError, ProxyResult};
use crate::rules::template::Source;
use http::HeaderMap;

/// The intercepted host, when the upstream claims several (`*.zendesk.com`, or more than one
/// name) or sends each request to its own host (`https://{host}`): it is then part of the
/// scope, as the account the API acts for.
pub(super) fn wildcard_host<'a>(upstream: &Upstream, host: Option<&'a str>) -> Option<&'a str> {
    let several = upstream.url_host
        || upstream.hosts.len() > 1
        || upstream
            .hosts
            .iter()
            .any(crate::config::HostPattern::is_wildcard);
    host.filter(|_| several)
}

/// The query's fields as text, once every part of the request the route's templates read is
/// known to be read exactly: a header they read is sent once and is UTF-8 text, the query is
/// text once decoded, and the body has one `Content-Type`. Anything else is refused, never read
/// as absent (a key would fall back to another template) or as U+FFFD (two requests the
/// upstream tells apart would be one key).
pub(super) fn readable(
    route: &Route,
    headers: &HeaderMap,
    query: &[crate::rules::urlencoded::Pair],
) -> ProxyResult<Vec<(String, String)>> {
    if headers
        .get_all(http::header::CONTENT_TYPE)
        .iter()
        .nth(1)
        .is_some()
    {
        return Err(ProxyError::new(
            ErrorKind::BodyInvalid,
            "the request has two Content-Type headers; the upstream may read the body by either",
        ));
    }
    let mut reads_query = false;
    for source in route.templates().flat_map(|t| t.sources()) {
        match source {
            Source::Query(_) => reads_query = true,
            Source::Header(name) => {
                let mut values = headers.get_all(name).iter();
                let first = values.next();
                if values.next().is_some() {
                    return Err(ProxyError::new(
                        ErrorKind::HeaderInvalid,
                        format!("{name} is sent more than once; route {} reads it, and the upstream may read either", route.name),
                    ));
                }
                if let Some(v) = first.filter(|v| std::str::from_utf8(v.as_bytes()).is_err()) {
                    return Err(ProxyError::new(
                        ErrorKind::HeaderInvalid,
                        format!(
                            "{name} ({}) is not UTF-8 text; route {} reads it. Send it as UTF-8",
                            crate::rules::urlencoded::shown(v.as_bytes()),
                            route.name
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    match crate::rules::urlencoded::as_text(query) {
        Ok(pairs) => Ok(pairs),
        Err(why) if reads_query => Err(ProxyError::new(
            ErrorKind::BadPath,
            format!("the query: {why}; route {} reads it", route.name),
        )),
        // Nothing reads it: the fingerprint takes its bytes.
        Err(_) => Ok(Vec::new()),
    }
}
