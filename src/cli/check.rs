//! `idemproxy check`: the configuration loaded and validated as `serve` would, with the
//! warnings an operator should read before starting (credentials that scope nothing, egress
//! hosts), printed and never fatal.

use crate::config::Config;

pub(super) fn check(config: &Config) -> anyhow::Result<()> {
    println!("{}: ok", config.origin);
    println!(
        "store: {} {}",
        config.store.display_url(),
        config.store.encryption_summary()
    );
    let egress = &config.egress;
    match egress.listen {
        None => println!("egress: off"),
        Some(addr) => {
            let tunnel: Vec<String> = egress.tunnel.iter().map(|t| t.to_string()).collect();
            println!(
                "egress: listen={addr} ca={} tunnel=[{}] proxy_token={}",
                egress.ca_cert.display(),
                tunnel.join(", "),
                if egress.proxy_token.is_some() {
                    "set"
                } else {
                    "none"
                }
            );
        }
    }
    for u in &config.upstreams {
        let at = u.prefix.as_deref().unwrap_or("-");
        let hosts: Vec<String> = u.hosts.iter().map(|h| h.to_string()).collect();
        let authority = match u.url_host {
            true => "{host}".to_owned(),
            false => u.authority.to_string(),
        };
        let pace = match &u.pace {
            Some(b) => format!(
                " pace={}/{} burst={} max_wait={}",
                b.rate.limit,
                crate::config::units::show_duration(b.rate.per),
                b.rate.burst,
                crate::config::units::show_duration(b.max_wait)
            ),
            None => String::new(),
        };
        println!(
            "upstream {}: {}://{authority}{} prefix={at} hosts=[{}] unmatched={} error_format={}{pace}",
            u.name,
            u.scheme,
            u.base_path,
            hosts.join(", "),
            u.unmatched.as_str(),
            u.error_format.as_str()
        );
    }
    for r in &config.routes {
        println!("route {}", r.summary());
    }
    for w in credential_warnings(config)
        .into_iter()
        .chain(crate::config::egress::warnings(&config.upstreams))
    {
        eprintln!("warning: {w}");
    }
    Ok(())
}

/// Templates that copy credential headers into keys, entity names or versions would store
/// the credentials in clear (keys and entities are stored and shown as they are).
fn credential_warnings(config: &Config) -> Vec<String> {
    use crate::rules::template::Source;
    let mut out = Vec::new();
    for r in &config.routes {
        let extra = config
            .upstream(&r.upstream)
            .map(|u| u.scope_headers.clone())
            .unwrap_or_default();
        let used = r.key.derive.iter().map(|t| ("key.derive", t)).chain(
            [
                ("entity", r.entity.as_ref()),
                ("version", r.version.as_ref()),
            ]
            .into_iter()
            .filter_map(|(w, t)| Some((w, t?))),
        );
        for (what, t) in used {
            for src in t.sources() {
                if let Source::Header(h) = src {
                    if crate::key::is_credential(h.as_str(), &extra) {
                        out.push(format!(
                            "route {}: {what} reads {{header.{h}}}, a credential: it would be stored and shown in clear (keys are already scoped by credentials)",
                            r.name
                        ));
                    }
                }
            }
        }
    }
    out
}
