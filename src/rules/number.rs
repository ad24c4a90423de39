//! JSON numbers by value, not by spelling: `9801`, `9801.0`, `98.01e2` and `9.801E+3` are one
//! number, so a template that names an entity from a number names one entity whichever way a
//! client wrote it. Exact, on the decimal text (bodies keep their numbers as written, see
//! serde_json's `arbitrary_precision`): no `f64` in between, so `100000000000000000001` and
//! `100000000000000000002` stay two numbers.

/// Most digits a whole number is written out with; past it, `<digits>e<exponent>`.
const MAX_PLAIN: i64 = 64;

/// The one spelling of the number `text` (a JSON number): a whole number as its digits
/// (`9801`, `-5`, `0`); otherwise the significant digits with a decimal point (`0.5`,
/// `-12.25`); very large or very small numbers as `<digits>e<exponent>` (`1e400`, `125e-90`).
/// Text that is not a JSON number is returned as it is.
pub fn canonical(text: &str) -> String {
    parse(text).map_or_else(|| text.to_owned(), |n| n.render())
}

/// A decimal number as `sign × digits × 10^exp`, digits without leading or trailing zeros.
struct Decimal {
    negative: bool,
    digits: String,
    exp: i64,
}

fn parse(text: &str) -> Option<Decimal> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mantissa, exp) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], rest[i + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let all = format!("{int}{frac}");
    let exp = exp.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let trimmed = all.trim_start_matches('0');
    let significant = trimmed.trim_end_matches('0');
    if significant.is_empty() {
        return Some(Decimal {
            negative: false,
            digits: "0".into(),
            exp: 0,
        });
    }
    let dropped = i64::try_from(trimmed.len() - significant.len()).ok()?;
    Some(Decimal {
        negative,
        digits: significant.to_owned(),
        exp: exp.checked_add(dropped)?,
    })
}

impl Decimal {
    fn render(&self) -> String {
        let sign = if self.negative { "-" } else { "" };
        let len = self.digits.len() as i64;
        // The exponent is any i64 a client wrote: it is bounded before any arithmetic or
        // allocation depends on it.
        if (0..=MAX_PLAIN).contains(&self.exp) && len + self.exp <= MAX_PLAIN {
            return format!("{sign}{}{}", self.digits, "0".repeat(self.exp as usize));
        }
        if (-MAX_PLAIN..0).contains(&self.exp) {
            let point = len + self.exp;
            return if point > 0 {
                let (i, f) = self.digits.split_at(point as usize);
                format!("{sign}{i}.{f}")
            } else {
                format!("{sign}0.{}{}", "0".repeat((-point) as usize), self.digits)
            };
        }
        format!("{sign}{}e{}", self.digits, self.exp)
    }
}

#[cfg(test)]
mod tests {
    use super::canonical;

    #[test]
    fn one_number_one_spelling() {
        for same in [
            &[
                "9801", "9801.0", "9.801e3", "98010e-1", "9.801E+3", "0009801",
            ][..],
            &["0", "-0", "0.000", "0e10"],
            &["0.5", "5e-1", "0.50", "50E-2"],
            &["-12.25", "-1225e-2"],
            &["1e400", "10e399"],
        ] {
            for s in same {
                assert_eq!(canonical(s), canonical(same[0]), "{s} is {}", same[0]);
            }
        }
        assert_eq!(canonical("9.801e3"), "9801");
        assert_eq!(canonical("0.05"), "0.05");
        assert_eq!(canonical("1e400"), "1e400");
        assert_ne!(
            canonical("100000000000000000001"),
            canonical("100000000000000000002")
        );
        assert_ne!(canonical("0.1"), canonical("0.1000000000000000001"));
        assert_ne!(canonical("5"), canonical("-5"));
        assert_eq!(canonical("abc"), "abc");
        assert_eq!(
            canonical("1e99999999999999999999"),
            "1e99999999999999999999"
        );
        // Exponents at the ends of i64: no overflow, no allocation of their size.
        for e in [
            "1e9223372036854775807",
            "12e9223372036854775806",
            "1e-9223372036854775808",
        ] {
            assert_eq!(canonical(e), e);
        }
        assert_eq!(
            canonical("5.5e-9223372036854775807"),
            "55e-9223372036854775808"
        );
    }
}
