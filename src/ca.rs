//! The egress listener's certificate authority: made once by `idemproxy ca init`, read at
//! start, and a leaf certificate per intercepted host minted from it on first use and cached.
//!
//! As mitmproxy does it: every leaf shares one key pair made at start, so a new host costs one
//! signature, not a key generation; each leaf gets a fresh random serial (reused serials break
//! Firefox) and never outlives the CA.

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::ServerConfig;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use time::{Duration as Days, OffsetDateTime};

/// File names `ca init` writes in its directory.
pub const CERT_FILE: &str = "idemproxy-ca.pem";
pub const KEY_FILE: &str = "idemproxy-ca.key";

/// How long a CA made by `ca init` is valid; how long a leaf is (at most: never past the CA).
const CA_DAYS: i64 = 3650;
const LEAF_DAYS: i64 = 90;
/// A cached leaf is minted again after this long, well inside its validity.
const LEAF_REFRESH: std::time::Duration = std::time::Duration::from_secs(7 * 86_400);
/// Most leaves kept; past it one is dropped for each new one (hosts come only from upstreams'
/// `hosts`, as well-formed names).
const MAX_LEAVES: usize = 4096;

/// The CA, ready to mint leaves.
pub struct Authority {
    issuer: rcgen::Certificate,
    issuer_key: KeyPair,
    ca_der: CertificateDer<'static>,
    not_after: OffsetDateTime,
    /// The one key pair of every leaf.
    leaf_key: KeyPair,
    /// A TLS configuration per host (its leaf, ALPN `h2` and `http/1.1`), with when it was made.
    /// A std `Mutex`: held to look up or insert, never across an await.
    cache: Mutex<HashMap<String, (std::time::Instant, Arc<ServerConfig>)>>,
}

impl Authority {
    /// Reads the CA written by `idemproxy ca init`. A key that group or others can read is
    /// refused, naming the file and the `chmod` that fixes it; a missing one names `ca init`.
    pub fn load(cert: &Path, key: &Path) -> anyhow::Result<Authority> {
        for f in [cert, key] {
            if !f.exists() {
                anyhow::bail!(
                    "the egress listener's CA {} does not exist: create it with `idemproxy ca init --dir {}`",
                    f.display(),
                    f.parent().map_or(".".into(), |p| p.display().to_string())
                );
            }
        }
        check_private(key)?;
        let cert_pem = std::fs::read_to_string(cert)
            .with_context(|| format!("cannot read the CA certificate {}", cert.display()))?;
        let key_pem = std::fs::read_to_string(key)
            .with_context(|| format!("cannot read the CA key {}", key.display()))?;
        let issuer_key = KeyPair::from_pem(&key_pem)
            .map_err(|e| anyhow::anyhow!("{}: not a private key ({e})", key.display()))?;
        let params = CertificateParams::from_ca_cert_pem(&cert_pem)
            .map_err(|e| anyhow::anyhow!("{}: not a CA certificate ({e})", cert.display()))?;
        let not_after = params.not_after;
        let ca_der =
            pem_der(&cert_pem).with_context(|| format!("{}: no certificate", cert.display()))?;
        // The issuer's name and key identifier, as the CA certificate has them.
        let issuer = params
            .self_signed(&issuer_key)
            .map_err(|e| anyhow::anyhow!("{}: the key does not sign ({e})", key.display()))?;
        let leaf_key = KeyPair::generate().context("cannot make the leaves' key pair")?;
        Ok(Authority {
            issuer,
            issuer_key,
            ca_der,
            not_after,
            leaf_key,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The TLS configuration that presents `host`'s leaf, minted on first use.
    pub fn server_config(&self, host: &str) -> anyhow::Result<Arc<ServerConfig>> {
        {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((made, cfg)) = cache.get(host) {
                if made.elapsed() < LEAF_REFRESH {
                    return Ok(cfg.clone());
                }
            }
        }
        let cfg = Arc::new(self.mint(host)?);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_LEAVES {
            // One out, not all: the hosts in use keep their leaves.
            if let Some(old) = cache.keys().next().cloned() {
                cache.remove(&old);
            }
        }
        cache.insert(host.to_owned(), (std::time::Instant::now(), cfg.clone()));
        Ok(cfg)
    }

    fn mint(&self, host: &str) -> anyhow::Result<ServerConfig> {
        let mut params = CertificateParams::new(vec![host.to_owned()])
            .with_context(|| format!("cannot name a certificate for {host:?}"))?;
        params.distinguished_name.push(DnType::CommonName, host);
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Days::days(1);
        params.not_after = (now + Days::days(LEAF_DAYS)).min(self.not_after);
        params.serial_number = Some(random_serial()?);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf = params
            .signed_by(&self.leaf_key, &self.issuer, &self.issuer_key)
            .context("cannot sign a leaf")?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.serialize_der()));
        let mut cfg =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(vec![leaf.der().clone(), self.ca_der.clone()], key)?;
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(cfg)
    }
}

fn pem_der(pem: &str) -> Option<CertificateDer<'static>> {
    rustls_pemfile::certs(&mut pem.as_bytes()).next()?.ok()
}

