//! How ferryctl prints: aligned tables for people, JSON or YAML for scripts.
//! Every command builds serializable views; this module only renders them.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Writes to stdout and flushes. Unlike `print!` it returns the error: a
/// closed pipe is `BrokenPipe`, which [`is_broken_pipe`] recognises so that
/// `main` ends quietly (Rust ignores SIGPIPE, so the write fails with EPIPE).
pub fn write_stdout(args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_fmt(args)?;
    stdout.flush()
}

/// True when `error` comes from writing to a reader that went away.
pub fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The `-o` flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns (lists) or `key: value` lines (one object).
    #[default]
    Table,
    /// Pretty-printed JSON.
    Json,
    /// YAML.
    Yaml,
}

/// A view that can be one row of a table.
pub trait Row: Serialize {
    /// Column titles.
    const HEADERS: &'static [&'static str];
    /// The cells, in `HEADERS` order.
    fn cells(&self) -> Vec<String>;
}

/// Prints a list of rows.
pub fn list<T: Row>(format: Format, rows: &[T]) -> anyhow::Result<()> {
    match format {
        Format::Table => {
            out!("{}", table(T::HEADERS, rows.iter().map(Row::cells)))?;
            Ok(())
        }
        Format::Json => json(&rows),
        Format::Yaml => yaml(&rows),
    }
}

/// Prints one object: as `key: value` lines in table mode (`pairs`), whole
/// otherwise.
pub fn object<T: Serialize>(
    format: Format,
    value: &T,
    pairs: impl FnOnce(&T) -> Vec<(&'static str, String)>,
) -> anyhow::Result<()> {
    match format {
        Format::Table => {
            let pairs = pairs(value);
            let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
            for (key, value) in pairs {
                if value.contains('\n') {
                    outln!("{key}:")?;
                    for line in value.lines() {
                        outln!("  {line}")?;
                    }
                } else {
                    outln!(
                        "{key:<width$}  {value}",
                        width = width + 1,
                        key = format!("{key}:")
                    )?;
                }
            }
            Ok(())
        }
        Format::Json => json(value),
        Format::Yaml => yaml(value),
    }
}

fn json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    outln!("{}", serde_json::to_string_pretty(value)?)?;
    Ok(())
}

fn yaml<T: Serialize>(value: &T) -> anyhow::Result<()> {
    out!("{}", serde_saphyr::to_string(value)?)?;
    Ok(())
}

/// Renders rows as left-aligned columns separated by two spaces.
pub fn table(headers: &[&str], rows: impl Iterator<Item = Vec<String>>) -> String {
    let rows: Vec<Vec<String>> = rows.collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            text.push_str(cell);
            text.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// A protobuf timestamp as RFC 3339 UTC (`2026-11-29T21:40:25Z`); empty when
/// unset.
pub fn timestamp(ts: Option<&prost_types::Timestamp>) -> String {
    let Some(ts) = ts else {
        return String::new();
    };
    let Ok(time) = SystemTime::try_from(*ts) else {
        return format!("{}s", ts.seconds);
    };
    rfc3339(time)
}

/// RFC 3339 in UTC with second precision.
pub fn rfc3339(time: SystemTime) -> String {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// `k=v,k2=v2`, sorted by key; `<all>` when empty.
pub fn labels<'a>(labels: impl IntoIterator<Item = (&'a String, &'a String)>) -> String {
    let mut pairs: Vec<_> = labels.into_iter().collect();
    pairs.sort();
    if pairs.is_empty() {
        return "<all>".to_owned();
    }
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_render_in_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_988_425);
        assert_eq!(rfc3339(t), "2026-11-29T21:40:25Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn tables_align_columns() {
        let text = table(
            &["ID", "VERSION"],
            vec![
                vec!["a".into(), "1".into()],
                vec!["longer-id".into(), "12".into()],
            ]
            .into_iter(),
        );
        assert_eq!(text, "ID         VERSION\na          1\nlonger-id  12\n");
    }
}
