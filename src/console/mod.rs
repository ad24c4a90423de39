//! The console: HTML pages for operators on the admin listener, beside the JSON API (which
//! is unchanged). Server-rendered with maud, no script, nothing from another origin, a strict
//! Content-Security-Policy; every value that came from a request or an upstream is escaped.
//!
//! - `/` — [`attention`]: keys whose outcome is unknown, and in-flight writes past their
//!   lease, oldest first, with the two acts ([`act`]: release, mark done).
//! - `/console/entity?e=…` — [`timeline`]: every decision that touched an entity.
//! - `/console/key?k=…` — [`keys`]: a key's records, stored answer and attempts.
//! - `/console/overview?window=…` — [`overview`]: decisions per route over a window, with a
//!   [`chart`].
//! - `/console/upstreams?window=…` — [`health`]: each upstream's answers by status, unknown
//!   outcomes, unreachable calls and time, over the window and in six slices of it.
//! - `/console/running` — [`running`]: the version, store, listeners, upstreams and routes in
//!   force (Traefik's and HAProxy's dashboards show theirs), never a secret.
//! - `/login`, `/logout` — [`session`]: sign-in with the admin token, a session cookie, and
//!   the CSRF token every POST carries.
//! - `/assets/…` — [`assets`]: the stylesheet and icon, built into the binary.
//!
//! Beside them: [`page`] (the frame, links, headers), [`decision`] (what a decision means),
//! [`rows`] (audit rows as a table),
//! [`form`] (posted forms and query strings), [`clock`] (UTC times).

mod act;
mod assets;
mod attention;
mod chart;
mod clock;
mod decision;
mod form;
mod health;
mod keys;
mod overview;
mod page;
mod rows;
mod running;
mod session;
pub use session::loopback_host;
mod timeline;

use crate::connection::RequestBody;
use crate::state::AppState;
use crate::store::{now_ms, StoreError};
use crate::upstream::ProxyBody;
use form::Form;
use http::{Method, Request, Response, StatusCode};
use maud::html;
use page::Frame;
use session::Access;

/// Whether `path` is the console's (the admin listener sends it here).
pub fn serves(path: &str) -> bool {
    matches!(path, "/" | "/login" | "/logout")
        || path.starts_with("/console/")
        || path.starts_with("/assets/")
}

/// Answers a console request. `open` is the admin API's rule (see `admin::admin_open`): the
/// console is on exactly when the API is.
pub async fn handle(
    state: &AppState,
    req: Request<RequestBody>,
    open: bool,
) -> Response<ProxyBody> {
    let path = req.uri().path().to_owned();
    if let Some(name) = path.strip_prefix("/assets/") {
        return assets::serve(name).unwrap_or_else(not_found);
    }
    let token = state.config.server.admin_token.as_deref();
    let method = req.method().clone();
    let access = session::access(token, open, req.uri(), req.headers());
    let (csrf, signed_in) = match (access, token) {
        (Access::Off, _) => {
            return page::problem(
                StatusCode::FORBIDDEN,
                "The console is off",
                "The admin listener is not on loopback and no admin_token is set: set \
                 server.admin_token to use the console.",
            )
        }
        (Access::ForeignHost, _) => {
            return page::problem(
                StatusCode::FORBIDDEN,
                "Not this host name",
                "Without an admin_token the console answers only to a loopback host name \
                 (127.0.0.1, [::1], localhost).",
            )
        }
        // Signed in already: the sign-in page has nothing to offer.
        (Access::Granted { .. }, Some(_)) if path == "/login" && method == Method::GET => {
            return page::redirect("/", None)
        }
        (_, Some(token)) if path == "/login" => return sign_in(state, req, token).await,
        (Access::SignIn, _) if method == Method::GET => return page::redirect("/login", None),
        (Access::SignIn, _) => {
            return page::problem(
                StatusCode::UNAUTHORIZED,
                "Sign in first",
                "Your session has ended (or the admin token changed): sign in again.",
            )
        }
        (Access::Granted { csrf, signed_in }, _) => (csrf, signed_in),
    };
    let frame = Frame {
        csrf: &csrf,
        signed_in,
        store: state.store.backend(),
    };
    match method {
        Method::GET | Method::HEAD => view(state, &frame, &path, &form::query(req.uri())).await,
        Method::POST => post(state, req, &path, token).await,
        _ => page::problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "Not here",
            "The console's pages are read with GET and its forms sent with POST.",
        ),
    }
}

