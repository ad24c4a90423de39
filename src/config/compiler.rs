//! The compile context: the config text and its origin for `file:line:col` messages, the
//! environment for `${VAR}`, and every error found so far. Shared by [`super::compile`] and
//! [`super::routes`].

use super::raw::Str;
use super::units::{expand_env, parse_duration};
use super::Mode;
use crate::rules::template::Template;
use http::HeaderName;
use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

pub(super) struct Compiler<'a> {
    pub(super) text: &'a str,
    pub(super) origin: &'a str,
    pub(super) env: &'a dyn Fn(&str) -> Option<String>,
    pub(super) errors: Vec<String>,
}

impl Compiler<'_> {
    pub(super) fn at(&self, span: Range<usize>) -> String {
        let upto = &self.text[..span.start.min(self.text.len())];
        let line = upto.matches('\n').count() + 1;
        let col = upto.rfind('\n').map_or(upto.len(), |i| upto.len() - i - 1) + 1;
        format!("{}:{line}:{col}", self.origin)
    }

    pub(super) fn err(&mut self, span: Range<usize>, msg: impl std::fmt::Display) {
        let at = self.at(span);
        self.errors.push(format!("{at}: {msg}"));
    }

    /// The string with `${ENV}` expanded, or `None` after recording the error.
    pub(super) fn s(&mut self, v: &Str) -> Option<String> {
        match expand_env(v.get_ref(), self.env) {
            Ok(s) => Some(s),
            Err(e) => {
                self.err(v.span(), e);
                None
            }
        }
    }

    pub(super) fn dur(&mut self, v: &Option<Str>, default: Duration) -> Duration {
        let Some(v) = v else { return default };
        let Some(s) = self.s(v) else { return default };
        parse_duration(&s).unwrap_or_else(|e| {
            self.err(v.span(), e);
            default
        })
    }

    pub(super) fn addr(&mut self, v: &Str) -> Option<SocketAddr> {
        let s = self.s(v)?;
        match s.parse() {
            Ok(a) => Some(a),
            Err(_) => {
                self.err(
                    v.span(),
                    format!("{s:?} is not an address like 127.0.0.1:8080"),
                );
                None
            }
        }
    }

    pub(super) fn header(&mut self, v: &Str) -> Option<HeaderName> {
        let s = self.s(v)?;
        HeaderName::from_bytes(s.as_bytes())
            .map_err(|_| self.err(v.span(), format!("{s:?} is not a header name")))
            .ok()
    }

    /// `mode = "enforce" | "observe"`.
    pub(super) fn mode(&mut self, v: &Str) -> Option<Mode> {
        let s = self.s(v)?;
        let mode = Mode::parse(&s);
        if mode.is_none() {
            self.err(v.span(), format!("mode = {s:?}: use enforce or observe"));
        }
        mode
    }

    pub(super) fn template(&mut self, v: &Str) -> Option<Template> {
        let s = self.s(v)?;
        Template::parse(&s).map_err(|e| self.err(v.span(), e)).ok()
    }
}
