//! A first run as a newcomer makes it: the example configuration with a data directory that does
//! not exist yet, a port someone else holds, a broker or control plane that is down, a file
//! that cannot be read, a store block without `options`. Each gets the real binaries and one
//! clear line on stderr (the exact line is asserted), or, for an outage, one log line per change
//! of state rather than one per retry.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_tests::process::{ChildProcess, project_bin, workspace_root};
use ferry_tests::{Mosquitto, free_port, ids, wait};

const EXIT: Duration = Duration::from_secs(15);
const OUTAGE: Duration = Duration::from_secs(30);

/// A bridge without stores that need a directory; its broker is never reached (the runs using
/// it fail before connecting).
const NO_STORES: &str = "\
bridge:
  id: first-run
sessions:
  - id: conn
    transport: mqtt
    options:
      session:
        broker_url: tcp://127.0.0.1:9
        client_id: first-run
stores:
  dlq:
    type: memory
    options:
      acknowledge_volatile: true
receivers:
  - id: in
    session_id: conn
    topics:
      - topic: \"in/#\"
senders:
  - id: out
    session_id: conn
bindings:
  - id: to-out
    sender_id: out
    address: out/topic
routes:
  - id: main
    receiver_id: in
    delivery_mode: direct_hold
    dispatch_mode: single
    bindings: [to-out]
";

fn edge_sqlite() -> PathBuf {
    workspace_root().join("deploy/examples/edge-sqlite.yaml")
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).map_or(0, |m| m.permissions().mode() & 0o777)
}

fn spawn<const A: usize, const E: usize>(
    bin: &str,
    args: [&str; A],
    env: [(&str, &str); E],
) -> anyhow::Result<ChildProcess> {
    ChildProcess::spawn(project_bin(bin)?, args, env)
}

/// Runs `bin ARGS` to its exit and checks the exit code and that stderr is exactly `line`.
async fn fails_with_line<const A: usize, const E: usize>(
    bin: &str,
    args: [&str; A],
    env: [(&str, &str); E],
    code: i32,
    line: &str,
) -> anyhow::Result<()> {
    let mut process = spawn(bin, args, env)?;
    let status = process.wait_exit(EXIT).await?;
    assert_eq!(status.code(), Some(code), "{}", process.output_tail());
    assert_eq!(process.stderr(), format!("{line}\n"), "{bin} {args:?}");
    Ok(())
}

/// The log lines of `stderr` containing every one of `needles`.
fn lines_with(stderr: &str, needles: &[&str]) -> usize {
    stderr
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

/// The first try: `FERRY_DATA_DIR=/tmp/ferry ferry-agent run --config
/// deploy/examples/edge-sqlite.yaml` with `/tmp/ferry` missing. The directories are created
/// (mode 0700, parents too, an existing parent untouched) and the agent runs while its brokers
/// are down: one warning per session naming the broker and the error, however many retries,
/// and one line per session when the broker is back.
#[tokio::test]
async fn the_example_runs_with_a_missing_data_directory_and_a_broker_that_is_down()
-> anyhow::Result<()> {
    let mut broker = Mosquitto::start().await?;
    broker.stop().await?;
    let root = tempfile::tempdir()?;
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755))?;
    let data = root.path().join("ferry/data");
    let url = broker.url();
    let client = ids::unique("first-run");
    let mut agent = spawn(
        "ferry-agent",
        [
            "run",
            "--config",
            &edge_sqlite().display().to_string(),
            "--log",
            "info,ferry_agent::transports::mqtt::session=debug",
        ],
        [
            ("FERRY_DATA_DIR", data.display().to_string().as_str()),
            ("SOURCE_BROKER_URL", &url),
            ("DEST_BROKER_URL", &url),
            ("FERRY_CLIENT_ID", &client),
        ],
    )?;
    wait::until(OUTAGE, "the three SQLite stores", || {
        let data = data.clone();
        async move {
            ["outbox.db", "lease.db", "dlq.db", "ferry-agent.lock"]
                .iter()
                .all(|f| data.join(f).exists())
        }
    })
    .await
    .map_err(|e| e.context(agent.output_tail()))?;
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&root.path().join("ferry")), 0o700);
    assert_eq!(
        mode(root.path()),
        0o755,
        "an existing directory keeps its mode"
    );

    // Several failed attempts per session (debug lines), one warning each.
    wait::until(OUTAGE, "three failed attempts of each session", || {
        let stderr = agent.stderr();
        async move {
            ["plant", "upstream"].iter().all(|s| {
                lines_with(
                    &stderr,
                    &["mqtt connection failed; retrying", &format!("session={s}")],
                ) >= 3
            })
        }
    })
    .await?;
    let stderr = agent.stderr();
    for session in ["plant", "upstream"] {
        let session = format!("session={session}");
        let broker_field = format!("broker={url}");
        assert_eq!(
            lines_with(&stderr, &["cannot reach the mqtt broker", &session]),
            1,
            "{stderr}"
        );
        assert_eq!(
            lines_with(
                &stderr,
                &[
                    "WARN",
                    "cannot reach the mqtt broker",
                    &session,
                    &broker_field,
                    "error=",
                    "Connection refused"
                ]
            ),
            1,
            "{stderr}"
        );
    }

    broker.restart().await?;
    wait::until(OUTAGE, "both sessions connected", || {
        let stderr = agent.stderr();
        async move {
            ["plant", "upstream"].iter().all(|s| {
                lines_with(
                    &stderr,
                    &[
                        "mqtt connected",
                        &format!("session={s}"),
                        "failed_attempts=",
                    ],
                ) == 1
            })
        }
    })
    .await
    .map_err(|e| e.context(agent.output_tail()))?;
    let status = agent.terminate(EXIT).await?;
    assert!(status.success(), "{status}\n{}", agent.output_tail());
    Ok(())
}

