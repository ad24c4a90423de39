//! The refusals several steps give: a key whose outcome is unknown, a key in progress. A leaf,
//! so the steps that refuse need not reach into each other for them.

use crate::error::{ErrorKind, ProxyError};
use std::time::Duration;

/// `409 outcome_unknown`: an earlier attempt reached the upstream and no one knows whether it
/// happened (`why`: what the proxy tried).
pub(super) fn outcome_unknown(why: Option<&str>) -> ProxyError {
    let why = why.map(|w| format!(": {w}")).unwrap_or_default();
    ProxyError::new(
        ErrorKind::OutcomeUnknown,
        format!("an earlier attempt with this key reached the upstream but its outcome is unknown{why}; check the upstream, then resolve it with `idemproxy keys release KEY`"),
    )
}

pub(super) fn in_progress() -> ProxyError {
    ProxyError::new(
        ErrorKind::RequestInProgress,
        "a request with this idempotency key is in progress",
    )
    .retry_after(Duration::from_secs(1))
}
