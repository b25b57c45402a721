//! Coalescing concurrent sends into batch calls (`SendMessageBatch`,
//! `PublishBatch`).
//!
//! Invariants:
//!
//! - **Each caller gets its own entry's result**: each entry resolves with
//!   what the service said about that entry (a missing answer is
//!   transient). A transient failure of the whole call fails every entry of
//!   it. A permanent one (a request-level validation error, which a single
//!   bad entry can cause) sends each entry again on its own, so only the bad
//!   one fails.
//! - **Order is kept**: entries leave in the order their sends were queued,
//!   one batch call at a time, so sends started one after the other on the
//!   same sender reach the service in that order (FIFO groups rely on it).
//! - A batch holds at most [`MAX_ENTRIES`] entries and at most
//!   [`MAX_MESSAGE_BYTES`] in total; an entry that would overflow it waits
//!   for the next one. Nothing waits for a batch to fill: a batch is what
//!   was queued by the time the previous call returned.
//! - When the session's token fires, queued entries fail with a transient
//!   error and the task ends.

use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::message::{MAX_MESSAGE_BYTES, Outgoing};
use crate::transports::SendError;

/// Most entries of one batch call.
pub const MAX_ENTRIES: usize = 10;

/// Sends queued before the batcher takes them; senders wait beyond it.
const QUEUE: usize = 1024;

/// The service's batch call.
pub(crate) trait BatchSink: Send + Sync + 'static {
    /// Sends `batch` in one call; one result per entry, in the batch's
    /// order.
    fn send_batch<'a>(&'a self, batch: &'a [Outgoing])
    -> BoxFuture<'a, Vec<Result<(), SendError>>>;
}

impl<T: BatchSink + ?Sized> BatchSink for std::sync::Arc<T> {
    fn send_batch<'a>(
        &'a self,
        batch: &'a [Outgoing],
    ) -> BoxFuture<'a, Vec<Result<(), SendError>>> {
        (**self).send_batch(batch)
    }
}

struct Pending {
    message: Outgoing,
    done: oneshot::Sender<Result<(), SendError>>,
}

/// Queues sends for one sink's batching task.
#[derive(Clone)]
pub(crate) struct Batcher {
    queue: mpsc::Sender<Pending>,
}

impl Batcher {
    /// Starts the batching task of `sink` with `spawn`, until `token` fires.
    pub fn start(
        sink: impl BatchSink,
        token: CancellationToken,
        spawn: impl FnOnce(BoxFuture<'static, ()>),
    ) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        spawn(Box::pin(run(sink, rx, token)));
        Self { queue }
    }

    /// Queues `message` and resolves with its entry's result.
    pub async fn send(&self, message: Outgoing) -> Result<(), SendError> {
        let (done, result) = oneshot::channel();
        let stopped = || SendError::Transient("the session stopped".into());
        self.queue
            .send(Pending { message, done })
            .await
            .map_err(|_| stopped())?;
        result.await.unwrap_or_else(|_| Err(stopped()))
    }
}

