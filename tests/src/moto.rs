//! One moto server (SQS, SNS and DynamoDB on loopback) shared by the tests of a process.
//!
//! [`Moto::shared`] starts moto's server (through `tests/moto_server.py`, which serves DynamoDB
//! requests one at a time: moto's transactions are not isolated otherwise) with the Python of the
//! venv at `$FERRY_VENV` (default: `.venv` at the repository root, where `./scripts/setup.sh`
//! installs it) on a free loopback port the
//! first time a test asks, and returns the same server to every later caller in the process.
//! The server dies with the test process (see [`crate::process`]). When `$FERRY_TEST_MOTO_URL`
//! is set (`./scripts/test.sh` starts one server for the whole run and sets it), that server is
//! used instead and nothing is started.
//!
//! Tests share the server, so they name their queues and tables with [`crate::ids::unique`].
//! Clients use the region [`REGION`] and the static credentials [`ACCESS_KEY_ID`] /
//! [`SECRET_ACCESS_KEY`]; moto accepts any.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use tempfile::TempDir;
use tokio::sync::OnceCell;

use crate::ports::{accepts_connections, free_port, loopback};
use crate::process::{ChildProcess, workspace_root};
use crate::wait;

/// The region every client uses.
pub const REGION: &str = "us-east-1";
/// The static access key id every client uses.
pub const ACCESS_KEY_ID: &str = "ferry-test";
/// The static secret every client uses.
pub const SECRET_ACCESS_KEY: &str = "ferry-test-secret";
/// The account moto answers for (in queue URLs and ARNs).
pub const ACCOUNT_ID: &str = "123456789012";

const START_TIMEOUT: Duration = Duration::from_secs(30);
const START_ATTEMPTS: usize = 5;

static SHARED: OnceCell<Moto> = OnceCell::const_new();

/// A running moto server.
pub struct Moto {
    endpoint: String,
    // Held for the life of the server; `None` when it came from $FERRY_TEST_MOTO_URL.
    server: Option<(ChildProcess, TempDir)>,
}

impl Moto {
    /// The server of this test process, started on first use. Fails with a hint to run
    /// `./scripts/test.sh` when moto is not installed.
    pub async fn shared() -> anyhow::Result<&'static Moto> {
        SHARED.get_or_try_init(Self::start_or_connect).await
    }

    /// A server of the caller's own on a free port, which it may [`Self::kill`] and
    /// [`Self::restart`] (an outage); started even when `$FERRY_TEST_MOTO_URL` is set.
    pub async fn start_private() -> anyhow::Result<Moto> {
        let binary = venv_python()?;
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            match Self::start(&binary, free_port()?).await {
                Ok(moto) => return Ok(moto),
                Err(error) if format!("{error:#}").contains("Address already in use") => {
                    last_error = Some(error);
                }
                Err(error) => return Err(error),
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow::anyhow!("no attempt made")))
    }

    /// SIGKILL: the server is gone, and with it everything it held.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some((server, _)) = self.server.as_mut() {
            server.sigkill()?;
        }
        Ok(())
    }

    /// Starts a killed private server again on its port, empty.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill()?;
        let port = self
            .endpoint
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("the endpoint has a port")?;
        *self = Self::start(&venv_python()?, port).await?;
        Ok(())
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The SDK configuration every client of this server shares: region, static credentials,
    /// endpoint.
    fn sdk_config(&self) -> aws_config::SdkConfig {
        use aws_config::{BehaviorVersion, Region};
        use aws_sdk_sqs::config::{Credentials, SharedCredentialsProvider};
        aws_config::SdkConfig::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(REGION))
            .credentials_provider(SharedCredentialsProvider::new(Credentials::new(
                ACCESS_KEY_ID,
                SECRET_ACCESS_KEY,
                None,
                None,
                "ferry-tests",
            )))
            .endpoint_url(&self.endpoint)
            .build()
    }

    /// An SQS client for this server.
    pub fn sqs(&self) -> aws_sdk_sqs::Client {
        aws_sdk_sqs::Client::new(&self.sdk_config())
    }

    /// An SNS client for this server.
    pub fn sns(&self) -> aws_sdk_sns::Client {
        aws_sdk_sns::Client::new(&self.sdk_config())
    }

    /// A DynamoDB client for this server.
    pub fn dynamodb(&self) -> aws_sdk_dynamodb::Client {
        aws_sdk_dynamodb::Client::new(&self.sdk_config())
    }

    /// The environment that points an AWS SDK in a child process (such as `ferry-agent`) at
    /// this server: endpoint, region and static credentials.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_REGION", REGION.to_owned()),
            ("AWS_DEFAULT_REGION", REGION.to_owned()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY.to_owned()),
            ("AWS_EC2_METADATA_DISABLED", "true".to_owned()),
        ]
    }

    async fn start_or_connect() -> anyhow::Result<Moto> {
        if let Some(url) = std::env::var_os("FERRY_TEST_MOTO_URL") {
            let endpoint = url.to_string_lossy().trim_end_matches('/').to_owned();
            return Ok(Moto {
                endpoint,
                server: None,
            });
        }
        let binary = venv_python()?;
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            match Self::start(&binary, free_port()?).await {
                Ok(moto) => return Ok(moto),
                Err(error) if format!("{error:#}").contains("Address already in use") => {
                    last_error = Some(error);
                }
                Err(error) => return Err(error),
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow::anyhow!("no attempt made"))
            .context(format!(
                "moto found no free port in {START_ATTEMPTS} attempts"
            )))
    }

    async fn start(binary: &Path, port: u16) -> anyhow::Result<Moto> {
        let dir = tempfile::Builder::new()
            .prefix("ferry-test-moto-")
            .tempdir()
            .context("creating a temporary directory for moto")?;
        let mut command = Command::new(binary);
        command.arg(workspace_root().join("tests").join("moto_server.py"));
        command.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        let mut server = ChildProcess::spawn_in_temp_dir(command, "moto", dir.path())?;
        let addr = loopback(port);
        let what = format!("moto to accept connections on {addr}");
        let started = wait::poll(START_TIMEOUT, what, || {
            let step = match server.try_status() {
                Ok(Some(status)) => Err(anyhow::anyhow!("moto exited ({status})")),
                Ok(None) => Ok(accepts_connections(addr).then_some(())),
                Err(error) => Err(error),
            };
            std::future::ready(step)
        })
        .await;
        if let Err(error) = started {
            let output = server.output_tail();
            server.sigkill()?;
            return Err(error.context(output));
        }
        Ok(Moto {
            endpoint: format!("http://{addr}"),
            server: Some((server, dir)),
        })
    }
}

/// The venv's Python, which has moto.
fn venv_python() -> anyhow::Result<PathBuf> {
    let venv = std::env::var_os("FERRY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv"));
    let binary = venv.join("bin").join("python");
    if !binary.is_file() {
        bail!(
            "moto is not installed ({} does not exist): run ./scripts/test.sh, or \
             ./scripts/setup.sh to install the test dependencies only",
            binary.display()
        );
    }
    Ok(binary)
}
