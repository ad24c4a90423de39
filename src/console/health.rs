//! `/console/upstreams?window=…`: each upstream's health over the last hour, day or week, from
//! the audit trail — its answers by status class, the calls that never reached it or got no
//! answer (unknown outcomes), and how long it took to answer — and the same in six slices of
//! the window, so a bad hour shows as one.

use super::page::{self, Frame, Nav};
use crate::state::AppState;
use crate::store::{now_ms, AuditCount, StoreResult};
use maud::{html, Markup};
use std::collections::BTreeMap;

/// Slices of the window shown one by one.
const SLICES: i64 = 6;

/// One upstream's calls over a stretch of time.
#[derive(Default, Clone)]
struct Health {
    /// Answers by status class: 1xx … 5xx.
    classes: [i64; 5],
    /// Sent, and no complete answer (unknown outcomes).
    unknown: i64,
    /// Never sent: connect, DNS or TLS failed.
    unreachable: i64,
    timed: i64,
    ms: i64,
    max_ms: i64,
}

impl Health {
    fn add(&mut self, c: &AuditCount) {
        if let Some(n) = usize::try_from(c.class - 1)
            .ok()
            .and_then(|i| self.classes.get_mut(i))
        {
            *n += c.requests;
        }
        match c.decision.as_str() {
            "unknown" => self.unknown += c.requests,
            "upstream_unreachable" => self.unreachable += c.requests,
            _ => {}
        }
        self.timed += c.timed;
        self.ms += c.upstream_ms;
        self.max_ms = self.max_ms.max(c.upstream_max_ms);
    }

    fn answered(&self) -> i64 {
        self.classes.iter().sum()
    }
}

/// The page for `window` (`hour`, `day` or `week`; the hour when absent or unknown).
pub async fn page(
    state: &AppState,
    frame: &Frame<'_>,
    window: Option<&str>,
) -> StoreResult<Markup> {
    let (name, label, length) = super::overview::window(window);
    let now = now_ms();
    let from = now - length;
    let counts = state.store.audit_counts(from).await?;
    let upstream_of: BTreeMap<&str, &str> = state
        .config
        .upstreams
        .iter()
        .flat_map(|u| {
            u.routes
                .iter()
                .map(|r| (r.name.as_str(), u.name.as_str()))
                .chain(std::iter::once((
                    u.unmatched_route.name.as_str(),
                    u.name.as_str(),
                )))
        })
        .collect();
    let slice = length / SLICES;
    let mut totals: BTreeMap<String, Health> = BTreeMap::new();
    let mut slices: BTreeMap<String, Vec<Health>> = BTreeMap::new();
    for u in &state.config.upstreams {
        totals.insert(u.name.clone(), Health::default());
        slices.insert(u.name.clone(), vec![Health::default(); SLICES as usize]);
    }
    for c in &counts {
        let Some(up) = upstream_of.get(c.route.as_str()) else {
            continue;
        };
        if let Some(t) = totals.get_mut(*up) {
            t.add(c);
        }
        let i = ((c.minute - from).max(0) / slice.max(1)).min(SLICES - 1) as usize;
        if let Some(h) = slices.get_mut(*up).and_then(|s| s.get_mut(i)) {
            h.add(c);
        }
    }
    let pacing = pacing(state);
    let body = html! {
        h1 { "Upstreams" }
        (super::overview::window_links("/console/upstreams", name))
        (pacing)
        p.lead { "What each API answered over the " (label) ", from the audit trail: answers by status, calls sent and left without an answer (unknown outcomes), calls never sent (unreachable), and the upstream's time." }
        table.health {
            thead { tr { th { "upstream" } th { "2xx" } th { "3xx" } th { "4xx" } th { "5xx" } th { "unknown" } th { "unreachable" } th { "mean ms" } th { "max ms" } } }
            tbody {
                @for (up, h) in &totals {
                    (row(up, h))
                }
            }
        }
        h2 { "In six slices of the " (label) }
        @for (up, parts) in &slices {
            h3 { code { (up) } }
            table.health {
                thead { tr { th { "from" } th { "answered" } th { "5xx" } th { "unknown" } th { "unreachable" } th { "mean ms" } th { "max ms" } } }
                tbody {
                    @for (i, h) in parts.iter().enumerate() {
                        tr data-upstream=(up) {
                            td.at { (page::when(from + i as i64 * slice, None)) }
                            td { (h.answered()) }
                            td class=(if h.classes[4] > 0 { "bad" } else { "" }) { (h.classes[4]) }
                            td class=(if h.unknown > 0 { "bad" } else { "" }) { (h.unknown) }
                            td class=(if h.unreachable > 0 { "bad" } else { "" }) { (h.unreachable) }
                            td { (mean(h)) }
                            td { (h.max_ms) }
                        }
                    }
                }
            }
        }
    };
    Ok(page::layout(frame, Nav::Upstreams, "Upstreams", body))
}

