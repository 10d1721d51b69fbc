//! The one place that scatters a host block over a rank's layers and segments: loads (host
//! slot → device KV), saves and puts (device KV → host slot) and remote reads (an owner's
//! slot → device KV) all build their copy lists here.
//!
//! A host block is rank-major (`rank → layer → segment`), so one rank's part of it is one
//! contiguous range; the device side is wherever the rank's [`KvLayout`] puts each layer.

use std::ops::Range;

use crate::{CopyDirection, CopyList, KvLayout, KvShape};

/// One rank's scatter between host block slots and its device KV.
#[derive(Clone, Debug)]
pub struct Scatter<'a> {
    shape: &'a KvShape,
    layout: &'a KvLayout,
    /// `(host offset in a slot, device address in block 0)` of every segment, in host order
    /// (layer by layer): a copy is an entry plus a slot and a block offset, so the layout is
    /// asked once per segment here rather than once per copy (a 1024-block load of 28
    /// layers is 57344 copies).
    table: Vec<(u64, u64)>,
}

impl<'a> Scatter<'a> {
    pub fn new(shape: &'a KvShape, layout: &'a KvLayout, rank: u32) -> Self {
        let segs = shape.segments();
        let mut table = Vec::with_capacity((shape.layers() * segs) as usize);
        for l in 0..shape.layers() {
            for s in 0..segs {
                table.push((
                    shape.segment_offset(rank, l, s),
                    layout.segment_addr(l, s, 0),
                ));
            }
        }
        Self {
            shape,
            layout,
            table,
        }
    }

    /// Copies per block before merging (`layers × segments`).
    pub fn copies_per_block(&self) -> usize {
        self.table.len()
    }

    /// Whether one block's rank part maps onto one contiguous device range in host order
    /// (vLLM's cross-layer blocks): then a block is one copy, and only block-major order
    /// keeps it so.
    pub fn block_contiguous(&self) -> bool {
        let first = self.table.first().map_or(0, |&(_, dev)| dev);
        let seg = self.shape.segment_bytes();
        (0u64..)
            .zip(&self.table)
            .all(|(i, &(_, dev))| dev == first + i * seg)
    }

    /// Appends the copies of `segments` (a range of [`Self::table`]) between host block
    /// `slot` and device block `block`, in `dir`.
    fn push(
        &self,
        list: &mut CopyList,
        dir: CopyDirection,
        segments: Range<usize>,
        slot: u64,
        block: u32,
    ) {
        let len = self.shape.segment_bytes();
        let at = u64::from(block) * self.layout.block_stride();
        for &(host, dev) in &self.table[segments] {
            match dir {
                CopyDirection::HostToDevice => list.push(slot + host, dev + at, len),
                CopyDirection::DeviceToHost => list.push(dev + at, slot + host, len),
            }
        }
    }

    /// Every layer of one block, layer by layer: host slot at `slot` (the block's start, all
    /// ranks) ↔ device block `block`. Addresses on the host side may be an owner's (a remote
    /// read's source), since nothing here dereferences them.
    pub fn push_block(&self, list: &mut CopyList, dir: CopyDirection, slot: u64, block: u32) {
        self.push(list, dir, 0..self.table.len(), slot, block);
    }

