//! Pins that hold blocks against eviction: a lease's (RAM blocks pinned, SSD blocks held on
//! disk) and a peer's (RAM blocks pinned until released or past their TTL).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::{Disk, Tiers};
use crate::model::{BlockHash, BlockKey, Namespace};
use crate::tier::cache::SlotRef;
use crate::tier::ssd::index::Entry as SsdEntry;

/// A block of a lease's local prefix that is held on the SSD tier (not read yet: the load
/// reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdBlock {
    pub hash: BlockHash,
    /// Its position in the local prefix (RAM and SSD blocks may alternate: RAM evicts the
    /// oldest blocks, often a prompt's first ones).
    pub at: usize,
}

/// A lease's prefix as [`Tiers::pin_prefix`] pinned it.
#[derive(Debug, Default)]
pub struct LeasePin {
    /// RAM blocks, pinned, in prefix order.
    pub blocks: Vec<SlotRef>,
    /// SSD blocks, in prefix order.
    pub ssd: Vec<SsdBlock>,
    /// The disk holds of `ssd`, released by [`Tiers::unpin`].
    pub holds: Vec<(BlockKey, SsdEntry)>,
}

impl<D: Disk> Tiers<D> {
    /// The prefix of `hashes` held here for a lease: RAM blocks pinned, SSD blocks held on
    /// disk (their slots cannot be evicted or reused until [`Self::unpin`]). The prefix
    /// ends at the first block that neither tier holds, or that RAM holds unsealed (a
    /// writer has it). One cache lookup per RAM block (the common case).
    pub fn pin_prefix(&mut self, ns: &Namespace, hashes: &[BlockHash]) -> LeasePin {
        let mut pin = LeasePin {
            blocks: Vec::with_capacity(hashes.len()),
            ..Default::default()
        };
        for (at, h) in hashes.iter().enumerate() {
            if let Some(s) = self.cache.pin_sealed(ns, h) {
                pin.blocks.push(s);
                continue;
            }
            let Some(tier) = self.ssd.as_mut() else { break };
            if self.cache.contains(ns, *h) {
                break;
            }
            let key = BlockKey {
                namespace: ns.clone(),
                hash: *h,
            };
            let Some(e) = tier.hold(&key) else { break };
            pin.ssd.push(SsdBlock { hash: *h, at });
            pin.holds.push((key, e));
        }
        if let Some(t) = &self.ssd {
            let c = t.metrics();
            c.hits_ram.fetch_add(pin.blocks.len() as u64, Relaxed);
            c.hits_ssd.fetch_add(pin.ssd.len() as u64, Relaxed);
        }
        self.ssd_held += pin.holds.len();
        pin
    }

    /// Drops one pin on each block, and the disk holds.
    pub fn unpin(&mut self, ns: &Namespace, hashes: &[BlockHash], holds: &[(BlockKey, SsdEntry)]) {
        self.cache.unpin(ns, hashes);
        self.ssd_held = self.ssd_held.saturating_sub(holds.len());
        if let Some(t) = self.ssd.as_mut() {
            for (key, e) in holds {
                t.release(key, e);
            }
        }
    }

    /// A peer pinned `blocks` (pinned here by [`Self::finish_pin_local`]): their pin now
    /// lives until [`Self::unpin_peer`] or its TTL past `now`. Returns its id.
    pub fn pin_for_peer(&mut self, ns: Namespace, blocks: &[SlotRef], now: Instant) -> u64 {
        let hashes = blocks.iter().map(|b| b.hash).collect();
        self.peer_pins.create(ns, hashes, now)
    }

    /// Releases a peer pin (unknown ids are ignored: it expired).
    pub fn unpin_peer(&mut self, id: u64) {
        if let Some((ns, hashes)) = self.peer_pins.remove(id) {
            self.cache.unpin(&ns, &hashes);
        }
    }

    /// Expires the peer pins due at `now`; returns how many.
    pub fn sweep_peer_pins(&mut self, now: Instant) -> usize {
        let gone = self.peer_pins.expire(now);
        for (ns, hashes) in &gone {
            self.cache.unpin(ns, hashes);
        }
        gone.len()
    }

    pub fn peer_pin_count(&self) -> usize {
        self.peer_pins.len()
    }
}
