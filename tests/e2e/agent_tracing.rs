//! Issue 17's acceptance: one trace per delivery across the store-and-forward hop. Real
//! Mosquitto brokers, `ferry-agent run` with SQLite stores exporting to an OTLP trace receiver
//! in this process, one MQTT v5 message with a publisher's `traceparent` fanned out to three
//! bindings; and a `ferryctl` command traced into the control plane's RPC span.

use std::time::Duration;

use ferry_tests::mqtt::QoS;
use ferry_tests::otlp::{Span, TraceReceiver};
use ferry_tests::{
    Collector, Mosquitto, PublishOptions, project_bin, publish_seq, publish_seq_with, wait,
};

use crate::agent_support::{Bridge, quiesced};
use crate::control_plane::ControlPlane;

const DELIVERY: Duration = Duration::from_secs(60);
const PUBLISHER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PUBLISHER_SPAN: &str = "00f067aa0ba902b7";
const BINDINGS: [&str; 3] = ["x", "y", "z"];

fn traced_message() -> PublishOptions {
    PublishOptions {
        user_properties: vec![(
            "traceparent".into(),
            format!("00-{PUBLISHER_TRACE}-{PUBLISHER_SPAN}-01"),
        )],
        ..PublishOptions::default()
    }
}

fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}

/// The spans of the publisher's trace, once it holds a receive, an append and an accepted send
/// per binding.
async fn whole_trace(receiver: &TraceReceiver) -> anyhow::Result<Vec<Span>> {
    let spans = receiver
        .wait_for(
            "receive, append and three accepted sends",
            DELIVERY,
            |spans| {
                let accepted = spans
                    .iter()
                    .filter(|s| s.name == "send" && s.attribute("outcome") == Some("accepted"))
                    .count();
                !named(spans, "receive").is_empty()
                    && !named(spans, "outbox.append").is_empty()
                    && accepted >= BINDINGS.len()
            },
        )
        .await?;
    Ok(spans
        .into_iter()
        .filter(|s| s.trace_id == PUBLISHER_TRACE)
        .collect())
}

/// The trace hangs together: publisher → receive → append, and receive → one accepted send per
/// binding, each to its binding's topic; each delivered copy carries its send span's context.
fn assert_one_trace(spans: &[Span], bridge: &Bridge, collector: &Collector) {
    let receive = named(spans, "receive");
    assert_eq!(receive.len(), 1, "one receive span: {spans:#?}");
    let receive = receive[0];
    assert_eq!(receive.parent_span_id, PUBLISHER_SPAN, "{receive:?}");
    assert_eq!(receive.attribute("route"), Some("r"));
    assert_eq!(
        receive.attribute("messaging.source"),
        Some(bridge.input().as_str())
    );
    assert!(
        receive.attribute("messaging.message.id").is_some(),
        "{receive:?}"
    );
    assert_eq!(receive.service_name, "ferry-agent");

    let append = named(spans, "outbox.append");
    assert_eq!(append.len(), 1, "one append span: {spans:#?}");
    assert_eq!(append[0].parent_span_id, receive.span_id);
    assert_eq!(append[0].attribute("records"), Some("3"));

    let counts = collector.counts();
    for binding in BINDINGS {
        let sends: Vec<&Span> = named(spans, "send")
            .into_iter()
            .filter(|s| s.attribute("binding") == Some(binding))
            .filter(|s| s.attribute("outcome") == Some("accepted"))
            .collect();
        assert_eq!(sends.len(), 1, "one accepted send to {binding}: {spans:#?}");
        let send = sends[0];
        assert_eq!(send.parent_span_id, receive.span_id, "{send:?}");
        assert_eq!(
            send.attribute("messaging.destination"),
            Some(bridge.output(binding).as_str())
        );
        let delivered = counts.traceparents(&bridge.output(binding));
        assert_eq!(
            delivered,
            [format!("00-{PUBLISHER_TRACE}-{}-01", send.span_id)],
            "the copy for {binding} continues the trace from its send span"
        );
    }
}

#[tokio::test]
async fn one_trace_from_the_publisher_through_the_outbox_to_every_destination() -> anyhow::Result<()>
{
    let receiver = TraceReceiver::start().await?;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &BINDINGS);
    bridge.telemetry = vec![format!("otlp_endpoint: {}", receiver.endpoint())];
    let collector = bridge.collector().await?;
    let _agent = bridge.start_agent().await?;

    publish_seq_with(
        &a.url(),
        &bridge.input(),
        0..1,
        QoS::AtLeastOnce,
        traced_message(),
    )
    .await?;
    for binding in BINDINGS {
        collector
            .wait_for(&bridge.output(binding), 0..1, DELIVERY)
            .await?;
    }
    let spans = whole_trace(&receiver).await?;
    assert_one_trace(&spans, &bridge, &collector);
    Ok(())
}

