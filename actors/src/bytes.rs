//! Sizes in a config: `"64MiB"` or a number of bytes.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count written as an integer or a string with a unit ("64MiB", "1 GiB", "4096").
///
/// Parsing is the `bytesize` crate's; this type keeps what a config needs around it: an exact
/// display (`3MiB`, or plain bytes where no unit divides), so a printed config reads back the
/// same, and the bound below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The largest size accepted: what a TOML integer can hold. `bytesize` saturates where a
    /// size overflows; a bound well inside u64 keeps arithmetic on sizes from overflowing too.
    pub const MAX: u64 = i64::MAX as u64;

    /// Parses a size: plain bytes, binary units (KiB, MiB, GiB, TiB; also Ki, Mi, …) or decimal
    /// ones (KB, MB, GB, TB; also K, M, …), in any case, with an optional space and fraction
    /// ("1.5GiB").
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let v: bytesize::ByteSize = s.parse().map_err(|e| {
            format!("{s:?} is not a byte size ({e}); write e.g. \"64MiB\" or a number of bytes")
        })?;
        if v.0 > Self::MAX {
            return Err(format!("{s:?} is larger than {} bytes", Self::MAX));
        }
        Ok(ByteSize(v.0))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            if v >= 1 << shift && v.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", v >> shift);
            }
        }
        write!(f, "{v}")
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Bytes;
        impl serde::de::Visitor<'_> for Bytes {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size like \"64MiB\" or a number of bytes")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(n))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteSize, E> {
                u64::try_from(n).map(ByteSize).map_err(|_| {
                    E::custom(format!(
                        "{n} is negative: expected a size like \"64MiB\" or a number of bytes"
                    ))
                })
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
                ByteSize::parse(s).map_err(E::custom)
            }
        }
        d.deserialize_any(Bytes)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}
