//! The remote suffix of one rank's load, as the [`crate::load::transfer::Transfer`] runs it next to
//! the local copies: each owner segment in prefix order, each block's rank part read as one
//! remote range scattered into its layer segments, straight into device KV (direct) or
//! through pool slots (staged). Direct errors are load failures: nothing falls back to
//! staging.

use std::sync::Arc;
use std::time::Instant;

use kvferry_gpu::{CopyBatch, CopyDirection, CopyOp, OwnedCopyEvent, Scatter};

use crate::api::{Stage, StageName};
use crate::error::NodeError;
use crate::load::memory::PoolGuard;
use crate::load::plan::RemotePart;
use crate::load::rank::RankHandle;
use crate::load::share::LeasePlan;
use crate::load::transfer::PartDone;
use crate::nic::stripe::{ReadRoute, StripePlan};
use crate::peer::batches::even_batches;
use crate::peer::link::{BoxFut, DeviceDest, ReadStats};
use crate::tier::store::{FetchGuard, FetchSlot};

pub use crate::peer::batches::STAGED_CHUNK;

/// Everything the suffix needs, owned (it runs as a future of the transfer).
pub struct Suffix {
    pub parts: Vec<RemotePart>,
    pub share: LeasePlan,
    pub handle: Arc<RankHandle>,
    /// Staged: each part's pool slots, reserved with the load when it was planned.
    pub(crate) fetches: Vec<(Vec<FetchSlot>, FetchGuard)>,
    pub route: Option<StripePlan>,
}

impl Suffix {
    /// Bytes moved and stages spent.
    pub fn run(self) -> BoxFut<Result<PartDone, NodeError>> {
        Box::pin(async move {
            let (bytes, stages) = if self.share.direct {
                self.direct().await?
            } else {
                self.staged().await?
            };
            Ok(PartDone {
                bytes,
                stages,
                spans: Vec::new(),
            })
        })
    }

    async fn direct(self) -> Result<(u64, Vec<Stage>), NodeError> {
        let Suffix {
            parts,
            share,
            handle,
            route,
            ..
        } = self;
        let shape = handle.shape;
        let rank = handle.rank;
        let planes: Vec<(u64, u64)> = handle
            .layout
            .planes()?
            .iter()
            .map(|p| (p.start, p.extent))
            .collect();
        let mut total = ReadStats::default();
        let mut next_read = 0;
        let mut bytes = 0;
        for part in parts {
            let seg = &share.remote[part.segment];
            let list = part.direct.unwrap_or_default();
            // This segment's reads, each with the NIC the stripe plan assigned it.
            let seg_route = route.as_ref().map(|r| ReadRoute {
                nics: r.nics.clone(),
                reads: seg
                    .blocks
                    .iter()
                    .zip(r.per_read.iter().skip(next_read))
                    .map(|(b, nic)| (b.addr + shape.rank_offset(rank), shape.rank_bytes(), *nic))
                    .collect(),
            });
            next_read += seg.blocks.len();
            bytes += list.bytes();
            let dest: Arc<dyn DeviceDest> = Arc::clone(&handle) as _;
            let r = seg
                .link
                .read_device_routed(dest, list, planes.clone(), seg_route)
                .await?;
            total.register += r.register;
            total.post += r.post;
            total.wire += r.wire;
        }
        let mut stages: Vec<Stage> = [
            (StageName::Register, total.register),
            (StageName::Post, total.post),
            (StageName::Wire, total.wire),
        ]
        .into_iter()
        .map(|(name, seconds)| Stage { name, seconds })
        .collect();
        let t = Instant::now();
        handle.device.flush_direct_writes()?;
        stages.push(Stage {
            name: StageName::Fence,
            seconds: t.elapsed().as_secs_f64(),
        });
        Ok((bytes, stages))
    }

