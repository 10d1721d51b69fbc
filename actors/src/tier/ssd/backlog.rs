//! [`Backlog`]: the bound on memory held by block copies queued for the disks
//! (`ssd.write-backlog`), shared by the store's thread (which charges) and the I/O threads
//! (which give back).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Bytes of block copies queued for a tier's disks (every queued write holds one): charged
/// when a write is queued, given back by the I/O thread as soon as it is done with the copy
/// (written or failed), before the write's answer goes out.
#[derive(Debug, Default)]
pub struct Backlog {
    bytes: AtomicU64,
    peak: AtomicU64,
}

impl Backlog {
    /// Bytes held by queued writes now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Relaxed)
    }

    /// The most [`Self::bytes`] ever was.
    pub fn peak(&self) -> u64 {
        self.peak.load(Relaxed)
    }

    /// Charges `bytes` if the backlog stays within `limit`; None (nothing charged) if not.
    pub fn try_charge(self: &Arc<Self>, bytes: u64, limit: u64) -> Option<Charge> {
        let mut now = self.bytes.load(Relaxed);
        loop {
            let next = now.checked_add(bytes).filter(|n| *n <= limit)?;
            match self
                .bytes
                .compare_exchange_weak(now, next, Relaxed, Relaxed)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Relaxed);
                    return Some(Charge {
                        backlog: Arc::clone(self),
                        bytes,
                    });
                }
                Err(seen) => now = seen,
            }
        }
    }
}

/// One queued write's share of the [`Backlog`], given back when dropped.
#[derive(Debug)]
pub struct Charge {
    backlog: Arc<Backlog>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.backlog.bytes.fetch_sub(self.bytes, Relaxed);
    }
}