/// Each paced upstream's budget, and what waits for it now.
fn pacing(state: &AppState) -> Markup {
    let load: BTreeMap<String, (usize, usize)> = state
        .pacer
        .load()
        .into_iter()
        .map(|(up, queued, paused)| (up, (queued, paused)))
        .collect();
    let paced: Vec<_> = state
        .config
        .upstreams
        .iter()
        .filter(|u| u.pace.is_some())
        .collect();
    let show = crate::config::units::show_duration;
    html! {
        @if !paced.is_empty() {
            h2 { "Rate limits, now" }
            table.health {
                thead { tr { th { "upstream" } th { "budget per account" } th { "longest wait" } th { "waiting" } th { "paused accounts" } } }
                tbody {
                    @for u in &paced {
                        @let (queued, paused) = load.get(&u.name).copied().unwrap_or_default();
                        @if let Some(b) = &u.pace {
                            tr data-pace=(u.name) {
                                td { code { (u.name) } }
                                td { (b.rate.limit) " per " (show(b.rate.per)) ", " (b.rate.burst) " at once" }
                                td { (show(b.max_wait)) }
                                td class=(if queued > 0 { "bad" } else { "" }) { (queued) }
                                td class=(if paused > 0 { "bad" } else { "" }) { (paused) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn row(up: &str, h: &Health) -> Markup {
    html! {
        tr data-upstream=(up) {
            td { code { (up) } }
            @for (i, n) in h.classes.iter().enumerate().skip(1) {
                td class=(if i == 4 && *n > 0 { "bad" } else { "" }) { (n) }
            }
            td class=(if h.unknown > 0 { "bad" } else { "" }) { (h.unknown) }
            td class=(if h.unreachable > 0 { "bad" } else { "" }) { (h.unreachable) }
            td { (mean(h)) }
            td { (h.max_ms) }
        }
    }
}

/// The mean upstream time, or a dash when nothing was timed.
fn mean(h: &Health) -> String {
    match h.timed {
        0 => "-".into(),
        n => (h.ms / n).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_answers_by_class_and_the_lost_ones() {
        let mut h = Health::default();
        let c = |decision: &str, class, requests, ms| AuditCount {
            decision: decision.into(),
            class,
            requests,
            timed: requests,
            upstream_ms: ms,
            upstream_max_ms: ms,
            ..Default::default()
        };
        h.add(&c("forwarded", 2, 3, 30));
        h.add(&c("released", 5, 1, 90));
        h.add(&c("unknown", 0, 2, 0));
        h.add(&c("upstream_unreachable", 0, 1, 0));
        assert_eq!((h.classes[1], h.classes[4], h.answered()), (3, 1, 4));
        assert_eq!((h.unknown, h.unreachable, h.max_ms), (2, 1, 90));
        assert_eq!(mean(&h), "17");
    }
}
