//! The telemetry flags every binary takes (flattened into its own clap
//! arguments), the last word over the configuration and the `OTEL_*`
//! variables.

use super::{LogFormat, Settings, TelemetryError, parse_ratio};
use crate::config::{Env, Telemetry as TelemetryConfig};

/// `--log`, `--log-format`, `--otlp-endpoint`, `--sampling-ratio`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TelemetryArgs {
    /// Log filter (tracing `EnvFilter` syntax, e.g. `info,ferry_agent=debug`). Default:
    /// `RUST_LOG` when set, else `info`.
    #[arg(long, global = true)]
    pub log: Option<String>,
    /// Log line format: `text` or `json` (one object per line, with the current span and its
    /// `trace_id`).
    #[arg(long, global = true, env = "FERRY_LOG_FORMAT", default_value = "text", value_parser = clap::value_parser!(LogFormat))]
    pub log_format: LogFormat,
    /// OTLP/gRPC collector to export spans to, e.g. `http://otel-collector:4317`. Overrides
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` and the configuration's `telemetry.otlp_endpoint`.
    /// Without any of them no span is recorded.
    #[arg(long, global = true)]
    pub otlp_endpoint: Option<String>,
    /// Fraction of new traces sampled, 0.0 to 1.0 (parent-based). Overrides
    /// `OTEL_TRACES_SAMPLER_ARG` and `telemetry.sampling_ratio`.
    #[arg(long, global = true, value_parser = parse_ratio)]
    pub sampling_ratio: Option<f64>,
}

impl clap::builder::ValueParserFactory for LogFormat {
    type Parser = fn(&str) -> Result<LogFormat, String>;

    fn value_parser() -> Self::Parser {
        |s| s.parse()
    }
}

impl TelemetryArgs {
    /// The settings of binary `service`: defaults, the configuration's
    /// `telemetry:` block (when there is one), the `OTEL_*` variables, then
    /// these flags.
    pub fn settings(
        &self,
        service: &str,
        config: Option<&TelemetryConfig>,
        env: &dyn Env,
    ) -> Result<Settings, TelemetryError> {
        let mut s = Settings::new(service);
        if let Some(config) = config {
            s = s.with_config(config);
        }
        let mut s = s.with_env(env)?;
        s.log_filter.clone_from(&self.log);
        s.log_format = self.log_format;
        if let Some(endpoint) = &self.otlp_endpoint {
            s.otlp_endpoint = Some(endpoint.clone());
        }
        if let Some(ratio) = self.sampling_ratio {
            s.sampling_ratio = ratio;
        }
        Ok(s)
    }
}
