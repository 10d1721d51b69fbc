//! SSD → RAM: blocks a peer reads are promoted into RAM slots, blocks a load reads go into
//! its staging slots; a damaged block leaves the tier either way.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::{Disk, Tiers};
use crate::model::{BlockHash, BlockKey, Namespace};
use crate::tier::cache::{BlockClass, Reservation, SlotRef};
use crate::tier::ssd::error::ReadFailure;
use crate::tier::ssd::io::{ReadInto, ReadOutcome};
use crate::tier::ssd::tier::PendingRead;
use crate::tier::ssd::SsdError;

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

/// Why one SSD block of a load was not read.
#[derive(Debug)]
pub(crate) struct ReadFail {
    pub(crate) failure: ReadFailure,
    pub(crate) source: Option<SsdError>,
}

/// SSD reads of a load begun by [`Tiers::begin_ssd_reads`].
pub(crate) struct SsdReads {
    out: Vec<Option<Result<(), ReadFail>>>,
    pending: Vec<(usize, PendingRead)>,
}

impl ReadFail {
    fn of(failure: ReadFailure) -> Self {
        Self {
            failure,
            source: None,
        }
    }
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

    /// Queues the reads of a lease's SSD blocks into staging slots (`(block, address)`);
    /// each read holds its block itself (the lease's hold may go meanwhile). The driver
    /// awaits the waits in order and hands the outcomes to [`Self::finish_ssd_reads`].
    pub(crate) fn begin_ssd_reads(
        &mut self,
        ns: &Namespace,
        reads: Vec<(BlockHash, u64)>,
        keep: Arc<dyn Send + Sync>,
    ) -> (SsdReads, Vec<D::ReadWait>) {
        let cap = self.cache.pool().slot_bytes();
        let mut r = SsdReads {
            out: Vec::with_capacity(reads.len()),
            pending: Vec::new(),
        };
        let mut waits = Vec::new();
        for (i, (hash, addr)) in reads.into_iter().enumerate() {
            let key = BlockKey {
                namespace: ns.clone(),
                hash,
            };
            let Some(tier) = self.ssd.as_mut() else {
                r.out.push(Some(Err(ReadFail::of(ReadFailure::Vanished))));
                continue;
            };
            // The read's own hold: the lease's may be released while the read runs.
            let Some(e) = tier.hold(&key) else {
                r.out.push(Some(Err(ReadFail::of(ReadFailure::Vanished))));
                continue;
            };
            let into = ReadInto {
                addr,
                cap,
                keep: Arc::clone(&keep),
            };
            match tier.read_held(&key, e, into) {
                Some((p, wait)) => {
                    r.out.push(None);
                    r.pending.push((i, p));
                    waits.push(wait);
                }
                None => r.out.push(Some(Err(ReadFail::of(ReadFailure::Io)))),
            }
        }
        (r, waits)
    }

    /// Each block's outcome, in order; damaged blocks leave the tier.
    pub(crate) fn finish_ssd_reads(
        &mut self,
        r: SsdReads,
        got: Vec<Option<ReadOutcome>>,
    ) -> Vec<Result<(), ReadFail>> {
        let SsdReads { mut out, pending } = r;
        let mut gone = Vec::new();
        for ((i, p), outcome) in pending.into_iter().zip(got) {
            let (ok, removed) = match self.ssd.as_mut() {
                Some(t) => t.read_done(&p, outcome.as_ref()),
                None => (false, false),
            };
            if removed {
                gone.push(p.key.clone());
            }
            out[i] = Some(if ok {
                Ok(())
            } else {
                Err(match outcome {
                    Some(ReadOutcome::Damaged(d)) => ReadFail::of(ReadFailure::Damaged(d)),
                    Some(ReadOutcome::Failed(e)) => ReadFail {
                        failure: ReadFailure::Io,
                        source: Some(e),
                    },
                    _ => ReadFail::of(ReadFailure::Io),
                })
            });
        }
        self.withdraw(gone);
        out.into_iter()
            .map(|o| o.unwrap_or(Err(ReadFail::of(ReadFailure::Io))))
            .collect()
    }
}
