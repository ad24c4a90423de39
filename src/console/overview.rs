//! The overview: per route, over the last hour, day or week, how many requests were
//! forwarded, replayed, refused (by reason), left unknown, reconciled, released, settled by an
//! operator, and — in observe mode — what enforce mode would have done; with a chart of the
//! decisions over the window. Counts are requests, not audit rows (a row may stand for a run
//! of folded replays).

use super::chart::{self, Counts};
use super::decision::{self, Kind};
use super::page::{self, Frame, Nav};
use crate::state::AppState;
use crate::store::{now_ms, AuditCount, StoreResult};
use maud::{html, Markup};
use std::collections::BTreeMap;

/// The windows offered: their name in the query string, their label, their length in ms.
const WINDOWS: [(&str, &str, i64); 3] = [
    ("hour", "last hour", 3_600_000),
    ("day", "last day", 86_400_000),
    ("week", "last week", 7 * 86_400_000),
];

/// The window a page was asked for (`hour`, `day` or `week`; the hour when absent or unknown):
/// its name, label and length in ms. Shared by the pages that look back over a window.
pub(super) fn window(asked: Option<&str>) -> (&'static str, &'static str, i64) {
    WINDOWS
        .iter()
        .copied()
        .find(|(n, _, _)| Some(*n) == asked)
        .unwrap_or(WINDOWS[0])
}

/// The links to the other windows of the page at `path`, the current one marked.
pub(super) fn window_links(path: &str, current: &str) -> Markup {
    html! {
        nav.windows {
            @for (n, l, _) in WINDOWS {
                a class=(if n == current { "current" } else { "" }) href={ (path) "?window=" (n) } { (l) }
            }
        }
    }
}

/// Most bars in a chart: a day's minutes are drawn twelve to a bar.
const BARS: i64 = 120;

/// One route's totals.
#[derive(Default)]
struct Totals {
    kinds: Counts,
    /// Requests per refusal reason (the error type).
    refused: BTreeMap<String, i64>,
    /// Requests per `observed:<would>`.
    observed: BTreeMap<String, i64>,
}

/// The page for `window` (`hour`, `day` or `week`; the hour when absent or unknown).
pub async fn page(
    state: &AppState,
    frame: &Frame<'_>,
    window: Option<&str>,
) -> StoreResult<Markup> {
    let (name, label, length) = self::window(window);
    let now = now_ms();
    let minute = 60_000;
    let step = (length / BARS).max(minute) / minute * minute;
    // Whole buckets, the last one holding this minute.
    let from = (now / step + 1) * step - step * (length / step);
    let counts = state.store.audit_counts(from).await?;
    let routes = totals(&counts);
    let series = buckets(&counts, from, step, (length / step) as usize);
    let body = html! {
        h1 { "Overview" }
        (window_links("/console/overview", name))
        @if routes.is_empty() {
            p.empty { "No protected request in the " (label) "." }
        } @else {
            table.overview {
                thead { tr {
                    th { "route" }
                    @for k in Kind::ALL { th { (page::kind_badge(k, k.name())) } }
                    th { "total" }
                } }
                tbody {
                    @for (route, t) in &routes {
                        tr data-route=(route) {
                            th { code { (route) } }
                            @for (i, k) in Kind::ALL.iter().enumerate() {
                                td class=(k.name()) { (t.kinds[i]) }
                            }
                            td.total { (t.kinds.iter().sum::<i64>()) }
                        }
                        @if !t.refused.is_empty() || !t.observed.is_empty() {
                            tr.detail data-detail=(route) { td colspan=(Kind::ALL.len() + 2) {
                                @if !t.refused.is_empty() {
                                    "refused: "
                                    @for (reason, n) in &t.refused { span.reason { code { (reason) } " " (n) } " " }
                                }
                                @if !t.observed.is_empty() {
                                    "observe mode, enforce would have: "
                                    @for (would, n) in &t.observed { span.reason { code { (would) } " " (n) } " " }
                                }
                            } }
                        }
                    }
                }
            }
            h2 { "Decisions over the " (label) }
            p.hint { "Each bar is " (step / minute) @if step == minute { " minute" } @else { " minutes" } "." }
            (chart::bars(&format!("decisions per {} min, {label}", step / minute), from, step, &series))
            p.legend { @for k in Kind::ALL { (page::kind_badge(k, k.name())) " " } }
        }
    };
    Ok(page::layout(frame, Nav::Overview, "Overview", body))
}

/// Totals per route, by kind and by reason.
fn totals(counts: &[AuditCount]) -> BTreeMap<String, Totals> {
    let mut routes: BTreeMap<String, Totals> = BTreeMap::new();
    for c in counts {
        let t = routes.entry(c.route.clone()).or_default();
        let kind = decision::kind(&c.decision);
        t.kinds[index(kind)] += c.requests;
        match kind {
            Kind::Refused => *t.refused.entry(c.decision.clone()).or_default() += c.requests,
            Kind::Observed => {
                let would = c.decision.trim_start_matches("observed:").to_owned();
                *t.observed.entry(would).or_default() += c.requests
            }
            _ => {}
        }
    }
    routes
}

/// Every route's requests per bucket and kind.
fn buckets(counts: &[AuditCount], from: i64, step: i64, n: usize) -> Vec<Counts> {
    let mut out = vec![[0; Kind::ALL.len()]; n];
    for c in counts {
        let i = (c.minute - from).div_euclid(step);
        if let Some(b) = usize::try_from(i).ok().and_then(|i| out.get_mut(i)) {
            b[index(decision::kind(&c.decision))] += c.requests;
        }
    }
    out
}

fn index(kind: Kind) -> usize {
    Kind::ALL.iter().position(|k| *k == kind).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(route: &str, decision: &str, minute: i64, requests: i64) -> AuditCount {
        AuditCount {
            route: route.into(),
            decision: decision.into(),
            minute,
            requests,
            ..Default::default()
        }
    }

    #[test]
    fn totals_by_kind_and_reason() {
        let counts = [
            count("a", "forwarded", 0, 2),
            count("a", "stale_version", 60_000, 1),
            count("a", "observed:replay", 60_000, 3),
            count("b", "replayed", 120_000, 5),
        ];
        let t = totals(&counts);
        assert_eq!(t["a"].kinds[index(Kind::Forwarded)], 2);
        assert_eq!(t["a"].refused["stale_version"], 1);
        assert_eq!(t["a"].observed["replay"], 3);
        assert_eq!(t["b"].kinds[index(Kind::Replayed)], 5);
        let b = buckets(&counts, 0, 120_000, 2);
        assert_eq!(b[0][index(Kind::Refused)], 1);
        assert_eq!(b[1][index(Kind::Replayed)], 5);
    }
}
