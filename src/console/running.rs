//! `/console/running`: what this process runs — its version, the configuration file, the store,
//! the listeners, each upstream (where it sends, the hosts it claims, its mode and
//! credentials) and each route with its rules — as Traefik's and HAProxy's dashboards show
//! theirs. Read from the configuration in force (a reload shows here at once). Secrets never:
//! store passwords are masked, tokens and keys said to be set or not, the egress CA shown by
//! its certificate's fingerprint.

use super::page::{self, Frame, Nav};
use crate::state::AppState;
use maud::{html, Markup};

/// The page.
pub fn page(state: &AppState, frame: &Frame<'_>) -> Markup {
    let config = &state.config;
    let server = &config.server;
    let egress = &config.egress;
    let set = |b: bool| if b { "set" } else { "none" };
    let ca = egress.listen.map(|_| crate::ca::identity(&egress.ca_cert));
    let body = html! {
        h1 { "Running" }
        dl.running {
            dt { "version" } dd { code { (env!("CARGO_PKG_VERSION")) } }
            dt { "configuration" } dd { code { (config.source.as_ref().map_or(config.origin.clone(), |p| p.display().to_string())) } }
            dt { "store" } dd { code { (config.store.display_url()) } " · " (state.store.backend()) " · " (config.store.encryption_summary()) }
            dt { "retention, lease" } dd { (crate::config::units::show_duration(config.store.retention)) ", " (crate::config::units::show_duration(config.store.lease)) }
        }
        h2 { "Listeners" }
        table.running {
            thead { tr { th { "listener" } th { "address (as configured)" } th { "serves" } } }
            tbody {
                tr { td { "main" } td { code { (server.listen) } } td { "/<prefix>/… of each upstream" @if server.tls.is_some() { ", over TLS" } } }
                @if let Some(a) = server.admin_listen {
                    tr { td { "admin" } td { code { (a) } } td { "health, metrics, the admin API and this console; admin token " (set(server.admin_token.is_some())) } }
                }
                @for u in config.upstreams.iter().filter(|u| u.listen.is_some()) {
                    tr { td { "upstream " code { (u.name) } } td { code { (u.listen.map(|a| a.to_string()).unwrap_or_default()) } } td { "every path to " code { (u.name) } } }
                }
                @match egress.listen {
                    Some(a) => tr { td { "egress" } td { code { (a) } } td { "HTTPS_PROXY for the hosts below; proxy token " (set(egress.proxy_token.is_some())) } },
                    None => tr { td { "egress" } td.none { "off" } td { "set egress.listen to serve clients whose API host is fixed" } },
                }
            }
        }
        @if let Some(ca) = ca {
            h3 { "Egress CA" }
            dl.running {
                dt { "certificate" } dd { code { (egress.ca_cert.display()) } }
                @match ca {
                    Ok((fingerprint, expires)) => {
                        dt { "SHA-256" } dd { code { (fingerprint) } }
                        dt { "expires" } dd { (expires) }
                    }
                    Err(e) => { dt { "problem" } dd.problem { (format!("{e:#}")) } }
                }
                dt { "tunnels" } dd { @if egress.tunnel.is_empty() { span.none { "none" } } @else { code { (join(egress.tunnel.iter())) } } }
            }
        }
        h2 { "Upstreams" }
        table.running {
            thead { tr { th { "upstream" } th { "sends to" } th { "prefix" } th { "hosts" } th { "mode" } th { "unmatched" } th { "credentials" } th { "idempotency header" } th { "timeout" } } }
            tbody {
                @for u in &config.upstreams {
                    tr {
                        td { code { (u.name) } }
                        td { code { (u.scheme) "://" @if u.url_host { "{host}" } @else { (u.authority) } (u.base_path) } }
                        td { code { (u.prefix.as_deref().unwrap_or("-")) } }
                        td { @if u.hosts.is_empty() { span.none { "none" } } @else { code { (join(u.hosts.iter())) } } }
                        td { (u.unmatched_route.mode.as_str()) }
                        td { (u.unmatched.as_str()) }
                        td { code { (join(u.credentials.iter())) } }
                        td { code { (u.native_idempotency_header.as_ref().map_or("-", |h| h.as_str())) } }
                        td { (crate::config::units::show_duration(u.timeout)) }
                    }
                }
            }
        }
        h2 { "Routes" }
        p.lead { "In the order they are matched; the first whose method and path match a write takes it." }
        table.running.routes {
            thead { tr { th { "route" } th { "rules" } } }
            tbody {
                @for r in &config.routes {
                    tr { td { code { (r.name) } } td { code.rules { (r.summary()) } } }
                }
            }
        }
    };
    page::layout(frame, Nav::Running, "Running", body)
}

fn join<T: std::fmt::Display>(items: impl Iterator<Item = T>) -> String {
    items.map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}
