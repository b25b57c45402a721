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

use rustls::ClientConfig;

use super::settings::SettingsError;

/// The rustls client configuration for a TLS session.
pub(crate) fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, SettingsError> {
    let roots = ferry_shared::tls::roots(ca_file).map_err(SettingsError::Tls)?;
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
