//! Times as the console shows them: UTC wall-clock text from the store's milliseconds, and
//! ages ("4m ago"). UTC, because an operator comparing replicas, logs and an upstream's
//! dashboard needs one clock; no time-zone crate for a conversion this small.

/// `2025-06-01 14:03:07.250` (UTC) from ms since the Unix epoch.
pub fn datetime(ms: i64) -> String {
    let (days, in_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    let (y, m, d) = civil(days);
    let secs = in_day / 1000;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        in_day % 1000
    )
}

/// The same time without its milliseconds, for lists where a second is close enough.
pub fn short(ms: i64) -> String {
    let mut text = datetime(ms);
    text.truncate(19);
    text
}

/// `1970-01-01T00:00:00Z`-style text for `<time datetime>`.
pub fn iso(ms: i64) -> String {
    short(ms).replacen(' ', "T", 1) + "Z"
}

/// How long ago `ms` was, from `now`: `12s`, `4m`, `3h 5m`, `2d 4h`.
pub fn age(ms: i64, now: i64) -> String {
    let s = (now - ms).max(0) / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, s / 60 % 60),
        _ => format!("{}d {}h", s / 86_400, s / 3600 % 24),
    }
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's
/// `civil_from_days`), exact for every day an `i64` of milliseconds can name.
fn civil(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc() {
        assert_eq!(datetime(0), "1970-01-01 00:00:00.000");
        // 2024-02-29 23:59:59.999 UTC: a leap day, the last millisecond.
        assert_eq!(datetime(1_709_251_199_999), "2024-02-29 23:59:59.999");
        assert_eq!(datetime(1_748_772_001_640), "2025-06-01 10:00:01.640");
        assert_eq!(iso(1_748_772_001_640), "2025-06-01T10:00:01Z");
        assert_eq!(datetime(-1), "1969-12-31 23:59:59.999");
    }

    #[test]
    fn ages() {
        assert_eq!(age(0, 59_999), "59s");
        assert_eq!(age(0, 61_000), "1m");
        assert_eq!(age(0, 3_700_000), "1h 1m");
        assert_eq!(age(0, 90_000_000), "1d 1h");
        assert_eq!(age(10, 0), "0s");
    }
}
