//! SSD → RAM: blocks a peer reads are promoted into RAM slots, blocks a load reads go into
//! its staging slots; a damaged block leaves the tier either way.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::{Disk, Tiers};
use crate::model::{BlockHash, BlockKey, Namespace};
use crate::tier::cache::{BlockClass, Reservation, SlotRef};
use crate::tier::ssd::io::{ReadInto, ReadOutcome};
use crate::tier::ssd::port::ReadEnd;
use crate::tier::ssd::tier::PendingRead;

/// SSD blocks being read into RAM slots for one lookup, in prefix order. Each block's slot
/// holds a writer pin for every rank until the read is done.
struct Promotion {
    reads: Vec<(PendingRead, u32)>,
}

/// A local pin begun by [`Tiers::begin_pin_local`]: RAM blocks (`Some`) already pinned,
/// SSD blocks (`None`) being promoted.
pub struct LocalPin {
    namespace: Namespace,
    parts: Vec<Option<SlotRef>>,
    promotion: Option<Promotion>,
}

impl<D: Disk> Tiers<D> {
    /// Pins the prefix of `hashes` held here, RAM and SSD blocks in any order: RAM blocks
    /// are pinned first (so promotions cannot evict them), then the SSD blocks get RAM
    /// slots (evicting as needed) and their reads are queued. The driver awaits the waits
    /// (in order) and hands their outcomes to [`Self::finish_pin_local`]; with no waits it
    /// calls it at once.
    pub fn begin_pin_local(
        &mut self,
        ns: &Namespace,
        hashes: &[BlockHash],
    ) -> (LocalPin, Vec<D::ReadWait>) {
        let mut parts: Vec<Option<SlotRef>> = Vec::new();
        let mut on_ssd = Vec::new();
        for h in hashes {
            if let Some(s) = self.cache.pin_sealed(ns, h) {
                parts.push(Some(s));
                continue;
            }
            let key = BlockKey {
                namespace: ns.clone(),
                hash: *h,
            };
            // A block in RAM but unsealed has a writer: not read from disk under it.
            if self.cache.contains(ns, *h) || !self.ssd.as_ref().is_some_and(|s| s.contains(&key)) {
                break;
            }
            parts.push(None);
            on_ssd.push(*h);
        }
        let (promotion, waits) = match self.start_promotion(ns, &on_ssd) {
            Some((p, waits)) => (Some(p), waits),
            None => (None, Vec::new()),
        };
        let pin = LocalPin {
            namespace: ns.clone(),
            parts,
            promotion,
        };
        (pin, waits)
    }

    /// Finishes a local pin with its reads' outcomes (None: the reply was lost). Returns
    /// the pinned prefix and how many of it came from SSD; the prefix ends at the first
    /// block that neither tier holds, that got no RAM slot, or whose read failed.
    pub fn finish_pin_local(
        &mut self,
        pin: LocalPin,
        outcomes: Vec<Option<ReadOutcome>>,
    ) -> (Vec<SlotRef>, usize) {
        let promoted = match pin.promotion {
            Some(p) => self.finish_promotion(&pin.namespace, p, outcomes),
            None => Vec::new(),
        };
        self.assemble(&pin.namespace, pin.parts, promoted)
    }

    /// The prefix in order: RAM blocks (`Some`) and promoted ones (`None`, filled from
    /// `promoted` in order). Where a promotion is missing the prefix ends, and the RAM
    /// blocks pinned past that point are unpinned. Also says how many came from SSD.
    fn assemble(
        &mut self,
        ns: &Namespace,
        parts: Vec<Option<SlotRef>>,
        promoted: Vec<SlotRef>,
    ) -> (Vec<SlotRef>, usize) {
        let mut promoted = promoted.into_iter();
        let mut out = Vec::with_capacity(parts.len());
        let mut cut = false;
        let mut from_ssd = 0;
        let mut unpin = Vec::new();
        for part in parts {
            match (part, cut) {
                (Some(s), false) => out.push(s),
                (Some(s), true) => unpin.push(s.hash),
                (None, false) => match promoted.next() {
                    Some(s) => {
                        out.push(s);
                        from_ssd += 1;
                    }
                    None => cut = true,
                },
                (None, true) => {}
            }
        }
        // Promoted past the cut (cannot happen: promotions are a prefix of the SSD parts).
        for s in promoted {
            unpin.push(s.hash);
        }
        self.cache.unpin(ns, &unpin);
        (out, from_ssd)
    }

