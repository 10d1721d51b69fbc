//! `LoadPlan`: what one rank's load will do, decided once and without I/O — the local
//! prefix's RAM copies in layer groups, its SSD blocks (read into staging slots chunk by
//! chunk, each chunk copied to the device while the next is read), the remote suffix per
//! owner in prefix order (with the direct reads' scatter lists), and the staging slots a
//! staged load needs. The
//! [`crate::load::transfer::Transfer`] executes it; nothing here touches actors, memory or devices.

use std::ops::Range;

use kvferry_gpu::{CopyDirection, CopyList, KvLayout, KvShape, Scatter};

/// Smallest load that is split into layer batches. A larger load is submitted as layer 0
/// alone (an engine's first attention layer waits for it), then the other layers in at most
/// [`REST_GROUPS`] batches of at least this many bytes; a smaller one goes as one batch.
///
/// Few, long batches are what the copy path wants. A batch's host runs are each block's
/// layers of that batch: long runs go through the copy engines at link speed (staged),
/// short ones through the gather kernel, which reads host memory over PCIe with every SM and
/// so holds up a save's device-side gather running at the same time. Measured on the H200
/// (a 256-block load of 28 layers × 64 KiB and a 256-block save at once, both directions'
/// bytes over the time): 28 one-layer batches 54 GB/s, 15 batches 54, 8 batches 70, 3
/// batches 82, one batch 87, of about 100 the link gives; the load alone 49–53 GB/s in every
/// case.
pub const MIN_LAYER_GROUP_BYTES: u64 = 32 << 20;

/// Batches after layer 0's: the other layers in at most this many, so an engine can start
/// on the first half while the second still copies.
pub const REST_GROUPS: u32 = 2;

/// SSD blocks per pipeline step: one round trip to the store and one device submission per
/// chunk; the disk reads of later chunks run while earlier ones copy to the device.
pub const SSD_CHUNK: usize = 8;

/// Chunks of staging slots a load's SSD part keeps (the disk has up to this many chunks of
/// reads queued while one copies): 32 slots, enough for a queue depth of 32.
pub const SSD_STAGING_CHUNKS: usize = 4;

/// How a load's remote suffix reaches the device: local, staged or direct.
pub use crate::api::TransferPath as LoadPath;

/// Copies of a contiguous run of layers, for every local block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerBatch {
    pub layers: Range<u32>,
    pub list: CopyList,
}

/// One owner's part of the remote suffix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemotePart {
    /// Index of the owner segment in the lease's remote plan.
    pub segment: usize,
    /// Destination device blocks, in the segment's block order.
    pub dest: Vec<u32>,
    /// Direct loads: the segment's blocks scattered straight into device KV (sources are the
    /// owner's addresses); `None` for staged loads, whose sources are pool slots reserved
    /// with the load before its transfer starts (`tier::store::ReserveLoad`).
    pub direct: Option<CopyList>,
}

/// The local prefix's blocks held on SSD: read into a ring of staging slots, `chunk` blocks
/// at a time, each block's rank part scattered to the device once its chunk has landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdPart {
    /// Destination device blocks, in the lease's SSD block order.
    pub dest: Vec<u32>,
    /// Pool slots to borrow for the reads (fewer still work: a shorter pipeline).
    pub staging_slots: usize,
    pub chunk: usize,
}

/// One rank's load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    pub path: LoadPath,
    /// Layers of the rank's KV (what per-layer progress counts to).
    pub layers: u32,
    /// The local prefix's RAM blocks, in layer order; empty where it has none.
    pub local: Vec<LayerBatch>,
    /// The local prefix's SSD blocks, if any.
    pub ssd: Option<SsdPart>,
    pub remote: Vec<RemotePart>,
    /// Pool slots a staged load reserves (one per remote block); 0 otherwise.
    pub staging_slots: usize,
    pub blocks: usize,
    /// Bytes the load moves for this rank.
    pub bytes: u64,
}

