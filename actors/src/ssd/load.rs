//! The SSD part of one rank's load, as the [`crate::transfer::Transfer`] runs it beside the
//! RAM copies and the remote suffix: the lease's SSD blocks are read, a chunk at a time,
//! into a ring of pool slots borrowed for the load, and each chunk is copied to the device
//! as soon as it has landed, while the disk reads the next chunks.
//!
//! The staging slots go back to the pool after the copies, instead of becoming RAM cache
//! entries: each TP rank reads and copies on its own (a promotion would have to share one
//! slot between ranks, and a damaged read must never touch an entry another rank copies
//! from), a load never evicts RAM to hold a prefix of any length (it borrows one ring), and
//! the disk reads of a load do not queue behind write-behind writes of blocks it evicted.
//! The block stays on disk, most recently used there.
//!
//! A block that does not come back intact fails the load with
//! [`SsdError::Unreadable`] naming it; its destination is never written.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use actix::Addr;
use kvferry_gpu::{CopyDirection, CopyList, Scatter};

use super::error::{ReadFailure, SsdError};
use crate::api::{Span, Stage, StageName};
use crate::error::NodeError;
use crate::model::{BlockHash, Namespace};
use crate::plan::SsdPart;
use crate::registry::RankHandle;
use crate::remote::link::{BoxFut, Drained, Keep};
use crate::store::{BlockStore, ReadSsd, ReserveStaging};
use crate::transfer::PartDone;

/// Everything the SSD part needs, owned (it runs as a future of the transfer).
pub struct SsdLoad {
    pub namespace: Namespace,
    /// The lease's SSD blocks, in prefix order (`part.dest` gives their destinations).
    pub hashes: Vec<BlockHash>,
    pub part: SsdPart,
    pub handle: Arc<RankHandle>,
    pub store: Addr<BlockStore>,
    /// When the transfer started: the spans are seconds since then.
    pub started: Instant,
}

/// One chunk's reads in flight: its blocks, its slots and when it was queued.
struct Reading {
    blocks: Range<usize>,
    slots: Vec<u64>,
    reply: actix::dev::Request<BlockStore, ReadSsd>,
    start: f64,
}

/// One chunk's copy to the device in flight.
struct Copying {
    slots: Vec<u64>,
    copy: Drained,
    start: f64,
}

