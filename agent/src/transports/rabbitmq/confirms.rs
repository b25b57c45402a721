//! Matching publisher confirms and returned messages to the sends they belong to.
//!
//! lapin hands each returned (unroutable, `mandatory`) message to whichever confirm it
//! completes next, and completes the tags of a `multiple` ack in hash order: under load the
//! return of one message rides on the confirm of another. Trusting that would fail a routable
//! message and, worse, report the unroutable one as accepted (a loss). So one task per session
//! collects every confirm and decides for all of them:
//!
//! - it awaits the confirms as they complete, and after each takes every other confirm that is
//!   already complete (lapin completes all tags of one ack in one step, so those are the ack's
//!   companions);
//! - it files every returned message it finds by (message id, exchange, routing key), the
//!   identity of a publish;
//! - then each completed send is decided: returned → permanent; ack → accepted; nack or an
//!   error (connection or channel lost) → transient.
//!
//! The broker sends a message's return before its ack, and acks a channel's publishes in
//! order, so when a confirm completes the return of its message has been filed.

use std::collections::HashMap;

use futures::FutureExt as _;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::{mpsc, oneshot};

use crate::transports::SendError;

/// Returned messages filed and not matched yet beyond this many are forgotten (they could
/// only come from sends that already gave up).
const MAX_UNMATCHED: usize = 10_000;

/// The identity of one publish: message id, exchange, routing key.
pub(crate) type PublishKey = (String, String, String);

/// A publish awaiting its confirm.
pub(crate) struct Awaiting {
    pub key: PublishKey,
    pub confirm: PublisherConfirm,
    pub reply: oneshot::Sender<Result<(), SendError>>,
}

type Completed = (
    PublishKey,
    oneshot::Sender<Result<(), SendError>>,
    lapin::Result<Confirmation>,
);

/// Runs until every [`Awaiting`] sender is dropped and every confirm is decided.
pub(crate) async fn collect(mut incoming: mpsc::UnboundedReceiver<Awaiting>) {
    let mut pending: FuturesUnordered<BoxFuture<'static, Completed>> = FuturesUnordered::new();
    let mut returned: HashMap<PublishKey, (usize, String)> = HashMap::new();
    let mut open = true;
    while open || !pending.is_empty() {
        let first = tokio::select! {
            item = incoming.recv(), if open => {
                match item {
                    Some(a) => pending.push(Box::pin(async move {
                        let confirmation = a.confirm.await;
                        (a.key, a.reply, confirmation)
                    })),
                    None => open = false,
                }
                continue;
            }
            Some(done) = pending.next(), if !pending.is_empty() => done,
        };
        let mut batch = vec![first];
        while let Some(Some(done)) = pending.next().now_or_never() {
            batch.push(done);
        }
        let mut decided = Vec::with_capacity(batch.len());
        for (key, reply, confirmation) in batch {
            let acked = match confirmation {
                Ok(c) => {
                    let ack = c.is_ack();
                    if let Some(r) = c.take_message() {
                        let d = &r.delivery;
                        let id = d
                            .properties
                            .message_id()
                            .as_ref()
                            .map(|s| s.as_str().to_owned())
                            .unwrap_or_default();
                        let entry = returned
                            .entry((id, d.exchange.to_string(), d.routing_key.to_string()))
                            .or_insert((0, String::new()));
                        entry.0 += 1;
                        entry.1 = format!("{} {}", r.reply_code, r.reply_text);
                    }
                    Ok(ack)
                }
                Err(e) => Err(e),
            };
            decided.push((key, reply, acked));
        }
        for (key, reply, acked) in decided {
            let outcome = match acked {
                Err(e) => Err(SendError::Transient(format!(
                    "no confirm from rabbitmq: {e}"
                ))),
                Ok(ack) => match take(&mut returned, &key) {
                    Some(reason) => Err(SendError::Permanent(format!(
                        "rabbitmq returned the message as unroutable ({reason}): no queue is bound for routing key \"{}\" on exchange \"{}\"",
                        key.2, key.1
                    ))),
                    None if ack => Ok(()),
                    None => Err(SendError::Transient(
                        "rabbitmq refused the message (nack)".into(),
                    )),
                },
            };
            reply.send(outcome).ok();
        }
        if returned.len() > MAX_UNMATCHED {
            tracing::warn!(
                unmatched = returned.len(),
                "forgetting returned rabbitmq messages no send claimed"
            );
            returned.clear();
        }
    }
}

/// Takes one filed return of `key`.
fn take(returned: &mut HashMap<PublishKey, (usize, String)>, key: &PublishKey) -> Option<String> {
    let (count, reason) = returned.get_mut(key)?;
    *count -= 1;
    let reason = reason.clone();
    if *count == 0 {
        returned.remove(key);
    }
    Some(reason)
}