/// The message waits in the outbox (destination down), the agent is SIGKILLed after the
/// append and restarted: the new run's sends still join the trace stored with the message.
#[tokio::test]
async fn the_trace_survives_a_sigkill_between_append_and_send() -> anyhow::Result<()> {
    let receiver = TraceReceiver::start().await?;
    let a = Mosquitto::start().await?;
    let mut b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &BINDINGS);
    bridge.telemetry = vec![format!("otlp_endpoint: {}", receiver.endpoint())];
    let collector = bridge.collector().await?;
    let mut agent = bridge.start_agent().await?;

    b.stop().await?;
    publish_seq_with(
        &a.url(),
        &bridge.input(),
        0..1,
        QoS::AtLeastOnce,
        traced_message(),
    )
    .await?;
    // Appended (and the append's spans exported) before the kill.
    receiver
        .wait_for("the receive and append spans", DELIVERY, |spans| {
            !named(spans, "outbox.append").is_empty() && !named(spans, "receive").is_empty()
        })
        .await?;
    wait::until(DELIVERY, "the records in the outbox", || {
        let m = agent.metrics();
        std::future::ready(
            m.is_ok_and(|m| BINDINGS.iter().all(|b| m.binding("r", b).received == 1)),
        )
    })
    .await?;
    agent.kill()?;
    b.restart().await?;
    agent.restart()?;
    agent.wait_ready(Duration::from_secs(20)).await?;
    for binding in BINDINGS {
        collector
            .wait_for(&bridge.output(binding), 0..1, DELIVERY)
            .await?;
    }
    let spans = whole_trace(&receiver).await?;
    assert_one_trace(&spans, &bridge, &collector);
    Ok(())
}

/// Nobody listens at the OTLP endpoint: every message is delivered all the same, and the spans
/// that could not be exported are counted on `/metrics`.
#[tokio::test]
async fn an_unreachable_collector_costs_no_delivery_and_counts_dropped_spans() -> anyhow::Result<()>
{
    const N: u64 = 300;
    let nobody = ferry_tests::free_port()?;
    let a = Mosquitto::start().await?;
    let b = Mosquitto::start().await?;
    let dir = tempfile::tempdir()?;
    let mut bridge = Bridge::new(&a.url(), &b.url(), dir.path(), &BINDINGS);
    bridge.telemetry = vec![format!("otlp_endpoint: http://127.0.0.1:{nobody}")];
    let collector = bridge.collector().await?;
    let agent = bridge.start_agent().await?;

    publish_seq(&a.url(), &bridge.input(), 0..N, QoS::AtLeastOnce).await?;
    for binding in BINDINGS {
        collector
            .wait_for(&bridge.output(binding), 0..N, DELIVERY)
            .await?;
    }
    let counts = quiesced(&agent, &bridge.bindings, DELIVERY).await?;
    for c in &counts {
        assert_eq!((c.received, c.sent, c.dropped), (N, N, 0), "{c:?}");
    }
    wait::until(DELIVERY, "ferry_spans_dropped_total above 0", || {
        let dropped = agent.metrics_text().ok().and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("ferry_spans_dropped_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
        });
        std::future::ready(dropped.is_some_and(|d| d > 0.0))
    })
    .await?;
    Ok(())
}

/// Deliver 4: `ferryctl` sends its own trace context and the control plane makes one span per
/// RPC, named for the method, a child of the caller's span: a `ferryctl get leases` and the
/// `ListLeases` call it makes form one trace, both exported.
#[tokio::test]
async fn a_ferryctl_command_and_its_rpc_form_one_trace() -> anyhow::Result<()> {
    let receiver = TraceReceiver::start().await?;
    let endpoint = receiver.endpoint().to_owned();
    let cp =
        ControlPlane::start_with(None, &[], &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)]).await?;
    let output = tokio::process::Command::new(project_bin("ferryctl")?)
        .args(["--endpoint", &cp.endpoint(), "get", "leases"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .output()
        .await?;
    anyhow::ensure!(
        output.status.success(),
        "ferryctl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let spans = receiver
        .wait_for(
            "ferryctl's span and the control plane's",
            DELIVERY,
            |spans| {
                let cli = spans.iter().find(|s| s.service_name == "ferryctl");
                cli.is_some_and(|cli| {
                    spans.iter().any(|s| {
                        s.service_name == "ferry-control-plane" && s.trace_id == cli.trace_id
                    })
                })
            },
        )
        .await?;
    let cli = spans
        .iter()
        .find(|s| s.service_name == "ferryctl" && s.parent_span_id.is_empty())
        .ok_or_else(|| anyhow::anyhow!("no root span of ferryctl: {spans:?}"))?;
    assert_eq!(cli.name, "ferryctl", "{cli:?}");
    let rpc = spans
        .iter()
        .find(|s| s.service_name == "ferry-control-plane" && s.trace_id == cli.trace_id)
        .ok_or_else(|| anyhow::anyhow!("no rpc span in ferryctl's trace: {spans:?}"))?;
    assert!(rpc.name.ends_with("/ListLeases"), "{rpc:?}");
    let ferryctl_span_ids: Vec<&str> = spans
        .iter()
        .filter(|s| s.service_name == "ferryctl" && s.trace_id == cli.trace_id)
        .map(|s| s.span_id.as_str())
        .collect();
    assert!(
        ferryctl_span_ids.contains(&rpc.parent_span_id.as_str()),
        "the rpc span's parent is one of ferryctl's spans: {rpc:?} {spans:?}"
    );
    Ok(())
}
