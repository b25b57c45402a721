//! TLS for Ferry's listeners and clients, with rustls (ring) only.
//!
//! A server has a certificate and key (`--tls-cert`, `--tls-key`) and, for
//! mTLS, the CA its clients' certificates must chain to (`--client-ca`). A
//! client certificate is then optional at the handshake (operators may use
//! bearer tokens instead) but, when one is sent, it must chain to that CA or
//! the handshake fails. A client trusts `--ca-cert` (else the system's
//! roots) and may present its own certificate (`--client-cert`,
//! `--client-key`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS could not be set up; names the file or flag.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {flag} {path}: {error}")]
    Read {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// A file holds no usable PEM item.
    #[error("{flag} {path}: {message}")]
    Pem {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// rustls refused the combination (a key that does not match, ...).
    #[error("TLS setup: {0}")]
    Rustls(String),
}

/// A PEM file read for `flag`. Its `Debug` names the file, never the
/// bytes (a private key must not reach a log).
#[derive(Clone)]
pub struct Pem {
    flag: &'static str,
    path: PathBuf,
    bytes: Vec<u8>,
}

impl std::fmt::Debug for Pem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pem({} {})", self.flag, self.path.display())
    }
}

impl Pem {
    /// Reads `path` (named after `flag` in errors).
    pub fn read(flag: &'static str, path: &Path) -> Result<Self, TlsError> {
        let bytes = std::fs::read(path).map_err(|error| TlsError::Read {
            flag,
            path: path.to_owned(),
            error,
        })?;
        Ok(Self {
            flag,
            path: path.to_owned(),
            bytes,
        })
    }

    /// The PEM text.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn error(&self, message: impl Into<String>) -> TlsError {
        TlsError::Pem {
            flag: self.flag,
            path: self.path.clone(),
            message: message.into(),
        }
    }

    /// The certificates in the file; at least one.
    pub fn certificates(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let certs = CertificateDer::pem_slice_iter(&self.bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.error(format!("not PEM certificates: {e}")))?;
        if certs.is_empty() {
            return Err(self.error("holds no PEM certificate"));
        }
        Ok(certs)
    }

    /// The private key in the file.
    pub fn private_key(&self) -> Result<PrivateKeyDer<'static>, TlsError> {
        PrivateKeyDer::from_pem_slice(&self.bytes)
            .map_err(|e| self.error(format!("holds no PEM private key: {e}")))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring the process's rustls provider unless one is set. tonic's
/// server builds its TLS configuration with rustls' process default, and
/// the workspace enables both ring and aws-lc-rs (through other crates), so
/// rustls cannot pick one by itself: without this the handshake task panics
/// and the client sees its connection reset.
pub fn install_default_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err: another thread installed one meanwhile, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// A server's TLS settings, read and checked at start-up.
#[derive(Debug, Clone)]
pub struct ServerTls {
    cert: Pem,
    key: Pem,
    client_ca: Option<Pem>,
}

impl ServerTls {
    /// Reads `--tls-cert`, `--tls-key` and `--client-ca` and checks that
    /// they make a working configuration.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, TlsError> {
        install_default_provider();
        let tls = Self {
            cert: Pem::read("--tls-cert", cert)?,
            key: Pem::read("--tls-key", key)?,
            client_ca: client_ca.map(|p| Pem::read("--client-ca", p)).transpose()?,
        };
        tls.rustls()?;
        Ok(tls)
    }

    /// Whether client certificates are verified (`--client-ca`).
    pub fn verifies_clients(&self) -> bool {
        self.client_ca.is_some()
    }

    /// The settings for tonic's gRPC server.
    pub fn tonic(&self) -> tonic::transport::ServerTlsConfig {
        let identity = tonic::transport::Identity::from_pem(self.cert.bytes(), self.key.bytes());
        let config = tonic::transport::ServerTlsConfig::new().identity(identity);
        match &self.client_ca {
            Some(ca) => config
                .client_ca_root(tonic::transport::Certificate::from_pem(ca.bytes()))
                .client_auth_optional(true),
            None => config,
        }
    }

    /// The rustls configuration of an HTTP listener (HTTP/2 and HTTP/1.1).
    pub fn rustls(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in ca.certificates()? {
                    roots
                        .add(cert)
                        .map_err(|e| ca.error(format!("not a CA certificate: {e}")))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| ca.error(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(self.cert.certificates()?, self.key.private_key()?)
            .map_err(|e| {
                TlsError::Rustls(format!(
                    "--tls-cert {} with --tls-key {}: {e}",
                    self.cert.path.display(),
                    self.key.path.display()
                ))
            })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}
