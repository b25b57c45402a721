//! `ferry quickstart` as a newcomer runs it, as a process: it runs everything
//! in itself (no child process), every destination receives readings, the
//! staged outage drains with nothing lost, and on SIGINT it prints a summary
//! whose figures agree with each other and with what `ferryctl metrics` read
//! from its control plane while it ran, exits 0 and leaves nothing behind
//! (no temporary directory, no listening port).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use ferry_tests::ports::accepts_connections;
use ferry_tests::process::ferryctl;
use ferry_tests::{ChildProcess, project_bin, wait};

const TIMEOUT: Duration = Duration::from_secs(30);
const BINDINGS: [&str; 3] = ["to-events", "to-audit", "to-analytics"];

#[tokio::test]
async fn quickstart_delivers_every_reading_and_leaves_nothing_behind() -> anyhow::Result<()> {
    let args = [
        "quickstart",
        "--rate",
        "50",
        "--outage-after",
        "2s",
        "--outage-for",
        "2s",
    ];
    let mut process = ChildProcess::spawn(project_bin("ferry")?, args, [("NO_COLOR", "1")])?;
    process.wait_for_output("Try ferryctl", TIMEOUT).await?;
    let started = process.stdout();
    let dir = PathBuf::from(word_after(&started, "  directory")?);
    let endpoint = word_after(&started, "  control plane")?.to_owned();
    let listener = word_after(&started, "through the upstream listener")?;
    let listener: SocketAddr = listener.trim_start_matches("tcp://").parse()?;
    let control_plane: SocketAddr = endpoint.trim_start_matches("http://").parse()?;
    assert!(dir.join("agent/outbox.db").is_file(), "{started}");
    assert_eq!(
        children(process.pid())?,
        Vec::<u32>::new(),
        "all in one process"
    );

    wait::until(TIMEOUT, "readings at every destination", || {
        let arrived = last_view(&process.stdout()).map(|view| {
            BINDINGS
                .iter()
                .all(|b| view_figure(&view, b, "arrived").is_ok_and(|n| n > 0))
        });
        std::future::ready(arrived.unwrap_or(false))
    })
    .await
    .with_context(|| process.output_tail())?;
    process
        .wait_for_output(
            "readings published during the outage arrived at every destination",
            TIMEOUT,
        )
        .await?;

    // What another reader of the control plane sees while it runs.
    let metrics = ferryctl(&endpoint, &["-o", "json", "metrics", "--by-agent"]).await?;
    let metrics: serde_json::Value = serde_json::from_str(&metrics)?;
    let sent_then = |binding: &str| {
        metrics
            .as_array()
            .into_iter()
            .flatten()
            .find(|row| row["binding_id"] == binding)
            .and_then(|row| row["sent"].as_u64())
    };
    let published_then = view_published(&last_view(&process.stdout())?)?;

    process.signal("INT")?;
    let status = process.wait_exit(TIMEOUT).await?;
    let out = process.stdout();
    assert!(status.success(), "{status}: {}", process.output_tail());

    let published = number_after(&line_with(&out, "summary: published")?, "published ")?;
    assert!(published >= published_then && published > 0, "{out}");
    for binding in BINDINGS {
        let line = line_with(&out, &format!("summary {binding}:"))?;
        let distinct = number_after(&line, "arrived ")?;
        let duplicates = number_after(&line, "distinct + ")?;
        let missing = number_after(&line, "duplicates, ")?;
        let received = number_after(&line, "agent: received ")?;
        let sent = number_after(&line, ", sent ")?;
        let in_flight = number_after(&line, "in flight ")?;
        assert_eq!(missing, 0, "{line}");
        assert_eq!(distinct, published, "{line}");
        assert_eq!(
            sent,
            distinct + duplicates,
            "the agent's sends are what arrived: {line}"
        );
        assert_eq!((received, in_flight), (published, 0), "{line}");
        let earlier = sent_then(binding).with_context(|| format!("{binding} in {metrics}"))?;
        assert!(
            0 < earlier && earlier <= sent,
            "ferryctl saw {earlier}, then {line}"
        );
        assert!(line.contains("conservation law holds"), "{line}");
    }

    assert!(out.contains(&format!("removed {}", dir.display())), "{out}");
    assert!(!dir.exists(), "{} is left behind", dir.display());
    assert!(
        !accepts_connections(control_plane),
        "the control plane still listens"
    );
    assert!(
        !accepts_connections(listener),
        "the upstream listener is still open"
    );
    Ok(())
}

/// The first word after `label` on the line that starts with it.
fn word_after<'a>(text: &'a str, label: &str) -> anyhow::Result<&'a str> {
    text.lines()
        .find_map(|line| line.split_once(label).map(|(_, rest)| rest))
        .and_then(|rest| rest.split_whitespace().next())
        .with_context(|| format!("no {label:?} in\n{text}"))
}

/// The first line containing `needle`.
fn line_with(text: &str, needle: &str) -> anyhow::Result<String> {
    text.lines()
        .find(|line| line.contains(needle))
        .map(str::to_owned)
        .with_context(|| format!("no line with {needle:?} in\n{text}"))
}

/// The digits right after `label` in `line`.
fn number_after(line: &str, label: &str) -> anyhow::Result<u64> {
    let rest = line
        .split_once(label)
        .with_context(|| format!("no {label:?} in {line:?}"))?
        .1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .with_context(|| format!("no number after {label:?} in {line:?}"))
}

/// The last line of the live view (`view t=… | to-events arrived=… | …`).
fn last_view(text: &str) -> anyhow::Result<String> {
    text.lines()
        .rfind(|line| line.starts_with("view "))
        .map(str::to_owned)
        .context("no view line yet")
}

fn view_published(view: &str) -> anyhow::Result<u64> {
    number_after(view, " published=")
}

/// `key=` of `binding`'s part of a view line.
fn view_figure(view: &str, binding: &str, key: &str) -> anyhow::Result<u64> {
    let part = view
        .split(" | ")
        .find(|part| part.starts_with(&format!("{binding} ")))
        .with_context(|| format!("no {binding} in {view:?}"))?;
    number_after(part, &format!(" {key}="))
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> anyhow::Result<Vec<u32>> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may contain spaces, so read after the last `)`.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            children.push(child);
        }
    }
    Ok(children)
}
