//! The host pool: one memfd-backed, page-aligned mapping cut into fixed-size slots.

use std::sync::Arc;

use kvferry_transport::HostRegion;
use rustix::fs::MemfdFlags;
use slab::Slab;
use thiserror::Error;

const PAGE: u64 = 4096;
const HUGE_PAGE: u64 = 2 << 20;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PoolError {
    #[error("pool of {size} bytes cannot hold one slot of {slot} bytes")]
    TooSmall { size: u64, slot: u64 },
    #[error("slot size must be a nonzero multiple of 64 bytes, got {0}")]
    SlotSize(u64),
    #[error("hugepages requested but unavailable: {reason}")]
    Hugepages { reason: String },
    #[error("{op} failed for a pool of {size} bytes")]
    Os {
        op: &'static str,
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("host pool exhausted: all {capacity} slots are in use")]
    Exhausted { capacity: usize },
}

/// The pool's memory: a transport [`HostRegion`] over a memfd, so the same mapping is what
/// copy engines read, what the MR table registers for peers, and what the shm provider hands
/// out. Transfers hold an `Arc` so the memory outlives every copy into or out of it.
pub type PoolMemory = HostRegion;

/// The mapping and its slot allocator. Slot contents are accessed through raw addresses by
/// copy engines; who may touch which slot when is decided by the block cache's pins.
pub struct HostPool {
    mem: Arc<PoolMemory>,
    slot_bytes: u64,
    capacity: usize,
    hugepages: bool,
    slots: Slab<()>,
}

fn hugepages_free() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
}

