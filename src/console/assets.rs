//! The console's only static files, built into the binary: its stylesheet and its icon.
//! Nothing is loaded from anywhere else (the CSP allows this origin alone).

use super::page::secure_headers;
use crate::upstream::{full, ProxyBody};
use http::{header, HeaderValue, Response, StatusCode};

const CSS: &str = include_str!("console.css");
const ICON: &str = include_str!("icon.svg");

/// `GET /assets/{name}`; `None` for a name that is not one of them.
pub fn serve(name: &str) -> Option<Response<ProxyBody>> {
    let (body, kind) = match name {
        "console.css" => (CSS, "text/css; charset=utf-8"),
        "icon.svg" => (ICON, "image/svg+xml"),
        _ => return None,
    };
    let mut resp = Response::new(full(body));
    *resp.status_mut() = StatusCode::OK;
    let headers = resp.headers_mut();
    secure_headers(headers);
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    // Shipped with the binary: an hour's caching, so an upgrade shows within the hour.
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=3600"),
    );
    Some(resp)
}
