//! A client's credentials towards a Ferry server: the bearer token it sends
//! (`--token`, `--token-file`, `FERRY_TOKEN`), the CA it trusts for
//! `https://` endpoints (`--ca-cert`, else the system's roots) and its own
//! certificate for mTLS (`--client-cert`, `--client-key`). `ferryctl` and the
//! agent (its stream and its `control_plane` stores) build their channels
//! here, so both present credentials the same way. Every request also
//! carries the caller's trace context (`traceparent`), so the server's RPC
//! span continues the client's trace.

use std::path::Path;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::tls::{Pem, TlsError};

/// A channel that sends the bearer token and the current trace context with
/// every call.
pub type AuthChannel = InterceptedService<Channel, Bearer>;

/// Why credentials could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClientAuthError {
    /// A certificate or key file.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The token cannot be sent in a header.
    #[error("the token must be printable ASCII")]
    Token,
    /// `--client-cert` without `--client-key`, or the reverse.
    #[error("--client-cert and --client-key go together")]
    HalfIdentity,
}

/// Adds `authorization: Bearer TOKEN` to every request, when there is a
/// token, and the current span's trace context. Its `Debug` says whether there is one, never what it is.
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Bearer(***)"
        } else {
            "Bearer(none)"
        })
    }
}

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        crate::telemetry::propagation::inject_current(request.metadata_mut());
        Ok(request)
    }
}

/// What a client presents.
#[derive(Debug, Clone, Default)]
pub struct ClientAuth {
    bearer: Bearer,
    ca: Option<Pem>,
    identity: Option<(Pem, Pem)>,
}

impl ClientAuth {
    /// Credentials from the flags: a token, a CA file, a certificate and key.
    pub fn new(
        token: Option<&str>,
        ca_cert: Option<&Path>,
        client_cert: Option<&Path>,
        client_key: Option<&Path>,
    ) -> Result<Self, ClientAuthError> {
        let bearer = match token.map(str::trim).filter(|t| !t.is_empty()) {
            Some(token) => Bearer(Some(
                format!("Bearer {token}")
                    .parse()
                    .map_err(|_| ClientAuthError::Token)?,
            )),
            None => Bearer(None),
        };
        let ca = ca_cert.map(|p| Pem::read("--ca-cert", p)).transpose()?;
        if let Some(ca) = &ca {
            ca.certificates()?;
        }
        let identity = match (client_cert, client_key) {
            (Some(cert), Some(key)) => {
                let cert = Pem::read("--client-cert", cert)?;
                let key = Pem::read("--client-key", key)?;
                cert.certificates()?;
                key.private_key()?;
                Some((cert, key))
            }
            (None, None) => None,
            _ => return Err(ClientAuthError::HalfIdentity),
        };
        Ok(Self {
            bearer,
            ca,
            identity,
        })
    }

    /// Reads a token file (`--token-file`): its content, without
    /// surrounding whitespace.
    pub fn read_token_file(path: &Path) -> Result<String, TlsError> {
        let pem = Pem::read("--token-file", path)?;
        Ok(String::from_utf8_lossy(pem.bytes()).trim().to_owned())
    }

    /// Whether a token is presented.
    pub fn has_token(&self) -> bool {
        self.bearer.0.is_some()
    }

    /// The endpoint `url` with this client's TLS settings (`https://`).
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, String> {
        let endpoint =
            Endpoint::from_shared(url.to_owned()).map_err(|e| format!("{url:?}: {e}"))?;
        if url.starts_with("https://") {
            let mut tls = ClientTlsConfig::new();
            tls = match &self.ca {
                Some(ca) => tls.ca_certificate(Certificate::from_pem(ca.bytes())),
                None => tls.with_native_roots(),
            };
            if let Some((cert, key)) = &self.identity {
                tls = tls.identity(Identity::from_pem(cert.bytes(), key.bytes()));
            }
            return endpoint
                .tls_config(tls)
                .map_err(|e| format!("{url:?}: {e}"));
        }
        if !url.starts_with("http://") {
            return Err(format!("{url:?} must start with http:// or https://"));
        }
        if self.ca.is_some() || self.identity.is_some() {
            return Err(format!(
                "{url:?} is plain http://; --ca-cert and --client-cert need an https:// endpoint"
            ));
        }
        Ok(endpoint)
    }

    /// `channel` sending this client's token with every call.
    pub fn wrap(&self, channel: Channel) -> AuthChannel {
        InterceptedService::new(channel, self.bearer.clone())
    }
}
