//! Address templates at send time: [`Templated`] wraps every sender a route uses, so each
//! transport receives a plain address and none of them parses templates itself.
//!
//! A binding address without braces goes through untouched (no parse, no allocation). One
//! with placeholders is filled from the envelope ([`AddressTemplate::fill`]); a message that
//! lacks a named header, or whose value would put a wildcard into the address, fails with
//! [`SendError::Permanent`], so the route or the drainer dead-letters it like any other
//! message the destination can never take. The outbox and the DLQ keep the template, not the
//! filled address: a redrive fills it again, and metrics and spans are labelled by the
//! binding's address as configured (bounded cardinality).

use std::sync::Arc;

use ferry_shared::address::AddressTemplate;
use ferry_shared::envelope::Envelope;
use tokio::sync::watch;

use super::{Address, SendError, SendFuture, Sender};

/// A sender that fills address templates, then sends with the sender it wraps.
pub struct Templated {
    inner: Arc<dyn Sender>,
}

impl Templated {
    /// Wraps `inner`.
    pub fn wrap(inner: Arc<dyn Sender>) -> Arc<dyn Sender> {
        Arc::new(Self { inner })
    }
}

/// The address `address` names for `envelope`.
fn resolve(envelope: &Envelope, address: &Address) -> Result<Address, SendError> {
    AddressTemplate::parse(address.as_str())
        .and_then(|t| t.fill(envelope))
        .map(Address::from)
        .map_err(|e| SendError::Permanent(e.to_string()))
}

impl Sender for Templated {
    fn send<'a>(&'a self, envelope: &'a Envelope, address: &'a Address) -> SendFuture<'a> {
        if !address.as_str().contains(['{', '}']) {
            return self.inner.send(envelope, address);
        }
        Box::pin(async move {
            let filled = resolve(envelope, address)?;
            self.inner.send(envelope, &filled).await
        })
    }

    fn connected(&self) -> watch::Receiver<bool> {
        self.inner.connected()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::SystemTime;

    use ferry_shared::envelope::Source;
    use prost::bytes::Bytes;

    use super::*;

    #[derive(Default)]
    struct Recording {
        sent: Mutex<Vec<String>>,
    }

    impl Sender for Recording {
        fn send<'a>(&'a self, _: &'a Envelope, address: &'a Address) -> SendFuture<'a> {
            if let Ok(mut sent) = self.sent.lock() {
                sent.push(address.to_string());
            }
            Box::pin(async { Ok(()) })
        }

        fn connected(&self) -> watch::Receiver<bool> {
            watch::channel(true).1
        }
    }

    fn envelope(headers: &[(&str, &str)]) -> Envelope {
        Envelope::new(
            "m",
            Bytes::new(),
            Source::new("mqtt", "s", "in", SystemTime::UNIX_EPOCH),
        )
        .with_headers(headers)
    }

    #[tokio::test]
    async fn templates_are_filled_and_plain_addresses_pass_through() {
        let recording = Arc::new(Recording::default());
        let sender = Templated::wrap(recording.clone());
        let e = envelope(&[("site", "eu")]);
        sender
            .send(&e, &"events/{header:site}".into())
            .await
            .expect("ok");
        sender.send(&e, &"plain/topic".into()).await.expect("ok");
        let missing = sender
            .send(&envelope(&[]), &"events/{header:site}".into())
            .await;
        assert!(missing.is_err_and(|e| e.is_permanent()));
        let wildcard = sender
            .send(&envelope(&[("site", "#")]), &"events/{header:site}".into())
            .await;
        assert!(wildcard.is_err_and(|e| e.is_permanent()));
        let sent = recording.sent.lock().map(|s| s.clone()).unwrap_or_default();
        assert_eq!(sent, vec!["events/eu".to_owned(), "plain/topic".to_owned()]);
    }
}
