//! How domain values become column values and back, the same for every
//! backend: times are `i64` nanoseconds since the Unix epoch (exact for
//! `SystemTime` between 1970 and 2262), versions are `i64` (never negative),
//! label maps and string lists are JSON text, digests are hex SHA-256.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::error::{StateError, StateResult};
use super::types::Labels;

/// A time as stored.
pub(crate) fn time_to_db(time: SystemTime) -> StateResult<i64> {
    let since = time
        .duration_since(UNIX_EPOCH)
        .map_err(|_| StateError::invalid("times before 1970 cannot be stored"))?;
    i64::try_from(since.as_nanos())
        .map_err(|_| StateError::invalid("times after 2262 cannot be stored"))
}

/// A stored time.
pub(crate) fn time_from_db(nanos: i64) -> StateResult<SystemTime> {
    let nanos = u64::try_from(nanos)
        .map_err(|_| StateError::corrupt(format!("negative stored time {nanos}")))?;
    Ok(UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// An optional stored time.
pub(crate) fn opt_time_from_db(nanos: Option<i64>) -> StateResult<Option<SystemTime>> {
    nanos.map(time_from_db).transpose()
}

/// An optional time as stored.
pub(crate) fn opt_time_to_db(time: Option<SystemTime>) -> StateResult<Option<i64>> {
    time.map(time_to_db).transpose()
}

/// A version (or count) as stored.
pub(crate) fn u64_to_db(value: u64) -> StateResult<i64> {
    i64::try_from(value).map_err(|_| StateError::invalid(format!("{value} is too large to store")))
}

/// A stored version (or count).
pub(crate) fn u64_from_db(value: i64) -> StateResult<u64> {
    u64::try_from(value).map_err(|_| StateError::corrupt(format!("negative stored number {value}")))
}

/// A stored attempt count.
pub(crate) fn u32_from_db(value: i64) -> StateResult<u32> {
    u32::try_from(value)
        .map_err(|_| StateError::corrupt(format!("stored count {value} out of range")))
}

/// Labels as stored (JSON object text).
pub(crate) fn labels_to_db(labels: &Labels) -> StateResult<String> {
    serde_json::to_string(labels).map_err(|e| StateError::invalid(format!("labels: {e}")))
}

/// Stored labels.
pub(crate) fn labels_from_db(text: &str) -> StateResult<Labels> {
    serde_json::from_str(text).map_err(|e| StateError::corrupt(format!("stored labels: {e}")))
}

/// A list of strings as stored (JSON array text).
pub(crate) fn strings_to_db(items: &[String]) -> StateResult<String> {
    serde_json::to_string(items).map_err(|e| StateError::invalid(format!("list: {e}")))
}

/// A stored list of strings.
pub(crate) fn strings_from_db(text: &str) -> StateResult<Vec<String>> {
    serde_json::from_str(text).map_err(|e| StateError::corrupt(format!("stored list: {e}")))
}

/// Lowercase hex SHA-256 of a document.
pub(crate) fn digest(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Refuses an empty identifier, naming the field.
pub(crate) fn require_id(field: &str, value: &str) -> StateResult<()> {
    if value.is_empty() {
        Err(StateError::invalid(format!("{field} must not be empty")))
    } else {
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_hex_sha256() {
        assert_eq!(
            digest("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn times_round_trip_exactly() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        assert_eq!(time_from_db(time_to_db(t).unwrap()).unwrap(), t);
        assert!(time_to_db(UNIX_EPOCH - Duration::from_secs(1)).is_err());
        assert!(time_from_db(-1).is_err());
    }
}
