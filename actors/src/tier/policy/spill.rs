//! RAM → SSD: what RAM evicts is written behind, sealed blocks are written through, and
//! each write's outcome comes back here.

use super::{by_namespace, Disk, Effect, Tiers};
use crate::model::{BlockHash, BlockKey, Namespace};
use crate::tier::quota::Tier;
use crate::tier::ssd::tier::{PendingWrite, WriteSkip};
use crate::tier::ssd::SsdError;

/// A write-through block waiting for room in the SSD write backlog.
pub(super) struct WaitingWrite {
    key: BlockKey,
    tp: u32,
    len: u64,
    slot: usize,
}

impl<D: Disk> Tiers<D> {
    /// Handles what RAM evicted: blocks the SSD tier takes (write-behind) stay advertised,
    /// the others are withdrawn.
    ///
    /// Called right after every reservation, before its slot is written: an evicted
    /// block's bytes are still in its freed slot, and are copied out here.
    pub fn handle_evictions(&mut self) {
        let evicted = self.cache.take_evicted();
        if evicted.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        let mut left_ram = Vec::new();
        let mut left_disk = Vec::new();
        for ev in evicted {
            let len = self.block_len(&ev.key.namespace);
            let Some(ssd) = self.ssd.as_mut() else {
                gone.push(ev.key);
                continue;
            };
            if ssd.contains(&ev.key) {
                // Still served from disk: only RAM lost it.
                left_ram.push(ev.key);
                continue;
            }
            let pool = self.cache.pool();
            match ssd.write(&ev.key, ev.tp, len, |dst| pool.read(ev.slot, 0, dst)) {
                Ok((write, wait, disk_evicted)) => {
                    self.effects.push(Effect::Watch { write, wait });
                    left_disk.extend(disk_evicted);
                }
                // Out of RAM and not on disk: it leaves the node (never wrong bytes: a miss).
                Err(why) => {
                    if why == WriteSkip::Backlog {
                        ssd.skipped_for_backlog(&ev.key);
                    }
                    gone.push(ev.key)
                }
            }
        }
        self.left_tier(left_ram, Tier::Ram);
        self.disk_evicted(left_disk);
        self.withdraw(gone);
    }

    /// Blocks the SSD tier evicted: those RAM still holds only left the disk, the others
    /// left the node.
    fn disk_evicted(&mut self, keys: Vec<BlockKey>) {
        let (in_ram, gone): (Vec<BlockKey>, Vec<BlockKey>) = keys
            .into_iter()
            .partition(|k| self.cache.contains(&k.namespace, k.hash));
        self.left_tier(in_ram, Tier::Ssd);
        self.withdraw(gone);
    }

    fn left_tier(&mut self, keys: Vec<BlockKey>, tier: Tier) {
        for (namespace, hashes) in by_namespace(keys) {
            self.effects.push(Effect::LeftTier {
                namespace,
                hashes,
                tier,
            });
        }
    }

    /// Withdraws blocks that left this node: those no tier holds any more.
    pub(super) fn withdraw(&mut self, keys: Vec<BlockKey>) {
        let gone: Vec<BlockKey> = keys
            .into_iter()
            .filter(|k| {
                !self.cache.contains(&k.namespace, k.hash)
                    && !self.ssd.as_ref().is_some_and(|s| s.contains(k))
            })
            .collect();
        for (namespace, hashes) in by_namespace(gone) {
            self.effects.push(Effect::Withdraw { namespace, hashes });
        }
    }

    /// A queued SSD write finished (`out`: what the disk said).
    pub fn handle_write_done(&mut self, w: PendingWrite, out: Result<(), SsdError>) {
        if let Some(ssd) = self.ssd.as_mut() {
            let done = ssd.write_done(&w, out);
            if done.is_err() {
                self.withdraw(vec![w.key.clone()]);
            }
            self.effects.push(Effect::Durable {
                key: w.key,
                out: done,
            });
        }
        // Its copy left the backlog: room for the write-through blocks waiting.
        self.pump_write_through();
    }

    /// Write-through: every newly sealed block goes to the SSD tier too. Returns the keys
    /// whose outcome will arrive: Ok once its write is done (the block file holds it, and
    /// the file header's used mark covers it: a process killed now loses nothing
    /// acknowledged). Blocks wait for room in the write backlog in RAM, pinned, in order.
    pub(super) fn write_through(&mut self, ns: &Namespace, sealed: &[BlockHash]) -> Vec<BlockKey> {
        if !self.ssd.as_ref().is_some_and(D::write_through) {
            return Vec::new();
        }
        let Some(&(tp, len)) = self.shapes.get(ns) else {
            return Vec::new();
        };
        let mut keys = Vec::with_capacity(sealed.len());
        for h in sealed {
            // Pinned until its copy is queued: the bytes stay in the slot meanwhile.
            let Some(s) = self.cache.pin_prefix(ns, std::slice::from_ref(h)).pop() else {
                continue;
            };
            let key = BlockKey {
                namespace: ns.clone(),
                hash: *h,
            };
            keys.push(key.clone());
            self.wt_waiting.push_back(WaitingWrite {
                key,
                tp,
                len,
                slot: s.slot,
            });
        }
        self.pump_write_through();
        keys
    }

    /// Queues the writes of waiting write-through blocks, oldest first, while the backlog
    /// has room. A block whose write cannot be queued for another reason is answered here.
    fn pump_write_through(&mut self) {
        let mut disk_evicted = Vec::new();
        while let (Some(w), Some(ssd)) = (self.wt_waiting.front(), self.ssd.as_mut()) {
            let pool = self.cache.pool();
            let out = ssd.write(&w.key, w.tp, w.len, |dst| pool.read(w.slot, 0, dst));
            if out.as_ref().err() == Some(&WriteSkip::Backlog) {
                // Every queued write frees room when it is done, and pumps again.
                break;
            }
            let present_on_disk = !ssd.is_writing(&w.key);
            let Some(w) = self.wt_waiting.pop_front() else {
                break;
            };
            self.cache
                .unpin(&w.key.namespace, std::slice::from_ref(&w.key.hash));
            match out {
                Ok((write, wait, evicted)) => {
                    self.effects.push(Effect::Watch { write, wait });
                    disk_evicted.extend(evicted);
                }
                // Its write in flight answers it.
                Err(WriteSkip::Present) if !present_on_disk => {}
                Err(WriteSkip::Present) => self.effects.push(Effect::Durable {
                    key: w.key,
                    out: Ok(()),
                }),
                Err(reason) => self.effects.push(Effect::Durable {
                    key: w.key,
                    out: Err(SsdError::NotWritten { reason }),
                }),
            }
        }
        self.disk_evicted(disk_evicted);
    }
}
