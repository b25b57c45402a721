//! The gRPC server: Ferry's five services, standard health checking
//! (`grpc.health.v1.Health`, for `grpc_health_probe` and load balancers; each
//! `ferry.v1` service reports SERVING once registered) and server reflection
//! (`grpc.reflection.v1` and `v1alpha`, for `grpcurl`).
//!
//! Every call passes the authentication layer ([`AuthLayer`]): a credential
//! checked against the role table of `ferry_shared::auth::policy`, unless
//! the server runs in the explicit open mode ([`Security::insecure`]).
//!
//! [`ControlPlane::serve`] runs until its shutdown future resolves: then the
//! shared cancellation token ends every agent stream cleanly (each records its
//! agent as disconnected first), in-flight calls finish, and it returns.
//! [`ControlPlane::serve_with_incoming`] does the same over any connection
//! stream (tests use in-memory duplex pipes).

use std::future::Future;
use std::sync::Arc;

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::layer::{AuthLayer, Authenticator};
use ferry_shared::auth::tls::ServerTls;
use pb::agent_service_server::AgentServiceServer;
use pb::config_service_server::ConfigServiceServer;
use pb::dlq_service_server::DlqServiceServer;
use pb::lease_service_server::LeaseServiceServer;
use pb::metrics_service_server::MetricsServiceServer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::{Connected, Router};
use tower::layer::util::{Identity, Stack};

use crate::services::agent::AgentServiceImpl;
use crate::services::config::ConfigServiceImpl;
use crate::services::dlq::StateDlq;
use crate::services::lease::LeaseServiceImpl;
use crate::services::metrics::MetricsServiceImpl;
use crate::services::{Context, Options};
use crate::state::StateStore;
use ferry_shared::dlq::service::DlqServer;

/// The largest request ConfigService decodes: well above the configuration
/// limit (`MAX_CONFIG_BYTES`), so that an oversized document reaches the
/// validator's size check and is refused with INVALID_ARGUMENT naming the
/// limit instead of a transport error.
pub const MAX_CONFIG_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The reflection service could not be built from the descriptor set.
    #[error("building the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The HTTP/2 server failed.
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// How the server authenticates its callers and whether it speaks TLS.
#[derive(Debug, Clone)]
pub struct Security {
    /// Credentials checked on every call ([`AuthLayer`]).
    pub auth: Authenticator,
    /// TLS (and mTLS with a client CA); plain HTTP/2 when `None`.
    pub tls: Option<ServerTls>,
}

impl Security {
    /// The open development mode: no TLS, every caller is
    /// [`Principal::insecure`](ferry_shared::auth::Principal::insecure).
    pub fn insecure() -> Self {
        Self {
            auth: Authenticator::Insecure,
            tls: None,
        }
    }
}

/// The control plane: its services over one state store.
pub struct ControlPlane {
    ctx: Context,
    security: Security,
}

impl ControlPlane {
    /// A control plane over `store`, in the open development mode until
    /// [`Self::with_security`] says otherwise (the binary always says: it
    /// refuses to start without credentials or `--insecure`).
    pub fn new(store: Arc<dyn StateStore>, options: Options) -> Self {
        Self {
            ctx: Context::new(store, options, CancellationToken::new()),
            security: Security::insecure(),
        }
    }

    /// The same control plane, authenticating and encrypting as `security` says.
    pub fn with_security(self, security: Security) -> Self {
        Self { security, ..self }
    }

    /// The shared context (state store, agent registry, shutdown token).
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    async fn router(&self) -> Result<Router<Stack<AuthLayer, Identity>>, ServeError> {
        let (reporter, health) = tonic_health::server::health_reporter();
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(ferry_shared::api::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(ferry_shared::api::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;

        let ctx = &self.ctx;
        let config = ConfigServiceServer::new(ConfigServiceImpl::new(ctx.clone()))
            .max_decoding_message_size(MAX_CONFIG_REQUEST_BYTES);
        let agent = AgentServiceServer::new(AgentServiceImpl::new(ctx.clone()));
        let lease = LeaseServiceServer::new(LeaseServiceImpl::new(ctx.clone()));
        let dlq = StateDlq::server(ctx.clone());
        let metrics = MetricsServiceServer::new(MetricsServiceImpl::new(ctx.clone()));
        reporter
            .set_serving::<ConfigServiceServer<ConfigServiceImpl>>()
            .await;
        reporter
            .set_serving::<AgentServiceServer<AgentServiceImpl>>()
            .await;
        reporter
            .set_serving::<LeaseServiceServer<LeaseServiceImpl>>()
            .await;
        reporter.set_serving::<DlqServiceServer<DlqServer>>().await;
        reporter
            .set_serving::<MetricsServiceServer<MetricsServiceImpl>>()
            .await;

        // One span per RPC (outermost, so a refused call has one too).
        let mut server = Server::builder().trace_fn(crate::rpc_span::rpc_span);
        if let Some(tls) = &self.security.tls {
            server = server.tls_config(tls.tonic())?;
        }
        Ok(server
            .layer(AuthLayer::new(self.security.auth.clone()))
            .add_service(health)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(config)
            .add_service(agent)
            .add_service(lease)
            .add_service(dlq)
            .add_service(metrics))
    }

    fn shutdown_signal(
        &self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> impl Future<Output = ()> + Send {
        let token = self.ctx.shutdown.clone();
        async move {
            tokio::select! {
                () = shutdown => {}
                () = token.cancelled() => {}
            }
            token.cancel();
        }
    }

    /// Serves gRPC on `listener` until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        self.serve_with_incoming(TcpListenerStream::new(listener), shutdown)
            .await
    }

    /// Serves gRPC on the connections `incoming` yields until `shutdown`
    /// resolves.
    pub async fn serve_with_incoming<I, IO, IE>(
        self,
        incoming: I,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError>
    where
        I: Stream<Item = Result<IO, IE>> + Send,
        IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
        IE: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let router = self.router().await?;
        let signal = self.shutdown_signal(shutdown);
        router
            .serve_with_incoming_shutdown(incoming, signal)
            .await?;
        Ok(())
    }
}
