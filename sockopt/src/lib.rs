//! The socket option Ferry's agent sets that no safe crate offers, and so
//! the one place its code calls the C library itself
//! (`docs/adr/0019-mqtt-receive-low-water.md`).
//!
//! `SO_RCVLOWAT` makes a TCP socket report itself readable only once that
//! many bytes are queued (or at its end or an error): the MQTT event loop
//! uses it to read a broker's acknowledgements in batches instead of waking
//! for each. `socket2`, `rustix` and `nix` set many options but not this one.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// The size of the option's value, as `setsockopt` takes it.
const C_INT_SIZE: libc::socklen_t = size_of::<libc::c_int>() as libc::socklen_t;

/// Sets the receive low-water mark of `socket` to `bytes` (at least 1):
/// until that many bytes are queued the socket is not readable, and the
/// kernel does not wake a reader that waits for it (since Linux 4.20 it
/// also checks at once whether the new mark is already reached).
pub fn set_receive_low_water(socket: &impl AsFd, bytes: u32) -> io::Result<()> {
    let value = libc::c_int::try_from(bytes.max(1))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "low-water mark too large"))?;
    let fd = socket.as_fd().as_raw_fd();
    // SAFETY: `fd` is borrowed from `socket`, open for the whole call;
    // `value` is a live `c_int` and `C_INT_SIZE` is its size, as
    // `SO_RCVLOWAT` takes; the kernel only reads it.
    #[expect(unsafe_code, reason = "setsockopt has no safe binding for SO_RCVLOWAT")]
    let result = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const value).cast(),
            C_INT_SIZE,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// What the event loop relies on: a socket below its mark does not
    /// become readable, one at it does, and lowering the mark under what is
    /// queued makes it readable at once (Linux 4.20 and later).
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_socket_is_readable_once_its_mark_is_reached() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let port = listener.local_addr().expect("bound").port();
        let (reader, accepted) =
            tokio::join!(TcpStream::connect(("127.0.0.1", port)), listener.accept());
        let (reader, (mut writer, _)) = (reader.expect("connected"), accepted.expect("accepted"));
        let readable = async |ms| {
            tokio::time::timeout(Duration::from_millis(ms), reader.readable())
                .await
                .is_ok()
        };
        set_receive_low_water(&reader, 8).expect("set");
        writer.write_all(&[1; 4]).await.expect("written");
        assert!(!readable(200).await, "4 bytes queued, mark 8");
        writer.write_all(&[2; 4]).await.expect("written");
        assert!(readable(2_000).await, "8 bytes queued, mark 8");

        // Read until the socket says it would block, which clears the
        // readiness the runtime saw.
        let mut buf = [0; 16];
        assert_eq!(reader.try_read(&mut buf).expect("read"), 8);
        let drained = reader.try_read(&mut buf).expect_err("nothing left");
        assert_eq!(drained.kind(), io::ErrorKind::WouldBlock);
        writer.write_all(&[3; 2]).await.expect("written");
        assert!(!readable(200).await, "2 bytes queued, mark 8");
        set_receive_low_water(&reader, 1).expect("set");
        assert!(readable(2_000).await, "2 bytes queued, mark lowered to 1");
    }

    #[test]
    fn a_mark_no_c_int_holds_is_an_error_not_a_panic() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bound");
        assert!(set_receive_low_water(&socket, 16).is_ok());
        let error = set_receive_low_water(&socket, u32::MAX).expect_err("refused");
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
    }
}