impl SsdLoad {
    pub fn run(self) -> BoxFut<Result<PartDone, NodeError>> {
        Box::pin(self.pipeline())
    }

    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Keeps up to the ring's chunks of reads queued on the disk; as each chunk lands (in
    /// order) its copy is submitted, and a copy's slots take the next chunk's read once the
    /// copy is done. On the first failure nothing more is queued, and the part returns only
    /// after every read and copy already started has finished (errors drain first).
    async fn pipeline(self) -> Result<PartDone, NodeError> {
        let n = self.hashes.len().min(self.part.dest.len());
        let (addrs, staging) = self
            .store
            .send(ReserveStaging {
                want: self.part.staging_slots.max(1),
            })
            .await??;
        // Two chunks at least, so one reads while the other copies.
        let chunk = self.part.chunk.min(addrs.len() / 2).max(1);
        let sc = Scatter::new(&self.handle.shape, &self.handle.layout, self.handle.rank);
        let mut free: VecDeque<u64> = addrs.into();
        let mut reading: VecDeque<Reading> = VecDeque::new();
        let mut copying: VecDeque<Copying> = VecDeque::new();
        let mut spans = Vec::new();
        let mut failed: Vec<(BlockHash, ReadFailure)> = Vec::new();
        let mut io_error: Option<SsdError> = None;
        let mut error: Option<NodeError> = None;
        let (mut bytes, mut disk, mut h2d) = (0u64, 0.0f64, 0.0f64);
        let mut next = 0;
        loop {
            while error.is_none() && failed.is_empty() && next < n {
                let k = chunk.min(n - next);
                if free.len() < k {
                    break;
                }
                let slots: Vec<u64> = free.drain(..k).collect();
                let reads = self.hashes[next..next + k]
                    .iter()
                    .copied()
                    .zip(slots.iter().copied())
                    .collect();
                let reply = self.store.send(ReadSsd {
                    namespace: self.namespace.clone(),
                    reads,
                    staging: Arc::clone(&staging),
                });
                reading.push_back(Reading {
                    blocks: next..next + k,
                    slots,
                    reply,
                    start: self.now(),
                });
                next += k;
            }
            if let Some(r) = reading.pop_front() {
                // Time spent waiting here is the part of the disk the pipeline did not hide.
                let t = Instant::now();
                let outcomes = r.reply.await;
                disk += t.elapsed().as_secs_f64();
                spans.push(Span {
                    name: "ssd_read",
                    start: r.start,
                    end: self.now(),
                });
                let outcomes = match outcomes {
                    Ok(o) => o,
                    Err(e) => {
                        // The store is gone: its reads may still land in these slots, so
                        // they are not reused (the staging guard keeps them until then).
                        error.get_or_insert(e.into());
                        continue;
                    }
                };
                let mut good = true;
                for (i, o) in r.blocks.clone().zip(outcomes) {
                    if let Err(f) = o {
                        good = false;
                        failed.push((self.hashes[i], f.failure));
                        if let Some(src) = f.source {
                            io_error.get_or_insert(src);
                        }
                    }
                }
                // The chunk's reads are all done (the store replied after the last one).
                if !good || error.is_some() || !failed.is_empty() {
                    free.extend(r.slots);
                    continue;
                }
                let mut list = CopyList::with_capacity(r.slots.len() * sc.copies_per_block());
                for (&slot, &dst) in r.slots.iter().zip(&self.part.dest[r.blocks.clone()]) {
                    sc.push_block(&mut list, CopyDirection::HostToDevice, slot, dst);
                }
                let chunk_bytes = list.bytes();
                let start = self.now();
                // SAFETY: sources are staging slots whose reads are done, lent to this load
                // by `staging` (held by the copy below until it drained) in pool memory it
                // keeps mapped; destinations are device KV held by `handle`.
                match unsafe { self.handle.device.submit(CopyDirection::HostToDevice, list) } {
                    Ok(ev) => {
                        let keep: Keep = Box::new(Arc::clone(&staging));
                        copying.push_back(Copying {
                            slots: r.slots,
                            copy: Drained::new(ev, vec![keep, Box::new(Arc::clone(&self.handle))]),
                            start,
                        });
                        bytes += chunk_bytes;
                    }
                    Err(e) => {
                        error.get_or_insert(e.into());
                        free.extend(r.slots);
                    }
                }
                // Slots for the next chunk's read: wait for the oldest copy if none are free.
                while error.is_none()
                    && failed.is_empty()
                    && next < n
                    && free.len() < chunk.min(n - next)
                {
                    let Some(c) = copying.pop_front() else { break };
                    self.finish_copy(c, &mut free, &mut spans, &mut h2d, &mut error)
                        .await;
                }
                continue;
            }
            match copying.pop_front() {
                Some(c) => {
                    self.finish_copy(c, &mut free, &mut spans, &mut h2d, &mut error)
                        .await
                }
                None if error.is_none() && failed.is_empty() && next < n => continue,
                None => break,
            }
        }
        if let Some(e) = error {
            return Err(e);
        }
        if !failed.is_empty() {
            return Err(SsdError::Unreadable {
                blocks: failed,
                source: io_error.map(Box::new),
            }
            .into());
        }
        Ok(PartDone {
            bytes,
            stages: vec![
                Stage {
                    name: StageName::Disk,
                    seconds: disk,
                },
                Stage {
                    name: StageName::H2d,
                    seconds: h2d,
                },
            ],
            spans,
        })
    }

    async fn finish_copy(
        &self,
        c: Copying,
        free: &mut VecDeque<u64>,
        spans: &mut Vec<Span>,
        h2d: &mut f64,
        error: &mut Option<NodeError>,
    ) {
        let t = Instant::now();
        let r = c.copy.await;
        *h2d += t.elapsed().as_secs_f64();
        spans.push(Span {
            name: "ssd_h2d",
            start: c.start,
            end: self.now(),
        });
        match r {
            Ok(_) => free.extend(c.slots),
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
}