/// What a plan is built from: the lease share's blocks (as addresses of whole host blocks:
/// local pool slots, and each owner segment's blocks in the owner's memory; SSD blocks by
/// their positions in the local prefix), the rank's KV and the destination blocks the
/// engine gave, in prefix order.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    pub shape: &'a KvShape,
    pub layout: &'a KvLayout,
    pub rank: u32,
    /// The RAM blocks of the local prefix, in order.
    pub local: &'a [u64],
    /// Positions in the local prefix (of `local.len() + ssd_at.len()` blocks) of its SSD
    /// blocks, increasing; the RAM blocks fill the other positions in order.
    pub ssd_at: &'a [usize],
    pub remote: &'a [Vec<u64>],
    pub direct: bool,
    pub dest: &'a [u32],
    /// Smallest layer group ([`MIN_LAYER_GROUP_BYTES`] unless a test says otherwise).
    pub min_group_bytes: u64,
    /// One batch per layer (the engine's forward waits layer by layer and runs each layer
    /// as soon as it lands), whatever its size; block-contiguous KV stays one batch.
    pub per_layer: bool,
}

/// Why a plan cannot be built; nothing has been consumed when it is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    #[error("the lease holds {leased} blocks, {given} destination blocks given")]
    BlockCount { leased: usize, given: usize },
    #[error("SSD block position {at} is out of order or past the local prefix of {local} blocks")]
    SsdPosition { at: usize, local: usize },
}

/// Splits `layers` into runs covering every layer once, in order: one run where the whole
/// load (each layer moving `bytes_per_layer`) is smaller than `min_bytes`; otherwise layer 0
/// alone, then the other layers in at most [`REST_GROUPS`] near-equal runs of at least
/// `min_bytes` (one where they are fewer bytes than that).
pub fn layer_groups(layers: u32, bytes_per_layer: u64, min_bytes: u64) -> Vec<Range<u32>> {
    if layers == 0 {
        return Vec::new();
    }
    let total = u64::from(layers).saturating_mul(bytes_per_layer);
    if layers == 1 || total < min_bytes {
        return std::iter::once(0..layers).collect();
    }
    let rest = layers - 1;
    let rest_bytes = u64::from(rest).saturating_mul(bytes_per_layer);
    let parts = (rest_bytes / min_bytes.max(1)).clamp(1, u64::from(REST_GROUPS));
    // At most REST_GROUPS and at most `rest`: fits u32.
    let parts = u32::try_from(parts).unwrap_or(1).min(rest);
    let mut out: Vec<Range<u32>> = std::iter::once(0..1).collect();
    let mut start = 1;
    for i in 0..parts {
        let len = rest / parts + u32::from(i < rest % parts);
        out.push(start..start + len);
        start += len;
    }
    out
}