fn random_serial() -> anyhow::Result<SerialNumber> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| anyhow::anyhow!("no randomness for a serial number"))?;
    bytes[0] &= 0x7f; // a positive INTEGER
    Ok(SerialNumber::from_slice(&bytes))
}

/// Refuses a key file that group or others may read.
fn check_private(key: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(key)
            .with_context(|| format!("cannot read {}", key.display()))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            anyhow::bail!(
                "the CA key {} can be read by group or others (mode {:o}): whoever reads it can intercept every host the proxy's clients trust it for. Run `chmod 600 {}`",
                key.display(),
                mode & 0o777,
                key.display()
            );
        }
    }
    Ok(())
}

/// `idemproxy ca init`: a new CA in `dir` (`idemproxy-ca.pem`, and `idemproxy-ca.key` made
/// 0600); refuses to overwrite either. Returns both paths.
pub fn init(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
    for p in [&cert_path, &key_path] {
        if p.exists() {
            anyhow::bail!(
                "{} exists: `ca init` never replaces a CA (clients trust it). Remove both files first to make a new one",
                p.display()
            );
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let key = KeyPair::generate().context("cannot make the CA key")?;
    let mut params = CertificateParams::default();
    let stamp = OffsetDateTime::now_utc();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("idemproxy egress CA {}", stamp.unix_timestamp()),
    );
    params
        .distinguished_name
        .push(DnType::OrganizationName, "idemproxy");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = stamp - Days::days(1);
    params.not_after = stamp + Days::days(CA_DAYS);
    params.serial_number = Some(random_serial()?);
    let cert = params.self_signed(&key).context("cannot sign the CA")?;
    write_private(&key_path, key.serialize_pem().as_bytes())?;
    std::fs::write(&cert_path, cert.pem())
        .with_context(|| format!("cannot write {}", cert_path.display()))?;
    Ok((cert_path, key_path))
}

fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The CA certificate's SHA-256 fingerprint (`AB:CD:…`) and its expiry date, for `ca show` and
/// the console. Never anything of the key.
pub fn identity(cert: &Path) -> anyhow::Result<(String, String)> {
    let pem =
        std::fs::read_to_string(cert).with_context(|| format!("cannot read {}", cert.display()))?;
    let der = pem_der(&pem).with_context(|| format!("{}: no certificate", cert.display()))?;
    let params = CertificateParams::from_ca_cert_pem(&pem)
        .map_err(|e| anyhow::anyhow!("{}: not a CA certificate ({e})", cert.display()))?;
    let digest = ring::digest::digest(&ring::digest::SHA256, der.as_ref());
    let hex: Vec<String> = digest.as_ref().iter().map(|b| format!("{b:02X}")).collect();
    Ok((hex.join(":"), params.not_after.date().to_string()))
}

/// What `idemproxy ca show` prints: where the CA is, its SHA-256 fingerprint and expiry, and
/// how each runtime is made to trust it. Never the key.
pub fn show(cert: &Path) -> anyhow::Result<String> {
    if !cert.exists() {
        anyhow::bail!(
            "{} does not exist: create the CA with `idemproxy ca init`",
            cert.display()
        );
    }
    let (fingerprint, expires) = identity(cert)?;
    let path = std::fs::canonicalize(cert).unwrap_or_else(|_| cert.to_owned());
    let p = path.display();
    Ok(format!(
        "certificate: {p}
sha256:      {}
expires:     {expires}

Trust it where the clients run (they must also send their API calls through the egress
listener: HTTPS_PROXY=http://<egress listen address>):
  Node.js:        NODE_EXTRA_CA_CERTS={p}   (Node's own fetch also needs NODE_USE_ENV_PROXY=1)
  Python:         REQUESTS_CA_BUNDLE={p}    (requests: replaces the default roots; or SSL_CERT_FILE)
  n8n (Docker):   -v {p}:/certs/idemproxy-ca.pem:ro -e NODE_EXTRA_CA_CERTS=/certs/idemproxy-ca.pem -e HTTPS_PROXY=http://<host>:<port>
  Debian/Ubuntu:  cp {p} /usr/local/share/ca-certificates/idemproxy-ca.crt && update-ca-certificates
  curl:           curl --proxy http://<host>:<port> --cacert {p} https://api.hubapi.com/...
",
        fingerprint
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_is_made_once_refused_when_readable_and_mints_cached_leaves() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = init(dir.path()).unwrap();
        assert!(init(dir.path()).is_err(), "never overwritten");
        let ca = Authority::load(&cert, &key).unwrap();
        let a = ca.server_config("api.hubapi.com").unwrap();
        let b = ca.server_config("api.hubapi.com").unwrap();
        assert!(Arc::ptr_eq(&a, &b), "cached");
        assert!(ca.server_config("acme.zendesk.com").is_ok());
        let shown = show(&cert).unwrap();
        assert!(
            shown.contains("sha256:") && !shown.contains("PRIVATE"),
            "{shown}"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&key).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
            let refused = Authority::load(&cert, &key).err().unwrap().to_string();
            assert!(refused.contains("chmod 600"), "{refused}");
        }
    }
}
