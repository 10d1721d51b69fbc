//! The memory-region table: keys, bounds and access for every registered range, refcounted
//! handles, and deregistration deferred until the last in-flight use has drained.
//!
//! Host pool regions may be registered for remote read; device regions are local-write only
//! and can never be named by a remote key (design rule 6).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use thiserror::Error;

use crate::region::HostRegion;
use crate::sink::DeviceSink;

/// Local and remote key of a region (one key serves both, as lkey/rkey would on a NIC).
///
/// 64 bits, drawn from the OS CSPRNG for every registration ([`MrTable`]): over tcp a key is
/// what a connection names to read pool memory, so it must not be guessable at line rate.
/// (Verbs rkeys are the NIC's own 32-bit keys and do not come from here.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MrKey(pub u64);

impl fmt::Display for MrKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

/// What a registration permits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Access(u8);

impl Access {
    /// Reads may land in the region.
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may read the region.
    pub const REMOTE_READ: Access = Access(2);

    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }

    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

/// Which kind of memory a registration covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MrKind {
    Host,
    Device,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MrError {
    #[error("key {key} is not registered")]
    UnknownKey { key: MrKey },
    #[error("key {key} is being deregistered")]
    Deregistering { key: MrKey },
    #[error("range {addr:#x}+{len} is outside region {key} ({base:#x}+{region_len})")]
    OutOfBounds {
        key: MrKey,
        addr: u64,
        len: u64,
        base: u64,
        region_len: u64,
    },
    #[error("region {key} does not permit {wanted}")]
    AccessDenied { key: MrKey, wanted: &'static str },
    #[error("{kind:?} memory cannot be registered with {wanted}")]
    InvalidAccess { kind: MrKind, wanted: &'static str },
    #[error("device range {base:#x}+{len} is empty or wraps")]
    InvalidRange { base: u64, len: u64 },
    #[error("the OS random source failed, so no unguessable key can be drawn")]
    NoRandomness,
}

enum Backing {
    Host(Arc<HostRegion>),
    Device(Arc<dyn DeviceSink>),
}

struct Entry {
    backing: Backing,
    addr: u64,
    len: u64,
    access: Access,
    handles: usize,
    uses: usize,
    deregistering: bool,
}

impl Entry {
    fn bounds(&self, key: MrKey, addr: u64, len: u64) -> Result<u64, MrError> {
        let oob = || MrError::OutOfBounds {
            key,
            addr,
            len,
            base: self.addr,
            region_len: self.len,
        };
        let offset = addr.checked_sub(self.addr).ok_or_else(oob)?;
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(offset),
            _ => Err(oob()),
        }
    }
}

struct Inner {
    entries: HashMap<u64, Entry>,
    deregistered: u64,
}

struct Shared {
    inner: Mutex<Inner>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave an entry half-updated (every update is
        // a single field write), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn release(&self, key: MrKey, handle: bool) {
        let mut inner = self.lock();
        let remove = match inner.entries.get_mut(&key.0) {
            Some(e) => {
                if handle {
                    e.handles = e.handles.saturating_sub(1);
                    if e.handles == 0 {
                        e.deregistering = true;
                    }
                } else {
                    e.uses = e.uses.saturating_sub(1);
                }
                e.deregistering && e.handles == 0 && e.uses == 0
            }
            None => false,
        };
        if remove {
            inner.entries.remove(&key.0);
            inner.deregistered += 1;
        }
    }
}

/// Counts for metrics and for tests that check everything drained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MrGauges {
    /// Registrations still in the table (including deferred ones).
    pub registered: usize,
    /// Registrations whose last handle dropped but which still have uses in flight.
    pub deferred: usize,
    /// In-flight uses (reads into or out of a region) across all registrations.
    pub uses: usize,
    /// Registrations removed so far.
    pub deregistered: u64,
}

/// A region exported to same-host peers (shm provider).
#[derive(Clone)]
pub struct MrExport {
    pub key: MrKey,
    pub addr: u64,
    pub len: u64,
    pub region: Arc<HostRegion>,
}

