//! A TCP proxy a test can cut and restore, to take a broker away from the agent without
//! stopping the broker.
//!
//! While cut, the proxy closes every connection it carries and closes each new one at once;
//! [`TcpProxy::restore`] lets connections through again.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A proxy from a free loopback port to `target`.
pub struct TcpProxy {
    port: u16,
    up: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl TcpProxy {
    /// Starts forwarding to `target` (`host:port`).
    pub async fn start(target: &str) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (up, watcher) = watch::channel(true);
        let target: Arc<str> = target.into();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if !*watcher.borrow() {
                    continue; // cut: dropping the socket closes it
                }
                let (target, mut watcher) = (Arc::clone(&target), watcher.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&*target).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = watcher.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Ok(Self { port, up, task })
    }

    /// The port the proxy listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection, and each new one until [`TcpProxy::restore`].
    pub fn cut(&self) {
        self.up.send_replace(false);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.up.send_replace(true);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