/// A data directory that cannot be created (a file in the way): exit 1, one line naming it
/// and the OS's reason, for the stores' directory, a managed agent's `--data-dir` and the
/// control plane's `--data-dir`. (Permission denied cannot be provoked here: the tests run as
/// root, which writes anywhere.)
#[tokio::test]
async fn a_data_directory_that_cannot_be_created_is_one_line() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let file = root.path().join("file");
    std::fs::write(&file, b"in the way")?;
    let blocked = file.join("data");
    let blocked = blocked.display().to_string();
    let line = format!("cannot create the data directory {blocked}: not a directory");

    fails_with_line(
        "ferry-agent",
        ["run", "--config", &edge_sqlite().display().to_string()],
        [("FERRY_DATA_DIR", blocked.as_str())],
        1,
        &format!("ferry-agent: {line}"),
    )
    .await?;
    let endpoint = format!("http://127.0.0.1:{}", free_port()?);
    fails_with_line(
        "ferry-agent",
        ["run", "--control-plane", &endpoint, "--data-dir", &blocked],
        [],
        1,
        &format!("ferry-agent: {line}"),
    )
    .await?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    fails_with_line(
        "ferry-control-plane",
        ["--listen", &listen, "--data-dir", &blocked],
        [],
        1,
        &format!("ferry-control-plane: {line}"),
    )
    .await?;
    Ok(())
}

/// A managed agent whose `--data-dir` is missing creates it (0700) and, with its control plane
/// down, logs one warning however many attempts fail, and keeps running.
#[tokio::test]
async fn a_managed_agent_creates_its_data_directory_and_logs_an_unreachable_control_plane_once()
-> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let data = root.path().join("edge/agent");
    let endpoint = format!("http://127.0.0.1:{}", free_port()?);
    let mut agent = spawn(
        "ferry-agent",
        [
            "run",
            "--control-plane",
            &endpoint,
            "--data-dir",
            &data.display().to_string(),
            "--agent-id",
            &ids::unique("first-run"),
            "--log",
            "info,ferry_agent::control=debug",
        ],
        [],
    )?;
    wait::until(OUTAGE, "three failed attempts", || {
        let stderr = agent.stderr();
        async move { lines_with(&stderr, &["control plane still unreachable"]) >= 3 }
    })
    .await
    .map_err(|e| e.context(agent.output_tail()))?;
    let stderr = agent.stderr();
    assert_eq!(
        lines_with(
            &stderr,
            &[
                "WARN",
                "cannot reach the control plane",
                &format!("endpoint={endpoint}"),
                "error="
            ]
        ),
        1,
        "{stderr}"
    );
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&root.path().join("edge")), 0o700);
    assert_eq!(mode(&data.join("configs")), 0o700);
    let status = agent.terminate(EXIT).await?;
    assert!(status.success(), "{status}\n{}", agent.output_tail());
    Ok(())
}

