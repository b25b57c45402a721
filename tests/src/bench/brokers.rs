//! Brokers A (source) and B (destination), and Mosquitto's bridge as the baseline.
//!
//! Every broker is a private [`Mosquitto`] from the harness (loopback, free port,
//! `set_tcp_nodelay true`, no limit on queued or in-flight messages) with persistence off: the
//! brokers are the same for both contenders, and neither contender's figures should include
//! Mosquitto's autosave. For the baseline, broker A's configuration carries one bridge
//! `connection` per destination, each forwarding `sensors/#` to B under its own prefix at QoS 1
//! (`topic sensors/# out 1 "" events/` publishes `sensors/x` on B as `events/sensors/x`).

use super::SOURCE_FILTER;
use crate::Mosquitto;

/// Starts broker B, the destination.
pub async fn start_destination(extra: &[String]) -> anyhow::Result<Mosquitto> {
    builder(extra).start().await
}

/// Starts broker A, the source; with `bridge_to`, it bridges to that port of 127.0.0.1 with one
/// connection per prefix in `prefixes`; with `unix_socket`, it also listens on a Unix socket.
pub async fn start_source(
    bridge_to: Option<(u16, &[&str])>,
    extra: &[String],
    unix_socket: bool,
) -> anyhow::Result<Mosquitto> {
    let mut builder = builder(extra);
    if unix_socket {
        builder = builder.unix_socket();
    }
    if let Some((port, prefixes)) = bridge_to {
        for line in bridge_config(port, prefixes) {
            builder = builder.config_line(line);
        }
    }
    builder.start().await
}

/// The harness's broker without persistence, plus `extra` configuration lines (a later line
/// overrides the harness's setting of the same option).
fn builder(extra: &[String]) -> crate::mosquitto::MosquittoBuilder {
    extra
        .iter()
        .fold(Mosquitto::builder().persistence(false), |builder, line| {
            builder.config_line(line.clone())
        })
}

/// The `mosquitto.conf` lines of a bridge to `127.0.0.1:{port}`: one connection per prefix,
/// forwarding [`SOURCE_FILTER`] at QoS 1 under `{prefix}/`.
pub fn bridge_config(port: u16, prefixes: &[&str]) -> Vec<String> {
    prefixes
        .iter()
        .flat_map(|prefix| {
            [
                format!("connection bench-{prefix}"),
                format!("address 127.0.0.1:{port}"),
                format!("remote_clientid ferry-bench-bridge-{prefix}"),
                // A persistent session on B, as Ferry's sender would keep one.
                "cleansession false".to_owned(),
                "bridge_attempt_unsubscribe false".to_owned(),
                // No $SYS state messages on either broker: only the measured traffic flows.
                "notifications false".to_owned(),
                "keepalive_interval 30".to_owned(),
                "restart_timeout 1".to_owned(),
                format!("topic {SOURCE_FILTER} out 1 \"\" {prefix}/"),
            ]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_prefix_gets_its_own_connection() {
        let lines = bridge_config(1884, &["events", "audit"]);
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.starts_with("connection "))
                .count(),
            2
        );
        assert!(lines.contains(&"topic sensors/# out 1 \"\" audit/".to_owned()));
        assert!(lines.contains(&"address 127.0.0.1:1884".to_owned()));
    }
}