impl LoadPlan {
    pub fn build(inp: PlanInput<'_>) -> Result<Self, PlanError> {
        let remote_blocks: usize = inp.remote.iter().map(Vec::len).sum();
        let n_local = inp.local.len() + inp.ssd_at.len();
        let leased = n_local + remote_blocks;
        if inp.dest.len() != leased {
            return Err(PlanError::BlockCount {
                leased,
                given: inp.dest.len(),
            });
        }
        let mut prev = None;
        for &at in inp.ssd_at {
            if at >= n_local || prev.is_some_and(|p| at <= p) {
                return Err(PlanError::SsdPosition { at, local: n_local });
            }
            prev = Some(at);
        }
        let shape = inp.shape;
        let layers = shape.layers();
        let sc = Scatter::new(shape, inp.layout, inp.rank);
        let h2d = CopyDirection::HostToDevice;
        let (local_dest, remote_dest) = inp.dest.split_at(n_local);
        // Split the local prefix's destinations between its RAM and SSD blocks.
        let mut ram_dest = Vec::with_capacity(inp.local.len());
        let mut ssd_dest = Vec::with_capacity(inp.ssd_at.len());
        let mut next_ssd = inp.ssd_at.iter().peekable();
        for (at, &d) in local_dest.iter().enumerate() {
            if next_ssd.next_if_eq(&&at).is_some() {
                ssd_dest.push(d);
            } else {
                ram_dest.push(d);
            }
        }
        let pairs: Vec<(u64, u32)> = inp.local.iter().copied().zip(ram_dest).collect();
        let bytes_per_layer =
            shape.segment_bytes() * u64::from(shape.segments()) * pairs.len() as u64;
        let local = if pairs.is_empty() {
            Vec::new()
        } else if sc.block_contiguous() {
            // One copy per block (cross-layer KV): splitting by layer would undo that, so
            // the prefix is one batch and every layer lands with it.
            let mut list = CopyList::with_capacity(pairs.len());
            for &(slot, block) in &pairs {
                sc.push_block(&mut list, h2d, slot, block);
            }
            vec![LayerBatch {
                layers: 0..layers,
                list,
            }]
        } else {
            let groups = if inp.per_layer {
                (0..layers).map(|l| l..l + 1).collect()
            } else {
                layer_groups(layers, bytes_per_layer, inp.min_group_bytes)
            };
            groups
                .into_iter()
                .map(|g| {
                    let n = (g.end - g.start) as usize * pairs.len() * shape.segments() as usize;
                    let mut list = CopyList::with_capacity(n);
                    sc.push_layers(&mut list, h2d, g.clone(), &pairs);
                    LayerBatch { layers: g, list }
                })
                .collect()
        };
        let mut remote = Vec::with_capacity(inp.remote.len());
        let mut at = 0;
        for (segment, blocks) in inp.remote.iter().enumerate() {
            let dest = remote_dest[at..at + blocks.len()].to_vec();
            at += blocks.len();
            let direct = inp.direct.then(|| {
                let mut list = CopyList::with_capacity(blocks.len() * sc.copies_per_block());
                for (&slot, &block) in blocks.iter().zip(&dest) {
                    sc.push_block(&mut list, h2d, slot, block);
                }
                list
            });
            remote.push(RemotePart {
                segment,
                dest,
                direct,
            });
        }
        let path = match (remote_blocks, inp.direct) {
            (0, _) => LoadPath::Local,
            (_, true) => LoadPath::Direct,
            (_, false) => LoadPath::Staged,
        };
        let ssd = (!ssd_dest.is_empty()).then(|| SsdPart {
            staging_slots: ssd_dest.len().min(SSD_CHUNK * SSD_STAGING_CHUNKS),
            chunk: SSD_CHUNK,
            dest: ssd_dest,
        });
        Ok(Self {
            path,
            layers,
            local,
            ssd,
            remote,
            staging_slots: if path == LoadPath::Staged {
                remote_blocks
            } else {
                0
            },
            blocks: leased,
            bytes: leased as u64 * shape.rank_bytes(),
        })
    }

    pub fn remote_blocks(&self) -> usize {
        self.remote.iter().map(|r| r.dest.len()).sum()
    }

    pub fn ssd_blocks(&self) -> usize {
        self.ssd.as_ref().map_or(0, |s| s.dest.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_gpu::{GroupKind, KvLayoutSpec, LayerLayout};

    const SEG: u64 = 1024;

    fn kv(layers: u32, blocks: u32) -> (KvShape, KvLayout) {
        let shape = KvShape::new(layers, 2, 2, SEG).unwrap();
        let plane = SEG * u64::from(blocks);
        let layout = KvLayout::new(
            KvLayoutSpec {
                kind: GroupKind::Attention,
                layers: (0..layers)
                    .map(|l| LayerLayout::Split {
                        k_base: (1 << 30) + u64::from(l) * 2 * plane,
                        v_base: (1 << 30) + (u64::from(l) * 2 + 1) * plane,
                    })
                    .collect(),
                block_stride: SEG,
                num_blocks: blocks,
                view_offset: 0,
            },
            &shape,
        )
        .unwrap();
        (shape, layout)
    }

    fn input<'a>(
        shape: &'a KvShape,
        layout: &'a KvLayout,
        local: &'a [u64],
        remote: &'a [Vec<u64>],
        direct: bool,
        dest: &'a [u32],
    ) -> PlanInput<'a> {
        PlanInput {
            shape,
            layout,
            rank: 1,
            local,
            ssd_at: &[],
            remote,
            direct,
            dest,
            min_group_bytes: 4 * SEG,
            per_layer: false,
        }
    }

