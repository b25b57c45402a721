//! What an MQTT string (a topic, a user property's key or value, a content
//! type) may hold, for the configuration's validator and the agent's sender
//! alike: a topic the validator accepts can be sent.

/// Why `s` cannot be sent as an MQTT string, if it cannot: longer than 65 535
/// bytes, or holding NUL (MQTT v5 §1.5.4, v3.1.1 §1.5.3: a malformed packet),
/// a control character (U+0001–U+001F, U+007F–U+009F) or a non-character
/// (U+FDD0–U+FDEF, U+xFFFE, U+xFFFF), which the specifications say a string
/// SHOULD NOT hold and a receiver MAY treat as malformed. Mosquitto does: it
/// closes the connection, so the publish could only be retried forever.
pub fn problem(s: &str) -> Option<String> {
    if s.len() > usize::from(u16::MAX) {
        return Some(format!(
            "is {} bytes, more than an MQTT string holds (65535)",
            s.len()
        ));
    }
    // Printable ASCII, what nearly every header and topic is, is always
    // fine; the rest is decoded character by character.
    if all_bytes(s, printable) {
        return None;
    }
    s.chars().find_map(|c| {
        let what = match c {
            '\0' => "NUL",
            '\u{1}'..='\u{1f}' | '\u{7f}'..='\u{9f}' => "a control character",
            '\u{fdd0}'..='\u{fdef}' => "a Unicode non-character",
            c if u32::from(c) & 0xfffe == 0xfffe => "a Unicode non-character",
            _ => return None,
        };
        Some(format!("contains {what} (U+{:04X})", u32::from(c)))
    })
}

/// Printable ASCII (0x20–0x7E).
#[inline]
pub fn printable(b: u8) -> bool {
    b.wrapping_sub(0x20) <= 0x5e
}

/// Whether every byte of `s` is `fine`: checked for all bytes at once, a fold
/// with no early exit that the compiler vectorizes. This runs for every
/// string of every send.
#[inline]
pub fn all_bytes(s: &str, fine: impl Fn(u8) -> bool) -> bool {
    s.bytes().fold(true, |all, b| all & fine(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Mosquitto refuses as a malformed packet is refused before it is
    /// sent; everything else, however unusual, is left alone.
    #[test]
    fn strings_mqtt_cannot_carry() {
        let long = "x".repeat(65_536);
        let refused = [
            ("a\0b", "contains NUL (U+0000)"),
            ("tab\there", "contains a control character (U+0009)"),
            ("\u{7f}", "contains a control character (U+007F)"),
            ("next\u{85}line", "contains a control character (U+0085)"),
            ("\u{9f}", "contains a control character (U+009F)"),
            ("\u{fdd0}", "contains a Unicode non-character (U+FDD0)"),
            ("\u{fdef}", "contains a Unicode non-character (U+FDEF)"),
            ("\u{fffe}", "contains a Unicode non-character (U+FFFE)"),
            ("end \u{ffff}", "contains a Unicode non-character (U+FFFF)"),
            ("\u{1fffe}", "contains a Unicode non-character (U+1FFFE)"),
            ("\u{10ffff}", "contains a Unicode non-character (U+10FFFF)"),
            (
                &long,
                "is 65536 bytes, more than an MQTT string holds (65535)",
            ),
        ];
        for (s, expected) in refused {
            assert_eq!(problem(s).as_deref(), Some(expected));
        }
        let kept = [
            "",
            "plain ascii ~!",
            "\u{a0}\u{bf}\u{c0}é",
            "\u{fdcf}\u{fdf0}\u{fffd}€",
            "\u{1f600}\u{10fffd}",
            &long[1..],
        ];
        for s in kept {
            assert_eq!(problem(s), None, "{s:?}");
        }
    }
}
