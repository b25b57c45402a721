//! The gRPC server: Ferry's services, standard health checking
//! (`grpc.health.v1.Health`, for `grpc_health_probe` and load balancers) and
//! server reflection (`grpc.reflection.v1` and `v1alpha`, for `grpcurl`).
//!
//! Reflection describes every `ferry.v1` service from the compiled descriptor
//! set, whether or not it is served yet: a service that is not registered
//! answers `UNIMPLEMENTED`, which is tonic's router fallback.

use std::future::Future;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;

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

/// Serves gRPC on `listener` until `shutdown` resolves, then stops accepting
/// and lets in-flight calls finish.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    // `health_reporter` starts with the whole server ("") SERVING.
    let (_health_reporter, health) = tonic_health::server::health_reporter();

    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ferry_shared::api::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ferry_shared::api::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    Server::builder()
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}
