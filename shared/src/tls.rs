//! The client-side trust roots every TLS client of Ferry uses: the PEM `ca_file` when one is
//! configured (only those certificates: a private CA), the system's trust store otherwise.

use std::path::Path;

use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The roots for `ca_file`, or the system's. An unreadable or empty file, or an empty system
/// store, is an error that says which.
pub fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            for cert in certs {
                let cert = cert.map_err(|e| format!("parsing {}: {e}", path.display()))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("certificate in {}: {e}", path.display()))?;
            }
            if roots.is_empty() {
                return Err(format!("{} holds no PEM certificate", path.display()));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for error in &native.errors {
                tracing::warn!(%error, "skipping part of the system trust store");
            }
            roots.add_parsable_certificates(native.certs);
            if roots.is_empty() {
                return Err("the system trust store has no certificates; set ca_file".into());
            }
        }
    }
    Ok(roots)
}
