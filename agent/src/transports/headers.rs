//! What every sender writes besides the payload: the outgoing header list and the remaining
//! time to live, the same for each transport.
//!
//! Outgoing headers are the envelope's headers minus the reserved keys, then
//! `ferry-message-id` with the envelope id (always), then `traceparent` / `tracestate` from
//! the trace context. So a consumer finds the same keys whatever the transport, and a header
//! that claims another message's id or trace never leaves.

use std::time::{Duration, SystemTime};

use ferry_shared::envelope::{Envelope, MESSAGE_ID_HEADER};

use super::SendError;

/// The W3C trace context header.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// The W3C trace state header.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// Keys the senders write from envelope fields rather than from the headers.
pub(crate) fn is_reserved(key: &str) -> bool {
    key == MESSAGE_ID_HEADER || key == TRACEPARENT_HEADER || key == TRACESTATE_HEADER
}

/// The header pairs to send with `envelope`, in order. An iterator, not a
/// list: the MQTT encoder walks it twice (sizes, then bytes) and allocates
/// nothing for it.
pub(crate) fn outgoing(envelope: &Envelope) -> impl Iterator<Item = (&str, &str)> + Clone {
    let own = envelope
        .headers
        .iter()
        .filter(|(k, _)| !is_reserved(k))
        .map(|(k, v)| (k.as_str(), v.as_str()));
    let trace = [
        (TRACEPARENT_HEADER, envelope.trace.traceparent.as_deref()),
        (TRACESTATE_HEADER, envelope.trace.tracestate.as_deref()),
    ];
    own.chain(std::iter::once((MESSAGE_ID_HEADER, envelope.id.as_str())))
        .chain(trace.into_iter().filter_map(|(k, v)| Some((k, v?))))
}

/// How long `envelope` has left at `now` (`None`: it never expires). An envelope whose expiry
/// has passed is a permanent error: it can never be delivered in time.
pub(crate) fn remaining(
    envelope: &Envelope,
    now: SystemTime,
) -> Result<Option<Duration>, SendError> {
    match envelope.expires_at {
        None => Ok(None),
        Some(at) => match at.duration_since(now) {
            Ok(left) if !left.is_zero() => Ok(Some(left)),
            _ => Err(SendError::Permanent(
                "the message expired before it was sent".into(),
            )),
        },
    }
}
