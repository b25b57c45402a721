//! Unique names, so that tests sharing a server (moto, PostgreSQL, a broker) never collide.

use uuid::Uuid;

/// A name unique in this and every other test process: `{prefix}-{32 hex digits}`.
///
/// The hex part is a UUIDv7 (time-ordered, random tail), so names sort by creation time, which
/// helps when reading leftovers. It uses only `[a-z0-9-]`, valid in SQS queue names, DynamoDB
/// table names, MQTT topics and client ids.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", Uuid::now_v7().simple())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let a = unique("queue");
        let b = unique("queue");
        assert_ne!(a, b);
        assert!(a.starts_with("queue-"));
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    }
}
