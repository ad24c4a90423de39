//! Templates such as `customer:{body.customer}` or `{header.x-workflow-id}:{entity}`.
//!
//! Parsed once at config load into [`Template`]; evaluated per request against a
//! [`RequestView`]. A template that names a missing field fails the request (never a silent
//! fallback), and a `[*]` step yields several values (one entity each).

use crate::rules::body::BodyPath;
use http::{HeaderMap, HeaderName};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde_json::Value;

/// What a value substituted into a URL keeps as is: the unreserved characters of RFC 3986.
/// Everything else (`/`, `?`, `#`, `%`, spaces...) is percent-encoded, so a value stays data.
const URL_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Where a template variable reads from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Path(String),
    Query(String),
    Header(HeaderName),
    Body(BodyPath),
    Route,
    Method,
    Entity,
    Fingerprint,
    /// `{stamp}`: the value a stamped route writes into the body (see `Route::stamp`). Known
    /// only once the key is reserved, so it is kept as written, unencoded, and filled in by
    /// the reconcile read (request values are always percent-encoded: `{` never comes from
    /// them). Only `reconcile.path` may use it.
    Stamp,
}

/// What `{stamp}` evaluates to until the stamp is known.
pub const STAMP_MARK: &str = "{stamp}";

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Lit(String),
    Var(Source),
}

/// Most values one template may produce (the product of its multi-valued parts).
pub const MAX_VALUES: usize = 1_000;

/// A parsed template.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
    text: String,
}

/// The request as templates see it. Borrowed: building one costs nothing.
pub struct RequestView<'a> {
    pub method: &'a str,
    pub path_params: &'a [(String, String)],
    pub query: &'a [(String, String)],
    pub headers: &'a HeaderMap,
    /// The parsed body (JSON or form); `None` when it is neither.
    pub body: Option<&'a Value>,
    pub route: &'a str,
    /// The request's entities joined by `,`, once known.
    pub entity: Option<&'a str>,
    pub fingerprint: Option<&'a str>,
}

impl Template {
    /// Parses `text`; `{` and `}` delimit variables (`{{` / `}}` are literal braces).
    pub fn parse(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut chars = text.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|p| p.1) == Some('{') => {
                    chars.next();
                    lit.push('{');
                }
                '}' if chars.peek().map(|p| p.1) == Some('}') => {
                    chars.next();
                    lit.push('}');
                }
                '{' => {
                    let rest = &text[i + 1..];
                    let end = rest
                        .find('}')
                        .ok_or_else(|| format!("unclosed '{{' in template {text:?}"))?;
                    let var = &rest[..end];
                    if !lit.is_empty() {
                        parts.push(Part::Lit(std::mem::take(&mut lit)));
                    }
                    parts.push(Part::Var(parse_source(var)?));
                    for _ in 0..var.chars().count() + 1 {
                        chars.next();
                    }
                }
                '}' => return Err(format!("unmatched '}}' in template {text:?}")),
                c => lit.push(c),
            }
        }
        if !lit.is_empty() {
            parts.push(Part::Lit(lit));
        }
        Ok(Template {
            parts,
            text: text.to_owned(),
        })
    }

    /// The template as written in the config.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every variable source of the template, for load-time checks.
    pub fn sources(&self) -> impl Iterator<Item = &Source> {
        self.parts.iter().filter_map(|p| match p {
            Part::Var(s) => Some(s),
            Part::Lit(_) => None,
        })
    }

    pub fn uses(&self, pred: impl Fn(&Source) -> bool) -> bool {
        self.sources().any(pred)
    }

    /// The body field this template is, when it is that one field and nothing else
    /// (`{body.properties}`): a reconcile expectation then takes its JSON value, objects too.
    pub fn only_body_field(&self) -> Option<&crate::rules::body::BodyPath> {
        match self.parts.as_slice() {
            [Part::Var(Source::Body(p))] => Some(p),
            _ => None,
        }
    }

    /// All values of the template (the product of multi-valued variables), or the name of the
    /// first missing field.
    pub fn eval(&self, view: &RequestView<'_>) -> Result<Vec<String>, String> {
        self.eval_with(view, false)
    }

    /// One value for a URL (a precheck path): like [`Template::eval_one`], with every
    /// variable's value percent-encoded, so `room 7` or `7?v=2` stays one path segment
    /// instead of breaking the URL or pointing at another resource.
    pub fn eval_url(&self, view: &RequestView<'_>) -> Result<String, String> {
        let mut vals = self.eval_with(view, true)?;
        vals.sort();
        vals.dedup();
        Ok(vals.join(","))
    }

    fn eval_with(&self, view: &RequestView<'_>, encode: bool) -> Result<Vec<String>, String> {
        let mut outs = vec![String::new()];
        for part in &self.parts {
            match part {
                Part::Lit(s) => outs.iter_mut().for_each(|o| o.push_str(s)),
                Part::Var(src) => {
                    let mut vals = lookup(src, view)?;
                    if encode && *src != Source::Stamp {
                        for v in &mut vals {
                            *v = utf8_percent_encode(v, URL_VALUE).to_string();
                        }
                    }
                    if vals.len() == 1 {
                        outs.iter_mut().for_each(|o| o.push_str(&vals[0]));
                    } else if outs.len().saturating_mul(vals.len()) > MAX_VALUES {
                        // Several `[*]` parts multiply: refuse before building the product.
                        return Err(format!("{} (over {MAX_VALUES} values)", source_name(src)));
                    } else {
                        outs = outs
                            .iter()
                            .flat_map(|o| vals.iter().map(move |v| format!("{o}{v}")))
                            .collect();
                    }
                }
            }
        }
        Ok(outs)
    }

    /// One value: several values are joined with `,` in sorted order.
    pub fn eval_one(&self, view: &RequestView<'_>) -> Result<String, String> {
        let mut vals = self.eval(view)?;
        vals.sort();
        vals.dedup();
        Ok(vals.join(","))
    }
}

