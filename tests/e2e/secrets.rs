//! Secrets stay secret (issue 16): a control plane and a managed agent run a
//! bridge whose two MQTT sessions log in to a Mosquitto with a password file,
//! one with a password and one with a token-like value; the configuration is
//! applied, read back every way ferryctl shows it, changed, rolled back and
//! its DLQ listed, a document is refused — and neither secret appears in any
//! log line of any process nor in any ferryctl output, while `***` shows
//! where a document was masked. The control plane runs with a token file
//! (no open mode): the bearer tokens of the operator, the admin and the
//! agent are secrets too. `--show-secrets` without the admin role is refused
//! with PERMISSION_DENIED naming the role; with it the document comes back as
//! stored (that one output is checked for the password and left out of the
//! grep).

use ferry_tests::mqtt::QoS;
use ferry_tests::{Collector, Mosquitto, ids, project_bin, publish_seq};

use crate::agent_managed::{ManagedAgent, TIMEOUT, running};
use crate::auth::support::write_tokens;
use crate::control_plane::ControlPlane;

const PASSWORD: &str = "Ferry-Pa55word-7f3e9c";
const TOKEN: &str = "ftok_4c1d9e0a7b2f48e6a1c3d5e7f9b0a2c4";
const N: u64 = 20;
/// Bearer tokens of the control plane's principals.
const OPERATOR_TOKEN: &str = "ftok_op_91b7e2c4d6a84f0e9b3c5d7e1f2a4b6c";
const ADMIN_TOKEN: &str = "ftok_admin_3e5a7c9b1d2f4e6a8c0b2d4f6a8c0e2b";
const AGENT_TOKEN: &str = "ftok_agent_7d9f1b3e5c7a9e1d3b5f7a9c1e3d5b7f";
const SECRETS: [&str; 5] = [PASSWORD, TOKEN, OPERATOR_TOKEN, ADMIN_TOKEN, AGENT_TOKEN];

/// Ingress logs in as `ferry-in` with the password, egress as `ferry-out`
/// with the token (plain TCP on loopback, so plaintext credentials are
/// allowed explicitly).
fn document(bridge: &str, broker: &str, dlq: &str, max_in_flight: u32) -> String {
    format!(
        r#"bridge:
  id: {bridge}
sessions:
  - id: ingress
    transport: mqtt
    options:
      session:
        broker_url: {broker}
        client_id: {bridge}-in
        username: ferry-in
        password: "{PASSWORD}"
        allow_plaintext_credentials: true
  - id: egress
    transport: mqtt
    options:
      session:
        broker_url: {broker}
        client_id: {bridge}-out
        username: ferry-out
        password: "{TOKEN}"
        allow_plaintext_credentials: true
stores:
  dlq:
    type: sqlite
    options:
      path: {dlq}
receivers:
  - id: in
    session_id: ingress
    topics:
      - topic: "in/#"
        qos: 1
senders:
  - id: out
    session_id: egress
bindings:
  - id: to-out
    sender_id: out
    address: out/{bridge}
routes:
  - id: main
    receiver_id: in
    delivery_mode: direct_hold
    dispatch_mode: single
    bindings: [to-out]
    policy:
      max_in_flight: {max_in_flight}
"#
    )
}

/// Every ferryctl run as the operator: its arguments, whether it succeeded,
/// and all it printed.
#[derive(Default)]
struct Transcript(Vec<(String, bool, String)>);

/// Runs ferryctl with `token` in `FERRY_TOKEN`.
async fn ferryctl(
    cp: &ControlPlane,
    token: &str,
    args: &[&str],
) -> anyhow::Result<std::process::Output> {
    Ok(tokio::process::Command::new(project_bin("ferryctl")?)
        .env("FERRY_TOKEN", token)
        .arg("--endpoint")
        .arg(cp.endpoint())
        .args(args)
        .output()
        .await?)
}

impl Transcript {
    async fn run(&mut self, cp: &ControlPlane, args: &[&str]) -> anyhow::Result<(bool, String)> {
        let output = ferryctl(cp, OPERATOR_TOKEN, args).await?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        self.0
            .push((args.join(" "), output.status.success(), text.clone()));
        Ok((output.status.success(), text))
    }