impl HostPool {
    /// Creates a pool of `size` bytes (rounded down to whole slots) of `slot_bytes` each.
    pub fn new(size: u64, slot_bytes: u64, hugepages: bool) -> Result<Self, PoolError> {
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(64) {
            return Err(PoolError::SlotSize(slot_bytes));
        }
        let capacity = size / slot_bytes;
        if capacity == 0 {
            return Err(PoolError::TooSmall {
                size,
                slot: slot_bytes,
            });
        }
        let align = if hugepages { HUGE_PAGE } else { PAGE };
        let len = (capacity * slot_bytes).div_ceil(align) * align;
        if hugepages {
            let need = len / HUGE_PAGE;
            match hugepages_free() {
                Some(free) if free >= need => {}
                Some(free) => {
                    return Err(PoolError::Hugepages {
                        reason: format!(
                            "{need} free 2 MiB hugepages needed, the system has {free} \
                             (raise vm.nr_hugepages or set pool.hugepages = false)"
                        ),
                    })
                }
                None => {
                    return Err(PoolError::Hugepages {
                        reason: "no HugePages_Free in /proc/meminfo".into(),
                    })
                }
            }
        }
        // Without hugepages an OS failure is the machine's; with them it is almost always the
        // hugepage reservation, which the operator fixes differently.
        let os = |op: &'static str, source: std::io::Error| {
            if hugepages {
                PoolError::Hugepages {
                    reason: format!("{op}: {source}"),
                }
            } else {
                PoolError::Os {
                    op,
                    size: len,
                    source,
                }
            }
        };
        let mut flags = MemfdFlags::CLOEXEC;
        if hugepages {
            flags |= MemfdFlags::HUGETLB;
        }
        let fd = rustix::fs::memfd_create(c"kvferry-pool", flags)
            .map_err(|e| os("memfd_create", e.into()))?;
        rustix::fs::ftruncate(&fd, len).map_err(|e| os("ftruncate", e.into()))?;
        let mem = HostRegion::map_shared(fd, len as usize, true)
            .map_err(|e| os("mmap", std::io::Error::other(e)))?;
        Ok(Self {
            mem: Arc::new(mem),
            slot_bytes,
            capacity: capacity as usize,
            hugepages,
            slots: Slab::with_capacity(capacity as usize),
        })
    }

    /// Takes a free slot.
    pub fn alloc(&mut self) -> Result<usize, PoolError> {
        if self.slots.len() >= self.capacity {
            return Err(PoolError::Exhausted {
                capacity: self.capacity,
            });
        }
        Ok(self.slots.insert(()))
    }

    /// Returns a slot; freeing a slot that is not taken is a no-op.
    pub fn free(&mut self, slot: usize) {
        self.slots.try_remove(slot);
    }

    /// Address of a slot's first byte.
    pub fn slot_addr(&self, slot: usize) -> u64 {
        self.mem.addr() + slot as u64 * self.slot_bytes
    }

    /// The memory, for holders that must keep it mapped (transfers, registrations).
    pub fn memory(&self) -> &Arc<PoolMemory> {
        &self.mem
    }

    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn used(&self) -> usize {
        self.slots.len()
    }

    pub fn base(&self) -> u64 {
        self.mem.addr()
    }

    pub fn hugepages(&self) -> bool {
        self.hugepages
    }

    /// Copies `data` into a slot at `offset`.
    ///
    /// The caller must hold the slot's writer pin (the cache guarantees no copy engine reads
    /// a slot that is being written).
    pub fn write(&self, slot: usize, offset: u64, data: &[u8]) {
        assert!(slot < self.capacity && offset + data.len() as u64 <= self.slot_bytes);
        // SAFETY: bounds asserted above keep the write inside this slot of the live mapping;
        // exclusivity of the slot is the block cache's writer pin.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.slot_addr(slot) + offset) as usize as *mut u8,
                data.len(),
            )
        }
    }

    /// Copies a slot's bytes at `offset` into `out` (verification and the tcp owner side).
    pub fn read(&self, slot: usize, offset: u64, out: &mut [u8]) {
        assert!(slot < self.capacity && offset + out.len() as u64 <= self.slot_bytes);
        // SAFETY: bounds asserted above keep the read inside this slot of the live mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.slot_addr(slot) + offset) as usize as *const u8,
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPool")
            .field("len", &self.mem.len())
            .field("slot_bytes", &self.slot_bytes)
            .field("capacity", &self.capacity)
            .field("used", &self.slots.len())
            .field("hugepages", &self.hugepages)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_until_exhausted_then_reuse() {
        let mut p = HostPool::new(4 * 8192 + 100, 8192, false).unwrap();
        assert_eq!(p.capacity(), 4);
        assert_eq!(p.base() % 4096, 0, "page aligned");
        let s: Vec<usize> = (0..4).map(|_| p.alloc().unwrap()).collect();
        assert!(matches!(
            p.alloc(),
            Err(PoolError::Exhausted { capacity: 4 })
        ));
        p.write(s[2], 10, b"hello");
        let mut out = [0u8; 5];
        p.read(s[2], 10, &mut out);
        assert_eq!(&out, b"hello");
        p.free(s[1]);
        assert_eq!(p.alloc().unwrap(), s[1]);
        assert_eq!(p.used(), 4);
    }

    #[test]
    fn the_pool_is_a_memfd_a_same_host_peer_maps_read_only() {
        let mut p = HostPool::new(2 * 4096, 4096, false).unwrap();
        let s = p.alloc().unwrap();
        p.write(s, 0, b"peer");
        let fd = p
            .memory()
            .reopen_read_only()
            .unwrap()
            .expect("memfd-backed");
        let view = HostRegion::map_read_only(fd, 2 * 4096).unwrap();
        let mut b = [0u8; 4];
        view.read_at(s * 4096, &mut b).unwrap();
        assert_eq!(&b, b"peer");
    }

    #[test]
    fn bad_sizes_are_typed_errors() {
        assert!(matches!(
            HostPool::new(100, 4096, false),
            Err(PoolError::TooSmall { .. })
        ));
        assert!(matches!(
            HostPool::new(1 << 20, 100, false),
            Err(PoolError::SlotSize(100))
        ));
        assert!(matches!(
            HostPool::new(1 << 20, 0, false),
            Err(PoolError::SlotSize(0))
        ));
    }

    #[test]
    fn hugepages_without_reservation_is_a_clear_error() {
        // Only meaningful where no hugepages are reserved (CI and dev machines here).
        if hugepages_free().unwrap_or(0) == 0 {
            let err = HostPool::new(4 << 20, 1 << 20, true).unwrap_err();
            assert!(matches!(err, PoolError::Hugepages { .. }), "{err}");
            assert!(err.to_string().contains("hugepages"), "{err}");
        } else {
            let p = HostPool::new(4 << 20, 1 << 20, true).unwrap();
            assert!(p.hugepages());
        }
    }
}
