//! A private Mosquitto broker per test.
//!
//! [`Mosquitto::start`] runs the `mosquitto` binary (from the `PATH`, or `/usr/sbin/mosquitto`)
//! on a free loopback port with a configuration generated in a temporary directory:
//! anonymous access, no limit on queued or in-flight messages, `TCP_NODELAY`, and — unless
//! turned off — persistence in that directory, so a [`Mosquitto::stop`] and
//! [`Mosquitto::restart`] keep persistent sessions and their queued QoS 1/2 messages, as a real
//! broker outage would. The broker is killed when the value is dropped.
//!
//! Mosquitto writes its persistence file when it shuts down (SIGTERM, [`Mosquitto::stop`]) and
//! every `autosave_interval` seconds, so after [`Mosquitto::kill`] (SIGKILL) recent session state
//! is lost, as with a real crash; add `autosave_interval 1` with
//! [`MosquittoBuilder::config_line`] to narrow that window.
//!
//! [`MosquittoBuilder::unix_socket`] has the broker listen on a Unix socket in its directory as
//! well ([`Mosquitto::unix_url`]), as a broker beside the agent may.
//!
//! [`MosquittoBuilder::user`] adds a user with a password (hashed into a password file with
//! `mosquitto_passwd`): a client that names that user must give its password, while clients
//! without a user name stay anonymous, so test publishers and collectors need no credentials.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::ports::{accepts_connections, free_port, loopback};
use crate::process::ChildProcess;
use crate::wait;

/// How long a broker may take to accept connections, or to shut down on SIGTERM.
const START_TIMEOUT: Duration = Duration::from_secs(10);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The password file's name in the broker's directory.
const PASSWORD_FILE: &str = "passwords";
/// The Unix socket's name in the broker's directory.
const UNIX_SOCKET: &str = "mqtt.sock";
/// Attempts on new ports when another process takes the free port first.
const START_ATTEMPTS: usize = 5;

/// Options for a [`Mosquitto`]; [`Mosquitto::builder`] makes one.
#[derive(Debug, Clone)]
pub struct MosquittoBuilder {
    persistence: bool,
    unix_socket: bool,
    extra: Vec<String>,
    users: Vec<(String, String)>,
}

impl MosquittoBuilder {
    /// Keeps sessions and queued messages across [`Mosquitto::stop`] / [`Mosquitto::restart`]
    /// (on by default).
    pub fn persistence(mut self, on: bool) -> Self {
        self.persistence = on;
        self
    }

    /// Also listens on a Unix socket in the broker's directory ([`Mosquitto::unix_url`]).
    pub fn unix_socket(mut self) -> Self {
        self.unix_socket = true;
        self
    }

    /// Appends a line to the generated `mosquitto.conf` (for example a bridge `connection`
    /// block, one line per call).
    pub fn config_line(mut self, line: impl Into<String>) -> Self {
        self.extra.push(line.into());
        self
    }

