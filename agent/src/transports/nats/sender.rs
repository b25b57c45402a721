//! The NATS JetStream sender: a send resolves on the stream's publish acknowledgement.
//!
//! - The subject is the binding address (checked: plain tokens, no wildcards).
//! - `Nats-Msg-Id` is the Ferry message id, so a stream with a duplicate window stores a
//!   replayed message once (the ack then says `duplicate`, which is still acceptance).
//! - The outgoing headers (`ferry-message-id`, `traceparent`, the envelope's own) become NATS
//!   headers; the content type becomes `Content-Type`.
//! - Outcomes: the ack is acceptance; no stream captures the subject (no responders) is a
//!   permanent error that says so; a message over the server's `max_payload` is oversized;
//!   no ack within `send_timeout` is a timeout; anything else (connection lost, a stream
//!   refusing for now) is transient. While disconnected a send fails at once, and a send
//!   waiting for its ack fails (transient) as soon as the connection is lost: the message may
//!   or may not be stored, and a resend is dropped by its `Nats-Msg-Id`.
//!
//! Caveat: a JetStream that is still starting after a server restart can answer "no
//! responders" for a while too; such messages are dead-lettered and can be redriven.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use async_nats::Client;
use async_nats::header::{HeaderMap, HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, Context};
use ferry_shared::address::nats_subject;
use ferry_shared::envelope::Envelope;
use tokio::sync::watch;
use tokio::time::timeout;

use super::NatsSenderSettings;
use crate::transports::headers::{outgoing, remaining};
use crate::transports::{Address, SendError, SendFuture, Sender};

/// Publishes envelopes to JetStream on one NATS session.
#[derive(Debug)]
pub struct NatsSender {
    client: Arc<OnceLock<Client>>,
    context: OnceLock<Context>,
    settings: NatsSenderSettings,
    connected: watch::Receiver<bool>,
}

impl NatsSender {
    pub(crate) fn new(
        client: Arc<OnceLock<Client>>,
        settings: NatsSenderSettings,
        connected: watch::Receiver<bool>,
    ) -> Self {
        Self {
            client,
            context: OnceLock::new(),
            settings,
            connected,
        }
    }

    /// The JetStream context, made on first use (the client exists once the session's task
    /// ran).
    fn context(&self) -> Option<&Context> {
        if let Some(c) = self.context.get() {
            return Some(c);
        }
        let client = self.client.get()?.clone();
        Some(self.context.get_or_init(|| {
            jetstream::ContextBuilder::new()
                .timeout(self.settings.send_timeout)
                .build(client)
        }))
    }

    /// Publishes `envelope` to subject `address` and resolves on its acknowledgement.
    pub async fn send(&self, envelope: &Envelope, address: &Address) -> Result<(), SendError> {
        let subject = address.as_str();
        nats_subject(subject).map_err(SendError::Permanent)?;
        remaining(envelope, SystemTime::now())?;
        if !*self.connected.borrow() {
            return Err(SendError::Transient("not connected to nats".into()));
        }
        let context = self
            .context()
            .ok_or_else(|| SendError::Transient("not connected to nats".into()))?;
        let headers = headers_for(envelope)?;
        let limit = self.settings.send_timeout;
        let publish = async {
            let ack = context
                .publish_with_headers(subject.to_owned(), headers, envelope.payload.clone())
                .await?;
            ack.await
        };
        // The client does not fail a request whose connection died; the ack would only time
        // out. A lost connection fails the send at once instead, like every other sender.
        let mut connected = self.connected.clone();
        let lost = async move {
            connected.wait_for(|up| !*up).await.ok();
        };
        let acked = tokio::select! {
            acked = timeout(limit, publish) => acked,
            () = lost => {
                return Err(SendError::Transient(
                    "the connection to nats was lost before the publish was acknowledged".into(),
                ));
            }
        };
        match acked {
            Err(_) => Err(SendError::Timeout(limit)),
            Ok(Ok(_ack)) => Ok(()),
            Ok(Err(e)) => Err(match e.kind() {
                PublishErrorKind::StreamNotFound => SendError::Permanent(format!(
                    "no JetStream stream captures subject \"{subject}\" (create a stream whose subjects include it)"
                )),
                PublishErrorKind::MaxPayloadExceeded => SendError::Oversized(e.to_string()),
                PublishErrorKind::TimedOut => SendError::Timeout(limit),
                _ => SendError::Transient(format!("jetstream publish failed: {e}")),
            }),
        }
    }
}

/// The NATS headers of `envelope`. A key NATS cannot carry (non-ASCII, whitespace, `:`) or a
/// value with a line break is a permanent error.
fn headers_for(envelope: &Envelope) -> Result<HeaderMap, SendError> {
    let refused = |what: &str, text: &str| {
        SendError::Permanent(format!("NATS headers cannot carry {what} {text:?}"))
    };
    let value = |text: &str| HeaderValue::from_str(text).map_err(|_| refused("the value", text));
    let mut headers = HeaderMap::new();
    for (key, text) in outgoing(envelope) {
        let name = HeaderName::from_str(key).map_err(|_| refused("the key", key))?;
        headers.append(name, value(text)?);
    }
    if let Some(content_type) = &envelope.content_type {
        headers.insert("Content-Type", value(content_type)?);
    }
    headers.insert(NATS_MESSAGE_ID, value(&envelope.id)?);
    Ok(headers)
}

impl Sender for NatsSender {
    fn send<'a>(&'a self, envelope: &'a Envelope, address: &'a Address) -> SendFuture<'a> {
        Box::pin(NatsSender::send(self, envelope, address))
    }

    fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use ferry_shared::envelope::{MESSAGE_ID_HEADER, Source};
    use prost::bytes::Bytes;

    use super::*;

    const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    fn envelope(headers: &[(&str, &str)]) -> Envelope {
        let source = Source::new("mqtt", "s", "in", UNIX_EPOCH);
        let mut e = Envelope::new("id-1", Bytes::new(), source).with_headers(headers);
        e.content_type = Some("application/json".into());
        e.trace.traceparent = Some(TRACEPARENT.into());
        e
    }

    #[test]
    fn the_message_id_is_the_nats_msg_id_and_headers_are_kept() {
        let h =
            headers_for(&envelope(&[("site", "eu"), ("tag", "a"), ("tag", "b")])).expect("headers");
        let first = |k: &str| h.get(k).map(|v| v.as_str().to_owned());
        assert_eq!(first("Nats-Msg-Id").as_deref(), Some("id-1"));
        assert_eq!(first(MESSAGE_ID_HEADER).as_deref(), Some("id-1"));
        assert_eq!(first("site").as_deref(), Some("eu"));
        assert_eq!(first("Content-Type").as_deref(), Some("application/json"));
        assert!(first("traceparent").is_some());
        assert_eq!(h.get_all("tag").count(), 2);
    }

    #[test]
    fn headers_nats_cannot_carry_are_permanent_errors() {
        for (k, v) in [("a key", "v"), ("k:x", "v"), ("k", "line\nbreak")] {
            assert!(
                headers_for(&envelope(&[(k, v)])).is_err_and(|e| e.is_permanent()),
                "{k:?}={v:?}"
            );
        }
    }
}
