//! The on-disk format of a block file, without I/O.
//!
//! A directory holds one file: a 4 KiB file header, then fixed-size block slots. A slot is a
//! 4 KiB block header followed by the block's bytes, padded to 4 KiB (what `O_DIRECT` needs).
//! The block header names the block (namespace and hash), its TP size and length, a write
//! sequence number (the LRU order a restart recovers) and the xxh3 of the bytes; its own
//! xxh3 closes it. Header and bytes go to disk in one write, so a torn write leaves either
//! an invalid header (an empty slot on restart) or bytes that fail their checksum (a miss
//! when read, never wrong bytes).

use xxhash_rust::xxh3::xxh3_64;

use crate::model::{BlockHash, BlockKey, Namespace, MAX_HASH_LEN};

/// `O_DIRECT` alignment of offsets, lengths and buffers (the largest logical block size
/// common disks have).
pub const ALIGN: u64 = 4096;
/// Bytes of the block header at the start of each slot (and of the file header).
pub const HEADER: u64 = ALIGN;
/// The name of the block file inside each directory.
pub const FILE_NAME: &str = "kvferry-blocks.dat";

const FILE_MAGIC: &[u8; 8] = b"KVFSSD01";
const BLOCK_MAGIC: &[u8; 8] = b"KVFBLK01";
const VERSION: u32 = 1;
/// Longest namespace text: three parts of at most 128 characters and two '/'.
const MAX_NS: usize = 3 * 128 + 2;
const NS_AT: usize = 48;
const HASH_AT: usize = NS_AT + MAX_NS;
const SUM_AT: usize = HASH_AT + MAX_HASH_LEN;

pub fn round_up(n: u64) -> u64 {
    n.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// Bytes one block slot takes on disk for blocks of at most `slot_bytes`.
pub fn slot_stride(slot_bytes: u64) -> u64 {
    HEADER.saturating_add(round_up(slot_bytes))
}

/// Block slots a file of at most `capacity` bytes holds.
pub fn slots_for(capacity: u64, stride: u64) -> u64 {
    capacity.saturating_sub(HEADER) / stride.max(1)
}

/// Offset of slot `slot`'s header; its bytes follow at `+ HEADER`.
pub fn slot_offset(slot: u64, stride: u64) -> u64 {
    HEADER + slot * stride
}

/// The file header: what the slots of this file look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileHeader {
    pub stride: u64,
    pub slots: u64,
    /// Slots `[0, used)` may hold blocks; a restart scans no further.
    pub used: u64,
}

impl FileHeader {
    pub fn encode(&self, out: &mut [u8]) {
        out[..HEADER as usize].fill(0);
        out[..8].copy_from_slice(FILE_MAGIC);
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[16..24].copy_from_slice(&self.stride.to_le_bytes());
        out[24..32].copy_from_slice(&self.slots.to_le_bytes());
        out[32..40].copy_from_slice(&self.used.to_le_bytes());
        let sum = xxh3_64(&out[..40]);
        out[40..48].copy_from_slice(&sum.to_le_bytes());
    }

    /// None for anything that is not a valid header of this version.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 48 || &b[..8] != FILE_MAGIC || u32_at(b, 8) != VERSION {
            return None;
        }
        if u64_at(b, 40) != xxh3_64(&b[..40]) {
            return None;
        }
        Some(Self {
            stride: u64_at(b, 16),
            slots: u64_at(b, 24),
            used: u64_at(b, 32),
        })
    }
}

/// What a block header says about the bytes behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHeader {
    pub key: BlockKey,
    pub tp: u32,
    pub len: u64,
    pub seq: u64,
    pub sum: u64,
}

/// Why a slot's header or bytes are not the block asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// No valid header (never written, torn, or overwritten by garbage).
    Header,
    /// A valid header of another block (the slot was reused).
    OtherKey,
    /// The bytes do not match the header's checksum.
    Checksum,
}

impl Damage {
    pub fn as_str(self) -> &'static str {
        match self {
            Damage::Header => "header",
            Damage::OtherKey => "key",
            Damage::Checksum => "checksum",
        }
    }
}

impl BlockHeader {
    pub fn new(key: BlockKey, tp: u32, data: &[u8], seq: u64) -> Self {
        Self {
            key,
            tp,
            len: data.len() as u64,
            seq,
            sum: xxh3_64(data),
        }
    }