async fn run(sink: impl BatchSink, mut rx: mpsc::Receiver<Pending>, token: CancellationToken) {
    let mut carry: Option<Pending> = None;
    loop {
        let first = match carry.take() {
            Some(p) => p,
            None => tokio::select! {
                () = token.cancelled() => break,
                p = rx.recv() => match p {
                    Some(p) => p,
                    None => return,
                },
            },
        };
        let mut size = first.message.size;
        let mut batch = vec![first];
        while batch.len() < MAX_ENTRIES {
            match rx.try_recv() {
                Ok(p) if size + p.message.size > MAX_MESSAGE_BYTES => {
                    carry = Some(p);
                    break;
                }
                Ok(p) => {
                    size += p.message.size;
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        let (messages, waiters): (Vec<Outgoing>, Vec<_>) =
            batch.into_iter().map(|p| (p.message, p.done)).unzip();
        let results = tokio::select! {
            () = token.cancelled() => {
                fail(waiters);
                break;
            }
            results = send(&sink, &messages) => results,
        };
        let mut results = results.into_iter();
        for waiter in waiters {
            let result = results.next().unwrap_or_else(|| {
                Err(SendError::Transient(
                    "the service did not answer for this entry".into(),
                ))
            });
            waiter.send(result).ok();
        }
    }
    rx.close();
    fail(carry.into_iter().map(|p| p.done));
    while let Ok(p) = rx.try_recv() {
        fail([p.done]);
    }
}

/// One batch call; a batch refused as a whole for a permanent reason is sent
/// again entry by entry.
async fn send(sink: &impl BatchSink, messages: &[Outgoing]) -> Vec<Result<(), SendError>> {
    let results = sink.send_batch(messages).await;
    let refused_whole = messages.len() > 1
        && results.len() == messages.len()
        && results
            .iter()
            .all(|r| r.as_ref().is_err_and(SendError::is_permanent));
    if !refused_whole {
        return results;
    }
    let mut one_by_one = Vec::with_capacity(messages.len());
    for m in messages {
        let mut r = sink.send_batch(std::slice::from_ref(m)).await;
        one_by_one.push(r.pop().unwrap_or_else(|| {
            Err(SendError::Transient(
                "the service did not answer for this entry".into(),
            ))
        }));
    }
    one_by_one
}

fn fail(waiters: impl IntoIterator<Item = oneshot::Sender<Result<(), SendError>>>) {
    for waiter in waiters {
        waiter
            .send(Err(SendError::Transient("the session stopped".into())))
            .ok();
    }
}

/// Entry ids of a batch call: the entry's index.
pub(crate) fn entry_id(index: usize) -> String {
    index.to_string()
}

/// The results of a batch call, one per entry in order: `ok` lists the ids
/// that succeeded, `failed` the `(id, error)` of the rest.
pub(crate) fn results(
    entries: usize,
    ok: impl IntoIterator<Item = String>,
    failed: impl IntoIterator<Item = (String, SendError)>,
) -> Vec<Result<(), SendError>> {
    let mut out: Vec<Result<(), SendError>> = (0..entries)
        .map(|_| {
            Err(SendError::Transient(
                "the service did not answer for this entry".into(),
            ))
        })
        .collect();
    let index = |id: &str| id.parse::<usize>().ok().filter(|i| *i < entries);
    for id in ok {
        if let Some(i) = index(&id) {
            out[i] = Ok(());
        }
    }
    for (id, error) in failed {
        if let Some(i) = index(&id) {
            out[i] = Err(error);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn message(body: &str, size: usize) -> Outgoing {
        Outgoing {
            body: body.into(),
            attributes: Vec::new(),
            group_id: None,
            dedup_id: None,
            size,
        }
    }

    /// Records batch sizes; fails bodies starting with `bad`.
    struct Recorder(Arc<Mutex<Vec<usize>>>);

    impl BatchSink for Recorder {
        fn send_batch<'a>(
            &'a self,
            batch: &'a [Outgoing],
        ) -> BoxFuture<'a, Vec<Result<(), SendError>>> {
            Box::pin(async move {
                self.0.lock().expect("lock").push(batch.len());
                tokio::task::yield_now().await;
                batch
                    .iter()
                    .map(|m| {
                        if m.body.starts_with("bad") {
                            Err(SendError::Permanent("InvalidParameterValue".into()))
                        } else {
                            Ok(())
                        }
                    })
                    .collect()
            })
        }
    }

    #[tokio::test]
    async fn concurrent_sends_share_batches_and_keep_their_results() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let token = CancellationToken::new();
        let batcher = Batcher::start(Recorder(Arc::clone(&sizes)), token.clone(), |f| {
            drop(tokio::spawn(f));
        });
        let sends = (0..25).map(|i| {
            let b = batcher.clone();
            let body = if i == 7 {
                "bad".to_owned()
            } else {
                format!("m{i}")
            };
            async move { b.send(message(&body, 10)).await }
        });
        let results = futures::future::join_all(sends).await;
        for (i, r) in results.iter().enumerate() {
            assert_eq!(r.is_ok(), i != 7, "entry {i}: {r:?}");
        }
        let sizes = sizes.lock().expect("lock").clone();
        assert_eq!(sizes.iter().sum::<usize>(), 25);
        assert!(sizes.iter().all(|n| *n <= MAX_ENTRIES));
        assert!(sizes.len() < 25, "coalesced: {sizes:?}");
        token.cancel();
    }

    #[tokio::test]
    async fn a_batch_stays_within_the_size_limit() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let token = CancellationToken::new();
        let batcher = Batcher::start(Recorder(Arc::clone(&sizes)), token.clone(), |f| {
            drop(tokio::spawn(f));
        });
        let sends = (0..4).map(|_| {
            let b = batcher.clone();
            async move { b.send(message("x", MAX_MESSAGE_BYTES / 2)).await }
        });
        for r in futures::future::join_all(sends).await {
            assert!(r.is_ok());
        }
        assert!(sizes.lock().expect("lock").iter().all(|n| *n <= 2));
        token.cancel();
    }

    /// Refuses any batch holding a body starting with `bad` as a whole.
    struct Strict;

    impl BatchSink for Strict {
        fn send_batch<'a>(
            &'a self,
            batch: &'a [Outgoing],
        ) -> BoxFuture<'a, Vec<Result<(), SendError>>> {
            let bad = batch.iter().any(|m| m.body.starts_with("bad"));
            Box::pin(async move {
                batch
                    .iter()
                    .map(|_| {
                        if bad {
                            Err(SendError::Permanent("InvalidParameterValue".into()))
                        } else {
                            Ok(())
                        }
                    })
                    .collect()
            })
        }
    }

    #[tokio::test]
    async fn a_batch_refused_as_a_whole_is_retried_entry_by_entry() {
        let batch = [message("a", 1), message("bad", 1), message("c", 1)];
        let results = send(&Strict, &batch).await;
        assert_eq!(results[0], Ok(()));
        assert!(results[1].as_ref().is_err_and(SendError::is_permanent));
        assert_eq!(results[2], Ok(()));
    }

    #[test]
    fn results_by_entry_id() {
        let r = results(
            3,
            ["0".to_owned(), "2".to_owned()],
            [("1".to_owned(), SendError::Permanent("x".into()))],
        );
        assert_eq!(r[0], Ok(()));
        assert_eq!(r[1], Err(SendError::Permanent("x".into())));
        assert_eq!(r[2], Ok(()));
        assert!(results(1, [], [])[0].is_err());
    }
}