fn parse_source(var: &str) -> Result<Source, String> {
    let (head, tail) = match var.split_once('.') {
        Some((h, t)) => (h, Some(t)),
        None => (var, None),
    };
    let need = |what: &str| {
        tail.filter(|t| !t.is_empty())
            .ok_or_else(|| format!("{{{var}}}: {what} needs a name, e.g. {{{what}.id}}"))
    };
    Ok(match head {
        "path" => Source::Path(need("path")?.to_owned()),
        "query" => Source::Query(need("query")?.to_owned()),
        "header" => {
            let name = need("header")?;
            Source::Header(
                HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
                    .map_err(|_| format!("{{{var}}}: {name:?} is not a header name"))?,
            )
        }
        "body" => Source::Body(BodyPath::parse(need("body")?)?),
        "route" | "method" | "entity" | "fingerprint" | "stamp" if tail.is_some() => {
            return Err(format!("{{{var}}}: {head} takes no field"))
        }
        "route" => Source::Route,
        "method" => Source::Method,
        "entity" => Source::Entity,
        "fingerprint" => Source::Fingerprint,
        "stamp" => Source::Stamp,
        other => {
            return Err(format!(
                "{{{var}}}: unknown source {other:?} (use path, query, header, body, route, method, entity, fingerprint or stamp)"
            ))
        }
    })
}

fn lookup(src: &Source, v: &RequestView<'_>) -> Result<Vec<String>, String> {
    let found = match src {
        Source::Path(n) => v
            .path_params
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, val)| vec![val.clone()]),
        Source::Query(n) => v
            .query
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, val)| vec![val.clone()]),
        Source::Header(n) => v
            .headers
            .get(n)
            // UTF-8 text, not only ASCII (`résa-7`); a value that is not text was refused
            // before evaluation (`pipeline::evaluate`), never read as absent.
            .and_then(|h| std::str::from_utf8(h.as_bytes()).ok())
            .map(|s| vec![s.trim().to_owned()]),
        Source::Body(p) => v.body.and_then(|b| {
            let vals = p.strings(b);
            (!vals.is_empty()).then_some(vals)
        }),
        Source::Route => Some(vec![v.route.to_owned()]),
        Source::Method => Some(vec![v.method.to_owned()]),
        Source::Entity => v.entity.map(|e| vec![e.to_owned()]),
        Source::Fingerprint => v.fingerprint.map(|f| vec![f.to_owned()]),
        Source::Stamp => Some(vec![STAMP_MARK.to_owned()]),
    };
    match found {
        Some(vals) if vals.iter().all(|s| !s.is_empty()) => Ok(vals),
        _ => Err(source_name(src)),
    }
}

