//! The upstream listener the agent connects to: a small TCP proxy in front
//! of the embedded upstream broker, which the quickstart takes down and
//! brings back to stage an outage (rumqttd cannot stop one of its
//! listeners; see ADR 0006).
//!
//! Taking it down closes the listening socket (new connections are refused,
//! as by a broker that is gone) and ends every proxied connection: first the
//! agent's bytes stop being forwarded, then, after [`SETTLE`], both sockets
//! are closed. The pause lets the broker's answers to what it already
//! received (PUBACKs) reach the agent, so the agent's `sent` counter and the
//! subscribers' arrivals keep telling the same story: a publish either
//! reached the broker and was acknowledged, or never left the proxy.
//! Bringing it back binds the same address again.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long answers from the broker still reach the agent after its own
/// bytes stopped being forwarded.
const SETTLE: Duration = Duration::from_millis(200);

/// A TCP proxy to `target` that can be taken down and brought back.
#[derive(Debug)]
pub struct Listener {
    addr: SocketAddr,
    target: SocketAddr,
    running: Option<Running>,
}

#[derive(Debug)]
struct Running {
    down: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Listener {
    /// Listens on a free loopback port, forwarding to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("binding the upstream listener")?;
        let addr = listener.local_addr()?;
        let mut this = Self {
            addr,
            target,
            running: None,
        };
        this.serve(listener);
        Ok(this)
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether it accepts connections now.
    pub fn is_up(&self) -> bool {
        self.running.is_some()
    }

    /// Closes the listener and every connection through it.
    pub async fn take_down(&mut self) {
        if let Some(running) = self.running.take() {
            running.down.cancel();
            if let Err(error) = running.task.await {
                tracing::warn!(%error, "the upstream listener's task failed");
            }
        }
    }

    /// Listens again on the same address.
    pub async fn bring_back(&mut self) -> anyhow::Result<()> {
        if self.running.is_none() {
            let listener = TcpListener::bind(self.addr)
                .await
                .with_context(|| format!("binding the upstream listener on {} again", self.addr))?;
            self.serve(listener);
        }
        Ok(())
    }

    fn serve(&mut self, listener: TcpListener) {
        let down = CancellationToken::new();
        let task = tokio::spawn(accept(listener, self.target, down.clone()));
        self.running = Some(Running { down, task });
    }
}

/// Accepts and proxies connections until `down`; then waits for every
/// connection to be closed.
async fn accept(listener: TcpListener, target: SocketAddr, down: CancellationToken) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = down.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    connections.spawn(proxy(client, target, down.clone()));
                }
                Err(error) => tracing::warn!(%error, "upstream listener: accept failed"),
            },
            // Reap finished connections so the set stays small.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// One proxied connection, until either side closes it or `down`.
async fn proxy(client: TcpStream, target: SocketAddr, down: CancellationToken) {
    let broker = match TcpStream::connect(target).await {
        Ok(broker) => broker,
        Err(error) => {
            tracing::warn!(%error, %target, "upstream listener: cannot reach the broker");
            return;
        }
    };
    // The halves live until the end of this function: dropping a write half
    // sends FIN, and the broker would drop the session (and the answers it
    // still owes) at once.
    let (mut client_read, mut client_write) = client.into_split();
    let (mut broker_read, mut broker_write) = broker.into_split();
    let settled = down.clone();
    let answers = async move {
        settled.cancelled().await;
        tokio::time::sleep(SETTLE).await;
    };
    let upward = forward(&mut client_read, &mut broker_write, down.cancelled());
    let downward = forward(&mut broker_read, &mut client_write, answers);
    tokio::pin!(upward, downward);
    // Either direction ending ends the connection (MQTT has no half-close),
    // except that a taken-down listener lets the answers settle first.
    tokio::select! {
        () = &mut upward => if down.is_cancelled() {
            downward.await;
        },
        () = &mut downward => {}
    }
}

/// Copies `from` to `to` until end of stream, an error or `stop`.
async fn forward(
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
    stop: impl Future<Output = ()>,
) {
    tokio::select! {
        () = stop => {}
        _ = tokio::io::copy(from, to) => {}
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server that echoes every byte back.
    async fn echo() -> anyhow::Result<SocketAddr> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut read, mut write) = stream.split();
                    let _echoed = tokio::io::copy(&mut read, &mut write).await;
                });
            }
        });
        Ok(addr)
    }

    async fn round_trip(stream: &mut TcpStream) -> anyhow::Result<[u8; 4]> {
        stream.write_all(b"ping").await?;
        let mut answer = [0; 4];
        stream.read_exact(&mut answer).await?;
        Ok(answer)
    }

    #[tokio::test]
    async fn taken_down_it_refuses_and_closes_connections_and_comes_back_on_the_same_address()
    -> anyhow::Result<()> {
        let mut listener = Listener::start(echo().await?).await?;
        let addr = listener.addr();
        let mut client = TcpStream::connect(addr).await?;
        assert_eq!(&round_trip(&mut client).await?, b"ping");

        listener.take_down().await;
        assert!(!listener.is_up());
        let mut rest = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest))
            .await
            .expect("the proxied connection ends");
        assert!(ended.is_err() || rest.is_empty(), "nothing more arrives");
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "refused while down"
        );

        listener.bring_back().await?;
        assert_eq!(listener.addr(), addr);
        let mut again = TcpStream::connect(addr).await?;
        assert_eq!(&round_trip(&mut again).await?, b"ping");
        Ok(())
    }
}
