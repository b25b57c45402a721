//! Loopback ports.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::Context;

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// The port is found by binding port 0 and closing the listener, so another process can take it
/// before the caller binds it; the servers started by this harness retry on a new port when
/// that happens.
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding 127.0.0.1:0")?;
    Ok(listener
        .local_addr()
        .context("local address of 127.0.0.1:0")?
        .port())
}

/// The loopback address with `port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// True when something accepts TCP connections on `addr` right now.
pub fn accepts_connections(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_port_can_be_bound() -> anyhow::Result<()> {
        let port = free_port()?;
        assert_ne!(port, 0);
        let _listener = TcpListener::bind(loopback(port))?;
        assert!(accepts_connections(loopback(port)));
        Ok(())
    }
}
