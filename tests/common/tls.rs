//! Test-time PKI: a CA and a leaf for `localhost` and `127.0.0.1`, generated with rcgen, and
//! the rustls server and client configs built on them with the `ring` provider.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tempfile::TempDir;

/// The rustls crypto provider every harness config uses (the crate builds rustls with `ring`
/// only, so there is no process-wide default to fall back on).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A CA plus one server leaf signed by it, with the CA's PEM written to a temp file so a proxy
/// config can point `ca_file` at it.
pub struct TestCa {
    /// DER of the CA certificate: the trust root for clients.
    pub ca_der: CertificateDer<'static>,
    /// PEM of the CA certificate.
    pub ca_pem: String,
    /// DER of the leaf (SANs `localhost` and `127.0.0.1`).
    pub leaf_der: CertificateDer<'static>,
    /// PKCS#8 DER of the leaf's private key.
    leaf_key_der: Vec<u8>,
    /// Keeps the directory holding `ca.pem` (and `leaf.pem`, `leaf.key`) alive.
    dir: TempDir,
}

impl TestCa {
    /// Generates a fresh CA and leaf and writes `ca.pem`, `leaf.pem` and `leaf.key` to a temp dir.
    pub fn generate() -> TestCa {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "idemproxy test CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate().expect("generate CA key");
        let ca_cert = ca_params.self_signed(&ca_key).expect("self-sign CA");

        let mut leaf_params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("leaf params");
        leaf_params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        leaf_params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        leaf_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf_key = KeyPair::generate().expect("generate leaf key");
        let leaf_cert = leaf_params
            .signed_by(&leaf_key, &ca_cert, &ca_key)
            .expect("sign leaf with CA");

        let dir = tempfile::tempdir().expect("create temp dir for test PKI");
        let ca_pem = ca_cert.pem();
        std::fs::write(dir.path().join("ca.pem"), &ca_pem).expect("write ca.pem");
        std::fs::write(dir.path().join("leaf.pem"), leaf_cert.pem()).expect("write leaf.pem");
        std::fs::write(dir.path().join("leaf.key"), leaf_key.serialize_pem())
            .expect("write leaf.key");

        TestCa {
            ca_der: ca_cert.der().clone(),
            ca_pem,
            leaf_der: leaf_cert.der().clone(),
            leaf_key_der: leaf_key.serialize_der(),
            dir,
        }
    }

    /// Path of the CA certificate PEM (for `ca_file` in a proxy config).
    pub fn ca_pem_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// Path of the leaf certificate PEM (for an inbound `tls = { cert, key }`).
    pub fn leaf_pem_path(&self) -> PathBuf {
        self.dir.path().join("leaf.pem")
    }

    /// Path of the leaf private key PEM (PKCS#8).
    pub fn leaf_key_path(&self) -> PathBuf {
        self.dir.path().join("leaf.key")
    }

    /// A rustls server config presenting the leaf (then the CA), ALPN `h2` and `http/1.1`.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key_der.clone()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring provider supports the default protocol versions")
            .with_no_client_auth()
            .with_single_cert(vec![self.leaf_der.clone(), self.ca_der.clone()], key)
            .expect("leaf certificate and key form a valid server identity");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }

    /// A rustls client config that trusts this CA only.
    pub fn client_config(&self) -> rustls::ClientConfig {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.ca_der.clone())
            .expect("add test CA to root store");
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring provider supports the default protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth()
    }

    /// A hyper client speaking HTTPS (HTTP/1.1 or h2 by ALPN) or plain HTTP, trusting this CA.
    pub fn https_client(&self) -> Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>> {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(self.client_config())
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .build();
        Client::builder(TokioExecutor::new()).build(connector)
    }
}

/// Convenience for tests that only hold a path: reads a PEM file to a string.
pub fn read_pem(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read PEM file {}: {e}", path.display()))
}
