//! The admin HTTP listener: `/metrics` (Prometheus text format), `/healthz`
//! (the process is alive and serving) and `/readyz` (every session connected
//! and every lease resolved). The shared `DlqService`, over the local DLQ
//! store ([`dlq`]), is served over gRPC on the same port: [`with_grpc`]
//! merges it into the router.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use ferry_shared::auth::layer::{AuthLayer, Authenticator};
use ferry_shared::os::ListenError;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::health::Readiness;
use crate::metrics::Metrics;

pub mod dlq;

/// `router` plus the gRPC `DlqService` of `store` and server reflection, on
/// one port (HTTP/1 for the admin routes, HTTP/2 for gRPC). Every gRPC call
/// passes `auth` first (reflection needs no credential); the HTTP routes
/// are for scrapers and probes and stay open.
pub fn with_grpc(
    router: Router,
    store: std::sync::Arc<dyn crate::stores::DlqStore>,
    redrive: std::sync::Arc<crate::routes::Redrive>,
    auth: Authenticator,
) -> Result<Router, tonic_reflection::server::Error> {
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ferry_shared::api::FILE_DESCRIPTOR_SET)
        .with_service_name("ferry.v1.DlqService")
        .build_v1()?;
    let grpc = tonic::service::Routes::new(dlq::LocalDlq::server(store, redrive))
        .add_service(reflection)
        .into_axum_router()
        .layer(AuthLayer::new(auth));
    Ok(router.merge(grpc))
}

#[derive(Clone)]
struct AdminState {
    metrics: Arc<Metrics>,
    readiness: Readiness,
}

/// The admin routes.
pub fn router(metrics: Arc<Metrics>, readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(AdminState { metrics, readiness })
}

/// Binds the admin listener on `addr` (`--admin-listen`); a refusal says
/// which flag to change.
pub async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, ListenError> {
    TcpListener::bind(addr).await.map_err(|error| ListenError {
        addr,
        what: "admin listener",
        flag: "--admin-listen",
        error,
    })
}

/// A serving admin listener; [`Running::stop`] ends it gracefully. Both the
/// standalone and the managed agent start and stop it this way.
pub struct Running {
    stop: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

impl Running {
    /// Serves `router` on `listener` (TLS with `tls`) in a task of its own.
    pub fn start(
        listener: TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
        router: Router,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        tracing::info!(%addr, tls = tls.is_some(), "admin listening");
        let stop = CancellationToken::new();
        let task = tokio::spawn(ferry_shared::listener::serve(
            listener,
            tls,
            router,
            stop.clone().cancelled_owned(),
        ));
        Ok(Self { stop, task })
    }

    /// Stops accepting, lets in-flight requests finish, and logs a failure
    /// of the listener (it is not the agent's: the bridges are already down).
    pub async fn stop(self) {
        self.stop.cancel();
        match self.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "admin listener failed"),
            Err(e) => tracing::warn!(error = %e, "admin task failed"),
        }
    }
}

async fn metrics_text(State(state): State<AdminState>) -> Response {
    match state.metrics.encode() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics: {error}\n"),
        )
            .into_response(),
    }
}

async fn ready(State(state): State<AdminState>) -> Response {
    let unmet = state.readiness.unmet();
    if unmet.is_empty() {
        (StatusCode::OK, "ready\n".to_owned()).into_response()
    } else {
        let mut body = String::from("not ready:\n");
        for name in unmet {
            body.push_str("- ");
            body.push_str(&name);
            body.push('\n');
        }
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get_text(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        let status = response[9..12].parse().expect("status code");
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    #[tokio::test]
    async fn readiness_follows_its_conditions() {
        let metrics = Arc::new(Metrics::new());
        metrics.binding("b", "r", "x").received(2);
        let readiness = Readiness::default();
        let session = readiness.condition("session mqtt-conn connected");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server =
            Running::start(listener, None, router(metrics, readiness.clone())).expect("start");

        assert_eq!(get_text(addr, "/healthz").await.0, 200);
        let (status, body) = get_text(addr, "/readyz").await;
        assert_eq!(status, 503);
        assert!(body.contains("session mqtt-conn connected"), "{body}");

        session.set(true);
        assert_eq!(get_text(addr, "/readyz").await.0, 200);
        session.set(false);
        assert_eq!(get_text(addr, "/readyz").await.0, 503);
        drop(session);
        assert_eq!(get_text(addr, "/readyz").await.0, 200);

        let (status, body) = get_text(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("ferry_messages_received_total"), "{body}");

        server.stop().await;
        let refused = tokio::net::TcpStream::connect(addr).await.is_err();
        assert!(refused, "the admin listener still accepts after stop");
    }
}
