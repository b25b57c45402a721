//! Answers read in batches: a plain TCP connection's receive low-water mark
//! (`SO_RCVLOWAT`) follows the answers the broker owes it
//! (`docs/adr/0019-mqtt-receive-low-water.md`).
//!
//! A broker acknowledges each publish in a write of its own, so a sender
//! with a window of publishes in flight was woken, and read, once for every
//! one or two PUBACKs: most of the agent's system calls and context switches
//! in a flat-out fan-out. With the mark at an eighth to a quarter of what
//! is owed the kernel wakes the event loop once that much has arrived, and
//! one read takes it; the rest keep the window busy meanwhile.
//!
//! Invariants:
//!
//! 1. **The owed answers always reach the mark.** Every answer the loop
//!    awaits is at least [`ANSWER_BYTES`] long on the wire (PUBACK, PUBREC
//!    and PUBCOMP 4 in both versions, SUBACK 5 in v3.1.1 and 6 in v5). With `owed` answers
//!    outstanding, at most one of them partly read into the loop's buffer,
//!    at least `4 × (owed − 1) + 1` bytes are still to arrive; [`mark`] never
//!    asks for more (it asks for at most `owed` bytes). So a loop waiting to
//!    read is woken by the answers themselves, never left waiting for bytes
//!    no one owes it. The mark is set again before every wait, after the
//!    reads that lowered `owed`. A QoS 2 publish whose PUBREC was read
//!    counts as owed its PUBCOMP: the loop waits to read only once it has
//!    nothing left to write, so the PUBREL that PUBCOMP answers is out by
//!    then, and a broker answers each PUBREL on its own.
//! 2. **Nothing else waits behind it.** A PINGRESP (2 bytes) is awaited with
//!    the mark at 1; the end of the connection (FIN, reset) wakes a reader
//!    whatever the mark. A session that receives (one with a receiver) keeps
//!    the mark at 1, so the publishes and PUBRELs a broker sends it never
//!    wait behind answers. Left behind the mark: a broker's DISCONNECT that
//!    it does not follow by closing the connection (MQTT v5 §3.14.4 says it
//!    must), read with the answers or at the next PINGREQ.
//! 3. **Plain TCP on Linux only.** Under TLS, rustls holds the bytes of a
//!    partly read record, which the kernel no longer counts, so invariant 1
//!    could not be kept: a TLS connection reads every answer as it comes.
//!    Linux wakes a reader when a mark is lowered under what is queued (since
//!    4.20); elsewhere the mark stays at 1. A Unix socket (ADR 0020) gets no
//!    mark either: its poll reports it readable for any byte whatever the
//!    mark, so one would only cost system calls.
//! 4. **A mark that cannot be set costs speed, not messages.** If raising
//!    it fails, the mark goes back to 1 and stays there for the connection;
//!    only a mark that cannot be lowered ends the connection, which must not
//!    wait on it.
//! 5. **Few system calls.** The mark moves in powers of two, so it is set
//!    again only when what is owed crosses one.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

/// The fewest bytes of an answer the loop awaits: a PUBACK, PUBREC or
/// PUBCOMP of a v3.1.1 or v5 broker (fixed header and packet id, v5's reason
/// code and properties omitted on success).
const ANSWER_BYTES: u32 = 4;

/// The low-water mark for `owed` answers: [`ANSWER_BYTES`] times a quarter
/// of them rounded down to a power of two (so between an eighth and a
/// quarter of the answers); 1 (the kernel's default: any byte) below eight.
fn mark(owed: usize) -> u32 {
    let quarter = owed / 4;
    if quarter < 2 {
        return 1;
    }
    let power = 1_usize << quarter.ilog2();
    u32::try_from(power).map_or(u32::MAX, |p| p.saturating_mul(ANSWER_BYTES))
}

/// The mark of one connection's socket.
pub(super) struct LowWater {
    /// A duplicate of a plain TCP connection's descriptor (the same socket;
    /// the stream itself is boxed behind a trait); `None` under TLS.
    socket: Option<OwnedFd>,
    /// The session's client id, for the warning when the mark fails.
    client_id: String,
    /// The mark set on the socket.
    set: u32,
}