    pub fn encode(&self, out: &mut [u8]) {
        out[..HEADER as usize].fill(0);
        out[..8].copy_from_slice(BLOCK_MAGIC);
        out[8..12].copy_from_slice(&self.tp.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
        out[24..32].copy_from_slice(&self.seq.to_le_bytes());
        out[32..40].copy_from_slice(&self.sum.to_le_bytes());
        let ns = self.key.namespace.as_str().as_bytes();
        let hash = self.key.hash.as_bytes();
        // A namespace is at most MAX_NS bytes by construction (Namespace::new checks it).
        let ns = &ns[..ns.len().min(MAX_NS)];
        out[40..42].copy_from_slice(&(ns.len() as u16).to_le_bytes());
        out[42] = hash.len() as u8;
        out[NS_AT..NS_AT + ns.len()].copy_from_slice(ns);
        out[HASH_AT..HASH_AT + hash.len()].copy_from_slice(hash);
        let sum = xxh3_64(&out[..SUM_AT]);
        out[SUM_AT..SUM_AT + 8].copy_from_slice(&sum.to_le_bytes());
    }

    /// The header in `b` (one `HEADER`-sized buffer), or why there is none.
    pub fn decode(b: &[u8]) -> Result<Self, Damage> {
        if b.len() < SUM_AT + 8 || &b[..8] != BLOCK_MAGIC {
            return Err(Damage::Header);
        }
        if u64_at(b, SUM_AT) != xxh3_64(&b[..SUM_AT]) {
            return Err(Damage::Header);
        }
        let ns_len = u16::from_le_bytes([b[40], b[41]]) as usize;
        let hash_len = b[42] as usize;
        if ns_len > MAX_NS || hash_len > MAX_HASH_LEN {
            return Err(Damage::Header);
        }
        let ns = std::str::from_utf8(&b[NS_AT..NS_AT + ns_len]).map_err(|_| Damage::Header)?;
        let mut parts = ns.split('/');
        let namespace = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(m), Some(d), Some(f), None) => {
                Namespace::new(m, d, f).map_err(|_| Damage::Header)?
            }
            _ => return Err(Damage::Header),
        };
        let hash = BlockHash::new(&b[HASH_AT..HASH_AT + hash_len]).map_err(|_| Damage::Header)?;
        let tp = u32_at(b, 8);
        if tp == 0 || tp > 64 {
            return Err(Damage::Header);
        }
        Ok(Self {
            key: BlockKey { namespace, hash },
            tp,
            len: u64_at(b, 16),
            seq: u64_at(b, 24),
            sum: u64_at(b, 32),
        })
    }

    /// Checks that this header names `key` and that `data` are its bytes.
    pub fn verify(&self, key: &BlockKey, data: &[u8]) -> Result<(), Damage> {
        if self.key != *key {
            return Err(Damage::OtherKey);
        }
        if data.len() as u64 != self.len || xxh3_64(data) != self.sum {
            return Err(Damage::Checksum);
        }
        Ok(())
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> BlockKey {
        BlockKey {
            namespace: Namespace::new("model", "bf16", "fp").unwrap(),
            hash: BlockHash::from_u64(i),
        }
    }

    #[test]
    fn block_header_round_trips_and_every_flipped_byte_is_caught() {
        let data = vec![7u8; 10_000];
        let h = BlockHeader::new(key(3), 2, &data, 42);
        let mut buf = vec![0u8; HEADER as usize];
        h.encode(&mut buf);
        let back = BlockHeader::decode(&buf).unwrap();
        assert_eq!(back, h);
        back.verify(&key(3), &data).unwrap();
        assert_eq!(back.verify(&key(4), &data), Err(Damage::OtherKey));
        let mut bad = data.clone();
        bad[9_999] ^= 1;
        assert_eq!(back.verify(&key(3), &bad), Err(Damage::Checksum));
        assert_eq!(back.verify(&key(3), &data[1..]), Err(Damage::Checksum));
        for i in 0..SUM_AT + 8 {
            let mut b = buf.clone();
            b[i] ^= 0x10;
            assert_eq!(BlockHeader::decode(&b), Err(Damage::Header), "byte {i}");
        }
        assert_eq!(
            BlockHeader::decode(&vec![0u8; HEADER as usize]),
            Err(Damage::Header)
        );
    }

    #[test]
    fn longest_names_fit_the_header() {
        let long = "x".repeat(128);
        let k = BlockKey {
            namespace: Namespace::new(&long, &long, &long).unwrap(),
            hash: BlockHash::new(&[9u8; MAX_HASH_LEN]).unwrap(),
        };
        let h = BlockHeader::new(k.clone(), 64, b"abc", u64::MAX);
        let mut buf = vec![0u8; HEADER as usize];
        h.encode(&mut buf);
        assert_eq!(BlockHeader::decode(&buf).unwrap().key, k);
    }

    #[test]
    fn file_header_and_geometry() {
        let f = FileHeader {
            stride: slot_stride(1 << 20),
            slots: 9,
            used: 4,
        };
        assert_eq!(f.stride, (1 << 20) + 4096);
        assert_eq!(slot_stride(100), 8192, "bytes pad to 4 KiB");
        let mut buf = vec![0u8; HEADER as usize];
        f.encode(&mut buf);
        assert_eq!(FileHeader::decode(&buf), Some(f));
        buf[17] ^= 1;
        assert_eq!(FileHeader::decode(&buf), None);
        assert_eq!(slots_for(4096 + 3 * 8192 + 1, 8192), 3);
        assert_eq!(slots_for(100, 8192), 0);
        assert_eq!(slot_stride(u64::MAX), u64::MAX, "saturates, never panics");
        assert_eq!(slot_offset(2, 8192), 4096 + 16384);
    }
}