    /// Adds a user that must authenticate with `password` (repeatable).
    pub fn user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.users.push((name.into(), password.into()));
        self
    }

    /// Starts the broker on a free loopback port and waits until it accepts connections.
    pub async fn start(self) -> anyhow::Result<Mosquitto> {
        let binary = mosquitto_binary()?;
        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::Builder::new()
                .prefix("ferry-test-mosquitto-")
                .tempdir()
                .context("creating a temporary directory for mosquitto")?;
            let mut broker = Mosquitto {
                binary: binary.clone(),
                config_path: dir.path().join("mosquitto.conf"),
                log_path: dir.path().join("mosquitto.log"),
                port: free_port()?,
                unix_socket: self.unix_socket.then(|| dir.path().join(UNIX_SOCKET)),
                process: None,
                dir,
            };
            std::fs::write(&broker.config_path, self.config(&broker))
                .with_context(|| format!("writing {}", broker.config_path.display()))?;
            self.write_password_file(&broker)?;
            match broker.launch().await {
                Ok(()) => return Ok(broker),
                // Another process took the port between `free_port` and the bind: try another.
                Err(error) if format!("{error:#}").contains("Address already in use") => {
                    last_error = Some(error);
                }
                Err(error) => return Err(error),
            }
        }
        Err(last_error
            .unwrap_or_else(|| anyhow::anyhow!("no attempt made"))
            .context(format!(
                "mosquitto found no free port in {START_ATTEMPTS} attempts"
            )))
    }

    fn config(&self, broker: &Mosquitto) -> String {
        let dir = broker.dir.path().display();
        let mut config = format!(
            "# Generated by ferry-tests for one test.\n\
             listener {port} 127.0.0.1\n\
             allow_anonymous true\n\
             max_queued_messages 0\n\
             max_inflight_messages 0\n\
             set_tcp_nodelay true\n\
             user root\n\
             log_dest file {log}\n\
             log_type error\n\
             log_type warning\n\
             log_type notice\n\
             log_type information\n\
             connection_messages true\n\
             log_timestamp_format %Y-%m-%dT%H:%M:%S\n",
            port = broker.port,
            log = broker.log_path.display(),
        );
        if let Some(path) = &broker.unix_socket {
            config.push_str(&format!("listener 0 {}\n", path.display()));
        }
        if self.persistence {
            // The location must end with a slash.
            config.push_str(&format!("persistence true\npersistence_location {dir}/\n"));
        } else {
            config.push_str("persistence false\n");
        }
        if !self.users.is_empty() {
            config.push_str(&format!(
                "password_file {}\n",
                broker.dir.path().join(PASSWORD_FILE).display()
            ));
        }
        for line in &self.extra {
            config.push_str(line);
            config.push('\n');
        }
        config
    }

    /// Writes the users as `name:password` lines and has `mosquitto_passwd -U` hash them in
    /// place.
    fn write_password_file(&self, broker: &Mosquitto) -> anyhow::Result<()> {
        if self.users.is_empty() {
            return Ok(());
        }
        let path = broker.dir.path().join(PASSWORD_FILE);
        let lines: String = self
            .users
            .iter()
            .map(|(name, password)| format!("{name}:{password}\n"))
            .collect();
        std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))?;
        let binary = broker.binary.with_file_name("mosquitto_passwd");
        let binary = if binary.is_file() {
            binary
        } else {
            PathBuf::from("mosquitto_passwd")
        };
        let output = Command::new(&binary)
            .arg("-U")
            .arg(&path)
            .output()
            .with_context(|| format!("running {}", binary.display()))?;
        if !output.status.success() {
            bail!(
                "mosquitto_passwd -U failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }
}

/// A Mosquitto broker on 127.0.0.1, owned by one test.
pub struct Mosquitto {
    binary: PathBuf,
    config_path: PathBuf,
    log_path: PathBuf,
    port: u16,
    unix_socket: Option<PathBuf>,
    process: Option<ChildProcess>,
    // Last, so the directory is removed after the process is gone.
    dir: TempDir,
}

impl Mosquitto {
    /// A builder, to turn persistence off or add configuration lines.
    pub fn builder() -> MosquittoBuilder {
        MosquittoBuilder {
            persistence: true,
            unix_socket: false,
            extra: Vec::new(),
            users: Vec::new(),
        }
    }

    /// Starts a broker with the default options (persistence on).
    pub async fn start() -> anyhow::Result<Self> {
        Self::builder().start().await
    }

    /// The broker's port (the same across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id of the broker last started (`None` after [`Self::stop`] or
    /// [`Self::kill`], until a restart).
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ChildProcess::pid)
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        loopback(self.port)
    }

    /// `tcp://127.0.0.1:PORT`, the form Ferry's configuration uses.
    pub fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// `unix:///…/mqtt.sock`, the broker's Unix socket, if it was built with
    /// [`MosquittoBuilder::unix_socket`].
    pub fn unix_url(&self) -> Option<String> {
        self.unix_socket
            .as_ref()
            .map(|path| format!("unix://{}", path.display()))
    }

    /// The temporary directory holding the configuration, log and persistence file.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The broker's log so far, across restarts, followed by anything it wrote to stderr
    /// (empty if it wrote nothing).
    pub fn log(&self) -> String {
        let mut text = read_lossy(&self.log_path);
        text.push_str(&read_lossy(&self.dir.path().join("mosquitto.stderr")));
        text
    }

    /// SIGSTOP: the broker keeps its connections open but answers nothing (a hung broker)
    /// until [`Self::cont`].
    pub fn stop_signal(&mut self) -> anyhow::Result<()> {
        self.process
            .as_mut()
            .context("mosquitto is not running")?
            .signal("STOP")
    }

    /// SIGCONT after [`Self::stop_signal`].
    pub fn cont(&mut self) -> anyhow::Result<()> {
        self.process
            .as_mut()
            .context("mosquitto is not running")?
            .signal("CONT")
    }

    /// True while the broker process runs.
    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(ChildProcess::is_running)
    }

    /// Shuts the broker down cleanly (SIGTERM, then waits; it saves its persistence file).
    /// Connections are refused until [`Self::restart`]. Does nothing if it is not running.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        let Some(mut process) = self.process.take() else {
            return Ok(());
        };
        if !process.is_running() {
            return Ok(());
        }
        process
            .terminate(STOP_TIMEOUT)
            .await
            .context("stopping mosquitto")?;
        Ok(())
    }

    /// Kills the broker (SIGKILL): a crash, without saving state. Does nothing if it is not
    /// running.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut process) = self.process.take() {
            process.sigkill().context("killing mosquitto")?;
        }
        Ok(())
    }

    /// Starts the broker again on the same port with the same configuration and state, stopping
    /// it first if it runs; waits until it accepts connections.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop().await?;
        // The port was ours a moment ago; mosquitto binds with SO_REUSEADDR, so only another
        // process taking it in between makes this fail.
        self.launch().await
    }

    async fn launch(&mut self) -> anyhow::Result<()> {
        // The log is appended to across restarts: only this run's lines count.
        let log_start = read_lossy(&self.log_path).len();
        let mut command = Command::new(&self.binary);
        command.arg("-c").arg(&self.config_path);
        let process = ChildProcess::spawn_in_temp_dir(command, "mosquitto", self.dir.path())?;
        let process = self.process.insert(process);
        let addr = loopback(self.port);
        let log_path = self.log_path.clone();
        let what = format!("mosquitto to accept connections on {addr}");
        let result = wait::poll(START_TIMEOUT, what, || {
            let step = if let Ok(Some(status)) = process.try_status() {
                // Final (bad configuration, port taken): no use waiting longer.
                Err(anyhow::anyhow!("mosquitto exited ({status})"))
            } else if read_lossy(&log_path)
                .get(log_start..)
                .is_some_and(|new| new.contains(" running"))
                && accepts_connections(addr)
            {
                Ok(Some(()))
            } else {
                Ok(None)
            };
            std::future::ready(step)
        })
        .await;
        if let Err(error) = result {
            let log = self.log();
            self.kill()?;
            return Err(error.context(format!("mosquitto log:\n{log}")));
        }
        Ok(())
    }
}

fn mosquitto_binary() -> anyhow::Result<PathBuf> {
    let from_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("mosquitto"))
            .find(|candidate| candidate.is_file())
    });
    let binary = from_path.unwrap_or_else(|| PathBuf::from("/usr/sbin/mosquitto"));
    if !binary.is_file() {
        bail!(
            "mosquitto is not installed (not on the PATH nor /usr/sbin): run ./scripts/setup.sh or ./scripts/test.sh"
        );
    }
    Ok(binary)
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}
