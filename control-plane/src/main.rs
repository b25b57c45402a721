//! `ferry-control-plane`: serves Ferry's gRPC API until SIGTERM or SIGINT.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use tokio::net::TcpListener;
use tracing::info;

/// Ferry's control plane: bridge configurations, leases, dead letters and
/// metrics over gRPC.
#[derive(Debug, Parser)]
#[command(name = "ferry-control-plane", version)]
struct Args {
    /// Address the gRPC server listens on.
    #[arg(long, default_value = "127.0.0.1:50051", env = "FERRY_LISTEN")]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the gRPC listener on {}", args.listen))?;
    let local = listener.local_addr().context("reading the bound address")?;
    info!(listen = %local, "control plane serving gRPC");

    ferry_control_plane::server::serve(listener, shutdown_signal()).await?;
    info!("control plane stopped");
    Ok(())
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the server");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = terminate => {}
        result = tokio::signal::ctrl_c() => {
            if let Err(error) = result {
                tracing::warn!(%error, "cannot listen for SIGINT");
                std::future::pending::<()>().await;
            }
        }
    }
    info!("shutdown requested");
}
