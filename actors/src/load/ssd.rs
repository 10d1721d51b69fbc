//! The SSD part of one rank's load, as the [`crate::load::transfer::Transfer`] runs it beside the
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

use futures::future::{poll_fn, select, Either};
use kvferry_gpu::{
    CopyBatch, CopyDirection, CopyStats, DeviceError, HostSpan, OwnedCopyEvent, Scatter,
};

use crate::api::{Span, Stage, StageName};
use crate::error::NodeError;
use crate::load::memory::PoolGuard;
use crate::load::plan::SsdPart;
use crate::load::rank::RankHandle;
use crate::load::transfer::PartDone;
use crate::model::BlockHash;
use crate::peer::link::BoxFut;
use crate::tier::ssd::error::{ReadFailure, SsdError};
use crate::tier::store::{ReadFail, SsdReads, StagingGuard};

/// Everything the SSD part needs, owned (it runs as a future of the transfer).
pub struct SsdLoad {
    /// The lease's SSD blocks, in prefix order (`part.dest` gives their destinations).
    pub hashes: Vec<BlockHash>,
    pub part: SsdPart,
    pub handle: Arc<RankHandle>,
    /// The staging ring, reserved with the load when it was planned: its slots' addresses
    /// and the guard that gives them back.
    pub(crate) staging: (Vec<u64>, Arc<StagingGuard>),
    /// The blocks, held on disk for this load since it was planned: the reads are queued
    /// through it, and it tells the store how each ended when the load drops it.
    pub(crate) reads: SsdReads,
    /// When the transfer started: the spans are seconds since then.
    pub started: Instant,
}

/// One chunk's reads in flight: its blocks, its slots, when it was queued, and the blocks
/// that failed before their read could be queued.
struct Reading {
    blocks: Range<usize>,
    slots: Vec<u64>,
    start: f64,
    refused: Vec<(usize, ReadFail)>,
}

/// One chunk's copy to the device in flight.
struct Copying {
    slots: Vec<u64>,
    /// Holds the staging slots and the rank handle until it resolved, however it ends.
    copy: OwnedCopyEvent,
    start: f64,
}

/// What happened first: the oldest chunk's reads landed, or the oldest copy drained.
enum Event {
    Landed(Vec<Result<(), ReadFail>>),
    Copied(Result<CopyStats, DeviceError>),
}

/// The pipeline's state between events.
#[derive(Default)]
struct Pipe {
    free: VecDeque<u64>,
    reading: VecDeque<Reading>,
    copying: VecDeque<Copying>,
    next: usize,
    spans: Vec<Span>,
    failed: Vec<(BlockHash, ReadFailure)>,
    io_error: Option<SsdError>,
    error: Option<NodeError>,
    bytes: u64,
    disk: f64,
    h2d: f64,
}

impl Pipe {
    fn stopping(&self) -> bool {
        self.error.is_some() || !self.failed.is_empty()
    }
}

