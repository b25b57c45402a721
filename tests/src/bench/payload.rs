//! The benchmark's messages: a sequence number and a send time, padded to a fixed size.
//!
//! A payload reads `{seq} {sent_ns}\n` followed by `.` padding up to [`PAYLOAD_BYTES`], so it
//! starts with its number as the harness's [`crate::mqtt::parse_seq`] expects. `sent_ns` is read
//! from a [`Clock`] shared by the publisher and the collectors of one process (monotonic, so a
//! wall-clock step cannot distort a latency). Warm-up probes carry [`PROBE`] instead.

use std::time::Instant;

/// The size of every benchmark message.
pub const PAYLOAD_BYTES: usize = 256;

/// The payload of a warm-up probe: it tells that a path is open, and is never measured.
pub const PROBE: &[u8] = b"probe";

/// Nanoseconds since the clock was made: the time base of send stamps and arrivals.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: Instant,
}

impl Clock {
    /// A clock starting at zero now.
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
        }
    }

    /// Nanoseconds since the clock was made.
    pub fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// What a received payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded {
    /// A measured message.
    Message { seq: u64, sent_ns: u64 },
    /// A warm-up probe.
    Probe,
    /// Anything else.
    Unparsed,
}

/// The payload of message `seq` sent at `sent_ns`, [`PAYLOAD_BYTES`] long.
pub fn encode(seq: u64, sent_ns: u64) -> Vec<u8> {
    let mut payload = format!("{seq} {sent_ns}\n").into_bytes();
    payload.resize(PAYLOAD_BYTES.max(payload.len()), b'.');
    payload
}

/// Reads a payload made by [`encode`], or a [`PROBE`].
pub fn decode(payload: &[u8]) -> Decoded {
    if payload == PROBE {
        return Decoded::Probe;
    }
    let Some(end) = payload.iter().position(|&byte| byte == b'\n') else {
        return Decoded::Unparsed;
    };
    let parsed = std::str::from_utf8(&payload[..end])
        .ok()
        .and_then(|head| head.split_once(' '))
        .and_then(|(seq, sent)| Some((seq.parse().ok()?, sent.parse().ok()?)));
    match parsed {
        Some((seq, sent_ns)) => Decoded::Message { seq, sent_ns },
        None => Decoded::Unparsed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_at_a_fixed_size() {
        let payload = encode(1234, 987_654_321);
        assert_eq!(payload.len(), PAYLOAD_BYTES);
        assert_eq!(
            decode(&payload),
            Decoded::Message {
                seq: 1234,
                sent_ns: 987_654_321
            }
        );
        assert_eq!(crate::mqtt::parse_seq(&payload), Some(1234));
    }

    #[test]
    fn probes_and_noise_are_told_apart() {
        assert_eq!(decode(PROBE), Decoded::Probe);
        assert_eq!(decode(b"hello"), Decoded::Unparsed);
        assert_eq!(decode(b"1 x\n"), Decoded::Unparsed);
    }
}
