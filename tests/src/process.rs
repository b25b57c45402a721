//! Child processes: the project's binaries (and the servers the harness starts).
//!
//! A [`ChildProcess`] writes its stdout and stderr to files (in its own temporary directory, or
//! one the caller gives), so a failing test can print them, and a test can wait for a log line.
//! SIGKILL uses [`std::process::Child::kill`]; SIGTERM goes through `sh -c 'kill -TERM PID'`
//! (no `unsafe`, no extra dependency).
//!
//! **Nothing outlives the test process.** Each child gets a watchdog: an `sh` process that reads
//! its stdin, a pipe whose write end only the test process holds, and SIGKILLs the child when it
//! reads end-of-file. The pipe closes when the test process exits for any reason (a panic, a
//! `static` that is never dropped, a SIGKILL from the test runner), so the child dies with it.
//! Once the harness has seen the child exit, the watchdog is disarmed (killed) first, so it can
//! never signal a recycled pid. For the harness's own servers the watchdog also removes their
//! temporary directory, which nobody else would then delete.
//!
//! **Open mode unless asked.** Every child starts with `FERRY_INSECURE=true` (the explicit
//! development mode of `ferry-control-plane` and of an agent's admin listener) unless the test
//! set `FERRY_INSECURE` itself: a test of authentication sets it to `false` and passes its
//! credentials (`tests/e2e/auth/`, `tests/e2e/secrets.rs`). Other programs ignore the variable.
//!
//! The project's binaries are found next to the test executable ([`project_bin`]): Cargo puts
//! them in `target/<profile>/`, test executables in `target/<profile>/deps/`. They must be built
//! before the tests run: `cargo build --workspace --bins --tests` (`./scripts/test.sh` does it;
//! building the binaries together with the tests avoids compiling the dependencies twice).

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::wait;

/// The variable of `--insecure`, set for every child that does not set it (see the module).
pub const INSECURE: &str = "FERRY_INSECURE";

/// A running (or exited) child process with its output captured to files.
pub struct ChildProcess {
    name: String,
    child: Child,
    watchdog: Option<Watchdog>,
    status: Option<ExitStatus>,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    _dir: Option<TempDir>,
}

