//! The data model: namespaces, block hashes and keys, instance and lease ids.

use std::fmt;
use std::sync::Arc;

use thiserror::Error;

/// Longest block hash accepted (bytes).
pub const MAX_HASH_LEN: usize = 32;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ModelError {
    #[error("block hash #{index} has {len} bytes; hashes must be 1 to 32 bytes")]
    HashLength { index: usize, len: usize },
    /// `value` is [`shown`]: escaped and cut, never the raw bytes a client sent.
    #[error(
        "namespace {field} must be 1 to 128 printable characters (ASCII, without '/', \
         spaces or control characters; {len} bytes given), got {value}"
    )]
    Namespace {
        field: &'static str,
        value: String,
        len: usize,
    },
    #[error(
        "namespace must be model/dtype/fingerprint, or model/dtype/fingerprint/tenant (parts \
         separated by '/'), got {0}"
    )]
    NamespaceParts(String),
    #[error("instance id must be 1 to 128 printable characters, got {0}")]
    InstanceId(String),
    #[error("lease id must be 32 hex characters, got {0}")]
    LeaseId(String),
}

/// What blocks are comparable across nodes: model, dtype and a layout fingerprint.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(Arc<str>);

/// Longest part of a refused name that an error (and so a log line) repeats.
pub const SHOWN_CHARS: usize = 64;

/// `s` as an error or a log line may show it: quoted, every control and non-ASCII character
/// escaped (`\u{1b}`), cut after [`SHOWN_CHARS`] characters with `...` — a client's bytes
/// never reach a terminal or a log raw, and a huge name costs a log line its prefix only.
pub fn shown(s: &str) -> String {
    let mut out = String::from("\"");
    for (i, c) in s.chars().enumerate() {
        if i == SHOWN_CHARS {
            out.push_str("...");
            break;
        }
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.extend(c.escape_unicode()),
        }
    }
    out.push('"');
    out
}

fn printable(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_graphic() && c != '/')
}

impl Namespace {
    /// `model/dtype/fingerprint`; each part 1 to 128 printable characters without '/'.
    pub fn new(model: &str, dtype: &str, fingerprint: &str) -> Result<Self, ModelError> {
        for (field, value) in [
            ("model", model),
            ("dtype", dtype),
            ("fingerprint", fingerprint),
        ] {
            if !printable(value) {
                return Err(ModelError::Namespace {
                    field,
                    value: shown(value),
                    len: value.len(),
                });
            }
        }
        Ok(Self(format!("{model}/{dtype}/{fingerprint}").into()))
    }

    /// This namespace for one tenant of its model (a LoRA adapter, say):
    /// `model/dtype/fingerprint/tenant`, a namespace of its own — its blocks never meet the
    /// model's or another tenant's, and quotas and metrics count it apart. `tenant` is 1 to
    /// 128 printable characters without '/'. A namespace that has a tenant keeps it.
    pub fn with_tenant(&self, tenant: &str) -> Result<Self, ModelError> {
        if !printable(tenant) {
            return Err(ModelError::Namespace {
                field: "tenant",
                value: shown(tenant),
                len: tenant.len(),
            });
        }
        if self.tenant().is_some() {
            return Ok(self.clone());
        }
        Ok(Self(format!("{}/{tenant}", self.0).into()))
    }

    /// The tenant part, where there is one.
    pub fn tenant(&self) -> Option<&str> {
        self.0.splitn(4, '/').nth(3)
    }

