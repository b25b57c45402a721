//! Maps keyed by the packet ids this client assigns.
//!
//! Every publish of a fan-out is put into two of them and taken out again
//! (the event loop's ids in flight, the sender's waiters), and the standard
//! map's SipHash cost more than the rest of each lookup. SipHash guards
//! against keys chosen to collide; these keys are chosen by this client
//! (the broker only acknowledges them) and there are at most 65 535, so a
//! multiplicative hash is enough.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map from packet id to `V`.
pub(super) type PacketIdMap<V> = HashMap<u16, V, BuildHasherDefault<PacketIdHasher>>;

/// Spreads a packet id over all 64 bits (Fibonacci hashing): consecutive
/// ids differ in the low bits the table indexes by and in the high bits it
/// keeps as tags.
#[derive(Default)]
pub(super) struct PacketIdHasher(u64);

/// 2^64 divided by the golden ratio, odd.
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for PacketIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u16` keys reach this map; any other input still hashes.
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(SPREAD);
        }
    }

    fn write_u16(&mut self, id: u16) {
        self.0 = (self.0 ^ u64::from(id)).wrapping_mul(SPREAD);
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    /// Every id gets its own hash, and consecutive ids land in different
    /// buckets of a small table and carry different tags.
    #[test]
    fn ids_spread_over_buckets_and_tags() {
        let build = BuildHasherDefault::<PacketIdHasher>::default();
        let hashes: Vec<u64> = (0..=u16::MAX).map(|id| build.hash_one(id)).collect();
        let mut distinct = hashes.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), hashes.len());
        let buckets: std::collections::HashSet<u64> =
            hashes[1..=128].iter().map(|h| h & 127).collect();
        assert!(buckets.len() > 64, "{} of 128 buckets used", buckets.len());
        let tags: std::collections::HashSet<u64> =
            hashes[1..=128].iter().map(|h| h >> 57).collect();
        assert!(tags.len() > 64, "{} of 128 tags used", tags.len());
    }
}
