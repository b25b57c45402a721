//! A TCP proxy that a test can cut and restore: a store's server "down" for one test without
//! touching the server other tests share.
//!
//! [`TcpProxy::start`] listens on a free loopback port and forwards every connection to its
//! target. [`TcpProxy::cut`] closes the listener (new connections are refused) and drops every
//! forwarded connection; [`TcpProxy::restore`] listens on the same port again.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// A proxy from a loopback port to `target`.
pub struct TcpProxy {
    addr: SocketAddr,
    target: SocketAddr,
    /// Cancels the listener and every connection of the current period.
    running: Arc<Mutex<Option<CancellationToken>>>,
}

impl TcpProxy {
    /// Starts forwarding a free loopback port to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the proxy")?;
        let addr = listener.local_addr()?;
        let proxy = TcpProxy {
            addr,
            target,
            running: Arc::new(Mutex::new(None)),
        };
        proxy.serve(listener).await;
        Ok(proxy)
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Refuses new connections and drops the forwarded ones.
    pub async fn cut(&self) {
        if let Some(token) = self.running.lock().await.take() {
            token.cancel();
        }
    }

    /// Listens again on the same port.
    pub async fn restore(&self) -> anyhow::Result<()> {
        let listener = TcpListener::bind(self.addr)
            .await
            .with_context(|| format!("binding the proxy again on {}", self.addr))?;
        self.serve(listener).await;
        Ok(())
    }

    async fn serve(&self, listener: TcpListener) {
        let token = CancellationToken::new();
        let target = self.target;
        let period = token.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = period.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                let connection = period.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        () = connection.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    }
                });
            }
        });
        *self.running.lock().await = Some(token);
    }
}