    /// Reserve slots, read each chunk into them, copy each chunk to the device as soon as it
    /// has landed; later reads run while earlier chunks copy.
    async fn staged(self) -> Result<(u64, Vec<Stage>), NodeError> {
        let Suffix {
            parts,
            share,
            handle,
            fetches,
            ..
        } = self;
        let shape = handle.shape;
        let rank = handle.rank;
        let sc = Scatter::new(&handle.shape, &handle.layout, rank);
        let span = |e| NodeError::span("remote", e);
        // Checked once for the whole suffix, when its first chunk is copied.
        let (mut wire, mut h2d, mut post) = (0.0f64, 0.0f64, 0.0f64);
        let mut bytes = 0;
        let mut copies: Vec<OwnedCopyEvent> = Vec::new();
        if fetches.len() != parts.len() {
            return Err(NodeError::bad(format!(
                "{} staged parts but {} reservations",
                parts.len(),
                fetches.len()
            )));
        }
        // Segments that landed: their parts are committed when the suffix ends (the guards
        // drop), in one message each, not while later segments still run.
        let mut landed = Vec::with_capacity(fetches.len());
        for (part, (slots, mut guard)) in parts.into_iter().zip(fetches) {
            let seg = &share.remote[part.segment];
            let memory = Arc::clone(guard.memory());
            // The copies out of the slots hold the pool memory and the destinations' handle
            // until they resolved; the pins stay with `guard`, released after them (below).
            let host = PoolGuard::whole(Arc::clone(&memory), Arc::clone(&handle))
                .into_span()
                .map_err(span)?;
            let chunks = even_batches(seg.blocks.len(), seg.link.lanes(), STAGED_CHUNK);
            let mut reads = Vec::new();
            for chunk in &chunks {
                let ops: Vec<CopyOp> = seg.blocks[chunk.clone()]
                    .iter()
                    .zip(&slots[chunk.start..])
                    .filter(|(_, s)| s.must_write)
                    .map(|(b, s)| CopyOp {
                        src: b.addr + shape.rank_offset(rank),
                        dst: s.addr + shape.rank_offset(rank),
                        len: shape.rank_bytes(),
                    })
                    .collect();
                reads.push(tokio::spawn(seg.link.read_host(ops, host.clone())));
            }
            // The first failure is returned, but only once every read of the segment has been
            // reported and every copy out of its slots has landed: the slots go back to the
            // pool with `guard`, and nothing may still write into them or read out of them
            // (errors drain before release).
            let mut failed: Option<NodeError> = None;
            for (chunk, read) in chunks.into_iter().zip(reads) {
                // Time spent waiting here is the part of the wire the pipeline did not hide.
                let tr = Instant::now();
                let r = read
                    .await
                    .map_err(|_| NodeError::Stopped {
                        what: "remote read",
                    })
                    .and_then(|r| r.map_err(NodeError::from));
                wire += tr.elapsed().as_secs_f64();
                let r = match (r, &failed) {
                    (Ok(r), None) => r,
                    (Err(e), None) => {
                        failed = Some(e);
                        continue;
                    }
                    (_, Some(_)) => continue,
                };
                post += r.post;
                let (lo, hi) = (chunk.start, chunk.end.min(slots.len()));
                let built = (|| {
                    let planes = handle.device_planes().map_err(span)?;
                    let mut batch = CopyBatch::with_capacity(
                        CopyDirection::HostToDevice,
                        (hi - lo) * sc.copies_per_block(),
                    );
                    for (s, &dst) in slots[lo..hi].iter().zip(&part.dest[lo..hi]) {
                        let at = s.addr.wrapping_sub(host.addr());
                        sc.push_block_into(&mut batch, &host, at, planes, dst)
                            .map_err(span)?;
                    }
                    Ok::<_, NodeError>(batch)
                })();
                match built.and_then(|b| {
                    let n = b.bytes();
                    Ok((b.submit(handle.device.as_ref(), None)?, n))
                }) {
                    Ok((ev, n)) => {
                        bytes += n;
                        copies.push(ev);
                    }
                    Err(e) => failed = Some(e),
                }
            }
            let th = Instant::now();
            for c in copies.drain(..) {
                if let Err(e) = c.await {
                    failed.get_or_insert(e.into());
                }
            }
            h2d += th.elapsed().as_secs_f64();
            if let Some(e) = failed {
                return Err(e);
            }
            guard.finish();
            landed.push(guard);
        }
        drop(landed);
        let stages = [
            (StageName::Post, post),
            (StageName::Wire, wire),
            (StageName::H2d, h2d),
        ]
        .into_iter()
        .map(|(name, seconds)| Stage { name, seconds })
        .collect();
        Ok((bytes, stages))
    }
}
