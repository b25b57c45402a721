//! Durations with units, as the configuration writes them: `100ms`, `1s`, `15m`, `1h`, `1.5s`,
//! `1m30s`.
//!
//! A bare number is rejected (is `30` seconds or milliseconds?), and so is a negative one. Zero
//! parses (`0s`); the validator decides where zero is meaningless.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A non-negative span of time written with a unit (`ms`, `s`, `m`, `h`, `d`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Duration(std::time::Duration);

impl Duration {
    /// The zero duration.
    pub const ZERO: Duration = Duration(std::time::Duration::ZERO);

    /// `n` milliseconds.
    pub const fn from_millis(n: u64) -> Self {
        Duration(std::time::Duration::from_millis(n))
    }

    /// `n` seconds.
    pub const fn from_secs(n: u64) -> Self {
        Duration(std::time::Duration::from_secs(n))
    }

    /// The standard library duration.
    pub const fn get(self) -> std::time::Duration {
        self.0
    }

    /// Whether this is zero.
    pub const fn is_zero(self) -> bool {
        self.0.is_zero()
    }
}

impl From<std::time::Duration> for Duration {
    fn from(d: std::time::Duration) -> Self {
        Duration(d)
    }
}

impl From<Duration> for std::time::Duration {
    fn from(d: Duration) -> Self {
        d.0
    }
}

/// Why a duration did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Nothing to parse.
    #[error("empty duration (write it with a unit, e.g. `1s`)")]
    Empty,
    /// A negative duration.
    #[error("duration `{0}` is negative")]
    Negative(String),
    /// A number without a unit.
    #[error("duration `{0}` has no unit (write e.g. `{0}s` or `{0}ms`)")]
    MissingUnit(String),
    /// A unit Ferry does not know.
    #[error("duration `{input}` has an unknown unit `{unit}` (use ms, s, m, h or d)")]
    UnknownUnit {
        /// The whole input.
        input: String,
        /// The offending unit.
        unit: String,
    },
    /// Not a duration at all.
    #[error("`{0}` is not a duration (write e.g. `100ms`, `1s`, `15m`, `1h`)")]
    Invalid(String),
    /// Too large to represent.
    #[error("duration `{0}` is too large")]
    Overflow(String),
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let s = input.trim();
        if s.is_empty() {
            return Err(DurationError::Empty);
        }
        if s.starts_with('-') {
            return Err(DurationError::Negative(s.to_owned()));
        }
        let s_body = s.strip_prefix('+').unwrap_or(s);
        let mut total_nanos: u128 = 0;
        let mut rest = s_body;
        while !rest.is_empty() {
            let num_len = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            let (num, after) = rest.split_at(num_len);
            if num.is_empty() {
                return Err(DurationError::Invalid(s.to_owned()));
            }
            let unit_len = after
                .find(|c: char| !c.is_ascii_alphabetic())
                .unwrap_or(after.len());
            let (unit, after) = after.split_at(unit_len);
            if unit.is_empty() {
                return if after.is_empty() && rest.len() == s_body.len() {
                    Err(DurationError::MissingUnit(s.to_owned()))
                } else {
                    Err(DurationError::Invalid(s.to_owned()))
                };
            }
            let unit_nanos: u128 = match unit {
                "ns" => 1,
                "us" | "µs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60 * 1_000_000_000,
                "h" => 3_600 * 1_000_000_000,
                "d" => 86_400 * 1_000_000_000,
                other => {
                    return Err(DurationError::UnknownUnit {
                        input: s.to_owned(),
                        unit: other.to_owned(),
                    });
                }
            };
            total_nanos = total_nanos
                .checked_add(scale(num, unit_nanos).ok_or_else(|| invalid_or_overflow(s, num))?)
                .ok_or_else(|| DurationError::Overflow(s.to_owned()))?;
            rest = after;
        }
        let secs = u64::try_from(total_nanos / 1_000_000_000)
            .map_err(|_| DurationError::Overflow(s.to_owned()))?;
        // The remainder is below 1e9 and fits in u32.
        let nanos = (total_nanos % 1_000_000_000) as u32;
        Ok(Duration(std::time::Duration::new(secs, nanos)))
    }
}

fn invalid_or_overflow(input: &str, num: &str) -> DurationError {
    if num.matches('.').count() > 1 || num.starts_with('.') || num.ends_with('.') {
        DurationError::Invalid(input.to_owned())
    } else {
        DurationError::Overflow(input.to_owned())
    }
}

