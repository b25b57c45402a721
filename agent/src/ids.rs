//! New unique ids: UUIDv7 in their hyphenated text form.
//!
//! One is made per record of every message (and per message that arrives
//! without one), so it is written straight into its string rather than
//! through `Display` and the formatting machinery, which cost about twice as
//! much (`docs/benchmarks.md`, issue 15).

/// A new UUIDv7, hyphenated, lower case.
pub fn new_id() -> String {
    uuid::Uuid::now_v7()
        .hyphenated()
        .encode_lower(&mut uuid::Uuid::encode_buffer())
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_uuids_v7_in_text_and_distinct() {
        let (a, b) = (new_id(), new_id());
        assert_ne!(a, b);
        let parsed = uuid::Uuid::parse_str(&a).expect("a UUID");
        assert_eq!(parsed.get_version_num(), 7);
        assert_eq!(parsed.hyphenated().to_string(), a);
    }
}