    /// A namespace as it displays itself (`model/dtype/fingerprint`, with an optional
    /// `/tenant`), every part checked.
    pub fn parse(s: &str) -> Result<Self, ModelError> {
        let mut parts = s.split('/');
        match (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) {
            (Some(model), Some(dtype), Some(fingerprint), tenant, None) => {
                let ns = Self::new(model, dtype, fingerprint)?;
                match tenant {
                    Some(t) => ns.with_tenant(t),
                    None => Ok(ns),
                }
            }
            _ => Err(ModelError::NamespaceParts(shown(s))),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({})", self.0)
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The engine's prefix hash of one token block: 1 to 32 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash {
    len: u8,
    bytes: [u8; MAX_HASH_LEN],
}

impl BlockHash {
    pub fn new(bytes: &[u8]) -> Result<Self, ModelError> {
        Self::at(0, bytes)
    }

    /// Like [`Self::new`], with the hash's position in its request for the error.
    pub fn at(index: usize, bytes: &[u8]) -> Result<Self, ModelError> {
        if bytes.is_empty() || bytes.len() > MAX_HASH_LEN {
            return Err(ModelError::HashLength {
                index,
                len: bytes.len(),
            });
        }
        let mut b = [0u8; MAX_HASH_LEN];
        b[..bytes.len()].copy_from_slice(bytes);
        Ok(Self {
            len: bytes.len() as u8,
            bytes: b,
        })
    }

    /// Parses a whole request's hashes, refusing it at the first bad one.
    pub fn parse_all<T: AsRef<[u8]>>(hashes: &[T]) -> Result<Vec<Self>, ModelError> {
        hashes
            .iter()
            .enumerate()
            .map(|(i, h)| Self::at(i, h.as_ref()))
            .collect()
    }

    /// A deterministic 8-byte hash for tests and the demo.
    pub fn from_u64(v: u64) -> Self {
        Self::at(0, &v.to_be_bytes()).unwrap_or(Self {
            len: 1,
            bytes: [0; MAX_HASH_LEN],
        })
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BlockHash(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        f.write_str(")")
    }
}

/// A block's identity: namespace and hash.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub namespace: Namespace,
    pub hash: BlockHash,
}

/// One engine instance (all its TP ranks share it).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(Arc<str>);

impl InstanceId {
    pub fn new(id: &str) -> Result<Self, ModelError> {
        if id.is_empty() || id.len() > 128 || !id.chars().all(|c| c.is_ascii_graphic()) {
            return Err(ModelError::InstanceId(shown(id)));
        }
        Ok(Self(id.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InstanceId({})", self.0)
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A lease: 16 random bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub [u8; 16]);

impl LeaseId {
    /// A fresh random id (the OS RNG; a counter fallback keeps ids unique if it fails).
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        if getrandom::fill(&mut b).is_err() {
            use std::sync::atomic::{AtomicU64, Ordering};
            static NEXT: AtomicU64 = AtomicU64::new(1);
            b[..8].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
            b[8..].copy_from_slice(&(std::process::id() as u64).to_le_bytes());
        }
        Self(b)
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Result<Self, ModelError> {
        let bad = || ModelError::LeaseId(shown(s));
        if s.len() != 32 || !s.is_ascii() {
            return Err(bad());
        }
        let mut b = [0u8; 16];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(b))
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({})", self.to_hex())
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_lengths() {
        assert!(BlockHash::new(&[1]).is_ok());
        assert!(BlockHash::new(&[7; 32]).is_ok());
        assert_eq!(
            BlockHash::new(&[]),
            Err(ModelError::HashLength { index: 0, len: 0 })
        );
        assert_eq!(
            BlockHash::new(&[0; 33]),
            Err(ModelError::HashLength { index: 0, len: 33 })
        );
        let err = BlockHash::parse_all(&[vec![1u8], vec![], vec![2]]).unwrap_err();
        assert_eq!(err, ModelError::HashLength { index: 1, len: 0 });
        // The length is part of the identity: a short hash is not a zero-padded long one.
        assert_ne!(
            BlockHash::new(&[1]).unwrap(),
            BlockHash::new(&[1, 0]).unwrap()
        );
    }

    #[test]
    fn names_and_ids() {
        assert_eq!(
            Namespace::new("llama", "bf16", "l4").unwrap().as_str(),
            "llama/bf16/l4"
        );
        assert!(Namespace::new("a/b", "bf16", "x").is_err());
        assert!(Namespace::new("", "bf16", "x").is_err());
        assert!(InstanceId::new("engine 0").is_err());
        assert!(
            Namespace::new("m", "bf16", "x").unwrap() != Namespace::new("m", "bf16", "y").unwrap()
        );
        let id = LeaseId::random();
        assert_eq!(LeaseId::from_hex(&id.to_hex()).unwrap(), id);
        assert_ne!(LeaseId::random(), id);
        assert!(LeaseId::from_hex("zz").is_err());
    }

    #[test]
    fn control_characters_are_refused_and_never_shown_raw() {
        for bad in [
            "\u{1b}[31mred",
            "\n",
            "a\u{0}b",
            "\u{7f}",
            "tab\there",
            "caf\u{e9}",
        ] {
            let e = Namespace::new(bad, "bf16", "x").unwrap_err();
            let text = e.to_string();
            assert!(
                matches!(e, ModelError::Namespace { field: "model", .. }),
                "{e:?}"
            );
            assert!(text.contains("control characters"), "{text}");
            assert!(
                text.chars().all(|c| c.is_ascii() && !c.is_ascii_control()),
                "raw bytes in {text:?}"
            );
        }
        let e = Namespace::new("\u{1b}[2J", "bf16", "x")
            .unwrap_err()
            .to_string();
        assert!(e.ends_with(r#"got "\u{1b}[2J""#), "{e}");
        // A huge name is cut: the error says how long it was, and shows a prefix only.
        let huge = "\u{7}".repeat(100_000);
        let e = Namespace::new("m", &huge, "x").unwrap_err();
        let text = e.to_string();
        assert!(text.len() < 600, "{} bytes", text.len());
        assert!(
            text.contains("100000 bytes given") && text.contains("dtype"),
            "{text}"
        );
        assert!(InstanceId::new("a\u{1b}b")
            .unwrap_err()
            .to_string()
            .contains(r"\u{1b}"));
        assert!(!LeaseId::from_hex("\r")
            .unwrap_err()
            .to_string()
            .contains('\r'));
    }
}
