//! The overview's chart: decisions per time bucket, one stacked bar per bucket coloured by
//! kind, drawn on the server as inline SVG (no script, nothing fetched; the stylesheet colours
//! it by class, which the page's CSP allows).

use super::clock;
use super::decision::Kind;
use maud::{html, Markup};

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 120.0;
/// Room at the left for the scale's label.
const LEFT: f64 = 36.0;

/// Requests of each kind (in [`Kind::ALL`]'s order) within one bucket.
pub type Counts = [i64; Kind::ALL.len()];

/// Stacked bars for `buckets` (their starts `from`, `from + step`, …); `title` for readers
/// that do not see it.
pub fn bars(title: &str, from: i64, step: i64, buckets: &[Counts]) -> Markup {
    let max = buckets
        .iter()
        .map(|b| b.iter().sum::<i64>())
        .max()
        .unwrap_or(0)
        .max(1);
    let n = buckets.len().max(1) as f64;
    let slot = (WIDTH - LEFT) / n;
    let bar = (slot - 1.0).max(1.0);
    let scale = (HEIGHT - 14.0) / max as f64;
    html! {
        svg.chart viewBox={ "0 0 " (WIDTH) " " (HEIGHT) } width=(WIDTH) height=(HEIGHT)
            role="img" aria-label=(title) xmlns="http://www.w3.org/2000/svg" {
            title { (title) }
            line.axis x1=(LEFT) y1=(HEIGHT - 12.0) x2=(WIDTH) y2=(HEIGHT - 12.0) {}
            text.scale x="0" y="10" { (max) }
            text.scale x="0" y=(HEIGHT - 14.0) { "0" }
            text.scale x=(LEFT) y=(HEIGHT) { (clock::short(from)) }
            text.scale.end x=(WIDTH) y=(HEIGHT) text-anchor="end" { "now" }
            @for (i, counts) in buckets.iter().enumerate() {
                @let x = LEFT + i as f64 * slot;
                @let segments = stack(counts, scale);
                @for (kind, y, h, count) in segments {
                    rect class=(kind.name()) x=(fmt(x)) y=(fmt(y)) width=(fmt(bar)) height=(fmt(h)) {
                        title { (clock::short(from + i as i64 * step)) ": " (count) " " (kind.name()) }
                    }
                }
            }
        }
    }
}

/// Each non-empty kind's segment of one bar: its kind, top, height and count, bottom up.
fn stack(counts: &Counts, scale: f64) -> Vec<(Kind, f64, f64, i64)> {
    let mut base = HEIGHT - 12.0;
    let mut out = Vec::new();
    for (kind, &count) in Kind::ALL.iter().zip(counts.iter()) {
        if count == 0 {
            continue;
        }
        let h = (count as f64 * scale).max(1.0);
        base -= h;
        out.push((*kind, base, h, count));
    }
    out
}

/// A coordinate with two decimals: short attributes, exact enough for a screen.
fn fmt(v: f64) -> String {
    format!("{v:.2}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacks_bottom_up() {
        let mut c: Counts = [0; Kind::ALL.len()];
        c[0] = 2;
        c[2] = 1;
        let s = stack(&c, 10.0);
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].0, s[0].1, s[0].2),
            (Kind::Forwarded, HEIGHT - 32.0, 20.0)
        );
        assert_eq!((s[1].0, s[1].1), (Kind::Refused, HEIGHT - 42.0));
        let svg = bars("t", 0, 60_000, &[c, [0; 8]]).into_string();
        assert_eq!(svg.matches("<rect").count(), 2, "{svg}");
    }
}
