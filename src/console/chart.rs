//! The overview's chart: decisions per time bucket, one stacked bar per bucket coloured by
//! kind, drawn on the server as inline SVG (no script, nothing fetched; the stylesheet colours
//! it by class, which the page's CSP allows).

use super::clock;
use super::decision::Kind;
use maud::{html, Markup};

const WIDTH: f64 = 1200.0;
const HEIGHT: f64 = 260.0;
/// Room at the left for the scale's labels, and below the bars for the times.
const LEFT: f64 = 48.0;
const BOTTOM: f64 = 22.0;
/// Labelled lines across the chart (besides the base).
const TICKS: i64 = 4;

/// Requests of each kind (in [`Kind::ALL`]'s order) within one bucket.
pub type Counts = [i64; Kind::ALL.len()];

/// Stacked bars for `buckets` (their starts `from`, `from + step`, …), a scale with labelled
/// lines at round numbers and times along the bottom (the page gives the legend); `title` for
/// readers that do not see it.
pub fn bars(title: &str, from: i64, step: i64, buckets: &[Counts]) -> Markup {
    let max = buckets
        .iter()
        .map(|b| b.iter().sum::<i64>())
        .max()
        .unwrap_or(0)
        .max(1);
    let tick = round_step(max, TICKS);
    let top = tick * ((max + tick - 1) / tick);
    let n = buckets.len().max(1);
    let slot = (WIDTH - LEFT) / n as f64;
    let bar = (slot - 1.0).max(1.0);
    let base = HEIGHT - BOTTOM;
    let scale = (base - 8.0) / top as f64;
    let times: Vec<usize> = (0..=4).map(|i| i * (n - 1) / 4).collect();
    html! {
        svg.chart viewBox={ "0 0 " (WIDTH) " " (HEIGHT) } width=(WIDTH) height=(HEIGHT)
            role="img" aria-label=(title) xmlns="http://www.w3.org/2000/svg" {
            title { (title) }
            @for k in 0..=(top / tick) {
                @let y = base - (k * tick) as f64 * scale;
                line.axis x1=(LEFT) y1=(fmt(y)) x2=(WIDTH) y2=(fmt(y)) {}
                text.scale x=(LEFT - 6.0) y=(fmt(y + 4.0)) text-anchor="end" { (k * tick) }
            }
            @for (i, counts) in buckets.iter().enumerate() {
                @let x = LEFT + i as f64 * slot;
                @let segments = stack(counts, scale, base);
                @for (kind, y, h, count) in segments {
                    rect class=(kind.name()) x=(fmt(x)) y=(fmt(y)) width=(fmt(bar)) height=(fmt(h)) {
                        title { (clock::short(from + i as i64 * step)) ": " (count) " " (kind.name()) }
                    }
                }
            }
            @for (j, &i) in times.iter().enumerate() {
                @let x = LEFT + i as f64 * slot + bar / 2.0;
                @let anchor = match j { 0 => "start", 4 => "end", _ => "middle" };
                text.scale x=(fmt(x)) y=(HEIGHT - 4.0) text-anchor=(anchor) {
                    @if j == 4 { "now" } @else { (clock::short(from + i as i64 * step)) }
                }
            }
        }
    }
}

/// A round step (1, 2 or 5 times a power of ten) that divides `max` into about `ticks` parts.
fn round_step(max: i64, ticks: i64) -> i64 {
    let raw = (max + ticks - 1) / ticks;
    let mut power = 1;
    while power * 10 <= raw {
        power *= 10;
    }
    [1, 2, 5, 10]
        .iter()
        .map(|m| m * power)
        .find(|s| *s >= raw)
        .unwrap_or(power * 10)
        .max(1)
}

/// Each non-empty kind's segment of one bar: its kind, top, height and count, bottom up.
fn stack(counts: &Counts, scale: f64, mut base: f64) -> Vec<(Kind, f64, f64, i64)> {
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
        let s = stack(&c, 10.0, 100.0);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].0, s[0].1, s[0].2), (Kind::Forwarded, 80.0, 20.0));
        assert_eq!((s[1].0, s[1].1), (Kind::Refused, 70.0));
        let svg = bars("t", 0, 60_000, &[c, [0; 8]]).into_string();
        assert_eq!(svg.matches("<rect").count(), 2, "{svg}");
        assert!(svg.contains("now"), "{svg}");
    }

    #[test]
    fn scales_step_in_round_numbers() {
        assert_eq!(round_step(1, 4), 1);
        assert_eq!(round_step(7, 4), 2);
        assert_eq!(round_step(37, 4), 10);
        assert_eq!(round_step(1234, 4), 500);
    }
}