impl LowWater {
    /// For the plain TCP connection of session `client_id`: its mark
    /// follows the answers owed (on Linux; see invariant 3). Without a
    /// descriptor to spare, the mark stays at 1.
    pub fn of(socket: &impl AsFd, client_id: &str) -> Self {
        if !cfg!(target_os = "linux") {
            return LowWater::none();
        }
        match socket.as_fd().try_clone_to_owned() {
            Ok(socket) => LowWater {
                socket: Some(socket),
                client_id: client_id.to_owned(),
                set: 1,
            },
            Err(error) => {
                read_one_by_one(client_id, &error);
                LowWater::none()
            }
        }
    }

    /// For a connection whose mark stays at 1 (TLS, see invariant 3).
    pub fn none() -> Self {
        LowWater {
            socket: None,
            client_id: String::new(),
            set: 1,
        }
    }

    /// Sets the mark for `owed` answers, if it changed (invariant 4). An
    /// error means the mark could not be lowered: the caller ends the
    /// connection rather than wait on it.
    pub fn follow(&mut self, owed: usize) -> io::Result<()> {
        let Some(socket) = &self.socket else {
            return Ok(());
        };
        let want = mark(owed);
        if want == self.set {
            return Ok(());
        }
        match ferry_sockopt::set_receive_low_water(socket, want) {
            Ok(()) => self.set = want,
            Err(error) if want > self.set => {
                read_one_by_one(&self.client_id, &error);
                // A mark above 1 must come down before the socket is let go.
                if self.set > 1 {
                    ferry_sockopt::set_receive_low_water(socket, 1)?;
                }
                *self = LowWater::none();
            }
            Err(error) => return Err(error),
        }
        Ok(())
    }
}

/// The warning when a connection cannot batch its reads.
fn read_one_by_one(client_id: &str, error: &io::Error) {
    tracing::warn!(
        client_id,
        %error,
        "MQTT: no receive low-water mark; acknowledgements are read one by one"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Invariant 1 for every count of answers a connection can owe (packet
    /// ids are 16 bits).
    #[test]
    fn the_mark_never_asks_for_more_than_the_owed_answers_send() {
        for owed in 0..=usize::from(u16::MAX) {
            let still_to_come = (owed as u64).saturating_sub(1) * u64::from(ANSWER_BYTES) + 1;
            assert!(
                u64::from(mark(owed)) <= still_to_come.max(1),
                "{owed} owed: mark {}",
                mark(owed)
            );
        }
    }

    /// Invariant 4, on a descriptor that takes no socket option (a pipe's):
    /// a mark that cannot be raised from 1 leaves the connection reading at
    /// 1 for good; one that cannot be lowered, or raised from above 1 and
    /// then not brought back to 1, is an error.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_mark_that_cannot_be_raised_stays_at_1_and_one_that_cannot_be_lowered_is_an_error() {
        let (pipe, _writer) = std::io::pipe().expect("a pipe");
        let not_a_socket = || Some(OwnedFd::from(pipe.try_clone().expect("a descriptor")));
        let mut raised = LowWater {
            socket: not_a_socket(),
            client_id: "c".into(),
            set: 1,
        };
        assert!(raised.follow(64).is_ok(), "reads one by one instead");
        assert!(raised.socket.is_none() && raised.set == 1);

        let mut lowered = LowWater {
            socket: not_a_socket(),
            client_id: "c".into(),
            set: 64,
        };
        assert!(lowered.follow(0).is_err(), "the caller ends the connection");

        // Raised from above 1, it must come back to 1 before the loop reads
        // one by one; if it cannot, the connection ends too.
        let mut raised_from_8 = LowWater {
            socket: not_a_socket(),
            client_id: "c".into(),
            set: 8,
        };
        assert!(raised_from_8.follow(64).is_err());
    }

    #[test]
    fn the_mark_is_a_quarter_of_the_owed_answers_in_powers_of_two() {
        let marks: Vec<u32> = [0, 1, 3, 4, 7, 8, 15, 16, 63, 64, 100]
            .into_iter()
            .map(mark)
            .collect();
        assert_eq!(marks, [1, 1, 1, 1, 1, 8, 8, 16, 32, 64, 64]);
    }
}