impl SsdLoad {
    pub fn run(self) -> BoxFut<Result<PartDone, NodeError>> {
        Box::pin(self.pipeline())
    }

    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Keeps the ring's chunks of reads queued on the disk; whichever comes first — the
    /// oldest chunk's reads landing (its copy is submitted at once, behind the copies
    /// already queued on the device) or the oldest copy draining (its slots take the next
    /// chunk's reads) — is handled first, so neither the disk nor the copy engine waits for
    /// the other. On the first failure nothing more is queued, and the part returns only
    /// after every read and copy already started has finished (errors drain first).
    async fn pipeline(mut self) -> Result<PartDone, NodeError> {
        let n = self.hashes.len().min(self.part.dest.len());
        let (addrs, staging) = (
            std::mem::take(&mut self.staging.0),
            Arc::clone(&self.staging.1),
        );
        // Two chunks at least, so one reads while the other copies.
        let chunk = self.part.chunk.min(addrs.len() / 2).max(1);
        let sc = Scatter::new(&self.handle.shape, &self.handle.layout, self.handle.rank);
        // The staging guard lends these pool slots to this load; the copies' guard takes it
        // (and the rank handle) with it.
        let guard = PoolGuard::whole(
            Arc::clone(staging.memory()),
            (Arc::clone(&staging), Arc::clone(&self.handle)),
        );
        let host = guard.into_span().map_err(|e| NodeError::span("ssd", e))?;
        let mut p = Pipe {
            free: addrs.into(),
            ..Default::default()
        };
        loop {
            while !p.stopping() && p.next < n {
                let k = chunk.min(n - p.next);
                if p.free.len() < k {
                    break;
                }
                let slots: Vec<u64> = p.free.drain(..k).collect();
                let blocks = p.next..p.next + k;
                let mut refused = Vec::new();
                for (i, &addr) in blocks.clone().zip(&slots) {
                    let keep = Arc::clone(&staging) as Arc<dyn Send + Sync>;
                    if let Err(f) = self.reads.start(i, addr, keep) {
                        refused.push((i, f));
                    }
                }
                p.reading.push_back(Reading {
                    blocks,
                    slots,
                    start: self.now(),
                    refused,
                });
                p.next += k;
            }
            let t = Instant::now();
            let reads = &mut self.reads;
            let event = match (p.reading.front(), p.copying.front_mut()) {
                (None, None) => break,
                (Some(r), None) => {
                    let b = r.blocks.clone();
                    Event::Landed(poll_fn(|cx| reads.poll_ended(b.clone(), cx)).await)
                }
                (None, Some(c)) => Event::Copied((&mut c.copy).await),
                (Some(r), Some(c)) => {
                    let b = r.blocks.clone();
                    let landed = poll_fn(|cx| reads.poll_ended(b.clone(), cx));
                    match select(std::pin::pin!(landed), &mut c.copy).await {
                        Either::Left((o, _)) => Event::Landed(o),
                        Either::Right((o, _)) => Event::Copied(o),
                    }
                }
            };
            let waited = t.elapsed().as_secs_f64();
            match event {
                Event::Landed(outcomes) => {
                    p.disk += waited;
                    if let Some(r) = p.reading.pop_front() {
                        self.landed(&mut p, r, outcomes, &sc, &host);
                    }
                }
                Event::Copied(out) => {
                    p.h2d += waited;
                    if let Some(c) = p.copying.pop_front() {
                        p.spans.push(Span {
                            name: "ssd_h2d",
                            start: c.start,
                            end: self.now(),
                        });
                        match out {
                            Ok(_) => p.free.extend(c.slots),
                            Err(e) => {
                                p.error.get_or_insert(e.into());
                            }
                        }
                    }
                }
            }
        }
        if let Some(e) = p.error {
            return Err(e);
        }
        if !p.failed.is_empty() {
            return Err(SsdError::Unreadable {
                blocks: p.failed,
                source: p.io_error.map(Box::new),
            }
            .into());
        }
        Ok(PartDone {
            bytes: p.bytes,
            stages: vec![
                Stage {
                    name: StageName::Disk,
                    seconds: p.disk,
                },
                Stage {
                    name: StageName::H2d,
                    seconds: p.h2d,
                },
            ],
            spans: p.spans,
        })
    }

    /// A chunk's reads are all done: its copy is submitted, unless a block of it (or of an
    /// earlier chunk) failed.
    fn landed(
        &self,
        p: &mut Pipe,
        mut r: Reading,
        mut outcomes: Vec<Result<(), ReadFail>>,
        sc: &Scatter<'_>,
        host: &HostSpan,
    ) {
        p.spans.push(Span {
            name: "ssd_read",
            start: r.start,
            end: self.now(),
        });
        // A block refused before its read was queued fails as it was refused.
        for (i, f) in r.refused.drain(..) {
            if let Some(o) = outcomes.get_mut(i - r.blocks.start) {
                *o = Err(f);
            }
        }
        for (i, o) in r.blocks.clone().zip(outcomes) {
            if let Err(f) = o {
                p.failed.push((self.hashes[i], f.failure));
                if let Some(src) = f.source {
                    p.io_error.get_or_insert(src);
                }
            }
        }
        if p.stopping() {
            p.free.extend(r.slots);
            return;
        }
        let built = self.batch(r.slots.iter().copied(), &r.blocks, sc, host);
        let start = self.now();
        let submitted = built.and_then(|b| {
            let bytes = b.bytes();
            let ev = b.submit(self.handle.device.as_ref(), None)?;
            Ok((ev, bytes))
        });
        match submitted {
            Ok((copy, chunk_bytes)) => {
                p.copying.push_back(Copying {
                    slots: r.slots,
                    copy,
                    start,
                });
                p.bytes += chunk_bytes;
            }
            Err(e) => {
                p.error.get_or_insert(e);
                p.free.extend(r.slots);
            }
        }
    }

    /// The copies of a chunk: each slot's block scattered to its destination.
    fn batch(
        &self,
        slots: impl ExactSizeIterator<Item = u64>,
        blocks: &Range<usize>,
        sc: &Scatter<'_>,
        host: &HostSpan,
    ) -> Result<CopyBatch, NodeError> {
        let span = |e| NodeError::span("ssd", e);
        let planes = self.handle.device_planes().map_err(span)?;
        let mut batch = CopyBatch::with_capacity(
            CopyDirection::HostToDevice,
            slots.len() * sc.copies_per_block(),
        );
        for (slot, &dst) in slots.zip(&self.part.dest[blocks.clone()]) {
            let at = slot.wrapping_sub(host.addr());
            sc.push_block_into(&mut batch, host, at, planes, dst)
                .map_err(span)?;
        }
        Ok(batch)
    }
}
