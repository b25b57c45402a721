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
    // A length under 128 is one ASCII byte, so the list of a message whose
    // fields are all shorter (nearly every one) is itself UTF-8 text: checked
    // once, its fields are slices of it, where a check per field cost a
    // call's overhead for each field. A field is UTF-8 exactly when
    // its slice of a valid text falls on character boundaries (`str::get`),
    // since a byte under 0x80 ends every length before it. Otherwise each
    // field is checked alone.
    let text = std::str::from_utf8(bytes).ok();
    let mut rest = bytes;
    let mut field = || -> StoreResult<&str> {
        let len = take_len(&mut rest).ok_or_else(|| corrupt("cut short"))?;
        if len > rest.len() {
            return Err(corrupt("cut short"));
        }
        let start = bytes.len() - rest.len();
        let (field, after) = rest.split_at(len);
        rest = after;
        match text {
            Some(text) => text.get(start..start + len),
            None => std::str::from_utf8(field).ok(),
        }
        .ok_or_else(|| corrupt("holding a field that is not UTF-8"))
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
        let bits = usize::from(byte & 0x7f);
        let part = bits.checked_shl(shift)?;
        // The last group may hold more bits than fit: that overflows too.
        if part >> shift != bits {
            return None;
        }
        len |= part;
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

    #[test]
    fn a_length_past_the_word_is_refused_not_cut() {
        // Nine groups of seven bits, then a tenth with more than the one bit
        // left of 64: the top bits would be lost.
        let mut bytes = vec![0x80; 9];
        bytes.push(0x02);
        assert_eq!(take_len(&mut &bytes[..]), None);
        bytes[9] = 0x01;
        assert_eq!(take_len(&mut &bytes[..]), Some(1 << 63));
    }

    #[test]
    fn a_field_cut_inside_a_character_is_refused_even_when_the_whole_list_is_utf8() {
        // The id is the first byte of "é"; the binding's length, 130, is
        // encoded 0x82 0x01, and 0x82 completes a character with it.
        let binding = "b".repeat(130);
        let mut bytes = vec![1, 0xc3, 0x82, 0x01];
        bytes.extend_from_slice(binding.as_bytes());
        bytes.extend_from_slice(&[1, b'a']);
        assert!(std::str::from_utf8(&bytes).is_ok());
        let e = decode(&bytes, 1, 7).expect_err("refused");
        assert!(
            matches!(&e, StoreError::Corrupt(m) if m.contains("a field that is not UTF-8")),
            "{e:?}"
        );
        assert!(decode_field_by_field(&bytes, 1).is_err());
    }

    /// The list's entries with each field checked on its own, or what is
    /// wrong with the list as `decode` words it.
    fn decode_field_by_field(bytes: &[u8], count: usize) -> Result<Vec<Entry<'_>>, &'static str> {
        let mut rest = bytes;
        let mut field = || {
            let len = take_len(&mut rest).ok_or("cut short")?;
            let (field, after) = rest.split_at_checked(len).ok_or("cut short")?;
            rest = after;
            std::str::from_utf8(field).map_err(|_| "a field that is not UTF-8")
        };
        let entries = (0..count)
            .map(|_| {
                Ok(Entry {
                    id: field()?,
                    binding: field()?,
                    address: field()?,
                })
            })
            .collect::<Result<Vec<_>, &str>>()?;
        if rest.is_empty() {
            Ok(entries)
        } else {
            Err("longer than its records")
        }
    }

    /// `decode` and [`decode_field_by_field`] agree, errors by their words.
    fn agree(bytes: &[u8], count: usize) -> Result<(), TestCaseError> {
        match (decode(bytes, count, 1), decode_field_by_field(bytes, count)) {
            (Ok(entries), Ok(expected)) => prop_assert_eq!(entries, expected),
            (Err(e), Err(expected)) => {
                prop_assert!(e.to_string().contains(expected), "{e} / {expected}")
            }
            (got, expected) => prop_assert!(false, "{got:?} / {expected:?}"),
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64), count in 0usize..4) {
            agree(&bytes, count)?;
        }

        /// Whatever the bytes, the list decodes as it does field by field:
        /// lists of text fields, some with their first or last byte cut
        /// off, with lengths of one and two bytes, so that the length after
        /// a cut character may complete it (and the whole list be UTF-8).
        #[test]
        fn decoding_checks_each_field_as_one_check_per_field_would(
            fields in proptest::collection::vec(("[aé€]{0,100}", 0..3u8), 1..7),
            count in 0usize..3,
        ) {
            let mut bytes = Vec::new();
            for (text, cut) in &fields {
                let field = text.as_bytes();
                let field = match cut {
                    1 => field.split_last().map_or(field, |(_, rest)| rest),
                    2 => field.split_first().map_or(field, |(_, rest)| rest),
                    _ => field,
                };
                put_len(&mut bytes, field.len());
                bytes.extend_from_slice(field);
            }
            agree(&bytes, count)?;
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
