//! TLS for `ssl://` / `mqtts://` sessions, with rustls.
//!
//! rumqttc's own `TlsConfiguration::Simple` needs a CA and builds its rustls
//! configuration with the process-default crypto provider, which panics when
//! several providers are compiled in. We build the `ClientConfig` ourselves
//! with the ring provider and hand it over as `TlsConfiguration::Rustls`:
//! the roots are the PEM `ca_file` when configured, the system's trust store
//! otherwise.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore};

use super::settings::SettingsError;

/// The rustls client configuration for a TLS session.
pub(crate) fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, SettingsError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| SettingsError::Tls(format!("reading {}: {e}", path.display())))?;
            for cert in certs {
                let cert = cert
                    .map_err(|e| SettingsError::Tls(format!("parsing {}: {e}", path.display())))?;
                roots.add(cert).map_err(|e| {
                    SettingsError::Tls(format!("certificate in {}: {e}", path.display()))
                })?;
            }
            if roots.is_empty() {
                return Err(SettingsError::Tls(format!(
                    "{} holds no PEM certificate",
                    path.display()
                )));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for error in &native.errors {
                tracing::warn!(%error, "skipping part of the system trust store");
            }
            roots.add_parsable_certificates(native.certs);
            if roots.is_empty() {
                return Err(SettingsError::Tls(
                    "the system trust store has no certificates; set ca_file".into(),
                ));
            }
        }
    }
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| SettingsError::Tls(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_ca_file_is_an_error() {
        let dir = tempfile::tempdir().ok();
        let Some(dir) = dir else { return };
        let missing = dir.path().join("missing.pem");
        assert!(matches!(
            client_config(Some(&missing)),
            Err(SettingsError::Tls(_))
        ));
        let empty = dir.path().join("empty.pem");
        assert!(std::fs::write(&empty, "not a certificate\n").is_ok());
        assert!(matches!(
            client_config(Some(&empty)),
            Err(SettingsError::Tls(_))
        ));
    }
}