/// A form sent with POST: read within the body limits, refused without this console's CSRF
/// token, then acted on.
async fn post(
    state: &AppState,
    req: Request<RequestBody>,
    path: &str,
    token: Option<&str>,
) -> Response<ProxyBody> {
    let tls = session::over_tls(req.uri(), req.headers());
    let headers = req.headers().clone();
    let form = match Form::read(
        req,
        state.config.server.max_body,
        state.config.server.body_timeout,
    )
    .await
    {
        Ok(f) => f,
        Err(form::Unreadable(status, m)) => return page::problem(status, "Not a console form", &m),
    };
    let given = form.get("csrf").unwrap_or_default();
    if !session::csrf_ok(token, &headers, given) {
        return page::problem(
            StatusCode::FORBIDDEN,
            "Refused: no valid CSRF token",
            "This form did not come from this console (or from a session that has \
             ended): nothing changed. Reload the page and try again.",
        );
    }
    match path {
        "/console/release" => act::release(state, &form).await,
        "/console/complete" => act::complete(state, &form).await,
        "/logout" => page::redirect("/login", Some(session::set_cookie(None, tls))),
        _ => not_found(),
    }
}

/// A page read with GET.
async fn view(
    state: &AppState,
    frame: &Frame<'_>,
    path: &str,
    query: &Form,
) -> Response<ProxyBody> {
    let page = match path {
        "/" => attention::page(state, frame).await.map(|m| (true, m)),
        "/login" | "/logout" => return page::redirect("/", None),
        "/console/entity" => timeline::page(state, frame, query.get("e"))
            .await
            .map(|m| (true, m)),
        "/console/key" => keys::page(state, frame, query.get("k"), query.get("done")).await,
        "/console/overview" => overview::page(state, frame, query.get("window"))
            .await
            .map(|m| (true, m)),
        "/console/running" => Ok((true, running::page(state, frame))),
        "/console/upstreams" => health::page(state, frame, query.get("window"))
            .await
            .map(|m| (true, m)),
        _ => return not_found(),
    };
    match page {
        Ok((true, markup)) => page::respond(StatusCode::OK, markup),
        Ok((false, markup)) => page::respond(StatusCode::NOT_FOUND, markup),
        Err(e) => store_failed(e),
    }
}

/// `GET /login` (the form) and `POST /login` (the token, checked; a session cookie when it is
/// the admin token). Signing in needs no CSRF token: a forged sign-in would need the admin
/// token itself, and whoever has it needs no forgery.
async fn sign_in(state: &AppState, req: Request<RequestBody>, token: &str) -> Response<ProxyBody> {
    let tls = session::over_tls(req.uri(), req.headers());
    if req.method() != Method::POST {
        return page::respond(StatusCode::OK, login_page(None));
    }
    let given = match Form::read(
        req,
        state.config.server.max_body,
        state.config.server.body_timeout,
    )
    .await
    {
        Ok(form) => form.get("token").unwrap_or_default().to_owned(),
        Err(form::Unreadable(status, m)) => return page::problem(status, "Not a sign-in form", &m),
    };
    if !session::token_ok(token, &given) {
        tracing::warn!("console sign-in refused: not the admin token");
        return page::respond(
            StatusCode::UNAUTHORIZED,
            login_page(Some("That is not the admin token.")),
        );
    }
    let session = session::new_session(token, now_ms());
    page::redirect("/", Some(session::set_cookie(Some(&session), tls)))
}

fn login_page(error: Option<&str>) -> maud::Markup {
    page::bare(
        "Sign in",
        html! {
            h1 { "idemproxy console" }
            @if let Some(e) = error { p.problem { (e) } }
            form.signin method="post" action="/login" {
                label for="token" { "Admin token (server.admin_token)" }
                input #token type="password" name="token" autocomplete="current-password" required autofocus;
                button type="submit" { "Sign in" }
            }
        },
    )
}

fn not_found() -> Response<ProxyBody> {
    page::problem(
        StatusCode::NOT_FOUND,
        "Not found",
        "The console has no such page.",
    )
}

fn store_failed(e: StoreError) -> Response<ProxyBody> {
    page::problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "The store failed",
        &format!("The store could not be read: {e}. Try again; /readyz says whether it is up."),
    )
}
