//! New unique ids: UUIDv7 in their hyphenated text form.
//!
//! One is made per record of every message (and per message that arrives
//! without one), so it is written straight into its string rather than
//! through `Display` and the formatting machinery, which cost about twice as
//! much (`docs/benchmarks.md`, issue 15).
//!
//! The 74 bits after the millisecond timestamp are random (RFC 9562's
//! method without a counter): ids sort by the millisecond they were made
//! in, not within it. `Uuid::now_v7` would order them within the
//! millisecond too, through a counter behind a process-wide lock, which cost
//! as much again as the rest of the id; nothing in Ferry orders by id, and two
//! ids of one millisecond collide with a chance of 2^-74.

use std::time::{SystemTime, UNIX_EPOCH};

/// A new UUIDv7, hyphenated, lower case.
pub fn new_id() -> String {
    // A clock before 1970 gives timestamp 0; the random bits keep it unique.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let at = uuid::Timestamp::from_unix(uuid::NoContext, now.as_secs(), now.subsec_nanos());
    uuid::Uuid::new_v7(at)
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

    #[test]
    fn ids_carry_the_millisecond_they_were_made_in() {
        let ms = |t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .expect("after 1970")
                .as_millis()
        };
        let before = ms(SystemTime::now());
        let id = uuid::Uuid::parse_str(&new_id()).expect("a UUID");
        let after = ms(SystemTime::now());
        let (secs, nanos) = id.get_timestamp().expect("v7 has one").to_unix();
        let at = u128::from(secs) * 1000 + u128::from(nanos / 1_000_000);
        assert!(
            (before..=after).contains(&at),
            "{before} <= {at} <= {after}"
        );
    }
}
