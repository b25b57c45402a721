//! A JetStream stream per test on the local NATS server.
//!
//! [`TestStream::create`] makes a stream named `{prefix}_<unique>` that captures the subjects
//! `{subject}.>` (the subject prefix is unique too) on the server named by `$FERRY_TEST_NATS`
//! (default `nats://127.0.0.1:4222`), with a two-minute duplicate window. Call
//! [`TestStream::delete`] at the end of the test.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, Context, stream};

use crate::{ids, wait};

/// The server used when `$FERRY_TEST_NATS` is not set.
pub const DEFAULT_URL: &str = "nats://127.0.0.1:4222";

/// The test server's URL.
pub fn url() -> String {
    std::env::var("FERRY_TEST_NATS").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// One message stored in a test stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its subject.
    pub subject: String,
    /// Its headers (first value of each).
    pub headers: Vec<(String, String)>,
    /// The body.
    pub payload: Vec<u8>,
}

impl Stored {
    /// The first value of header `key`.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A stream that exists until [`TestStream::delete`].
pub struct TestStream {
    /// The stream's name.
    pub name: String,
    /// The unique subject prefix; the stream captures `{subject}.>`.
    pub subject: String,
    /// A JetStream context on the test server.
    pub context: Context,
}

impl TestStream {
    /// Creates the stream.
    pub async fn create(prefix: &str) -> anyhow::Result<Self> {
        let url = url();
        let client = async_nats::connect(url.as_str())
            .await
            .with_context(|| format!("connecting to NATS at {url} (set FERRY_TEST_NATS)"))?;
        let context = jetstream::new(client);
        let unique = ids::unique(prefix).replace('-', "_");
        let subject = unique.to_lowercase();
        context
            .create_stream(stream::Config {
                name: unique.clone(),
                subjects: vec![format!("{subject}.>")],
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await?;
        Ok(Self {
            name: unique,
            subject,
            context,
        })
    }

    /// Every message the stream holds, in stream order.
    pub async fn messages(&self) -> anyhow::Result<Vec<Stored>> {
        let mut stream = self.context.get_stream(&self.name).await?;
        let last = stream.info().await?.state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            let m = stream.get_raw_message(seq).await?;
            let headers = m
                .headers
                .iter()
                .filter_map(|(k, v)| Some((k.to_string(), v.first()?.to_string())))
                .collect();
            out.push(Stored {
                subject: m.subject.to_string(),
                headers,
                payload: m.payload.to_vec(),
            });
        }
        Ok(out)
    }

    /// Waits until the stream holds `n` messages, and returns them.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> anyhow::Result<Vec<Stored>> {
        wait::until_ok(
            timeout,
            format!("{n} messages in stream {}", self.name),
            move || async move {
                let all = self.messages().await?;
                anyhow::ensure!(all.len() >= n, "{} so far", all.len());
                Ok(all)
            },
        )
        .await
    }

    /// Deletes the stream.
    pub async fn delete(self) -> anyhow::Result<()> {
        self.context.delete_stream(&self.name).await?;
        Ok(())
    }
}
