//! The compiled types of one route (`[[routes]]`): its mode, key rule, prechecks, reconcile
//! and what in-flight duplicates get — what the pipeline reads per request.

use super::*;

/// What the proxy does with a protected request (SPEC "Observe mode").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Keys, locks, checks: duplicates are replayed, conflicts refused.
    #[default]
    Enforce,
    /// Everything is forwarded as is; what enforce mode would have done is recorded.
    Observe,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Observe => "observe",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "enforce" => Some(Mode::Enforce),
            "observe" => Some(Mode::Observe),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    Wait,
    Reject,
}

#[derive(Debug)]
pub struct KeyRule {
    /// `None` when `header = ""`: client keys are ignored.
    pub header: Option<HeaderName>,
    /// Tried in order: the first template whose every field the request has makes the key
    /// (a workflow engine's run id when it sends one, else the intent alone). Empty: no
    /// derivation.
    pub derive: Vec<Template>,
    pub required: bool,
    /// How long a key derived from the intent alone (a template that reads no header) stays
    /// a retry: an identical call within it gets the first answer, one after it is a new
    /// action. `None`: the route's retention. Keys from a client header or a run id keep
    /// the retention.
    pub window: Option<Duration>,
}

impl KeyRule {
    /// The `{fingerprint}` default of a route without `key.derive`.
    pub fn default_derive() -> Vec<Template> {
        Template::parse("{fingerprint}").into_iter().collect()
    }
}

#[derive(Debug)]
pub struct Precheck {
    pub method: Method,
    pub path: Template,
    pub expect_status: Vec<u16>,
    /// `body.status` = "free": a body path and the JSON value it must hold.
    pub expect: Vec<(BodyPath, serde_json::Value)>,
}

/// SPEC "Reconciling unknown outcomes": how to ask the real system whether a write whose
/// answer was lost happened, so a retry gets the object instead of `409 outcome_unknown`.
#[derive(Debug)]
pub struct Reconcile {
    pub method: Method,
    /// A template over the original request.
    pub path: Template,
    pub found: Vec<u16>,
    pub not_found: Vec<u16>,
    /// The status a found write is answered (and replayed) with, when not the read's own: a
    /// create's client may accept only `201` (@hubspot/api-client does).
    pub answer_status: Option<u16>,
    /// How long to wait before the read (and the least time between two reads of one key).
    pub after: Duration,
    /// Body fields a `found` answer must hold, else it counts as `not_found`.
    pub expect: Vec<(BodyPath, Expected)>,
    /// The body a found write is answered with, when the read's own is not what the write
    /// answers (a list read by `external_id` for a create that answers one object): JSON in
    /// which a string `"{read}"` is the read's body and `"{read.X}"` its field `X`. A field
    /// the read lacks counts as `not_found` (an empty list found nothing).
    pub answer: Option<serde_json::Value>,
    /// A second read, sent once the first found the write, whose body is the answer (shaped
    /// by `answer` when set): the read that can tell (a ticket's audits, by the stamp the
    /// update carried) is not the object the write answers with (the ticket).
    pub answer_path: Option<Template>,
    /// Body fields that, when a request has one, leave its lost answer unreconciled (it stays
    /// unknown): a ticket update that adds a comment is not "found" by reading the ticket,
    /// and sending it again would add the comment twice.
    pub unless: Vec<BodyPath>,
}

/// An expected value: as written, or a template over the original request.
#[derive(Debug)]
pub enum Expected {
    Value(serde_json::Value),
    Template(Template),
    /// Exactly one body field (`"{body.properties}"`): its JSON value, objects too, less the
    /// parts `fingerprint.ignore` leaves out (`strip`, relative to the field), so every retry
    /// of the write asks the same question.
    Field {
        path: BodyPath,
        strip: Vec<BodyPath>,
    },
}

