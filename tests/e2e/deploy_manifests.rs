//! Every command line in `deploy/` is one the binaries accept.
//!
//! The manifests are parsed (systemd units line by line, Kubernetes YAML as documents), and each
//! command line of a Ferry binary is run as that binary with `--help` appended: clap parses the
//! flags and their values left to right and stops at `--help` with exit 0, so an unknown flag, a
//! flag of another subcommand or a value that does not parse (an address, a `key=value` label)
//! fails the test with clap's own message. Flags are all a manifest passes on the command line;
//! the `FERRY_*` environment variables it sets are checked against the help of the same command,
//! which names every variable the binary reads (`[env: …]` or in the text).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};
use ferry_tests::process::{project_bin, workspace_root};
use serde_json::Value;

/// One command line found in a manifest.
#[derive(Debug)]
struct CommandLine {
    /// `file: what` for messages.
    origin: String,
    /// The binary's file name (`ferry-agent`).
    binary: String,
    args: Vec<String>,
    /// Environment variables the manifest sets for it.
    env: Vec<(String, String)>,
    /// Whether `env` is meant for this command (a unit's `Environment=` is for every
    /// `Exec*=` line, but meant for `ExecStart=`, not for an `ExecStartPre=` check).
    reads_env: bool,
}

#[test]
fn every_deploy_command_line_uses_flags_the_binaries_accept() -> anyhow::Result<()> {
    let deploy = workspace_root().join("deploy");
    let mut lines = Vec::new();
    for unit in files(&deploy.join("systemd"), "service")? {
        lines.extend(systemd_commands(&unit)?);
    }
    for manifest in files(&deploy.join("kubernetes"), "yaml")? {
        lines.extend(kubernetes_commands(&manifest)?);
    }
    // Every binary and both agent modes (standalone from a file, managed) are deployed.
    for (binary, flag) in [
        ("ferry-control-plane", "--listen"),
        ("ferry-agent", "--config"),
        ("ferry-agent", "--data-dir"),
    ] {
        let found = lines
            .iter()
            .any(|l| l.binary == binary && l.args.iter().any(|a| a == flag));
        ensure!(
            found,
            "no manifest in deploy/ runs `{binary} {flag}`: {lines:#?}"
        );
    }
    for line in &lines {
        check(line).with_context(|| {
            format!("{}: `{} {}`", line.origin, line.binary, line.args.join(" "))
        })?;
    }
    Ok(())
}

/// Runs the command line with `--help` appended and checks the environment it is given.
fn check(line: &CommandLine) -> anyhow::Result<()> {
    let output = Command::new(project_bin(&line.binary)?)
        .args(&line.args)
        .arg("--help")
        .env_clear()
        .envs(line.env.iter().map(|(k, v)| (k, v)))
        .output()
        .context("running the binary")?;
    let help = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "the binary refuses it: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    let meant = line.env.iter().filter(|_| line.reads_env);
    for (name, _) in meant.filter(|(k, _)| k.starts_with("FERRY_")) {
        ensure!(
            help.contains(name.as_str()),
            "sets {name}, which this command does not read"
        );
    }
    Ok(())
}

/// `ExecStart=` and `ExecStartPre=` lines of a unit, with its `Environment=` lines.
fn systemd_commands(unit: &Path) -> anyhow::Result<Vec<CommandLine>> {
    let text =
        std::fs::read_to_string(unit).with_context(|| format!("reading {}", unit.display()))?;
    let entries: Vec<(&str, &str)> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .collect();
    let env = entries
        .iter()
        .filter(|(k, _)| *k == "Environment")
        .map(|(_, v)| {
            v.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("{}: Environment={v} is not KEY=VALUE", unit.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut commands = Vec::new();
    for (key, value) in entries.iter().filter(|(k, _)| k.starts_with("ExecStart")) {
        ensure!(
            !value.contains(['"', '\'', '\\']),
            "{}: {key}= uses quoting, which this check does not parse",
            unit.display()
        );
        // systemd's prefixes (`-`, `@`, `+`, `!`) and specifiers (`%H`: the host name).
        let value = value
            .trim_start_matches(['-', '@', '+', '!'])
            .replace("%H", "edge-01");
        let mut words = value.split_whitespace().map(str::to_owned);
        let program = words
            .next()
            .with_context(|| format!("{}: empty {key}=", unit.display()))?;
        commands.push(CommandLine {
            origin: format!("{}: {key}", file_name(unit)),
            binary: file_name(Path::new(&program)),
            args: words.collect(),
            env: env.clone(),
            reads_env: *key == "ExecStart",
        });
    }
    ensure!(!commands.is_empty(), "{} has no ExecStart=", unit.display());
    Ok(commands)
}

/// The containers of every workload in a Kubernetes manifest: image `ferry/<name>` runs the
/// binary `ferry-<name>` with the container's `args` (or `command` after the binary).
fn kubernetes_commands(manifest: &Path) -> anyhow::Result<Vec<CommandLine>> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("reading {}", manifest.display()))?;
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
        .with_context(|| format!("{} is not valid YAML", manifest.display()))?;
    let mut commands = Vec::new();
    for doc in &docs {
        let kind = doc["kind"].as_str().unwrap_or_default();
        let pod = match kind {
            "Pod" => &doc["spec"],
            "Deployment" | "DaemonSet" | "StatefulSet" | "Job" => &doc["spec"]["template"]["spec"],
            _ => continue,
        };
        let containers = pod["containers"]
            .as_array()
            .with_context(|| format!("{}: a {kind} without containers", manifest.display()))?;
        for container in containers {
            let image = container["image"].as_str().unwrap_or_default();
            let Some(name) = image.strip_prefix("ferry/") else {
                continue;
            };
            let name = name.split([':', '@']).next().unwrap_or(name);
            let mut argv = strings(&container["command"])?;
            if !argv.is_empty() {
                let program = argv.remove(0);
                ensure!(
                    file_name(Path::new(&program)) == format!("ferry-{name}"),
                    "{image} runs {program}"
                );
            }
            argv.extend(strings(&container["args"])?);
            let env = container["env"]
                .as_array()
                .map(|vars| {
                    vars.iter()
                        .map(|v| {
                            // `valueFrom` (a field or a secret) stands for some value.
                            let value = v["value"].as_str().unwrap_or("from-the-cluster");
                            (
                                v["name"].as_str().unwrap_or_default().to_owned(),
                                value.to_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            commands.push(CommandLine {
                origin: format!(
                    "{}: {kind} {}",
                    file_name(manifest),
                    doc["metadata"]["name"].as_str().unwrap_or("?")
                ),
                binary: format!("ferry-{name}"),
                args: argv,
                env,
                reads_env: true,
            });
        }
    }
    Ok(commands)
}

/// A YAML list of strings (absent: empty).
fn strings(value: &Value) -> anyhow::Result<Vec<String>> {
    match value {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_owned)
                    .with_context(|| format!("{i} is not a string"))
            })
            .collect(),
        other => bail!("{other} is not a list"),
    }
}

/// The files of `dir` ending in `.ext`, sorted.
fn files(dir: &Path, ext: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == ext));
    files.sort();
    ensure!(!files.is_empty(), "no *.{ext} in {}", dir.display());
    Ok(files)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}
