//! An AWS session: the SDK configuration of one `sqs` or `sns` session, the
//! clients built from it, and its connected state.
//!
//! There is no connection to hold: "connected" means the service answered
//! the last call. The session starts disconnected and probes the service
//! (`ListQueues` / `ListTopics`, one result) once a second until it answers;
//! any call that finds it unreachable (dispatch failure, timeout) marks it
//! disconnected again and the probing resumes. An answer of any kind,
//! an error included, counts as reachable. So the drainer's gate and
//! `direct_hold` wait out an outage without spending their retry budgets.
//!
//! The SDK configuration comes from the standard chain (environment, profile,
//! web identity, container and instance metadata) with the session's
//! `region` and `endpoint_url` on top; it is loaded once, by the first task
//! that needs a client. Credentials never reach a log line.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};
use tokio::sync::{OnceCell, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::error::AwsError;
use crate::transports::Session;

/// How long the session waits between probes while the service is
/// unreachable.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Bound of one connection attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound of one call attempt: above the longest long poll (20 s), so a
/// connection that never answers cannot hang a receiver.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// The service a session talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    /// Amazon SQS.
    Sqs,
    /// Amazon SNS.
    Sns,
}

/// Where and how an AWS session connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AwsSessionSettings {
    /// The session's id (logs, envelopes' source).
    pub id: String,
    /// The service.
    pub service: Service,
    /// Region; `None`: the SDK's region chain.
    pub region: Option<String>,
    /// Endpoint override (an emulator).
    pub endpoint_url: Option<String>,
}

/// An SDK configuration from the standard chain with `region` and
/// `endpoint_url` on top, connections bounded by 3 s and each call attempt by
/// `attempt_timeout`: what the AWS sessions and the DynamoDB stores
/// (`crate::stores::dynamodb`) build their clients from.
pub(crate) async fn sdk_config(
    region: Option<&str>,
    endpoint_url: Option<&str>,
    attempt_timeout: Duration,
) -> aws_config::SdkConfig {
    let timeouts = TimeoutConfig::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .operation_attempt_timeout(attempt_timeout)
        .build();
    let mut loader = aws_config::defaults(BehaviorVersion::latest()).timeout_config(timeouts);
    if let Some(region) = region {
        loader = loader.region(Region::new(region.to_owned()));
    }
    if let Some(endpoint) = endpoint_url {
        loader = loader.endpoint_url(endpoint);
    }
    loader.load().await
}

/// What the session's tasks, receiver and senders share.
pub(crate) struct Shared {
    pub settings: AwsSessionSettings,
    pub token: CancellationToken,
    sdk: OnceCell<aws_config::SdkConfig>,
    sqs: OnceCell<aws_sdk_sqs::Client>,
    sns: OnceCell<aws_sdk_sns::Client>,
    connected: watch::Sender<bool>,
    ever_connected: AtomicBool,
    reconnects: AtomicU64,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    async fn sdk(&self) -> &aws_config::SdkConfig {
        self.sdk
            .get_or_init(|| {
                sdk_config(
                    self.settings.region.as_deref(),
                    self.settings.endpoint_url.as_deref(),
                    ATTEMPT_TIMEOUT,
                )
            })
            .await
    }

    /// The SQS client.
    pub async fn sqs(&self) -> &aws_sdk_sqs::Client {
        self.sqs
            .get_or_init(|| async { aws_sdk_sqs::Client::new(self.sdk().await) })
            .await
    }

    /// The SNS client.
    pub async fn sns(&self) -> &aws_sdk_sns::Client {
        self.sns
            .get_or_init(|| async { aws_sdk_sns::Client::new(self.sdk().await) })
            .await
    }

    /// The connected state.
    pub fn connected(&self) -> watch::Receiver<bool> {
        self.connected.subscribe()
    }

    /// Records what a call found out about the service: it answered, or it
    /// could not be reached.
    pub fn observed<T>(&self, result: &Result<T, AwsError>) {
        match result {
            Err(e) if e.unreachable => self.set_connected(false),
            _ => self.set_connected(true),
        }
    }

    fn set_connected(&self, up: bool) {
        let changed = self.connected.send_if_modified(|c| {
            let changed = *c != up;
            *c = up;
            changed
        });
        if !changed {
            return;
        }
        if up {
            if self.ever_connected.swap(true, Ordering::Relaxed) {
                self.reconnects.fetch_add(1, Ordering::Relaxed);
            }
            tracing::info!(session = %self.settings.id, "AWS service reachable");
        } else {
            tracing::warn!(session = %self.settings.id, "AWS service unreachable");
        }
    }

    /// Runs `task` until the session's token fires; [`AwsSession::stopped`]
    /// waits for it.
    pub fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(task);
        self.tasks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(handle);
    }

    async fn probe(&self) -> Result<(), AwsError> {
        match self.settings.service {
            Service::Sqs => self
                .sqs()
                .await
                .list_queues()
                .max_results(1)
                .send()
                .await
                .map(drop)
                .map_err(|e| super::error::classify("ListQueues", &e)),
            Service::Sns => self
                .sns()
                .await
                .list_topics()
                .send()
                .await
                .map(drop)
                .map_err(|e| super::error::classify("ListTopics", &e)),
        }
    }
}

/// One `sqs` or `sns` session.
pub struct AwsSession {
    pub(crate) shared: Arc<Shared>,
}

impl AwsSession {
    /// Starts the session's prober; everything stops when `token` fires.
    pub fn start(settings: AwsSessionSettings, token: CancellationToken) -> Self {
        let shared = Arc::new(Shared {
            settings,
            token,
            sdk: OnceCell::new(),
            sqs: OnceCell::new(),
            sns: OnceCell::new(),
            connected: watch::Sender::new(false),
            ever_connected: AtomicBool::new(false),
            reconnects: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
        });
        let prober = Arc::clone(&shared);
        shared.spawn(async move { prober_loop(prober).await });
        Self { shared }
    }

    /// Resolves once every task of the session has ended (after its token
    /// fired).
    pub async fn stopped(self) {
        loop {
            let tasks: Vec<_> = std::mem::take(
                &mut *self
                    .shared
                    .tasks
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
            );
            if tasks.is_empty() {
                return;
            }
            for task in tasks {
                if let Err(e) = task.await
                    && e.is_panic()
                {
                    tracing::error!(session = %self.shared.settings.id, "an AWS session task panicked");
                }
            }
        }
    }
}

/// Probes the service while it is unreachable.
async fn prober_loop(shared: Arc<Shared>) {
    let mut connected = shared.connected.subscribe();
    loop {
        tokio::select! {
            () = shared.token.cancelled() => return,
            down = connected.wait_for(|up| !*up) => if down.is_err() { return },
        }
        let result = tokio::select! {
            () = shared.token.cancelled() => return,
            result = shared.probe() => result,
        };
        shared.observed(&result);
        if let Err(e) = result {
            tracing::debug!(session = %shared.settings.id, error = %e.error, "probe failed");
            tokio::select! {
                () = shared.token.cancelled() => return,
                () = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
        }
    }
}

impl Session for AwsSession {
    fn connected(&self) -> watch::Receiver<bool> {
        self.shared.connected()
    }

    fn reconnects(&self) -> u64 {
        self.shared.reconnects.load(Ordering::Relaxed)
    }
}
