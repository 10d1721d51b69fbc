//! Registration plans and key lookup: how a region is split into NIC memory regions, which
//! access each gets, and how an address range maps onto the resulting keys.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::mr_table::MrKind;

/// `IBV_ACCESS_LOCAL_WRITE`.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
/// `IBV_ACCESS_REMOTE_READ`.
pub const ACCESS_REMOTE_READ: u32 = 4;
/// `IBV_ACCESS_RELAXED_ORDERING` (the first optional flag: ignored by devices without it).
pub const ACCESS_RELAXED_ORDERING: u32 = 1 << 20;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegistrationError {
    #[error("region {addr:#x}+{len} is empty or wraps")]
    BadRange { addr: u64, len: u64 },
    #[error("registration chunk {chunk} is zero")]
    ZeroChunk { chunk: u64 },
    #[error("range {addr:#x}+{len} is not registered on this NIC")]
    NotRegistered { addr: u64, len: u64 },
    #[error("range {addr:#x}+{len} crosses a registration boundary at {boundary:#x}")]
    CrossesBoundary { addr: u64, len: u64, boundary: u64 },
    #[error("range {addr:#x}+{len} overlaps an existing registration")]
    Overlap { addr: u64, len: u64 },
}

/// One NIC memory region of a split registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub addr: u64,
    pub len: u64,
}

/// Splits `addr..addr+len` into pieces of at most `max_chunk` bytes, cut on `max_chunk`
/// boundaries relative to `addr` so the cut points are predictable for planners (a pool of
/// fixed-size slots whose size divides `max_chunk` never has a slot cut in two).
pub fn split(addr: u64, len: u64, max_chunk: u64) -> Result<Vec<Chunk>, RegistrationError> {
    if max_chunk == 0 {
        return Err(RegistrationError::ZeroChunk { chunk: max_chunk });
    }
    if len == 0 || addr.checked_add(len).is_none() {
        return Err(RegistrationError::BadRange { addr, len });
    }
    let mut out = Vec::with_capacity(len.div_ceil(max_chunk) as usize);
    let mut off = 0;
    while off < len {
        let n = max_chunk.min(len - off);
        out.push(Chunk {
            addr: addr + off,
            len: n,
        });
        off += n;
    }
    Ok(out)
}

/// Access flags for a registration. Host pool memory is readable by peers (and writable
/// locally, for staging reads into it); device memory is local-write only (design rule 6).
pub fn access_flags(kind: MrKind, relaxed_ordering: bool) -> u32 {
    let base = match kind {
        MrKind::Host => ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
        MrKind::Device => ACCESS_LOCAL_WRITE,
    };
    if relaxed_ordering {
        base | ACCESS_RELAXED_ORDERING
    } else {
        base
    }
}

/// Keys of one NIC memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NicKeys {
    pub lkey: u32,
    pub rkey: u32,
}

/// One scatter/gather element as the NIC takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// The NIC regions registered on one NIC (local) or advertised by a peer for one NIC
/// (remote), by start address.
#[derive(Clone, Debug, Default)]
pub struct KeyMap {
    chunks: BTreeMap<u64, (u64, NicKeys)>,
}

impl KeyMap {
    pub fn new() -> Self {
        KeyMap::default()
    }

    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    pub fn insert(&mut self, chunk: Chunk, keys: NicKeys) -> Result<(), RegistrationError> {
        let end = chunk
            .addr
            .checked_add(chunk.len)
            .ok_or(RegistrationError::BadRange {
                addr: chunk.addr,
                len: chunk.len,
            })?;
        let overlaps_prev = self
            .chunks
            .range(..end)
            .next_back()
            .is_some_and(|(a, (l, _))| a + l > chunk.addr);
        if chunk.len == 0 || overlaps_prev {
            return Err(RegistrationError::Overlap {
                addr: chunk.addr,
                len: chunk.len,
            });
        }
        self.chunks.insert(chunk.addr, (chunk.len, keys));
        Ok(())
    }

    pub fn remove(&mut self, addr: u64) -> Option<NicKeys> {
        self.chunks.remove(&addr).map(|(_, k)| k)
    }

    fn containing(&self, addr: u64) -> Option<(u64, u64, NicKeys)> {
        let (a, (l, k)) = self.chunks.range(..=addr).next_back()?;
        (addr < a + l).then_some((*a, *l, *k))
    }

    /// The end of the region holding `addr`, if one does (where a read starting at `addr`
    /// must stop: one read names one rkey).
    pub fn region_end(&self, addr: u64) -> Option<u64> {
        self.containing(addr).map(|(a, l, _)| a + l)
    }