    #[test]
    fn layer_groups_cover_every_layer_once_in_order() {
        for layers in [1u32, 2, 3, 7, 28, 61, 512] {
            for (per_layer, min) in [(1u64, 1u64), (64 << 10, 8 << 20), (16 << 20, 8 << 20)] {
                let g = layer_groups(layers, per_layer, min);
                assert!(g.len() <= 1 + REST_GROUPS as usize);
                assert_eq!(g.first().unwrap().start, 0);
                assert_eq!(g.last().unwrap().end, layers);
                for w in g.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[1].start < w[1].end);
                }
            }
        }
        // A 28-layer model, 64 KiB per block and layer: one block or sixteen are one batch;
        // 64 blocks and more: layer 0, then two halves.
        assert_eq!(
            layer_groups(28, 64 << 10, MIN_LAYER_GROUP_BYTES),
            vec![0..28]
        );
        assert_eq!(
            layer_groups(28, 1 << 20, MIN_LAYER_GROUP_BYTES),
            vec![0..28]
        );
        for per_layer in [4u64 << 20, 16 << 20, 64 << 20] {
            assert_eq!(
                layer_groups(28, per_layer, MIN_LAYER_GROUP_BYTES),
                vec![0..1, 1..15, 15..28]
            );
        }
        // Just above the minimum: the other layers in one batch, not two below it.
        assert_eq!(
            layer_groups(28, 5 << 20 >> 2, MIN_LAYER_GROUP_BYTES),
            vec![0..1, 1..28]
        );
        // Two layers: each its own.
        assert_eq!(
            layer_groups(2, 64 << 20, MIN_LAYER_GROUP_BYTES),
            vec![0..1, 1..2]
        );
        // Overflowing sizes do not panic.
        assert_eq!(layer_groups(3, u64::MAX, 1).len(), 3);
        assert!(layer_groups(0, 1, 1).is_empty());
    }

    #[test]
    fn a_local_load_is_layer_batches_covering_each_segment_once() {
        let (shape, layout) = kv(6, 16);
        let local = [0x1000_0000, 0x2000_0000, 0x3000_0000];
        let dest = [4, 9, 1];
        let p = LoadPlan::build(input(&shape, &layout, &local, &[], false, &dest)).unwrap();
        assert_eq!(p.path, LoadPath::Local);
        assert_eq!(p.blocks, 3);
        assert_eq!(p.bytes, 3 * shape.rank_bytes());
        assert_eq!(p.staging_slots, 0);
        // 3 blocks × 2 segments × 1 KiB = 6 KiB per layer, groups of at least 4 KiB: layer
        // 0, then the other five in two batches.
        let groups: Vec<_> = p.local.iter().map(|b| b.layers.clone()).collect();
        assert_eq!(groups, vec![0..1, 1..4, 4..6]);
        let mut seen = std::collections::BTreeSet::new();
        for b in &p.local {
            assert_eq!(b.list.len(), 6 * b.layers.len());
            for op in b.list.ops() {
                // Host side: rank 1's part of one of the slots; device side: this layer.
                let slot = local
                    .iter()
                    .position(|&s| op.src >= s && op.src < s + 0x1000_0000);
                let slot = slot.unwrap();
                let within = op.src - local[slot] - shape.rank_offset(1);
                let (layer, seg) = ((within / SEG) as u32 / 2, (within / SEG) as u32 % 2);
                assert!(b.layers.contains(&layer));
                assert_eq!(op.dst, layout.segment_addr(layer, seg, dest[slot]));
                assert!(seen.insert(op.dst));
            }
        }
        assert_eq!(seen.len(), 3 * 6 * 2);
    }

    #[test]
    fn a_per_layer_load_is_one_batch_per_layer_whatever_its_size() {
        let (shape, layout) = kv(6, 16);
        let local = [0x1000_0000, 0x2000_0000, 0x3000_0000];
        let dest = [4, 9, 1];
        // The same load as above (three batches), and one block (one batch by size alone).
        for n in [3, 1] {
            let mut inp = input(&shape, &layout, &local[..n], &[], false, &dest[..n]);
            inp.per_layer = true;
            let p = LoadPlan::build(inp).unwrap();
            let groups: Vec<_> = p.local.iter().map(|b| b.layers.clone()).collect();
            assert_eq!(groups, (0..6).map(|l| l..l + 1).collect::<Vec<_>>());
            let mut seen = std::collections::BTreeSet::new();
            for b in &p.local {
                assert_eq!(b.list.len(), 2 * n);
                for op in b.list.ops() {
                    let slot = dest[..n]
                        .iter()
                        .position(|&d| {
                            (0..2).any(|seg| op.dst == layout.segment_addr(b.layers.start, seg, d))
                        })
                        .unwrap();
                    assert!(op.src >= local[slot] && op.src < local[slot] + 0x1000_0000);
                    assert!(seen.insert(op.dst));
                }
            }
            assert_eq!(seen.len(), n * 6 * 2);
        }
    }

    #[test]
    fn remote_parts_follow_the_prefix_in_order_per_owner() {
        let (shape, layout) = kv(2, 16);
        let local = [0x1000_0000];
        let remote = vec![vec![0xa000, 0xb000], vec![0xc000]];
        let dest = [3, 5, 7, 11];
        let staged =
            LoadPlan::build(input(&shape, &layout, &local, &remote, false, &dest)).unwrap();
        assert_eq!(staged.path, LoadPath::Staged);
        assert_eq!(staged.staging_slots, 3);
        assert_eq!(staged.remote_blocks(), 3);
        assert_eq!(staged.remote[0].dest, vec![5, 7]);
        assert_eq!(staged.remote[1].dest, vec![11]);
        assert_eq!(staged.remote[1].segment, 1);
        assert!(staged.remote.iter().all(|r| r.direct.is_none()));

        let direct = LoadPlan::build(input(&shape, &layout, &local, &remote, true, &dest)).unwrap();
        assert_eq!(direct.path, LoadPath::Direct);
        assert_eq!(direct.staging_slots, 0);
        let l = direct.remote[0].direct.as_ref().unwrap();
        assert_eq!(l.bytes(), 2 * shape.rank_bytes());
        // The first read starts at rank 1's part of the owner's first block.
        assert_eq!(l.ops()[0].src, 0xa000 + shape.rank_offset(1));
        assert_eq!(l.ops()[0].dst, layout.segment_addr(0, 0, 5));
    }

    #[test]
    fn a_destination_count_that_differs_from_the_lease_is_refused() {
        let (shape, layout) = kv(2, 16);
        let e = LoadPlan::build(input(
            &shape,
            &layout,
            &[1 << 20],
            &[vec![2 << 20]],
            false,
            &[1],
        ));
        assert_eq!(
            e,
            Err(PlanError::BlockCount {
                leased: 2,
                given: 1
            })
        );
    }

    /// RAM and SSD blocks alternate in the local prefix (RAM evicts a prompt's oldest
    /// blocks first); each gets the destination of its position, then the remote suffix.
    #[test]
    fn ssd_blocks_take_their_prefix_positions_then_the_remote_suffix_follows() {
        let (shape, layout) = kv(4, 32);
        let local = [0x1000_0000, 0x2000_0000, 0x3000_0000];
        let remote = vec![vec![0xa000]];
        let dest = [10, 11, 12, 13, 14, 15, 16];
        // Prefix of 6: SSD at 0, 1 and 4; RAM at 2, 3 and 5; then one remote block.
        let p = LoadPlan::build(PlanInput {
            ssd_at: &[0, 1, 4],
            ..input(&shape, &layout, &local, &remote, false, &dest)
        })
        .unwrap();
        assert_eq!(p.path, LoadPath::Staged);
        assert_eq!((p.blocks, p.ssd_blocks(), p.remote_blocks()), (7, 3, 1));
        assert_eq!(p.bytes, 7 * shape.rank_bytes());
        let ssd = p.ssd.as_ref().unwrap();
        assert_eq!(ssd.dest, vec![10, 11, 14]);
        assert_eq!((ssd.chunk, ssd.staging_slots), (SSD_CHUNK, 3));
        assert_eq!(p.remote[0].dest, vec![16]);
        // RAM copies go to 12, 13 and 15, slot by slot in order.
        let want = [12, 13, 15];
        let mut ops = 0;
        for op in p.local.iter().flat_map(|b| b.list.ops()) {
            let slot = local
                .iter()
                .position(|&s| op.src >= s && op.src < s + 0x1000_0000)
                .unwrap();
            let seg = ((op.src - local[slot] - shape.rank_offset(1)) / SEG) as u32;
            assert_eq!(op.dst, layout.segment_addr(seg / 2, seg % 2, want[slot]));
            ops += 1;
        }
        assert_eq!(ops, 3 * 4 * 2);

        // Only SSD blocks: a local load with no RAM batches; a long run borrows one ring.
        let dest: Vec<u32> = (0..100).collect();
        let at: Vec<usize> = (0..100).collect();
        let p = LoadPlan::build(PlanInput {
            ssd_at: &at,
            ..input(&shape, &layout, &[], &[], false, &dest)
        })
        .unwrap();
        assert_eq!(p.path, LoadPath::Local);
        assert!(p.local.is_empty());
        assert_eq!(
            p.ssd.as_ref().unwrap().staging_slots,
            SSD_CHUNK * SSD_STAGING_CHUNKS
        );
    }

    #[test]
    fn ssd_positions_out_of_order_or_past_the_prefix_are_refused() {
        let (shape, layout) = kv(2, 16);
        let local = [1 << 20];
        for (at, bad) in [(&[1usize, 1][..], 1), (&[2, 1][..], 1), (&[0, 3][..], 3)] {
            let e = LoadPlan::build(PlanInput {
                ssd_at: at,
                ..input(&shape, &layout, &local, &[], false, &[1, 2, 3])
            });
            assert_eq!(e, Err(PlanError::SsdPosition { at: bad, local: 3 }));
        }
    }

    #[test]
    fn cross_layer_prefixes_are_one_copy_per_block_in_one_batch() {
        let shape = KvShape::new(8, 2, 2, SEG).unwrap();
        let layout =
            KvLayout::new(KvLayoutSpec::cross_layer(1 << 30, 8, 2, 32, SEG), &shape).unwrap();
        let local = [0x10_0000, 0x20_0000, 0x30_0000];
        for per_layer in [false, true] {
            let mut inp = input(&shape, &layout, &local, &[], false, &[2, 3, 9]);
            // Asked for layer by layer, it still copies whole blocks: every layer at once.
            inp.per_layer = per_layer;
            let p = LoadPlan::build(inp).unwrap();
            assert_eq!(p.local.len(), 1);
            assert_eq!(p.local[0].layers, 0..8);
            assert_eq!(p.local[0].list.len(), 3);
        }
    }
}
