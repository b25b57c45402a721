//! One span per RPC (issue 17), made by the server's `trace_fn`: named for
//! the gRPC method, a child of the caller's span when the request carries a
//! `traceparent` (ferryctl and agents send theirs), with the agent id and the
//! bridge recorded by the service once it knows them ([`record_agent`],
//! [`record_bridge`]). Log lines inside a handler carry the span's fields
//! and, when it is traced, its trace and span ids.

use ferry_shared::telemetry::propagation;
use tonic::codegen::http;
use tracing::Span;
use tracing::field::Empty;

/// The span of one request (`Server::trace_fn`).
pub fn rpc_span(request: &http::Request<()>) -> Span {
    let method = request.uri().path();
    let span = tracing::info_span!(
        "rpc",
        otel.name = method,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.method = method,
        agent = Empty,
        bridge = Empty,
    );
    propagation::follow_headers(&span, request.headers());
    span
}

/// Names the agent the current RPC is about.
pub fn record_agent(agent: &str) {
    Span::current().record("agent", agent);
}

/// Names the bridge the current RPC is about (a partition key
/// `{bridge}/{route}` names its bridge).
pub fn record_bridge(bridge_or_partition: &str) {
    let bridge = bridge_or_partition
        .split_once('/')
        .map_or(bridge_or_partition, |(bridge, _)| bridge);
    Span::current().record("bridge", bridge);
}