/// The variable as written, for error messages.
pub fn source_name(src: &Source) -> String {
    match src {
        Source::Path(n) => format!("path.{n}"),
        Source::Query(n) => format!("query.{n}"),
        Source::Header(n) => format!("header.{n}"),
        Source::Body(p) => format!("body.{p}"),
        Source::Route => "route".into(),
        Source::Method => "method".into(),
        Source::Entity => "entity".into(),
        Source::Fingerprint => "fingerprint".into(),
        Source::Stamp => "stamp".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn view<'a>(headers: &'a HeaderMap, body: Option<&'a Value>) -> RequestView<'a> {
        RequestView {
            method: "POST",
            path_params: &[],
            query: &[],
            headers,
            body,
            route: "r",
            entity: Some("e1"),
            fingerprint: Some("fp"),
        }
    }

    #[test]
    fn parses_and_evaluates() {
        let t = Template::parse("contact:{body.inputs[*].id}").unwrap();
        let body = json!({"inputs": [{"id": "2"}, {"id": 1}]});
        let h = HeaderMap::new();
        let v = t.eval(&view(&h, Some(&body))).unwrap();
        assert_eq!(v, vec!["contact:2", "contact:1"]);
        let t = Template::parse("{header.X-Wf}:{entity}:{route}:{fingerprint}").unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-wf", "w1".parse().unwrap());
        assert_eq!(t.eval_one(&view(&h, None)).unwrap(), "w1:e1:r:fp");
    }

    /// A caller cannot forge the stamp's mark: `{stamp}` sent in a body value is encoded like
    /// any value, so only the template's own `{stamp}` is filled in by the reconcile read.
    #[test]
    fn a_stamp_mark_in_request_data_stays_encoded() {
        let t = Template::parse("/t?x={body.x}&s={stamp}").unwrap();
        let body = json!({"x": "{stamp}"});
        let h = HeaderMap::new();
        let url = t.eval_url(&view(&h, Some(&body))).unwrap();
        assert_eq!(url, "/t?x=%7Bstamp%7D&s={stamp}");
        assert_eq!(url.matches(STAMP_MARK).count(), 1);
    }

    #[test]
    fn url_values_are_percent_encoded() {
        let t = Template::parse("/slots/{body.id}?x=1").unwrap();
        let h = HeaderMap::new();
        let body = json!({"id": "room 7/b?c#d%"});
        assert_eq!(
            t.eval_url(&view(&h, Some(&body))).unwrap(),
            "/slots/room%207%2Fb%3Fc%23d%25?x=1"
        );
        let body = json!({"id": "A-1.b_c~"});
        assert_eq!(
            t.eval_url(&view(&h, Some(&body))).unwrap(),
            "/slots/A-1.b_c~?x=1"
        );
    }

    #[test]
    fn products_of_lists_are_bounded() {
        let t = Template::parse("{body.a[*]}:{body.b[*]}").unwrap();
        let list: Vec<i32> = (0..100).collect();
        let body = json!({"a": list, "b": list});
        let h = HeaderMap::new();
        assert!(t.eval(&view(&h, Some(&body))).unwrap_err().contains("over"));
        let small = json!({"a": [1, 2], "b": [3]});
        assert_eq!(t.eval(&view(&h, Some(&small))).unwrap().len(), 2);
    }

    #[test]
    fn missing_fields_are_errors() {
        let t = Template::parse("customer:{body.customer}").unwrap();
        let h = HeaderMap::new();
        assert_eq!(
            t.eval(&view(&h, Some(&json!({})))).unwrap_err(),
            "body.customer"
        );
        let t = Template::parse("{header.x-id}").unwrap();
        assert_eq!(t.eval(&view(&h, None)).unwrap_err(), "header.x-id");
    }

    #[test]
    fn bad_templates() {
        assert!(Template::parse("{nope.x}").is_err());
        assert!(Template::parse("{body.}").is_err());
        assert!(Template::parse("{path").is_err());
        assert!(Template::parse("a}b").is_err());
        assert!(Template::parse("{route.x}").is_err());
        assert_eq!(
            Template::parse("{{x}}")
                .unwrap()
                .eval_one(&view(&HeaderMap::new(), None)),
            Ok("{x}".into())
        );
    }
}