/// A port someone else holds: exit 1 and one line naming the address, the listener, the flag
/// to change, for the agent's `--admin-listen` (standalone and managed) and the control plane's
/// `--listen` and `--http-listen`. The control plane's missing `--data-dir` is created (0700)
/// before it binds.
#[tokio::test]
async fn a_port_in_use_is_one_line_naming_the_flag() -> anyhow::Result<()> {
    let held = std::net::TcpListener::bind("127.0.0.1:0")?;
    let taken = held.local_addr()?.to_string();
    let root = tempfile::tempdir()?;
    let config = root.path().join("bridge.yaml");
    std::fs::write(&config, NO_STORES)?;
    let in_use = |what: &str, flag: &str| {
        format!(
            "cannot listen on {taken} ({what}): address already in use, another process holds it; choose another {flag}"
        )
    };

    fails_with_line(
        "ferry-agent",
        [
            "run",
            "--config",
            &config.display().to_string(),
            "--admin-listen",
            &taken,
        ],
        [],
        1,
        &format!(
            "ferry-agent: {}",
            in_use("admin listener", "--admin-listen")
        ),
    )
    .await?;
    let endpoint = format!("http://127.0.0.1:{}", free_port()?);
    let agent_dir = root.path().join("agent").display().to_string();
    fails_with_line(
        "ferry-agent",
        [
            "run",
            "--control-plane",
            &endpoint,
            "--data-dir",
            &agent_dir,
            "--admin-listen",
            &taken,
        ],
        [],
        1,
        &format!(
            "ferry-agent: {}",
            in_use("admin listener", "--admin-listen")
        ),
    )
    .await?;

    let cp_dir = root.path().join("cp/state");
    let cp_data = cp_dir.display().to_string();
    fails_with_line(
        "ferry-control-plane",
        ["--listen", &taken, "--data-dir", &cp_data],
        [],
        1,
        &format!(
            "ferry-control-plane: {}",
            in_use("gRPC listener", "--listen")
        ),
    )
    .await?;
    assert_eq!(mode(&cp_dir), 0o700);
    assert_eq!(mode(&root.path().join("cp")), 0o700);
    let free = format!("127.0.0.1:{}", free_port()?);
    fails_with_line(
        "ferry-control-plane",
        [
            "--listen",
            &free,
            "--http-listen",
            &taken,
            "--data-dir",
            &cp_data,
        ],
        [],
        1,
        &format!(
            "ferry-control-plane: {}",
            in_use("HTTP listener", "--http-listen")
        ),
    )
    .await?;
    Ok(())
}

/// A configuration file that is missing, a directory, or (when not root) unreadable: exit 2
/// and one line naming the file and the reason, from `run` and from `validate`.
#[tokio::test]
async fn an_unreadable_configuration_file_is_one_line() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let missing = root.path().join("missing.yaml");
    let locked = root.path().join("locked.yaml");
    std::fs::write(&locked, NO_STORES)?;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000))?;
    let mut cases = vec![
        (missing, "no such file or directory"),
        (root.path().to_owned(), "is a directory"),
    ];
    // Root reads a file whatever its mode, so permission denied is tested only as another user.
    if std::fs::read(&locked).is_err() {
        cases.push((locked, "permission denied"));
    }
    for (file, reason) in cases {
        let shown = file.display().to_string();
        let line = format!("ferry-agent: cannot read configuration file {shown}: {reason}");
        fails_with_line("ferry-agent", ["run", "--config", &shown], [], 2, &line).await?;
        fails_with_line("ferry-agent", ["validate", &shown], [], 2, &line).await?;
    }
    Ok(())
}

/// A memory outbox written without `options`: the validator's explanation, not a serde
/// `missing field options`.
#[tokio::test]
async fn a_store_without_options_gets_the_validators_line() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let config = root.path().join("bridge.yaml");
    let yaml = NO_STORES.replace(
        "stores:\n",
        "stores:\n  outbox:\n    type: memory\n  lease:\n    type: memory\n",
    );
    std::fs::write(&config, yaml)?;
    fails_with_line(
        "ferry-agent",
        ["validate", &config.display().to_string()],
        [],
        2,
        "stores.outbox.options.acknowledge_volatile: a memory outbox loses its records on restart, after their sources were acknowledged; set acknowledge_volatile: true to accept that (development only)",
    )
    .await
}
