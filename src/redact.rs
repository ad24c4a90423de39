//! URLs fit for logs and errors: a password in a store URL, in its user part or its query, is
//! masked. A leaf: it imports nothing of the crate, so the config (which shows the store URL it
//! loaded) and the store (which names the database it cannot reach) both use it.

/// A store URL fit for logs and errors: the password, if any, is masked.
pub fn redact_url(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        // Unparseable: show the scheme only, in case the rest holds a secret.
        return match url.find("://") {
            Some(i) => format!("{}://***", &url[..i]),
            None => "***".into(),
        };
    };
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some("***"));
    }
    let secret =
        |k: &str| k.eq_ignore_ascii_case("password") || k.eq_ignore_ascii_case("sslpassword");
    if parsed.query_pairs().any(|(k, _)| secret(&k)) {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret(&k) {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}
