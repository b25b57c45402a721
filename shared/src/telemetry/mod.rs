//! The one telemetry set-up every Ferry binary runs: `tracing` with a log
//! layer (text or JSON, filtered by `--log`, `RUST_LOG` or the configuration)
//! and, when an OTLP endpoint is configured, an OpenTelemetry layer that
//! exports Ferry's spans over OTLP/gRPC through a bounded queue ([`export`]),
//! encoded by Ferry's own exporter ([`otlp`]) where it can stand in for the
//! SDK's.
//!
//! Where the settings come from, the later overriding the earlier: the
//! defaults, the YAML `telemetry:` block ([`Settings::with_config`]), the
//! standard variables `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`,
//! `OTEL_TRACES_SAMPLER_ARG`, `OTEL_RESOURCE_ATTRIBUTES`
//! ([`Settings::with_env`]), then the binary's flags.
//!
//! Tracing off (no endpoint) costs the data path one relaxed atomic load per
//! message: [`is_tracing`] is false and the per-message spans are never
//! created. Only spans of Ferry's own crates are exported (not the spans of
//! the libraries below), and log events stay in the log; a log line inside a
//! traced span names its `trace_id` and `span_id` ([`log_ids`]).
//!
//! [`propagation`] carries W3C trace context between spans and the envelope
//! or gRPC metadata; the spans made per message are [`message`] spans, made on
//! the SDK's tracer without `tracing`'s registry.

mod args;
mod export;
mod log_ids;
pub mod message;
mod otlp;
pub mod propagation;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::fmt::writer::BoxMakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

pub use args::TelemetryArgs;
pub use export::{EXPORT_TIMEOUT, MAX_BATCH, QUEUE_CAPACITY, dropped_spans};

use crate::config::{Env, ProcessEnv, Telemetry as TelemetryConfig};
use log_ids::WithTraceIds;

/// How long shutdown waits for the queued spans to be exported.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// True once spans are exported: the per-message spans are created only then.
static TRACING: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (an OTLP endpoint is configured). Per-message
/// spans are created only when it is true, so tracing off costs nothing but
/// this load.
#[inline]
pub fn is_tracing() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// The log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (with the current spans and their fields).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format (text or json)")),
        }
    }
}

/// Why the telemetry set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The log filter does not parse.
    #[error("invalid log filter {filter:?}: {reason}")]
    Filter {
        /// The filter as given.
        filter: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A setting is out of range or malformed.
    #[error("{name}: {reason}")]
    Setting {
        /// The variable, flag or key.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The OTLP exporter cannot be built.
    #[error("OTLP exporter: {0}")]
    Exporter(String),
    /// A global subscriber is already set.
    #[error("logging was already set up: {0}")]
    AlreadySet(String),
}

/// Everything the set-up needs.
pub struct Settings {
    /// The log filter (`EnvFilter` syntax); `None`: `RUST_LOG`, else `info`.
    pub log_filter: Option<String>,
    /// Text or JSON lines.
    pub log_format: LogFormat,
    /// Where log lines go.
    pub log_writer: BoxMakeWriter,
    /// ANSI colours in text lines.
    pub ansi: bool,
    /// OTLP/gRPC collector; `None`: no export, no per-message spans.
    pub otlp_endpoint: Option<String>,
    /// `service.name`.
    pub service_name: String,
    /// Fraction of new traces sampled (parent-based).
    pub sampling_ratio: f64,
    /// Further resource attributes.
    pub resource_attributes: BTreeMap<String, String>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("log_filter", &self.log_filter)
            .field("log_format", &self.log_format)
            .field("otlp_endpoint", &self.otlp_endpoint)
            .field("service_name", &self.service_name)
            .field("sampling_ratio", &self.sampling_ratio)
            .field("resource_attributes", &self.resource_attributes)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// Defaults for the binary `service_name`: text lines on stderr (in
    /// colour only for a person at a terminal, never with `NO_COLOR`), no
    /// export, every trace sampled.
    pub fn new(service_name: &str) -> Self {
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        Settings {
            log_filter: None,
            log_format: LogFormat::Text,
            log_writer: BoxMakeWriter::new(std::io::stderr),
            ansi,
            otlp_endpoint: None,
            service_name: service_name.to_owned(),
            sampling_ratio: 1.0,
            resource_attributes: BTreeMap::new(),
        }
    }

    /// The YAML `telemetry:` block (validated already).
    pub fn with_config(mut self, config: &TelemetryConfig) -> Self {
        if config.otlp_endpoint.is_some() {
            self.otlp_endpoint.clone_from(&config.otlp_endpoint);
        }
        self.service_name.clone_from(&config.service_name);
        self.sampling_ratio = config.sampling_ratio;
        self.resource_attributes
            .extend(config.resource_attributes.clone());
        self
    }

    /// The standard OpenTelemetry variables, where set and non-empty.
    pub fn with_env(mut self, env: &dyn Env) -> Result<Self, TelemetryError> {
        let var = |name| env.var(name).filter(|v| !v.trim().is_empty());
        if let Some(endpoint) = var("OTEL_EXPORTER_OTLP_ENDPOINT") {
            self.otlp_endpoint = Some(endpoint);
        }
        if let Some(name) = var("OTEL_SERVICE_NAME") {
            self.service_name = name;
        }
        if let Some(ratio) = var("OTEL_TRACES_SAMPLER_ARG") {
            self.sampling_ratio =
                parse_ratio(&ratio).map_err(|reason| TelemetryError::Setting {
                    name: "OTEL_TRACES_SAMPLER_ARG",
                    reason,
                })?;
        }
        if let Some(attributes) = var("OTEL_RESOURCE_ATTRIBUTES") {
            for pair in attributes.split(',').filter(|p| !p.trim().is_empty()) {
                match pair.split_once('=') {
                    Some((k, v)) if !k.trim().is_empty() => {
                        self.resource_attributes
                            .insert(k.trim().to_owned(), v.trim().to_owned());
                    }
                    _ => {
                        return Err(TelemetryError::Setting {
                            name: "OTEL_RESOURCE_ATTRIBUTES",
                            reason: format!("{pair:?} is not key=value"),
                        });
                    }
                }
            }
        }
        Ok(self)
    }
}

/// A sampling ratio from text: a number from 0.0 to 1.0.
pub fn parse_ratio(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{text:?} is not a ratio between 0.0 and 1.0")),
    }
}