    /// Reserves RAM slots for the run of `hashes` held on SSD and queues their reads. The
    /// run stops at the first block not on SSD, present in RAM in any state (a writer has
    /// it), or without a RAM slot.
    fn start_promotion(
        &mut self,
        ns: &Namespace,
        hashes: &[BlockHash],
    ) -> Option<(Promotion, Vec<D::ReadWait>)> {
        let ssd = self.ssd.as_mut()?;
        // Held first: making room in RAM writes evicted blocks to disk, which must not
        // evict the blocks about to be read.
        let mut held = Vec::new();
        for h in hashes {
            let key = BlockKey {
                namespace: ns.clone(),
                hash: *h,
            };
            let Some(e) = ssd.hold(&key) else { break };
            held.push((key, e));
        }
        let mut p = Promotion { reads: Vec::new() };
        let mut waits = Vec::new();
        let mut held = held.into_iter();
        for (key, e) in held.by_ref() {
            let h = key.hash;
            let mut slot = None;
            let mut reserved = 0;
            if !self.cache.contains(ns, h) {
                for rank in 0..e.tp {
                    let r = self
                        .cache
                        .reserve(ns, h, e.tp, rank, e.len, BlockClass::Retained);
                    // Before the read lands: an evicted block's bytes are still in its slot.
                    self.handle_evictions();
                    match r {
                        Ok(Reservation::Write(s)) => {
                            slot = Some(s);
                            reserved += 1;
                        }
                        Ok(Reservation::Present) | Err(_) => break,
                    }
                }
            }
            let pool = self.cache.pool();
            let read = match (slot, reserved == e.tp, self.ssd.as_mut()) {
                (Some(s), true, Some(ssd)) => ssd.read_held(
                    &key,
                    e,
                    ReadInto {
                        addr: s.addr,
                        cap: pool.slot_bytes(),
                        keep: Arc::clone(pool.memory()) as Arc<dyn Send + Sync>,
                    },
                ),
                (_, _, Some(ssd)) => {
                    ssd.release(&key, &e);
                    None
                }
                _ => None,
            };
            let Some((r, wait)) = read else {
                if let Some(ssd) = &self.ssd {
                    ssd.metrics().promote_no_room.fetch_add(1, Relaxed);
                }
                for _ in 0..reserved {
                    self.cache.abort(ns, h);
                }
                break;
            };
            p.reads.push((r, e.tp));
            waits.push(wait);
        }
        if let Some(ssd) = self.ssd.as_mut() {
            for (key, e) in held {
                ssd.release(&key, &e);
            }
        }
        (!p.reads.is_empty()).then_some((p, waits))
    }

    /// Seals the blocks whose reads were good and pins the good prefix of them; a damaged
    /// block frees its RAM slot, leaves the SSD tier, and ends the prefix.
    fn finish_promotion(
        &mut self,
        ns: &Namespace,
        p: Promotion,
        outcomes: Vec<Option<ReadOutcome>>,
    ) -> Vec<SlotRef> {
        let mut out = Vec::new();
        let mut prefix = true;
        let mut gone = Vec::new();
        for ((r, tp), outcome) in p.reads.into_iter().zip(outcomes) {
            let h = r.key.hash;
            let (ok, removed) = match self.ssd.as_mut() {
                Some(ssd) => ssd.read_done(&r, outcome.as_ref()),
                None => (false, false),
            };
            if ok {
                for rank in 0..tp {
                    self.cache.commit(ns, h, rank);
                }
                if prefix {
                    out.extend(self.cache.pin_prefix(ns, std::slice::from_ref(&h)));
                }
            } else {
                for _ in 0..tp {
                    self.cache.abort(ns, h);
                }
                prefix = false;
                if removed {
                    gone.push(r.key);
                }
            }
        }
        self.withdraw(gone);
        out
    }

    /// Holds a load's SSD blocks on disk (in order; None where a block is no longer there)
    /// until the load hands each one's [`ReadEnd`] to [`Self::end_ssd_reads`]: the load
    /// reads them through the tier's [`crate::tier::ssd::port::ReadPort`] meanwhile, and
    /// the lease's own hold may go first.
    pub(crate) fn hold_ssd_reads(
        &mut self,
        ns: &Namespace,
        hashes: &[BlockHash],
    ) -> Vec<Option<PendingRead>> {
        hashes
            .iter()
            .map(|&hash| {
                let key = BlockKey {
                    namespace: ns.clone(),
                    hash,
                };
                let tier = self.ssd.as_mut()?;
                let e = tier.hold(&key)?;
                Some(PendingRead {
                    key,
                    loc: e.loc,
                    len: e.len,
                })
            })
            .collect()
    }

    /// A load's held SSD blocks, each with how its read ended: the holds end, and damaged
    /// or unreadable blocks leave the tier and are withdrawn.
    pub(crate) fn end_ssd_reads(&mut self, ends: Vec<(PendingRead, ReadEnd)>) {
        let Some(tier) = self.ssd.as_mut() else {
            return;
        };
        let gone = ends
            .into_iter()
            .filter_map(|(r, end)| tier.read_ended(&r, end).then_some(r.key))
            .collect();
        self.withdraw(gone);
    }
}
