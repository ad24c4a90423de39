//! Request bodies as rules see them: JSON, or forms in Stripe's bracket notation.
//!
//! A form `metadata[order_id]=7&items[0][id]=a` reads as the JSON
//! `{"metadata": {"order_id": "7"}, "items": [{"id": "a"}]}`, so one [`BodyPath`] language
//! (`body.metadata.order_id`, `body.items[*].id`) serves both.

use http::HeaderMap;
use serde_json::{Map, Value};
use std::fmt;

/// How a body is read, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Json,
    Form,
    /// Anything else: only its raw bytes matter (fingerprint).
    Raw,
}

impl BodyKind {
    pub fn of(headers: &HeaderMap) -> BodyKind {
        let Some(ct) = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
        else {
            return BodyKind::Raw;
        };
        let mime = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if mime == "application/json" || mime.ends_with("+json") {
            BodyKind::Json
        } else if mime == "application/x-www-form-urlencoded" {
            BodyKind::Form
        } else {
            BodyKind::Raw
        }
    }
}

/// One step of a body path.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Key(String),
    Index(usize),
    /// `[*]`: every element of an array.
    All,
}

/// A path into a body: `a.b`, `items[*].id`, `items[0]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BodyPath(pub Vec<Step>);

impl BodyPath {
    pub fn parse(s: &str) -> Result<BodyPath, String> {
        let mut steps = Vec::new();
        for seg in s.split('.') {
            let (name, mut rest) = match seg.find('[') {
                Some(i) => (&seg[..i], &seg[i..]),
                None => (seg, ""),
            };
            if name.is_empty() && (steps.is_empty() || rest.is_empty()) {
                return Err(format!("body path {s:?} has an empty segment"));
            }
            if !name.is_empty() {
                steps.push(Step::Key(name.to_owned()));
            }
            while !rest.is_empty() {
                let close = rest
                    .find(']')
                    .filter(|_| rest.starts_with('['))
                    .ok_or_else(|| format!("body path {s:?}: bad [...]"))?;
                let idx = &rest[1..close];
                steps.push(if idx == "*" {
                    Step::All
                } else {
                    Step::Index(
                        idx.parse().map_err(|_| {
                            format!("body path {s:?}: [{idx}] is not an index or *")
                        })?,
                    )
                });
                rest = &rest[close + 1..];
            }
        }
        Ok(BodyPath(steps))
    }

    /// Every value the path reaches.
    pub fn values<'v>(&self, root: &'v Value) -> Vec<&'v Value> {
        let mut cur = vec![root];
        for step in &self.0 {
            cur = cur
                .into_iter()
                .flat_map(|v| -> Vec<&Value> {
                    match (step, v) {
                        (Step::Key(k), Value::Object(m)) => m.get(k).into_iter().collect(),
                        (Step::Index(i), Value::Array(a)) => a.get(*i).into_iter().collect(),
                        (Step::All, Value::Array(a)) => a.iter().collect(),
                        _ => Vec::new(),
                    }
                })
                .collect();
        }
        cur
    }

    /// The values as template strings; `null` counts as missing.
    pub fn strings(&self, root: &Value) -> Vec<String> {
        self.values(root)
            .into_iter()
            .filter_map(|v| match v {
                Value::Null => None,
                Value::String(s) => Some(s.clone()),
                // One number, one name, however it is written: `9801`, `9801.0`, `9.801e3`.
                Value::Number(n) => Some(crate::rules::number::canonical(&n.to_string())),
                other => Some(other.to_string()),
            })
            .collect()
    }

    /// Whether [`BodyPath::set`] would succeed on `root`, without changing (or copying) it:
    /// every step reaches an object (a missing key is made) or an array index that exists.
    pub fn settable(&self, root: &Value) -> bool {
        let Some((last, init)) = self.0.split_last() else {
            return false;
        };
        let mut cur = root;
        for (n, step) in init.iter().enumerate() {
            cur = match (step, cur) {
                (Step::Key(k), Value::Object(m)) => match m.get(k) {
                    Some(v) => v,
                    // Made as an empty object: the rest of the path must be keys.
                    None => return self.0[n + 1..].iter().all(|s| matches!(s, Step::Key(_))),
                },
                (Step::Index(i), Value::Array(a)) => match a.get(*i) {
                    Some(v) => v,
                    None => return false,
                },
                _ => return false,
            };
        }
        match (last, cur) {
            (Step::Key(_), Value::Object(_)) => true,
            (Step::Index(i), Value::Array(a)) => *i < a.len(),
            _ => false,
        }
    }

    /// Sets the one value the path names, making the objects on its way (a route's `stamp`).
    /// `false` when it cannot: a step meets something other than an object, or an index
    /// past the end, or `[*]` (load refuses stamps through `[*]`).
    pub fn set(&self, root: &mut Value, value: Value) -> bool {
        let Some((last, init)) = self.0.split_last() else {
            return false;
        };
        let mut cur = root;
        for step in init {
            cur = match (step, cur) {
                (Step::Key(k), Value::Object(m)) => m
                    .entry(k.clone())
                    .or_insert_with(|| Value::Object(Default::default())),
                (Step::Index(i), Value::Array(a)) => match a.get_mut(*i) {
                    Some(v) => v,
                    None => return false,
                },
                _ => return false,
            };
        }
        match (last, cur) {
            (Step::Key(k), Value::Object(m)) => {
                m.insert(k.clone(), value);
                true
            }
            (Step::Index(i), Value::Array(a)) if *i < a.len() => {
                a[*i] = value;
                true
            }
            _ => false,
        }
    }

    /// Removes what the path reaches (for `fingerprint.ignore`).
    pub fn remove(&self, root: &mut Value) {
        remove_at(root, &self.0);
    }
}