/// The running set-up: flush it with [`Telemetry::shutdown`] before exit.
#[derive(Debug)]
pub struct Telemetry {
    export: Option<(SdkTracerProvider, export::ExportTask)>,
}

/// Sets up logging and, with an endpoint, span export, for the whole
/// process. With an endpoint it must run inside a tokio runtime (the export
/// task and the gRPC channel live there).
pub fn init(settings: Settings) -> Result<Telemetry, TelemetryError> {
    let filter_text = settings
        .log_filter
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok().filter(|f| !f.is_empty()))
        .unwrap_or_else(|| "info".to_owned());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter_text).map_err(|e| {
        TelemetryError::Filter {
            filter: filter_text.clone(),
            reason: e.to_string(),
        }
    })?;
    let (otel, export) = match &settings.otlp_endpoint {
        None => (None, None),
        Some(endpoint) => {
            let (provider, task) = provider(&settings, endpoint)?;
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("ferry"))
                // Each of these costs every span something for nothing we
                // use: busy/idle times, thread and source attributes, the
                // `target` attribute, and making the span's OpenTelemetry
                // context current on every poll (Ferry propagates explicitly,
                // `propagation`).
                .with_tracked_inactivity(false)
                .with_threads(false)
                .with_location(false)
                .with_target(false)
                .with_context_activation(false)
                .with_filter(filter_fn(|meta| {
                    meta.is_span() && meta.target().starts_with("ferry")
                }));
            (Some(layer), Some((provider, task)))
        }
    };
    let endpoint = settings.otlp_endpoint.clone();
    let service = settings.service_name.clone();
    let sampling_ratio = settings.sampling_ratio;
    let log = match settings.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(settings.log_writer)
            .with_ansi(settings.ansi)
            .map_event_format(WithTraceIds)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .with_writer(settings.log_writer)
            .map_event_format(WithTraceIds)
            .boxed(),
    }
    .with_filter(filter);
    tracing_subscriber::registry()
        .with(log)
        .with(otel)
        .try_init()
        .map_err(|e| TelemetryError::AlreadySet(e.to_string()))?;
    if let Some((provider, _)) = &export {
        message::set_tracer(Some(provider.tracer("ferry")));
        TRACING.store(true, Ordering::Relaxed);
        tracing::info!(
            endpoint = endpoint.as_deref().unwrap_or_default(),
            %service,
            sampling_ratio,
            "exporting spans over OTLP/gRPC"
        );
    }
    Ok(Telemetry { export })
}