/// `num` (digits with at most one inner `.`) times `unit_nanos`, in whole nanoseconds
/// (fractions below a nanosecond are dropped). `None` on a malformed number or overflow.
fn scale(num: &str, unit_nanos: u128) -> Option<u128> {
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) if !i.is_empty() && !f.is_empty() && !f.contains('.') => (i, f),
        Some(_) => return None,
        None => (num, ""),
    };
    let int: u128 = int.parse().ok()?;
    let mut total = int.checked_mul(unit_nanos)?;
    let mut place = unit_nanos;
    for digit in frac.chars() {
        place /= 10;
        let d = u128::from(digit.to_digit(10)?);
        total = total.checked_add(d * place)?;
    }
    Some(total)
}

impl fmt::Display for Duration {
    /// Writes the largest unit that divides it exactly: `100ms`, `1500ms`, `15m`, `1h`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        const UNITS: [(&str, u128); 7] = [
            ("d", 86_400_000_000_000),
            ("h", 3_600_000_000_000),
            ("m", 60_000_000_000),
            ("s", 1_000_000_000),
            ("ms", 1_000_000),
            ("us", 1_000),
            ("ns", 1),
        ];
        if nanos == 0 {
            return f.write_str("0s");
        }
        for (unit, size) in UNITS {
            if nanos.is_multiple_of(size) {
                return write!(f, "{}{unit}", nanos / size);
            }
        }
        // Not a whole number of any unit above nanoseconds: seconds with a fraction.
        let secs = self.0.as_secs();
        let frac = format!("{:09}", self.0.subsec_nanos());
        write!(f, "{secs}.{}s", frac.trim_end_matches('0'))
    }
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = Duration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration with a unit, such as `100ms`, `1s`, `15m` or `1h`")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                v.parse().map_err(E::custom)
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
                Err(E::custom(DurationError::MissingUnit(v.to_string())))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
                if v < 0 {
                    Err(E::custom(DurationError::Negative(v.to_string())))
                } else {
                    Err(E::custom(DurationError::MissingUnit(v.to_string())))
                }
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
                Err(E::custom(DurationError::MissingUnit(v.to_string())))
            }
        }

        deserializer.deserialize_str(DurationVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Result<Duration, DurationError> {
        s.parse()
    }

    #[test]
    fn parses_units() {
        assert_eq!(d("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(d("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(d("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(d("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(d("2d"), Ok(Duration::from_secs(172_800)));
        assert_eq!(d("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(d("0.25h"), Ok(Duration::from_secs(900)));
        assert_eq!(d("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(d("0s"), Ok(Duration::ZERO));
        assert_eq!(d(" 5s "), Ok(Duration::from_secs(5)));
    }

    #[test]
    fn rejects_unitless_negative_and_garbage() {
        assert_eq!(d("30"), Err(DurationError::MissingUnit("30".into())));
        assert_eq!(d("-1s"), Err(DurationError::Negative("-1s".into())));
        assert_eq!(d(""), Err(DurationError::Empty));
        assert!(matches!(d("1x"), Err(DurationError::UnknownUnit { .. })));
        assert!(matches!(d("s"), Err(DurationError::Invalid(_))));
        assert!(matches!(d("1.s"), Err(DurationError::Invalid(_))));
        assert!(matches!(d("1..5s"), Err(DurationError::Invalid(_))));
        assert!(matches!(d("1s30"), Err(DurationError::Invalid(_))));
        assert!(matches!(
            d("99999999999999999999999d"),
            Err(DurationError::Overflow(_))
        ));
        assert!(d("1s").is_ok());
    }

    #[test]
    fn displays_shortest_exact_form() {
        for s in [
            "100ms", "1s", "15m", "1h", "1.5s", "2d", "0s", "90s", "250us",
        ] {
            let parsed = d(s).expect("parses");
            let shown = parsed.to_string();
            assert_eq!(d(&shown), Ok(parsed), "{s} -> {shown}");
        }
        assert_eq!(Duration::from_millis(1500).to_string(), "1500ms");
        assert_eq!(Duration::from_secs(3600).to_string(), "1h");
        assert_eq!(Duration::from_secs(90).to_string(), "90s");
    }

    #[test]
    fn yaml_numbers_need_a_unit() {
        let err = serde_saphyr::from_str::<Duration>("30").expect_err("unitless");
        assert!(err.to_string().contains("has no unit"), "{err}");
        let ok: Duration = serde_saphyr::from_str("30s").expect("with unit");
        assert_eq!(ok, Duration::from_secs(30));
    }
}