impl ChildProcess {
    /// Starts `program` with `args` and the extra environment variables `env` (added to this
    /// process's environment), capturing its output in a new temporary directory.
    pub fn spawn<I, A, E, K, V>(program: impl AsRef<Path>, args: I, env: E) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = A>,
        A: AsRef<OsStr>,
        E: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let program = program.as_ref();
        let mut command = Command::new(program);
        command.args(args).envs(env);
        let dir = tempfile::Builder::new()
            .prefix("ferry-test-process-")
            .tempdir()
            .context("creating a temporary directory for the process output")?;
        let name = file_name(program);
        let mut process = Self::start(command, &name, dir.path(), true)?;
        process._dir = Some(dir);
        Ok(process)
    }

    /// Starts `command` (its stdin, stdout and stderr are replaced), appending its output to
    /// `{log_dir}/{name}.stdout` and `{log_dir}/{name}.stderr`. The directory is the caller's.
    pub fn spawn_command(command: Command, name: &str, log_dir: &Path) -> anyhow::Result<Self> {
        Self::start(command, name, log_dir, false)
    }

    /// Like [`Self::spawn_command`] for a temporary directory the caller owns: if the test
    /// process dies without cleaning up, the watchdog removes `dir` after killing the child.
    pub(crate) fn spawn_in_temp_dir(
        command: Command,
        name: &str,
        dir: &Path,
    ) -> anyhow::Result<Self> {
        Self::start(command, name, dir, true)
    }

    fn start(
        mut command: Command,
        name: &str,
        log_dir: &Path,
        temporary: bool,
    ) -> anyhow::Result<Self> {
        if !command.get_envs().any(|(key, _)| key == INSECURE) {
            command.env(INSECURE, "true");
        }
        let stdout_path = log_dir.join(format!("{name}.stdout"));
        let stderr_path = log_dir.join(format!("{name}.stderr"));
        command
            .stdin(Stdio::null())
            .stdout(append(&stdout_path)?)
            .stderr(append(&stderr_path)?);
        let child = command
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", command.get_program()))?;
        let watchdog = Watchdog::guard(child.id(), temporary.then_some(log_dir))
            .with_context(|| format!("starting the watchdog of {name}"));
        let mut process = Self {
            name: name.to_owned(),
            child,
            watchdog: None,
            status: None,
            stdout_path,
            stderr_path,
            _dir: None,
        };
        // On error `process` is dropped, which kills the child.
        process.watchdog = Some(watchdog?);
        Ok(process)
    }

    /// The name used in messages and log file names (the program's file name by default).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has exited, without blocking.
    pub fn try_status(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        if self.status.is_none() {
            let status = self
                .child
                .try_wait()
                .with_context(|| format!("checking whether {} exited", self.name))?;
            if let Some(status) = status {
                self.exited(status);
            }
        }
        Ok(self.status)
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.try_status(), Ok(None))
    }

    /// Sends SIGKILL and waits for the process to be gone. Does nothing to an exited process.
    pub fn sigkill(&mut self) -> anyhow::Result<ExitStatus> {
        if let Some(status) = self.try_status()? {
            return Ok(status);
        }
        self.child
            .kill()
            .with_context(|| format!("sending SIGKILL to {}", self.name))?;
        let status = self
            .child
            .wait()
            .with_context(|| format!("waiting for {} after SIGKILL", self.name))?;
        self.exited(status);
        Ok(status)
    }

    /// Sends SIGTERM (the process then shuts down on its own; see [`Self::wait_exit`]).
    pub fn sigterm(&mut self) -> anyhow::Result<()> {
        if self.try_status()?.is_some() {
            bail!(
                "cannot send SIGTERM to {}: it has already exited",
                self.name
            );
        }
        let status = Command::new("sh")
            .args(["-c", "kill -TERM \"$1\"", "sh", &self.pid().to_string()])
            .status()
            .context("running sh to send SIGTERM")?;
        if !status.success() {
            bail!(
                "sending SIGTERM to {} (pid {}) failed: {status}",
                self.name,
                self.pid()
            );
        }
        Ok(())
    }

    /// Sends `signal` (a name `kill` understands: `STOP`, `CONT`, ...) to a running process.
    pub fn signal(&mut self, signal: &str) -> anyhow::Result<()> {
        if self.try_status()?.is_some() {
            bail!(
                "cannot send SIG{signal} to {}: it has already exited",
                self.name
            );
        }
        let status = Command::new("sh")
            .args([
                "-c",
                "kill -s \"$1\" \"$2\"",
                "sh",
                signal,
                &self.pid().to_string(),
            ])
            .status()
            .with_context(|| format!("running sh to send SIG{signal}"))?;
        if !status.success() {
            bail!(
                "sending SIG{signal} to {} (pid {}) failed: {status}",
                self.name,
                self.pid()
            );
        }
        Ok(())
    }

    /// Waits up to `timeout` for the process to exit and returns its status. The error includes
    /// the end of its output.
    pub async fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let what = format!("{} (pid {}) to exit", self.name, self.pid());
        let result = wait::until(timeout, what, || std::future::ready(!self.is_running())).await;
        match result {
            Ok(()) => self
                .try_status()?
                .with_context(|| format!("{} exited without a status", self.name)),
            Err(error) => Err(error.context(self.output_tail())),
        }
    }

    /// Sends SIGTERM and waits up to `timeout` for the exit.
    pub async fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        self.sigterm()?;
        self.wait_exit(timeout).await
    }

    /// Waits until stdout or stderr contains `needle`; fails early if the process exits first.
    pub async fn wait_for_output(&mut self, needle: &str, timeout: Duration) -> anyhow::Result<()> {
        let what = format!("{:?} in the output of {}", needle, self.name);
        let result = wait::poll(timeout, what, || {
            let found = self.stdout().contains(needle) || self.stderr().contains(needle);
            let step = match self.try_status() {
                _ if found => Ok(Some(())),
                Ok(Some(status)) => Err(anyhow::anyhow!("{} exited ({status}) first", self.name)),
                Ok(None) => Ok(None),
                Err(error) => Err(error),
            };
            std::future::ready(step)
        })
        .await;
        result.map_err(|error| error.context(self.output_tail()))
    }

    /// Everything the process wrote to stdout so far (lossy UTF-8; empty if unreadable).
    pub fn stdout(&self) -> String {
        read_lossy(&self.stdout_path)
    }

    /// Everything the process wrote to stderr so far (lossy UTF-8; empty if unreadable).
    pub fn stderr(&self) -> String {
        read_lossy(&self.stderr_path)
    }

    /// The file that receives stdout.
    pub fn stdout_path(&self) -> &Path {
        &self.stdout_path
    }

    /// The file that receives stderr.
    pub fn stderr_path(&self) -> &Path {
        &self.stderr_path
    }

    /// The last lines of stdout and stderr, for error messages.
    pub fn output_tail(&self) -> String {
        format!(
            "{} output:\n--- stdout (last lines) ---\n{}\n--- stderr (last lines) ---\n{}",
            self.name,
            tail(&self.stdout(), 40),
            tail(&self.stderr(), 40)
        )
    }

    fn exited(&mut self, status: ExitStatus) {
        self.status = Some(status);
        // The pid may be reused from now on: the watchdog must never fire.
        self.watchdog = None;
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if self.status.is_none() {
            // Best effort: the watchdog (dropped after this) is disarmed either way, and an
            // error here means the child is already gone.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// SIGKILLs a process when the test process goes away; see the module documentation.
struct Watchdog {
    sh: Child,
}

impl Watchdog {
    /// Watches `pid`; `cleanup` is a directory to remove after killing it.
    fn guard(pid: u32, cleanup: Option<&Path>) -> std::io::Result<Self> {
        let cleanup = cleanup.map(Path::as_os_str).unwrap_or_default();
        let sh = Command::new("sh")
            .args([
                "-c",
                "read -r _; kill -KILL \"$1\" 2>/dev/null; \
                 [ -z \"$2\" ] || rm -rf -- \"$2\" 2>/dev/null || { sleep 1; rm -rf -- \"$2\"; }",
                "ferry-test-watchdog",
            ])
            .arg(pid.to_string())
            .arg(cleanup)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Self { sh })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // SIGKILL first, so that the end-of-file that `wait` causes (it closes stdin) is never
        // acted upon. Errors mean the watchdog is already gone.
        let _ = self.sh.kill();
        let _ = self.sh.wait();
    }
}

/// The path of the project binary `name` (for example `ferry-agent`), built in the same target
/// directory and profile as the running test executable. `$FERRY_BIN_DIR` overrides the
/// directory. Fails with a hint when the binary has not been built.
pub fn project_bin(name: &str) -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("FERRY_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().context("locating the test executable")?;
            // target/<profile>/deps/<test>-<hash>  →  target/<profile>/
            exe.parent()
                .and_then(Path::parent)
                .with_context(|| format!("no target directory above {}", exe.display()))?
                .to_path_buf()
        }
    };
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !path.is_file() {
        bail!(
            "{} not found: build the binaries first with `cargo build --workspace --bins` \
             (./scripts/test.sh does), or set FERRY_BIN_DIR",
            path.display()
        );
    }
    Ok(path)
}

/// `ferryctl --endpoint ENDPOINT ARGS…`: its standard output, or an error with its standard
/// error when it exits non-zero.
pub async fn ferryctl(endpoint: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = tokio::process::Command::new(project_bin("ferryctl")?)
        .arg("--endpoint")
        .arg(endpoint)
        .args(args)
        .output()
        .await
        .context("running ferryctl")?;
    anyhow::ensure!(
        output.status.success(),
        "ferryctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The repository root (the workspace that contains this crate).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

fn append(path: &Path) -> anyhow::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

fn file_name(program: &Path) -> String {
    program
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "process".to_owned())
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
