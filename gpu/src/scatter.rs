//! The one place that scatters a host block over a rank's layers and segments: loads (host
//! slot → device KV), saves and puts (device KV → host slot) and remote reads (an owner's
//! slot → device KV) all build their copy lists here.
//!
//! A host block is rank-major (`rank → layer → segment`), so one rank's part of it is one
//! contiguous range; the device side is wherever the rank's [`KvLayout`] puts each layer.

use std::ops::Range;

use crate::{
    CopyBatch, CopyDirection, CopyList, Device, DeviceSpan, HostSpan, KvLayout, KvShape, SpanError,
};

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

impl Scatter<'_> {
    /// Every segment's device plane (all blocks of it), in host order, checked by `device`:
    /// one query per plane for a whole load, where one per copy would cost microseconds each
    /// on CUDA. [`Self::push_block_into`] cuts its copies out of them.
    pub fn device_planes<D: Device + ?Sized>(
        &self,
        device: &D,
    ) -> Result<Vec<DeviceSpan>, SpanError> {
        let blocks = u64::from(self.layout.num_blocks().max(1));
        // Cannot overflow: the layout was validated with these planes.
        let extent = (blocks - 1) * self.layout.block_stride() + self.shape.segment_bytes();
        self.table
            .iter()
            .map(|&(_, dev)| DeviceSpan::new(device, dev, extent))
            .collect()
    }

    /// [`Self::push_block`] into a batch of checked spans: the slot is the bytes at `slot` in
    /// `host` (the block's start, all ranks), the device side sub-spans of `planes`, from
    /// [`Self::device_planes`]. Nothing is pushed where a copy falls outside its span.
    pub fn push_block_into(
        &self,
        batch: &mut CopyBatch,
        host: &HostSpan,
        slot: u64,
        planes: &[DeviceSpan],
        block: u32,
    ) -> Result<(), SpanError> {
        if planes.len() != self.table.len() {
            return Err(SpanError::PlaneCount {
                want: self.table.len(),
                given: planes.len(),
            });
        }
        let len = self.shape.segment_bytes();
        let at = u64::from(block).saturating_mul(self.layout.block_stride());
        // Every span is checked before anything is pushed, so a refused block leaves the
        // batch as it was.
        if !crate::span::inside(host.len(), slot, self.shape.block_bytes()) {
            return Err(SpanError::OutsideSpan {
                side: "host",
                span_len: host.len(),
                offset: slot,
                len: self.shape.block_bytes(),
            });
        }
        for plane in planes {
            plane.sub(at, len)?;
        }
        for (&(off, _), plane) in self.table.iter().zip(planes) {
            batch.push_within(host, slot + off, plane.sub(at, len)?)?;
        }
        Ok(())
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

    /// Host memory owned through a raw pointer, as a pool is.
    struct Raw(*mut [u8]);
    // SAFETY: owned by this value alone and only touched through raw pointers.
    unsafe impl Send for Raw {}
    // SAFETY: as above.
    unsafe impl Sync for Raw {}
    // SAFETY: a live heap allocation freed only in `Drop`, read back only with no batch in
    // flight.
    unsafe impl crate::HostMemory for Raw {
        fn span(&self) -> (u64, u64) {
            (self.0 as *mut u8 as u64, self.0.len() as u64)
        }
    }
    impl Drop for Raw {
        fn drop(&mut self) {
            // SAFETY: from `Box::into_raw`, freed once.
            drop(unsafe { Box::from_raw(self.0) });
        }
    }

    #[test]
    fn a_block_into_a_batch_is_the_block_scatter_over_checked_planes() {
        let dev = crate::HostDevice::new(0);
        let (layers, blocks, seg) = (3u32, 8u32, 64u64);
        let plane = seg * u64::from(blocks);
        let kv = dev.alloc(2 * u64::from(layers) * plane + 4096).unwrap();
        dev.write(kv.ptr(), &vec![0xa5; kv.len() as usize]).unwrap();
        let shape = KvShape::new(layers, 2, 2, seg).unwrap();
        let layout = KvLayout::new(
            KvLayoutSpec {
                kind: GroupKind::Attention,
                layers: (0..u64::from(layers))
                    .map(|l| LayerLayout::Split {
                        k_base: kv.ptr() + 2 * l * plane,
                        v_base: kv.ptr() + (2 * l + 1) * plane,
                    })
                    .collect(),
                block_stride: seg,
                num_blocks: blocks,
                view_offset: 0,
            },
            &shape,
        )
        .unwrap();
        let sc = Scatter::new(&shape, &layout, 1);
        let planes = sc.device_planes(&*dev).unwrap();
        assert_eq!(planes.len(), sc.copies_per_block());
        // Two slots of host memory, filled with a pattern.
        let slots: Box<[u8]> = (0..2 * shape.block_bytes())
            .map(|i| (i % 241) as u8)
            .collect();
        let want = slots.to_vec();
        let mem: std::sync::Arc<dyn crate::HostMemory> =
            std::sync::Arc::new(Raw(Box::into_raw(slots)));
        let host = HostSpan::new(mem, 0, 2 * shape.block_bytes()).unwrap();
        let mut batch = CopyBatch::new(CopyDirection::HostToDevice);
        let mut list = CopyList::default();
        for (slot, block) in [(0, 5), (shape.block_bytes(), 2)] {
            sc.push_block_into(&mut batch, &host, slot, &planes, block)
                .unwrap();
            sc.push_block(
                &mut list,
                CopyDirection::HostToDevice,
                host.addr() + slot,
                block,
            );
        }
        assert_eq!(batch.list(), &list, "the same copies as the raw scatter");
        // A slot past the span, a block past the planes, planes of another scatter: refused,
        // nothing pushed.
        let before = batch.list().clone();
        assert!(sc
            .push_block_into(&mut batch, &host, shape.block_bytes() + 1, &planes, 0)
            .is_err());
        assert!(sc
            .push_block_into(&mut batch, &host, 0, &planes, blocks)
            .is_err());
        assert!(matches!(
            sc.push_block_into(&mut batch, &host, 0, &planes[1..], 0),
            Err(SpanError::PlaneCount { want: 6, given: 5 })
        ));
        assert_eq!(batch.list(), &before);
        batch.submit(&*dev, None).unwrap().wait_blocking().unwrap();
        let mut back = vec![0u8; kv.len() as usize];
        dev.read(kv.ptr(), &mut back).unwrap();
        let mut expect = vec![0xa5u8; kv.len() as usize];
        for op in list.ops() {
            let (s, d) = (
                (op.src - host.addr()) as usize,
                (op.dst - kv.ptr()) as usize,
            );
            expect[d..d + op.len as usize].copy_from_slice(&want[s..s + op.len as usize]);
        }
        assert!(
            back == expect,
            "bytes land where the scatter says, canaries elsewhere"
        );
        // Planes outside device memory are refused when checked.
        let off = KvLayout::new(KvLayoutSpec::cross_layer(0x40_0000, 3, 2, 8, 64), &shape);
        if let Ok(off) = off {
            assert!(Scatter::new(&shape, &off, 0).device_planes(&*dev).is_err());
        }
    }
}
