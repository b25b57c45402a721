//! The authentication layer: one tower layer in front of every gRPC service
//! of the control plane and of the agent's admin listener. For each request
//! it finds the credential (a bearer token, else the client certificate),
//! turns it into a [`Principal`], checks the role against the
//! [`policy`](super::policy) table and inserts the principal into the
//! request's extensions, where services read it with
//! [`Caller::of`](super::Caller::of).
//!
//! - no credential → `UNAUTHENTICATED` naming what to send;
//! - an unknown token or a certificate that names nobody → `UNAUTHENTICATED`
//!   saying why;
//! - a role the table does not allow, or a method with no entry →
//!   `PERMISSION_DENIED` naming the method and the roles allowed.
//!
//! Health and reflection pass without a credential. In the explicit open
//! mode ([`Authenticator::Insecure`]) every request is
//! [`Principal::insecure`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use super::tokens::Tokens;
use super::{Principal, certs, policy};

/// How requests are authenticated.
#[derive(Debug, Clone)]
pub enum Authenticator {
    /// `--insecure`: today's open mode, for development.
    Insecure,
    /// Every request needs a credential.
    Enforce {
        /// Bearer tokens (`--tokens`), when configured.
        tokens: Option<Tokens>,
        /// Whether client certificates are accepted (`--client-ca`).
        certificates: bool,
    },
}

impl Authenticator {
    /// The principal of `request`, or the status that refuses it. `None`
    /// for the open services, which need none.
    pub fn check<B>(&self, request: &http::Request<B>) -> Result<Option<Principal>, Status> {
        let path = request.uri().path();
        if policy::is_open(path) {
            return Ok(None);
        }
        let (tokens, certificates) = match self {
            Self::Insecure => return Ok(Some(Principal::insecure())),
            Self::Enforce {
                tokens,
                certificates,
            } => (tokens, *certificates),
        };
        let principal = match bearer(request)? {
            Some(token) => match tokens
                .as_ref()
                .and_then(|t| t.snapshot().principal(token).cloned())
            {
                Some(principal) => principal,
                None if tokens.is_none() => {
                    return Err(Status::unauthenticated(
                        "bearer tokens are not accepted here (the server has no --tokens file); present a client certificate",
                    ));
                }
                None => {
                    return Err(Status::unauthenticated(
                        "the bearer token is not in the server's token file (mistyped, or revoked)",
                    ));
                }
            },
            None => match peer_certificate(request).filter(|_| certificates) {
                Some(cert) => certs::principal(&cert).map_err(Status::unauthenticated)?,
                None => {
                    return Err(Status::unauthenticated(format!(
                        "no credential: {path} needs `authorization: Bearer TOKEN` (ferryctl --token or FERRY_TOKEN){}",
                        if certificates {
                            " or a client certificate"
                        } else {
                            ""
                        }
                    )));
                }
            },
        };
        policy::authorize(path, &principal)?;
        Ok(Some(principal))
    }
}

/// The token of an `authorization: Bearer TOKEN` header.
fn bearer<B>(request: &http::Request<B>) -> Result<Option<&str>, Status> {
    let Some(value) = request.headers().get(http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let text = value
        .to_str()
        .map_err(|_| Status::unauthenticated("the authorization header is not ASCII"))?;
    match text.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(Some(token.trim()))
        }
        _ => Err(Status::unauthenticated(
            "the authorization header must be `Bearer TOKEN`",
        )),
    }
}

/// The client's leaf certificate, when the connection is TLS and it sent one.
fn peer_certificate<B>(
    request: &http::Request<B>,
) -> Option<rustls::pki_types::CertificateDer<'static>> {
    let info = request
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()?;
    info.peer_certs()?.first().cloned()
}

/// The [`tower::Layer`] that puts [`Authenticator`] in front of a service.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    auth: Authenticator,
}

impl AuthLayer {
    /// The layer for `auth`.
    pub fn new(auth: Authenticator) -> Self {
        Self { auth }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            auth: self.auth.clone(),
        }
    }
}

/// A service behind [`AuthLayer`].
#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Authenticator,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        match self.auth.check(&request) {
            Ok(principal) => {
                if let Some(principal) = principal {
                    request.extensions_mut().insert(principal);
                }
                Box::pin(self.inner.call(request))
            }
            Err(status) => {
                tracing::debug!(path = request.uri().path(), code = ?status.code(), message = status.message(), "request refused");
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}
