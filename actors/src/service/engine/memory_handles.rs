//! Memory handles: client memory (memfds, DMA-BUFs) the fd socket imported, waiting for the
//! RegisterInstance that names them. Plain state with an injected `now`; the engine server
//! holds it behind a lock and sweeps it.
//!
//! A handle belongs to the instance, rank and device it was sent for; RegisterInstance takes
//! it out of the table and into the rank's registration, which keeps the memory alive until
//! the rank is unregistered and drained. A handle nobody registers within the TTL is closed,
//! and so are an instance's unused handles when its session ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_proto::shm::board::Board;
use kvferry_proto::shm::mailbox::Mailbox;

use thiserror::Error;

use crate::lease::registry::Memory;
use crate::model::InstanceId;

/// What kind of memory a handle holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host KV of a client without a GPU (or a host pool such as SGLang HiCache's), mapped as
    /// memory of the node's device (pinned host memory on a CUDA device).
    Memfd,
    /// An engine worker's GPU KV.
    Dmabuf,
    /// An engine worker's GPU KV in a VMM allocation (vLLM 0.34's extensible KV cache),
    /// by the POSIX fd `cuMemExportToShareableHandle` made of it, mapped on the device.
    Vmm,
    /// A completion board (see [`kvferry_proto::shm::board`]).
    Board,
    /// A request mailbox (see `service::engine::mailbox`), attached to a session.
    Mailbox,
}

impl MemoryKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            MemoryKind::Memfd => "memfd",
            MemoryKind::Dmabuf => "dmabuf",
            MemoryKind::Vmm => "vmm",
            MemoryKind::Board => "board",
            MemoryKind::Mailbox => "mailbox",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "memfd" => Some(MemoryKind::Memfd),
            "dmabuf" => Some(MemoryKind::Dmabuf),
            "vmm" => Some(MemoryKind::Vmm),
            "board" => Some(MemoryKind::Board),
            "mailbox" => Some(MemoryKind::Mailbox),
            _ => None,
        }
    }
}

/// What a handle keeps open until a registration or a session takes it.
#[derive(Clone)]
pub enum Held {
    /// KV memory, for a registration's region.
    Kv(Memory),
    /// A completion board, for a registration.
    Board(Arc<Board>),
    /// A request mailbox, for a session.
    Mailbox(Arc<Mailbox>),
}

/// One imported piece of client memory.
#[derive(Clone)]
pub struct MemoryHandle {
    pub instance: InstanceId,
    pub rank: u32,
    pub device: u32,
    pub kind: MemoryKind,
    /// Address of byte 0 of the memory as this process addresses it; layout offsets are
    /// added to it.
    pub base: u64,
    pub len: u64,
    pub memory: Held,
}

impl std::fmt::Debug for MemoryHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryHandle")
            .field("instance", &self.instance)
            .field("rank", &self.rank)
            .field("device", &self.device)
            .field("kind", &self.kind)
            .field("len", &self.len)
            .finish()
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandleError {
    #[error("{max} memory handles are waiting for RegisterInstance; register or wait for them to expire")]
    TooMany { max: usize },
}

struct Entry {
    handle: MemoryHandle,
    expires: Instant,
}

/// Handles by id. Ids are random, so one client cannot name another's handle by counting.
pub struct MemoryHandles {
    entries: HashMap<u64, Entry>,
    ttl: Duration,
    max: usize,
}

impl MemoryHandles {
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            entries: HashMap::new(),
            ttl,
            max,
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Stores a handle; returns its id (never 0).
    pub fn insert(&mut self, handle: MemoryHandle, now: Instant) -> Result<u64, HandleError> {
        self.expire(now);
        if self.entries.len() >= self.max {
            return Err(HandleError::TooMany { max: self.max });
        }
        let id = loop {
            let mut b = [0u8; 8];
            let id = match getrandom::fill(&mut b) {
                Ok(()) => u64::from_le_bytes(b) >> 1,
                // No OS randomness: fall back to a counter, still unique.
                Err(_) => self.entries.keys().max().copied().unwrap_or(0) + 1,
            };
            if id != 0 && !self.entries.contains_key(&id) {
                break id;
            }
        };
        self.entries.insert(
            id,
            Entry {
                handle,
                expires: crate::clock::deadline(now, self.ttl),
            },
        );
        Ok(id)
    }

    /// The live handle `id` (expired handles are gone, swept or not).
    pub fn get(&self, id: u64, now: Instant) -> Option<&MemoryHandle> {
        self.entries
            .get(&id)
            .filter(|e| e.expires > now)
            .map(|e| &e.handle)
    }

    /// Removes `id` (a registration now holds its memory).
    pub fn take(&mut self, id: u64) -> Option<MemoryHandle> {
        self.entries.remove(&id).map(|e| e.handle)
    }

    /// Closes the handles past their TTL; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, e| e.expires > now);
        before - self.entries.len()
    }

    /// Closes every unused handle of `instance`; returns how many.
    pub fn drop_instance(&mut self, instance: &InstanceId) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, e| e.handle.instance != *instance);
        before - self.entries.len()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use kvferry_gpu::{Device, DeviceBuffer, HostDevice};

    use super::*;

    fn handle(instance: &str, memory: &Arc<DeviceBuffer>) -> MemoryHandle {
        MemoryHandle {
            instance: InstanceId::new(instance).unwrap(),
            rank: 0,
            device: 0,
            kind: MemoryKind::Memfd,
            base: 0x1000,
            len: 4096,
            memory: Held::Kv(Memory::Mapped(Arc::clone(memory))),
        }
    }

    #[test]
    fn handles_expire_drop_with_their_instance_and_are_bounded() {
        let t0 = Instant::now();
        let memory = Arc::new(HostDevice::new(0).alloc(4096).unwrap());
        let mut h = MemoryHandles::new(Duration::from_secs(10), 3);
        let a = h.insert(handle("a", &memory), t0).unwrap();
        let b = h
            .insert(handle("b", &memory), t0 + Duration::from_secs(5))
            .unwrap();
        let c = h
            .insert(handle("a", &memory), t0 + Duration::from_secs(5))
            .unwrap();
        assert!(a != 0 && a != b && b != c && a != c);
        assert_eq!(
            h.insert(handle("d", &memory), t0 + Duration::from_secs(5)),
            Err(HandleError::TooMany { max: 3 })
        );
        assert_eq!(Arc::strong_count(&memory), 4);
        // Expired handles are invisible before the sweep and gone after it.
        let later = t0 + Duration::from_secs(11);
        assert!(h.get(a, later).is_none());
        assert!(h.get(b, later).is_some());
        assert_eq!(h.expire(later), 1);
        assert_eq!(Arc::strong_count(&memory), 3, "expiry closes the memory");
        assert_eq!(h.drop_instance(&InstanceId::new("a").unwrap()), 1);
        let taken = h.take(b).unwrap();
        assert!(h.is_empty());
        drop(taken);
        assert_eq!(Arc::strong_count(&memory), 1);
    }
}