/// Where a read's bytes come from on the owner side, valid while this lives.
pub struct RemoteSource {
    pub(crate) region: Arc<HostRegion>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    _use: MrUse,
}

impl RemoteSource {
    pub(crate) fn ptr(&self) -> *const u8 {
        self.region.ptr_at(self.offset)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where one local segment's bytes go, valid while this lives.
pub(crate) enum Target {
    Host {
        region: Arc<HostRegion>,
        offset: usize,
    },
    Device {
        sink: Arc<dyn DeviceSink>,
        addr: u64,
    },
}

pub(crate) struct LocalTarget {
    pub(crate) target: Target,
    pub(crate) len: u64,
    _use: MrUse,
}

/// One in-flight use of a registration; deregistration waits for all of them.
struct MrUse {
    shared: Arc<Shared>,
    key: MrKey,
}

impl Drop for MrUse {
    fn drop(&mut self) {
        self.shared.release(self.key, false);
    }
}

/// A registration. Clones share it; when the last clone drops, deregistration is requested and
/// completes as soon as no read uses the region any more.
pub struct MrHandle {
    shared: Arc<Shared>,
    key: MrKey,
    addr: u64,
    len: u64,
    access: Access,
    kind: MrKind,
}

impl MrHandle {
    pub fn key(&self) -> MrKey {
        self.key
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn access(&self) -> Access {
        self.access
    }
    pub fn kind(&self) -> MrKind {
        self.kind
    }
}

impl fmt::Debug for MrHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrHandle")
            .field("key", &self.key)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Clone for MrHandle {
    fn clone(&self) -> Self {
        if let Some(e) = self.shared.lock().entries.get_mut(&self.key.0) {
            e.handles += 1;
        }
        MrHandle {
            shared: self.shared.clone(),
            key: self.key,
            addr: self.addr,
            len: self.len,
            access: self.access,
            kind: self.kind,
        }
    }
}

impl Drop for MrHandle {
    fn drop(&mut self) {
        self.shared.release(self.key, true);
    }
}

/// The table one node (or one NIC) checks every access against. Cheap to clone.
#[derive(Clone)]
pub struct MrTable {
    shared: Arc<Shared>,
}

impl Default for MrTable {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MrTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrTable")
            .field("gauges", &self.gauges())
            .finish()
    }
}

impl MrTable {
    pub fn new() -> Self {
        MrTable {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    entries: HashMap::new(),
                    deregistered: 0,
                }),
            }),
        }
    }

    fn insert(
        &self,
        backing: Backing,
        addr: u64,
        len: u64,
        access: Access,
        kind: MrKind,
    ) -> Result<MrHandle, MrError> {
        let mut inner = self.shared.lock();
        // Every key is 64 fresh random bits: a peer that knows one key (or a stale one) learns
        // nothing about another, and guessing one takes 2^63 tries on average.
        let key = loop {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).map_err(|_| MrError::NoRandomness)?;
            let k = u64::from_le_bytes(b);
            if k != 0 && !inner.entries.contains_key(&k) {
                break k;
            }
        };
        inner.entries.insert(
            key,
            Entry {
                backing,
                addr,
                len,
                access,
                handles: 1,
                uses: 0,
                deregistering: false,
            },
        );
        Ok(MrHandle {
            shared: self.shared.clone(),
            key: MrKey(key),
            addr,
            len,
            access,
            kind,
        })
    }

    /// Registers a whole host region.
    pub fn register_host(
        &self,
        region: Arc<HostRegion>,
        access: Access,
    ) -> Result<MrHandle, MrError> {
        if access.contains(Access::LOCAL_WRITE) && !region.is_writable() {
            return Err(MrError::InvalidAccess {
                kind: MrKind::Host,
                wanted: "local write on a read-only mapping",
            });
        }
        let (addr, len) = (region.addr(), region.len() as u64);
        self.insert(Backing::Host(region), addr, len, access, MrKind::Host)
    }

    /// Registers a device range for local write; its bytes are delivered through `sink`.
    /// Device memory is never remotely accessible, so no access flags are taken.
    pub fn register_device(
        &self,
        base: u64,
        len: u64,
        sink: Arc<dyn DeviceSink>,
    ) -> Result<MrHandle, MrError> {
        if len == 0 || base.checked_add(len).is_none() {
            return Err(MrError::InvalidRange { base, len });
        }
        self.insert(
            Backing::Device(sink),
            base,
            len,
            Access::LOCAL_WRITE,
            MrKind::Device,
        )
    }

    /// Owner side: checks key, access and bounds of a peer's read and pins the region until the
    /// returned source drops.
    pub fn acquire_remote_read(
        &self,
        rkey: MrKey,
        addr: u64,
        len: u64,
    ) -> Result<RemoteSource, MrError> {
        let mut inner = self.shared.lock();
        let e = inner
            .entries
            .get_mut(&rkey.0)
            .ok_or(MrError::UnknownKey { key: rkey })?;
        if e.deregistering {
            return Err(MrError::Deregistering { key: rkey });
        }
        if !e.access.contains(Access::REMOTE_READ) {
            return Err(MrError::AccessDenied {
                key: rkey,
                wanted: "remote read",
            });
        }
        let Backing::Host(region) = &e.backing else {
            return Err(MrError::AccessDenied {
                key: rkey,
                wanted: "remote read",
            });
        };
        let offset = e.bounds(rkey, addr, len)?;
        let len_usize = usize::try_from(len).map_err(|_| MrError::OutOfBounds {
            key: rkey,
            addr,
            len,
            base: e.addr,
            region_len: e.len,
        })?;
        let region = region.clone();
        e.uses += 1;
        Ok(RemoteSource {
            region,
            offset: offset as usize,
            len: len_usize,
            _use: MrUse {
                shared: self.shared.clone(),
                key: rkey,
            },
        })
    }

    /// Requester side: checks a destination segment and pins its region until the target drops.
    pub(crate) fn acquire_local_write(
        &self,
        lkey: MrKey,
        addr: u64,
        len: u64,
    ) -> Result<LocalTarget, MrError> {
        let mut inner = self.shared.lock();
        let e = inner
            .entries
            .get_mut(&lkey.0)
            .ok_or(MrError::UnknownKey { key: lkey })?;
        if e.deregistering {
            return Err(MrError::Deregistering { key: lkey });
        }
        if !e.access.contains(Access::LOCAL_WRITE) {
            return Err(MrError::AccessDenied {
                key: lkey,
                wanted: "local write",
            });
        }
        let offset = e.bounds(lkey, addr, len)?;
        let target = match &e.backing {
            Backing::Host(region) => Target::Host {
                region: region.clone(),
                offset: offset as usize,
            },
            Backing::Device(sink) => Target::Device {
                sink: sink.clone(),
                addr,
            },
        };
        e.uses += 1;
        Ok(LocalTarget {
            target,
            len,
            _use: MrUse {
                shared: self.shared.clone(),
                key: lkey,
            },
        })
    }

    /// Whether `key` is still in the table (deferred deregistrations included).
    pub fn is_registered(&self, key: MrKey) -> bool {
        self.shared.lock().entries.contains_key(&key.0)
    }

    /// Host regions peers may read, with the region itself (for passing its memfd).
    pub fn exports(&self) -> Vec<MrExport> {
        let inner = self.shared.lock();
        let mut out: Vec<MrExport> = inner
            .entries
            .iter()
            .filter(|(_, e)| !e.deregistering && e.access.contains(Access::REMOTE_READ))
            .filter_map(|(k, e)| match &e.backing {
                Backing::Host(r) => Some(MrExport {
                    key: MrKey(*k),
                    addr: e.addr,
                    len: e.len,
                    region: r.clone(),
                }),
                Backing::Device(_) => None,
            })
            .collect();
        out.sort_by_key(|e| e.addr);
        out
    }

    pub fn gauges(&self) -> MrGauges {
        let inner = self.shared.lock();
        let mut g = MrGauges {
            registered: inner.entries.len(),
            deregistered: inner.deregistered,
            ..MrGauges::default()
        };
        for e in inner.entries.values() {
            g.uses += e.uses;
            if e.deregistering {
                g.deferred += 1;
            }
        }
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_key_bounds_access() {
        let t = MrTable::new();
        let pool = Arc::new(HostRegion::anonymous(4096).unwrap());
        let h = t.register_host(pool.clone(), Access::REMOTE_READ).unwrap();
        let base = pool.addr();
        assert!(t.acquire_remote_read(h.key(), base + 100, 100).is_ok());
        assert!(matches!(
            t.acquire_remote_read(MrKey(h.key().0 ^ 1), base, 1),
            Err(MrError::UnknownKey { .. })
        ));
        assert!(matches!(
            t.acquire_remote_read(h.key(), base + 4000, 100),
            Err(MrError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.acquire_remote_read(h.key(), base - 1, 2),
            Err(MrError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.acquire_local_write(h.key(), base, 1),
            Err(MrError::AccessDenied { .. })
        ));
    }

    struct NullSink;
    impl DeviceSink for NullSink {
        fn write(&self, _: u64, _: &[u8]) -> Result<(), crate::sink::SinkError> {
            Ok(())
        }
        fn flush(&self) -> Result<(), crate::sink::SinkError> {
            Ok(())
        }
    }

    #[test]
    fn keys_are_random_64_bit() {
        let t = MrTable::new();
        let pool = Arc::new(HostRegion::anonymous(4096).unwrap());
        let hs: Vec<MrHandle> = (0..64)
            .map(|_| t.register_host(pool.clone(), Access::REMOTE_READ).unwrap())
            .collect();
        let keys: std::collections::HashSet<u64> = hs.iter().map(|h| h.key().0).collect();
        assert_eq!(keys.len(), 64, "keys repeat");
        // Sequential or 32-bit keys would leave the high half constant or zero.
        let highs: std::collections::HashSet<u64> = keys.iter().map(|k| k >> 32).collect();
        assert!(highs.len() > 60, "high halves {highs:?}");
        // Neighbours of a live key name nothing.
        let k = hs[0].key().0;
        for guess in [
            k ^ 1,
            k.wrapping_add(1),
            k.wrapping_sub(1),
            k >> 32,
            k & 0xffff_ffff,
        ] {
            if !keys.contains(&guess) {
                assert!(t.acquire_remote_read(MrKey(guess), pool.addr(), 1).is_err());
            }
        }
    }

    #[test]
    fn device_never_remote() {
        let t = MrTable::new();
        let h = t
            .register_device(0x7000_0000, 1 << 20, Arc::new(NullSink))
            .unwrap();
        assert!(matches!(
            t.acquire_remote_read(h.key(), 0x7000_0000, 16),
            Err(MrError::AccessDenied { .. })
        ));
        assert!(t.acquire_local_write(h.key(), 0x7000_0000, 16).is_ok());
        assert!(t.exports().is_empty());
    }

    #[test]
    fn deregistration_deferred_while_in_use() {
        let t = MrTable::new();
        let pool = Arc::new(HostRegion::anonymous(4096).unwrap());
        let h = t.register_host(pool.clone(), Access::REMOTE_READ).unwrap();
        let h2 = h.clone();
        let key = h.key();
        let src = t.acquire_remote_read(key, pool.addr(), 10).unwrap();
        drop(h);
        assert!(t.is_registered(key));
        drop(h2);
        // Last handle gone, but a use is in flight: still registered, no new uses.
        assert!(t.is_registered(key));
        assert_eq!(t.gauges().deferred, 1);
        assert!(matches!(
            t.acquire_remote_read(key, pool.addr(), 10),
            Err(MrError::Deregistering { .. })
        ));
        drop(src);
        assert!(!t.is_registered(key));
        assert_eq!(
            t.gauges(),
            MrGauges {
                deregistered: 1,
                ..MrGauges::default()
            }
        );
    }
}