    async fn ok(&mut self, cp: &ControlPlane, args: &[&str]) -> anyhow::Result<String> {
        let (ok, text) = self.run(cp, args).await?;
        anyhow::ensure!(ok, "ferryctl {args:?} failed:\n{text}");
        Ok(text)
    }
}

#[tokio::test]
async fn no_password_or_token_reaches_a_log_line_or_ferryctl_output() -> anyhow::Result<()> {
    let broker = Mosquitto::builder()
        .user("ferry-in", PASSWORD)
        .user("ferry-out", TOKEN)
        .start()
        .await?;
    let dir = tempfile::tempdir()?;
    let id = ids::unique("secrets");
    let tokens = dir.path().join("tokens.yaml");
    write_tokens(
        &tokens,
        &[
            ("alice", "operator", None, OPERATOR_TOKEN),
            ("root", "admin", None, ADMIN_TOKEN),
            (&id, "agent", Some(&id), AGENT_TOKEN),
        ],
    )?;
    let mut cp = ControlPlane::start_with(
        None,
        &["--tokens".to_owned(), tokens.display().to_string()],
        &[("FERRY_INSECURE", "false")],
    )
    .await?
    .with_token(OPERATOR_TOKEN)?;
    let mut agent = ManagedAgent::start_with_env(
        &cp.endpoint(),
        &dir.path().join("agent"),
        &id,
        vec![("FERRY_TOKEN".to_owned(), AGENT_TOKEN.to_owned())],
    )?;
    let out = Collector::start(&broker.url(), "collector", "out/#", QoS::AtLeastOnce).await?;
    let dlq = dir.path().join("dlq.db").display().to_string();
    let mut ctl = Transcript::default();

    let v1 = dir.path().join("v1.yaml");
    std::fs::write(&v1, document("vault", &broker.url(), &dlq, 10))?;
    let v1 = v1.display().to_string();
    ctl.ok(&cp, &["apply", "-f", &v1, "--selector", "site=a"])
        .await?;
    running(&cp, &agent, &id, "vault", 1).await?;
    // The credentials work: messages cross the password-protected broker.
    publish_seq(&broker.url(), "in/x", 0..N, QoS::AtLeastOnce).await?;
    out.wait_for_total(N, TIMEOUT).await?;
    let log = broker.log();
    for user in ["u'ferry-in'", "u'ferry-out'"] {
        assert!(log.contains(user), "{user} logged in:\n{log}");
    }

    let v2 = dir.path().join("v2.yaml");
    std::fs::write(&v2, document("vault", &broker.url(), &dlq, 20))?;
    let v2 = v2.display().to_string();
    ctl.ok(
        &cp,
        &["apply", "-f", &v2, "--selector", "site=a", "-o", "yaml"],
    )
    .await?;
    running(&cp, &agent, &id, "vault", 2).await?;

    for format in ["yaml", "json"] {
        let shown = ctl.ok(&cp, &["get", "configs", "-o", format]).await?;
        assert!(shown.contains("***"), "masked in -o {format}:\n{shown}");
        assert!(shown.contains("ferry-in"), "the rest is shown:\n{shown}");
        let shown = ctl
            .ok(&cp, &["describe", "config", "vault", "-o", format])
            .await?;
        assert!(
            shown.contains("***"),
            "masked in describe -o {format}:\n{shown}"
        );
    }
    let described = ctl
        .ok(&cp, &["describe", "config", "vault", "--version", "1"])
        .await?;
    assert!(described.contains("***"), "{described}");
    ctl.ok(&cp, &["get", "configs"]).await?;
    ctl.ok(&cp, &["get", "routes", "vault"]).await?;

    let history = ctl.ok(&cp, &["history", "vault"]).await?;
    assert!(history.contains("APPLIED BY"), "{history}");
    // Every version names the operator who applied it, and from where.
    assert!(history.contains("alice from 127.0.0.1:"), "{history}");
    ctl.ok(&cp, &["history", "vault", "-o", "json"]).await?;
    ctl.ok(&cp, &["rollback", "vault", "--to", "1"]).await?;
    ctl.ok(&cp, &["rollback", "vault", "--to", "2", "-o", "yaml"])
        .await?;
    running(&cp, &agent, &id, "vault", 4).await?;
    ctl.ok(&cp, &["get", "dlq"]).await?;
    ctl.ok(&cp, &["get", "dlq", "-o", "json"]).await?;
    ctl.ok(&cp, &["get", "agents"]).await?;
    ctl.ok(&cp, &["describe", "agent", &id]).await?;

    // Revealing needs the admin role: refused, naming it.
    for args in [
        &["get", "configs", "-o", "yaml", "--show-secrets"][..],
        &["describe", "config", "vault", "--show-secrets"][..],
    ] {
        let (ok, text) = ctl.run(&cp, args).await?;
        assert!(!ok, "{args:?}: {text}");
        assert!(
            text.contains("PermissionDenied") && text.contains("needs the admin role"),
            "{args:?}: {text}"
        );
    }
    // The admin may: the document as stored (this output alone holds the
    // password, so it is not in the transcript the grep below reads).
    let revealed = ferryctl(
        &cp,
        ADMIN_TOKEN,
        &[
            "describe",
            "config",
            "vault",
            "--show-secrets",
            "-o",
            "yaml",
        ],
    )
    .await?;
    let revealed = String::from_utf8_lossy(&revealed.stdout);
    assert!(revealed.contains(PASSWORD), "revealed:\n{revealed}");

    // A document the control plane refuses, and a masked one applied back:
    // the errors name the field, never its value.
    let broken = dir.path().join("broken.yaml");
    std::fs::write(
        &broken,
        document("vault", "ssl://nowhere:8883", &dlq, 0).replace("qos: 1", "qos: 7"),
    )?;
    let (ok, text) = ctl
        .run(&cp, &["apply", "-f", &broken.display().to_string()])
        .await?;
    assert!(!ok, "{text}");
    let masked = ctl
        .ok(&cp, &["describe", "config", "vault", "-o", "yaml"])
        .await?;
    let round_trip = dir.path().join("masked.yaml");
    let document = masked_document(&masked)?;
    std::fs::write(&round_trip, document)?;
    let (ok, text) = ctl
        .run(&cp, &["apply", "-f", &round_trip.display().to_string()])
        .await?;
    assert!(!ok && text.contains("is the mask `***`"), "{text}");

    // The agent keeps running with the secrets it was given.
    publish_seq(&broker.url(), "in/x", N..2 * N, QoS::AtLeastOnce).await?;
    out.wait_for_total(2 * N, TIMEOUT).await?;

    agent.process.terminate(TIMEOUT).await?;
    cp.process.terminate(TIMEOUT).await?;
    let logs = [
        ("agent", agent.process.stdout() + &agent.process.stderr()),
        ("control plane", cp.process.stdout() + &cp.process.stderr()),
        ("mosquitto", broker.log()),
    ];
    let mut lines = 0;
    for (process, log) in &logs {
        lines += log.lines().count();
        for secret in SECRETS {
            if let Some(line) = log.lines().find(|l| l.contains(secret)) {
                panic!("the {process} logged a secret: {line}");
            }
        }
    }
    for (args, _, text) in &ctl.0 {
        for secret in SECRETS {
            assert!(
                !text.contains(secret),
                "ferryctl {args} printed a secret:\n{text}"
            );
        }
    }
    assert!(lines > 20, "the processes logged: {lines} lines");
    eprintln!(
        "{lines} log lines and {} ferryctl outputs hold neither secret",
        ctl.0.len()
    );
    Ok(())
}

/// The `document:` of `ferryctl describe config -o yaml`.
fn masked_document(described: &str) -> anyhow::Result<String> {
    let value: serde_json::Value = serde_saphyr::from_str(described)?;
    value["yaml"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("no yaml in {described}"))
}