/// The tracer provider: parent-based ratio sampling, the resource, and the
/// bounded export queue in front of the OTLP/gRPC exporter: Ferry's own
/// ([`otlp`]) where it can stand in for the SDK's, else the SDK's.
fn provider(
    settings: &Settings,
    endpoint: &str,
) -> Result<(SdkTracerProvider, export::ExportTask), TelemetryError> {
    if !(0.0..=1.0).contains(&settings.sampling_ratio) {
        return Err(TelemetryError::Setting {
            name: "sampling ratio",
            reason: format!("{} is not between 0.0 and 1.0", settings.sampling_ratio),
        });
    }
    let resource = Resource::builder()
        .with_service_name(settings.service_name.clone())
        .with_attributes(
            settings
                .resource_attributes
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .build();
    let (queue, task) =
        match otlp::OtlpExporter::for_endpoint(endpoint, EXPORT_TIMEOUT, &ProcessEnv) {
            Ok(exporter) => start_export(exporter, &resource),
            Err(reason) => {
                tracing::debug!(%reason, "spans exported by the OpenTelemetry SDK's OTLP exporter");
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .with_timeout(EXPORT_TIMEOUT)
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
                start_export(exporter, &resource)
            }
        };
    let provider = SdkTracerProvider::builder()
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            settings.sampling_ratio,
        ))))
        .with_resource(resource)
        .with_span_processor(queue)
        .build();
    Ok((provider, task))
}

/// The export queue in front of `exporter`, which exports for `resource`.
fn start_export<E: opentelemetry_sdk::trace::SpanExporter + 'static>(
    mut exporter: E,
    resource: &Resource,
) -> (export::ExportQueue, export::ExportTask) {
    exporter.set_resource(resource);
    export::start(exporter)
}

impl Telemetry {
    /// Exports the spans still queued (within [`FLUSH_TIMEOUT`]) and stops
    /// the export. Log lines keep going to the log.
    pub async fn shutdown(self) {
        if let Some((provider, task)) = self.export {
            TRACING.store(false, Ordering::Relaxed);
            message::set_tracer(None);
            task.flush_and_stop(FLUSH_TIMEOUT).await;
            if let Err(e) = provider.shutdown() {
                tracing::debug!(error = %e, "tracer provider shutdown");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Vars(&'static [(&'static str, &'static str)]);

    impl Env for Vars {
        fn var(&self, name: &str) -> Option<String> {
            self.0
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn variables_override_the_configuration() {
        let config = TelemetryConfig {
            otlp_endpoint: Some("http://from-yaml:4317".into()),
            service_name: "yaml-name".into(),
            sampling_ratio: 0.5,
            resource_attributes: BTreeMap::from([("a".into(), "1".into())]),
        };
        let s = Settings::new("ferry-agent").with_config(&config);
        assert_eq!(s.otlp_endpoint.as_deref(), Some("http://from-yaml:4317"));
        assert_eq!(s.service_name, "yaml-name");
        let s = s
            .with_env(&Vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://from-env:4317"),
                ("OTEL_SERVICE_NAME", ""),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "b=2, deployment.environment=test",
                ),
            ]))
            .expect("valid variables");
        assert_eq!(s.otlp_endpoint.as_deref(), Some("http://from-env:4317"));
        assert_eq!(s.service_name, "yaml-name", "an empty variable is unset");
        assert!((s.sampling_ratio - 0.25).abs() < f64::EPSILON);
        assert_eq!(s.resource_attributes.len(), 3);
        assert_eq!(s.resource_attributes["deployment.environment"], "test");
    }

    /// An `https://` collector gets the SDK's exporter with TLS (rustls,
    /// the system's roots): building it must not fail for want of a TLS
    /// feature.
    #[tokio::test]
    async fn an_https_endpoint_builds_an_exporter() {
        let built = provider(&Settings::new("x"), "https://collector.invalid:4317");
        assert!(built.is_ok(), "{:?}", built.err());
    }

    #[test]
    fn bad_variables_are_named() {
        let e = Settings::new("x")
            .with_env(&Vars(&[("OTEL_TRACES_SAMPLER_ARG", "2")]))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            e.as_deref(),
            Some("OTEL_TRACES_SAMPLER_ARG: \"2\" is not a ratio between 0.0 and 1.0")
        );
        let e = Settings::new("x")
            .with_env(&Vars(&[("OTEL_RESOURCE_ATTRIBUTES", "novalue")]))
            .err()
            .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("not key=value")));
        assert_eq!("json".parse(), Ok(LogFormat::Json));
        assert!("xml".parse::<LogFormat>().is_err());
    }
}