    /// Every region `(range, keys)`, by address.
    pub fn regions(&self) -> impl Iterator<Item = (Chunk, NicKeys)> + '_ {
        self.chunks
            .iter()
            .map(|(a, (l, k))| (Chunk { addr: *a, len: *l }, *k))
    }

    /// The rkey covering the whole remote range (one read names one rkey, so a range across
    /// two peer regions is refused; the planner keeps reads inside one).
    pub fn remote_key(&self, addr: u64, len: u64) -> Result<u32, RegistrationError> {
        let nr = RegistrationError::NotRegistered { addr, len };
        let (a, l, k) = self.containing(addr).ok_or(nr.clone())?;
        let end = addr.checked_add(len).ok_or(nr)?;
        if end > a + l {
            return Err(RegistrationError::CrossesBoundary {
                addr,
                len,
                boundary: a + l,
            });
        }
        Ok(k.rkey)
    }

    /// Turns local destination ranges into SGEs, splitting a range wherever it crosses from
    /// one NIC region into the next (adjacent chunks of a split registration).
    pub fn local_sges(&self, ranges: &[(u64, u64)]) -> Result<Vec<Sge>, RegistrationError> {
        let mut out = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            let mut at = addr;
            let end = addr
                .checked_add(len)
                .ok_or(RegistrationError::BadRange { addr, len })?;
            while at < end {
                let (a, l, k) = self
                    .containing(at)
                    .ok_or(RegistrationError::NotRegistered { addr, len })?;
                // One SGE carries at most u32::MAX bytes.
                let n = (a + l).min(end).min(at + u64::from(u32::MAX)) - at;
                out.push(Sge {
                    addr: at,
                    len: n as u32,
                    lkey: k.lkey,
                });
                at += n;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn splits_at_chunk_size() {
        let c = split(0x1000, 10 * GIB, 4 * GIB).unwrap();
        assert_eq!(
            c,
            vec![
                Chunk {
                    addr: 0x1000,
                    len: 4 * GIB
                },
                Chunk {
                    addr: 0x1000 + 4 * GIB,
                    len: 4 * GIB
                },
                Chunk {
                    addr: 0x1000 + 8 * GIB,
                    len: 2 * GIB
                },
            ]
        );
        assert_eq!(split(0, 4 * GIB, 4 * GIB).unwrap().len(), 1);
        assert!(split(0, 0, GIB).is_err());
        assert!(split(u64::MAX, 2, GIB).is_err());
        assert!(split(0, 1, 0).is_err());
    }

    #[test]
    fn access_by_kind() {
        assert_eq!(access_flags(MrKind::Device, false), ACCESS_LOCAL_WRITE);
        assert_eq!(access_flags(MrKind::Device, true) & ACCESS_REMOTE_READ, 0);
        assert_eq!(
            access_flags(MrKind::Host, true),
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ | ACCESS_RELAXED_ORDERING
        );
    }

    #[test]
    fn sges_split_across_chunks() {
        let mut m = KeyMap::new();
        for (i, c) in split(0x10_000, 3 * 4096, 4096)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            let k = i as u32 + 1;
            m.insert(
                c,
                NicKeys {
                    lkey: k,
                    rkey: 100 + k,
                },
            )
            .unwrap();
        }
        assert!(m
            .insert(
                Chunk {
                    addr: 0x10_800,
                    len: 16
                },
                NicKeys { lkey: 9, rkey: 9 }
            )
            .is_err());
        let s = m
            .local_sges(&[(0x10_000 + 4000, 200), (0x10_000 + 8192, 10)])
            .unwrap();
        assert_eq!(
            s,
            vec![
                Sge {
                    addr: 0x10_000 + 4000,
                    len: 96,
                    lkey: 1
                },
                Sge {
                    addr: 0x10_000 + 4096,
                    len: 104,
                    lkey: 2
                },
                Sge {
                    addr: 0x10_000 + 8192,
                    len: 10,
                    lkey: 3
                },
            ]
        );
        assert!(matches!(
            m.local_sges(&[(0x10_000 + 3 * 4096 - 1, 2)]),
            Err(RegistrationError::NotRegistered { .. })
        ));
        assert_eq!(m.remote_key(0x10_000 + 4096, 4096), Ok(102));
        assert!(matches!(
            m.remote_key(0x10_000 + 4095, 2),
            Err(RegistrationError::CrossesBoundary {
                boundary: 0x11_000,
                ..
            })
        ));
        assert!(m.remote_key(0x9_000, 1).is_err());
        assert_eq!(m.remove(0x10_000), Some(NicKeys { lkey: 1, rkey: 101 }));
        assert_eq!(m.len(), 2);
    }
}