fn remove_at(v: &mut Value, steps: &[Step]) {
    let Some((first, rest)) = steps.split_first() else {
        return;
    };
    match (first, v) {
        (Step::Key(k), Value::Object(m)) if rest.is_empty() => {
            m.remove(k);
        }
        (Step::Key(k), Value::Object(m)) => {
            if let Some(child) = m.get_mut(k) {
                remove_at(child, rest);
            }
        }
        (Step::Index(i), Value::Array(a)) if rest.is_empty() && *i < a.len() => {
            a[*i] = Value::Null;
        }
        (Step::Index(i), Value::Array(a)) => {
            if let Some(child) = a.get_mut(*i) {
                remove_at(child, rest);
            }
        }
        (Step::All, Value::Array(a)) if rest.is_empty() => a.clear(),
        (Step::All, Value::Array(a)) => a.iter_mut().for_each(|c| remove_at(c, rest)),
        _ => {}
    }
}

impl fmt::Display for BodyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            match s {
                Step::Key(k) if i == 0 => write!(f, "{k}")?,
                Step::Key(k) => write!(f, ".{k}")?,
                Step::Index(n) => write!(f, "[{n}]")?,
                Step::All => write!(f, "[*]")?,
            }
        }
        Ok(())
    }
}

/// Parses a body of `kind`; `Ok(None)` for raw bodies, `Err` when it claims to be JSON or a
/// form but is not.
pub fn parse(kind: BodyKind, bytes: &[u8]) -> Result<Option<Value>, String> {
    match kind {
        BodyKind::Raw => Ok(None),
        BodyKind::Json if bytes.iter().all(u8::is_ascii_whitespace) => Ok(Some(Value::Null)),
        BodyKind::Json => serde_json::from_slice(bytes)
            .map(Some)
            .map_err(|e| format!("the body is not valid JSON: {e}")),
        BodyKind::Form => parse_form(bytes).map(Some),
    }
}

/// The name of a form field as a path: `metadata[order_id]` → `["metadata", "order_id"]`.
pub fn form_name_steps(name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (head, mut rest) = match name.find('[') {
        Some(i) if name.ends_with(']') => (&name[..i], &name[i..]),
        _ => return vec![name.to_owned()],
    };
    out.push(head.to_owned());
    while let Some(stripped) = rest.strip_prefix('[') {
        let Some(end) = stripped.find(']') else { break };
        out.push(stripped[..end].to_owned());
        rest = &stripped[end + 1..];
    }
    out
}

/// Deepest `a[b][c]...` nesting accepted in a form field name.
pub const MAX_FORM_DEPTH: usize = 32;

fn parse_form(bytes: &[u8]) -> Result<Value, String> {
    // Decoded without loss: a field whose bytes are not text is refused, never read as
    // U+FFFD (two customers would then be one).
    let pairs =
        crate::rules::urlencoded::text_pairs(bytes).map_err(|e| format!("the form body: {e}"))?;
    let mut root = Value::Object(Map::new());
    for (name, value) in pairs {
        let steps = form_name_steps(&name);
        // The tree is built recursively: a bound on nesting keeps hostile names from
        // exhausting the stack (Stripe's own forms nest a handful of levels).
        if steps.len() > MAX_FORM_DEPTH {
            return Err(format!(
                "form field {:.40}... nests deeper than {MAX_FORM_DEPTH} levels",
                name
            ));
        }
        insert_form(&mut root, &steps, Value::String(value));
    }
    Ok(arrays_from_indices(root))
}

fn insert_form(node: &mut Value, steps: &[String], value: Value) {
    let Some((first, rest)) = steps.split_first() else {
        return;
    };
    if first.is_empty() {
        // `expand[]=a`: append to an array.
        if !node.is_array() {
            *node = Value::Array(Vec::new());
        }
        if let Value::Array(a) = node {
            if rest.is_empty() {
                a.push(value);
            } else {
                a.push(Value::Object(Map::new()));
                if let Some(last) = a.last_mut() {
                    insert_form(last, rest, value);
                }
            }
        }
        return;
    }
    if !node.is_object() {
        *node = Value::Object(Map::new());
    }
    if let Value::Object(m) = node {
        if rest.is_empty() {
            m.insert(first.clone(), value);
        } else {
            let child = m
                .entry(first.clone())
                .or_insert_with(|| Value::Object(Map::new()));
            insert_form(child, rest, value);
        }
    }
}

/// Objects whose keys are all indices (`items[0]`, `items[1]`) become arrays in index order.
fn arrays_from_indices(v: Value) -> Value {
    match v {
        Value::Object(m) => {
            let all_idx = !m.is_empty() && m.keys().all(|k| k.parse::<usize>().is_ok());
            let mut converted: Vec<(String, Value)> = m
                .into_iter()
                .map(|(k, v)| (k, arrays_from_indices(v)))
                .collect();
            if all_idx {
                converted.sort_by_key(|(k, _)| k.parse::<usize>().unwrap_or(usize::MAX));
                Value::Array(converted.into_iter().map(|(_, v)| v).collect())
            } else {
                Value::Object(converted.into_iter().collect())
            }
        }
        Value::Array(a) => Value::Array(a.into_iter().map(arrays_from_indices).collect()),
        other => other,
    }
}

#[cfg(test)]
#[path = "body_tests.rs"]
mod tests;
