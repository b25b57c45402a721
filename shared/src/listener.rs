//! One accept loop for the HTTP listeners (the agent's admin listener, the
//! control plane's `/metrics` listener): plain or TLS, HTTP/1.1 and HTTP/2
//! on one port (gRPC and `/metrics` side by side), until shutdown.
//!
//! Each request carries its connection's info in its extensions, as tonic's
//! own server does: [`TcpConnectInfo`] on a plain connection,
//! [`TlsConnectInfo`] (with the client's certificates) on a TLS one. So
//! `tonic::Request::remote_addr` works and the authentication layer finds
//! the client certificate the same way on every listener.
//!
//! A TLS handshake runs in its connection's task (a slow client never holds
//! up the accept loop) and gives up after [`HANDSHAKE_TIMEOUT`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};
use tower::ServiceExt;

/// How long a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `service` on `listener` (TLS when `tls` is set) until `shutdown`
/// resolves; then stops accepting and waits for open connections to finish.
pub async fn serve<S, B>(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    service: S,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()>
where
    S: tower::Service<http::Request<hyper::body::Incoming>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: the listener
                    // itself is fine, the next accept may succeed.
                    tracing::warn!(%error, "accepting a connection failed");
                    continue;
                }
            },
        };
        let service = service.clone();
        let watcher = graceful.watcher();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let builder = Builder::new(TokioExecutor::new());
            match acceptor {
                None => {
                    let info = stream.connect_info();
                    let service = with_info(service, info);
                    let connection =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    if let Err(error) = watcher.watch(connection.into_owned()).await {
                        tracing::debug!(%peer, %error, "connection ended with an error");
                    }
                }
                Some(acceptor) => {
                    let stream = match tokio::time::timeout(
                        HANDSHAKE_TIMEOUT,
                        acceptor.accept(stream),
                    )
                    .await
                    {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(error)) => {
                            tracing::info!(%peer, %error, "TLS handshake refused");
                            return;
                        }
                        Err(_) => {
                            tracing::info!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let info: TlsConnectInfo<TcpConnectInfo> = stream.connect_info();
                    let service = with_info(service, info);
                    let connection =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    if let Err(error) = watcher.watch(connection.into_owned()).await {
                        tracing::debug!(%peer, %error, "connection ended with an error");
                    }
                }
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// `service` with `info` inserted into every request's extensions.
fn with_info<S, I, B>(
    service: S,
    info: I,
) -> TowerToHyperService<
    tower::util::MapRequest<S, impl FnMut(http::Request<B>) -> http::Request<B> + Clone>,
>
where
    S: tower::Service<http::Request<B>>,
    I: Clone + Send + Sync + 'static,
{
    TowerToHyperService::new(service.map_request(move |mut request: http::Request<B>| {
        request.extensions_mut().insert(info.clone());
        request
    }))
}