    /// `layers` of every `(slot, block)` pair, block by block: one block's layers of the
    /// range are one contiguous host run (a rank's part of a slot is laid out layer by
    /// layer), so the copy path sees runs of `layers × segments` segments instead of single
    /// segments. The order inside a batch does not decide what lands first (a batch
    /// completes as a whole); long runs decide how it is copied: the copy engines take them
    /// at link speed, while runs of one segment go to the gather kernel, whose reads of
    /// host memory keep every SM busy and stall a save's device-side gather meanwhile (on
    /// the H200 a 256-block save beside such a load took 16.7 ms instead of 9.7).
    pub fn push_layers(
        &self,
        list: &mut CopyList,
        dir: CopyDirection,
        layers: Range<u32>,
        pairs: &[(u64, u32)],
    ) {
        let segs = self.shape.segments() as usize;
        let layers = layers.start.min(layers.end) as usize..layers.end as usize;
        let segments =
            (layers.start * segs).min(self.table.len())..(layers.end * segs).min(self.table.len());
        for &(slot, block) in pairs {
            self.push(list, dir, segments.clone(), slot, block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GroupKind, KvLayoutSpec, LayerLayout};

    fn split(layers: u32, blocks: u32, seg: u64) -> (KvShape, KvLayout) {
        let shape = KvShape::new(layers, 2, 2, seg).unwrap();
        let plane = seg * u64::from(blocks);
        let layout = KvLayout::new(
            KvLayoutSpec {
                kind: GroupKind::Attention,
                layers: (0..layers)
                    .map(|l| LayerLayout::Split {
                        k_base: 0x10_0000 + u64::from(l) * 2 * plane,
                        v_base: 0x10_0000 + (u64::from(l) * 2 + 1) * plane,
                    })
                    .collect(),
                block_stride: seg,
                num_blocks: blocks,
                view_offset: 0,
            },
            &shape,
        )
        .unwrap();
        (shape, layout)
    }

    #[test]
    fn a_block_covers_its_rank_part_once_in_host_order() {
        let (shape, layout) = split(3, 8, 64);
        let sc = Scatter::new(&shape, &layout, 1);
        let mut l = CopyList::default();
        sc.push_block(&mut l, CopyDirection::HostToDevice, 0x1000, 5);
        assert_eq!(l.len(), 6);
        assert_eq!(l.bytes(), shape.rank_bytes());
        // Host side: rank 1's part, contiguous and in order.
        let base = 0x1000 + shape.rank_offset(1);
        for (i, op) in l.ops().iter().enumerate() {
            assert_eq!(op.src, base + i as u64 * 64);
            assert_eq!(op.dst, layout.segment_addr(i as u32 / 2, i as u32 % 2, 5));
        }
        // The save direction is the mirror image.
        let mut d = CopyList::default();
        sc.push_block(&mut d, CopyDirection::DeviceToHost, 0x1000, 5);
        for (a, b) in l.ops().iter().zip(d.ops()) {
            assert_eq!((a.src, a.dst, a.len), (b.dst, b.src, b.len));
        }
        assert!(!sc.block_contiguous());
    }

    #[test]
    fn a_layer_range_is_one_host_run_per_block_with_the_block_scatters_bytes() {
        let (shape, layout) = split(4, 8, 64);
        let sc = Scatter::new(&shape, &layout, 0);
        let pairs = [(0x1000, 2), (0x9000, 7), (0x5000, 0)];
        let mut l = CopyList::default();
        sc.push_layers(&mut l, CopyDirection::HostToDevice, 1..3, &pairs);
        assert_eq!(l.len(), 2 * 3 * 2);
        // Block by block, each block's host side one run: layers 1..3 of its slot.
        for (i, &(slot, _)) in pairs.iter().enumerate() {
            let ops = &l.ops()[i * 4..(i + 1) * 4];
            let start = slot + shape.segment_offset(0, 1, 0);
            for (k, o) in ops.iter().enumerate() {
                assert_eq!(o.src, start + k as u64 * 64, "block {i} op {k}");
            }
        }
        // Same bytes as the block-major scatter of those layers.
        let layer_of = |dst: u64| {
            (0..4)
                .find(|&ly| (0..2).any(|s| (0..8).any(|b| layout.segment_addr(ly, s, b) == dst)))
                .unwrap()
        };
        let mut whole = CopyList::default();
        for &(slot, b) in &pairs {
            sc.push_block(&mut whole, CopyDirection::HostToDevice, slot, b);
        }
        let mut a: Vec<_> = l.ops().to_vec();
        let mut b: Vec<_> = whole
            .ops()
            .iter()
            .copied()
            .filter(|o| (1..3).contains(&layer_of(o.dst)))
            .collect();
        a.sort_by_key(|o| o.dst);
        b.sort_by_key(|o| o.dst);
        assert_eq!(a, b);
    }

    #[test]
    fn cross_layer_blocks_are_one_copy_each() {
        let shape = KvShape::new(4, 1, 2, 128).unwrap();
        let spec = KvLayoutSpec::cross_layer(0x40_0000, 4, 2, 16, 128);
        let layout = KvLayout::new(spec, &shape).unwrap();
        let sc = Scatter::new(&shape, &layout, 0);
        assert!(sc.block_contiguous());
        let mut l = CopyList::default();
        for (slot, b) in [(0x1000u64, 3u32), (0x8000, 9)] {
            sc.push_block(&mut l, CopyDirection::HostToDevice, slot, b);
        }
        assert_eq!(l.len(), 2);
        assert_eq!(l.bytes(), 2 * shape.rank_bytes());
    }
}
