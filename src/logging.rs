//! Logs and terminal output that an attacker cannot forge. Entity names, keys and paths come
//! from requests; a `%0a` or `%1b` in a contact id must not write a fake log line or drive the
//! operator's terminal. Every log line passes through [`EscapingWriter`], and the CLI prints
//! stored values through [`escape_controls`].

use std::borrow::Cow;
use std::io::Write;

/// The `--log-format` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

/// Logs to stderr, `RUST_LOG` filtering (default `info`), without terminal colours: a log line
/// holds no escape sequence of ours, so any other is escaped.
pub fn init(format: Format) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(|| EscapingWriter(std::io::stderr()));
    match format {
        Format::Text => builder.init(),
        Format::Json => builder.json().init(),
    }
}

/// Control characters in `s` (C0, DEL, C1) as `\n`, `\t`, `\x1b` or `\u{9b}`; with
/// `keep_newlines`, line feeds stay (for multi-line output whose lines we made).
pub fn escape_controls(s: &str, keep_newlines: bool) -> Cow<'_, str> {
    let needs = |c: char| c.is_control() && !(keep_newlines && c == '\n');
    if !s.chars().any(needs) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            c if !needs(c) => out.push(c),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x80 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    Cow::Owned(out)
}

/// Writes each formatted log record with its control characters escaped, all but the line
/// feed that ends it. The formatter hands over one whole record per write.
pub struct EscapingWriter<W: Write>(pub W);

impl<W: Write> Write for EscapingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        let (body, end) = match text.strip_suffix('\n') {
            Some(body) => (body, "\n"),
            None => (&*text, ""),
        };
        let escaped = escape_controls(body, false);
        self.0.write_all(escaped.as_bytes())?;
        self.0.write_all(end.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forged_lines_and_escapes_are_neutralised() {
        assert_eq!(escape_controls("contact:1", false), "contact:1");
        assert_eq!(
            escape_controls("a\nINFO forged\x1b[2J\u{9b}", false),
            "a\\nINFO forged\\x1b[2J\\u{9b}"
        );
        assert_eq!(escape_controls("a\nb", true), "a\nb");
        let mut out = EscapingWriter(Vec::new());
        out.write_all(b"level=info entity=\"x\ny\x1b\"\n").unwrap();
        assert_eq!(out.0, b"level=info entity=\"x\\ny\\x1b\"\n");
    }
}