#[derive(Debug)]
pub struct Route {
    pub name: String,
    pub upstream: String,
    pub methods: Vec<Method>,
    pub path_text: String,
    pub path: PathPattern,
    pub entity: Option<Template>,
    pub key: KeyRule,
    pub in_flight: InFlight,
    /// The route's own `mode`, else its upstream's, else enforce.
    pub mode: Mode,
    pub lock_timeout: Duration,
    pub fingerprint: FingerprintRule,
    pub version: Option<Template>,
    /// Claim-first: the first key to succeed owns the entities for this long.
    pub claim: Option<Duration>,
    pub release_claim: bool,
    pub precheck: Option<Precheck>,
    pub reconcile: Option<Reconcile>,
    /// How long a completed key stays replayable: the route's, else `store.retention`
    /// (resolved at load).
    pub retention: Duration,
    /// Some template or rule reads the body: it must parse.
    pub needs_body: bool,
    /// A read sent as POST (a search, a batch read): never keyed, locked or recorded;
    /// streamed through like a GET.
    pub read_only: bool,
    /// The body field this route writes its stamp into before forwarding (`stamp =
    /// "body.ticket.external_id"`): a value made from the scoped key and its action, so a
    /// reconcile read can find the object by it (`{stamp}` in `reconcile.path`) where the API
    /// has no other consistent read for a create.
    pub stamp: Option<BodyPath>,
    /// The upstream applies this write idempotently (the same association created twice is
    /// one; an upsert by email sets the same values): after an unknown outcome a retry is
    /// sent again with the same key, as to an upstream that dedupes by its own header.
    pub resend_unknown: bool,
}

impl Route {
    /// The implicit route of `unmatched = "protect"`.
    pub fn unmatched(upstream: &str, retention: Duration, mode: Mode) -> Route {
        Route {
            name: format!("{upstream}:unmatched"),
            upstream: upstream.to_owned(),
            methods: Config::DEFAULT_METHODS.to_vec(),
            path_text: "/{*path}".into(),
            path: PathPattern::parse("/{*path}")
                .unwrap_or_else(|_| unreachable!("constant pattern")),
            entity: None,
            key: KeyRule {
                header: Some(HeaderName::from_static("idempotency-key")),
                derive: KeyRule::default_derive(),
                required: true,
                window: None,
            },
            in_flight: InFlight::Wait,
            mode,
            lock_timeout: Duration::from_secs(30),
            fingerprint: FingerprintRule::default(),
            version: None,
            claim: None,
            release_claim: false,
            precheck: None,
            reconcile: None,
            retention,
            needs_body: false,
            read_only: false,
            stamp: None,
            resend_unknown: false,
        }
    }

    /// One line for `idemproxy check`.
    pub fn summary(&self) -> String {
        let methods: Vec<&str> = self.methods.iter().map(|m| m.as_str()).collect();
        if self.read_only {
            return format!(
                "{}: upstream={} methods={} path={} key=none read_only (streamed; never keyed, locked or replayed)",
                self.name,
                self.upstream,
                methods.join(","),
                self.path_text
            );
        }
        let derive: Vec<&str> = self.key.derive.iter().map(|d| d.text()).collect();
        let derive = derive.join(", else ");
        let mut key = match (&self.key.header, derive.is_empty()) {
            (Some(h), false) => format!("header {h}, else derive {derive}"),
            (Some(h), true) => format!("header {h}"),
            (None, false) => format!("derive {derive}"),
            (None, true) => "none".into(),
        };
        if let Some(w) = self.key.window {
            let w = units::show_duration(w);
            key.push_str(&format!("; intent-only keys a retry within {w}"));
        }
        let required = if self.key.required {
            "required"
        } else {
            "optional"
        };
        let mut reconcile = match &self.reconcile {
            Some(rc) => match &rc.answer_path {
                Some(a) => format!(
                    " reconcile={} {} then {}",
                    rc.method,
                    rc.path.text(),
                    a.text()
                ),
                None => format!(" reconcile={} {}", rc.method, rc.path.text()),
            },
            None => String::new(),
        };
        if let Some(rc) = self.reconcile.as_ref().filter(|rc| !rc.unless.is_empty()) {
            let unless: Vec<String> = rc.unless.iter().map(|p| format!("body.{p}")).collect();
            reconcile.push_str(&format!(" unless {}", unless.join(",")));
        }
        if let Some(field) = &self.stamp {
            reconcile.push_str(&format!(" stamp=body.{field}"));
        }
        if self.resend_unknown {
            reconcile.push_str(" resend_unknown");
        }
        format!(
            "{}: upstream={} methods={} path={} entity={} key=[{key}] ({required}) in_flight={} mode={}{reconcile}",
            self.name,
            self.upstream,
            methods.join(","),
            self.path_text,
            self.entity.as_ref().map(|t| t.text()).unwrap_or("-"),
            self.in_flight.as_str(),
            self.mode.as_str()
        )
    }
}
