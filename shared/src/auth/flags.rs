//! The security flags every Ferry server takes (the control plane for its
//! listeners, the agent for its admin listener), parsed once:
//! `--tls-cert`, `--tls-key`, `--client-ca`, `--tokens` and `--insecure`.
//!
//! A server starts only with credentials configured (`--tokens`, or
//! `--client-ca` for client certificates) or with the explicit `--insecure`,
//! which is logged as a warning at start-up; neither is an error naming the
//! flags.

use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use super::layer::Authenticator;
use super::tls::{ServerTls, TlsError};
use super::tokens::{TokenFileError, Tokens};

/// The flags, for `#[command(flatten)]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServerSecurityArgs {
    /// PEM certificate (chain) of the server: its listeners speak TLS.
    #[arg(long, env = "FERRY_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "FERRY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) that client certificates must chain to (mTLS,
    /// needs `--tls-cert`). A client certificate names its principal with a
    /// `ferry://ROLE/NAME` subject alternative name URI
    /// (`ferry://agent/edge-01`).
    #[arg(long, env = "FERRY_CLIENT_CA", requires = "tls_cert")]
    pub client_ca: Option<PathBuf>,
    /// Token file (YAML: name, role, agent_id, sha256 of each token),
    /// re-read when it changes; `ferryctl token hash` makes an entry.
    #[arg(long, env = "FERRY_TOKENS")]
    pub tokens: Option<PathBuf>,
    /// Development only: accept every call without a credential.
    #[arg(long, env = "FERRY_INSECURE")]
    pub insecure: bool,
}

/// Why the security flags do not make a server.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// Credentials and `--insecure` together: which one is meant?
    #[error("--insecure accepts every call; it cannot go with --tokens or --client-ca")]
    InsecureWithCredentials,
    /// Neither credentials nor `--insecure`.
    #[error(
        "no credentials configured: give --tokens FILE (bearer tokens) and/or --client-ca FILE with --tls-cert and --tls-key (client certificates), or --insecure for an open development server"
    )]
    NoCredentials,
    /// A certificate or key.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The token file.
    #[error(transparent)]
    Tokens(#[from] TokenFileError),
}

impl ServerSecurityArgs {
    /// The TLS settings alone (`--tls-cert`, `--tls-key`, `--client-ca`),
    /// for a listener that serves no RPC.
    pub fn tls(&self) -> Result<Option<ServerTls>, TlsError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                ServerTls::load(cert, key, self.client_ca.as_deref()).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The authenticator and TLS settings the flags describe; the token file
    /// is watched until `stop`. `what` names the listener in the warning of
    /// the open mode.
    pub fn load(
        &self,
        what: &str,
        stop: CancellationToken,
    ) -> Result<(Authenticator, Option<ServerTls>), SecurityError> {
        if self.insecure && (self.tokens.is_some() || self.client_ca.is_some()) {
            return Err(SecurityError::InsecureWithCredentials);
        }
        let tls = self.tls()?;
        if self.insecure {
            tracing::warn!(
                listener = what,
                tls = tls.is_some(),
                "--insecure: every call is accepted without a credential, as admin; for development only"
            );
            return Ok((Authenticator::Insecure, tls));
        }
        let certificates = tls.as_ref().is_some_and(ServerTls::verifies_clients);
        let tokens = self
            .tokens
            .as_deref()
            .map(|path| Tokens::watch(path, stop))
            .transpose()?;
        if tokens.is_none() && !certificates {
            return Err(SecurityError::NoCredentials);
        }
        if tls.is_none() {
            tracing::warn!(
                listener = what,
                "no --tls-cert: bearer tokens travel in clear text"
            );
        }
        Ok((
            Authenticator::Enforce {
                tokens,
                certificates,
            },
            tls,
        ))
    }
}
