//! A message's records as its row stores them (layout 6, `super::outbox`
//! invariant 7): the id, binding and address of each, in seq order, so that
//! a record needs no row of its own until something acts on it alone.
//!
//! Each field is its length (LEB128) and its UTF-8 bytes: the three fields
//! of the first record, then of the second, and so on. The number of
//! records is the message's seq range, which the row holds apart.

use crate::stores::{NewRecord, StoreError, StoreResult};

/// Encodes `records` in seq order.
pub(super) fn encode(records: &[NewRecord]) -> Vec<u8> {
    let len: usize = records
        .iter()
        .map(|r| r.id.len() + r.binding.len() + r.address.len() + 6)
        .sum();
    let mut out = Vec::with_capacity(len);
    for r in records {
        for field in [&*r.id, &*r.binding, &*r.address] {
            put_len(&mut out, field.len());
            out.extend_from_slice(field.as_bytes());
        }
    }
    out
}

/// One record's fields, borrowed from the encoded list.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Entry<'a> {
    pub(super) id: &'a str,
    pub(super) binding: &'a str,
    pub(super) address: &'a str,
}

/// The `count` records of `bytes`, in seq order; an error naming `msg` when
/// the list does not hold exactly that many well-formed entries.
pub(super) fn decode(bytes: &[u8], count: usize, msg: i64) -> StoreResult<Vec<Entry<'_>>> {
    let corrupt = |what: &str| {
        StoreError::Corrupt(format!("outbox message {msg}: its record list is {what}"))
    };
    let mut rest = bytes;
    let mut field = || -> StoreResult<&str> {
        let len = take_len(&mut rest).ok_or_else(|| corrupt("cut short"))?;
        if len > rest.len() {
            return Err(corrupt("cut short"));
        }
        let (text, after) = rest.split_at(len);
        rest = after;
        std::str::from_utf8(text).map_err(|_| corrupt("not UTF-8"))
    };
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        entries.push(Entry {
            id: field()?,
            binding: field()?,
            address: field()?,
        });
    }
    if !rest.is_empty() {
        return Err(corrupt("longer than its records"));
    }
    Ok(entries)
}

fn put_len(out: &mut Vec<u8>, mut len: usize) {
    while len >= 0x80 {
        out.push((len as u8) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
}

/// A length, or `None` when `bytes` end inside it or it overflows.
fn take_len(bytes: &mut &[u8]) -> Option<usize> {
    let mut len = 0usize;
    for shift in (0..usize::BITS).step_by(7) {
        let (&byte, rest) = bytes.split_first()?;
        *bytes = rest;
        len |= usize::from(byte & 0x7f).checked_shl(shift)?;
        if byte & 0x80 == 0 {
            return Some(len);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(id: &str, binding: &str, address: &str) -> NewRecord {
        NewRecord {
            id: id.to_owned(),
            binding: binding.into(),
            address: address.into(),
        }
    }

    #[test]
    fn records_come_back_in_order() {
        let long = "a".repeat(300);
        let records = [record("1", "x", "out/1"), record("2", "", &long)];
        let bytes = encode(&records);
        assert_eq!(
            decode(&bytes, 2, 7).expect("decoded"),
            [
                Entry {
                    id: "1",
                    binding: "x",
                    address: "out/1"
                },
                Entry {
                    id: "2",
                    binding: "",
                    address: &long
                }
            ]
        );
    }

    #[test]
    fn a_list_of_another_length_is_corrupt_and_named() {
        let bytes = encode(&[record("1", "x", "a")]);
        for (count, cut) in [(2, bytes.len()), (1, bytes.len() - 1), (0, bytes.len())] {
            let e = decode(&bytes[..cut], count, 7).expect_err("refused");
            assert!(
                matches!(&e, StoreError::Corrupt(m) if m.contains("outbox message 7")),
                "{e:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64), count in 0usize..4) {
            let _ = decode(&bytes, count, 1);
        }

        #[test]
        fn what_is_encoded_decodes(fields in proptest::collection::vec((".{0,40}", ".{0,8}", ".{0,200}"), 0..5)) {
            let records: Vec<NewRecord> = fields.iter().map(|(i, b, a)| record(i, b, a)).collect();
            let bytes = encode(&records);
            let entries = decode(&bytes, records.len(), 1).expect("decoded");
            for (e, r) in entries.iter().zip(&records) {
                prop_assert_eq!(e.id, r.id.as_str());
                prop_assert_eq!(e.binding, &*r.binding);
                prop_assert_eq!(e.address, &*r.address);
            }
        }
    }
}
