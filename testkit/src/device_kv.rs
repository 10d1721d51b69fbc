//! Device KV with canaries in the layouts engines allocate.

use std::sync::Arc;

use kvferry_client::{PlanePlacement, RegionLayer};
use kvferry_gpu::{
    Device, DeviceBuffer, DeviceError, GroupKind, KvLayoutSpec, KvShape, LayerLayout,
};
use kvferry_proto::api::RegisterInstance;
use kvferry_proto::InstanceId;

use crate::pattern::{fill_segment, CANARY};

/// How a test lays out its device KV: the layouts engines allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    /// K and V in separate buffers per layer.
    Split,
    /// One buffer per layer, K plane then V plane (vLLM FlashAttention; with a one-segment
    /// shape, MLA).
    Contiguous,
    /// One buffer per layer, K and V interleaved per block (FlashInfer); the block stride
    /// holds both.
    FlashInfer,
    /// One buffer for every layer, a block holding each layer's K and V in turn (vLLM's
    /// cross-layer KV); the block stride holds the whole block.
    CrossLayer,
}

/// Device KV for one rank, allocated by us, every byte set to [`CANARY`].
pub struct DeviceKv {
    pub device: Arc<dyn Device>,
    pub shape: KvShape,
    pub kind: KvKind,
    pub num_blocks: u32,
    pub block_stride: u64,
    pub view_offset: u64,
    /// Where each K, V or KV plane buffer lies (with its canary tail).
    buffers: Vec<Span>,
    plane: u64,
    /// What owns the memory of `buffers`.
    _memory: Vec<DeviceBuffer>,
}

/// One plane buffer of a [`DeviceKv`]: `len` bytes at device address `ptr`.
#[derive(Clone, Copy, Debug)]
struct Span {
    ptr: u64,
    len: u64,
}

impl Span {
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> u64 {
        self.len
    }
}

/// Bytes of canary after each plane, so a write past the last block is caught.
const TAIL: u64 = 4096;

impl DeviceKv {
    pub fn alloc(
        device: Arc<dyn Device>,
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let dev = Arc::clone(&device);
        Self::alloc_with(
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            |len| dev.alloc(len),
        )
    }

    /// [`DeviceKv::alloc`] with each buffer's memory from `alloc(bytes)`.
    pub(crate) fn alloc_with(
        device: Arc<dyn Device>,
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
        mut alloc: impl FnMut(u64) -> Result<DeviceBuffer, DeviceError>,
    ) -> Result<Self, DeviceError> {
        let (count, per_buffer) =
            Self::buffers_needed(shape, kind, num_blocks, block_stride, view_offset);
        let memory = (0..count)
            .map(|_| alloc(per_buffer))
            .collect::<Result<Vec<_>, _>>()?;
        let spans = memory
            .iter()
            .map(|b| Span {
                ptr: b.ptr(),
                len: b.len(),
            })
            .collect();
        Self::over(
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            spans,
            memory,
        )
    }

    /// Split K/V planes one after another in a single allocation (block stride = one
    /// segment), as an engine worker that hands over one CUDA IPC handle has them.
    pub fn alloc_in_one(
        device: Arc<dyn Device>,
        shape: KvShape,
        num_blocks: u32,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let memory = device.alloc(Self::in_one_bytes(shape, num_blocks, view_offset))?;
        Self::in_one(device, memory, shape, num_blocks, view_offset)
    }

    /// Bytes of memory [`DeviceKv::in_one`] lays a KV of this geometry out in.
    pub fn in_one_bytes(shape: KvShape, num_blocks: u32, view_offset: u64) -> u64 {
        let (count, per) = Self::buffers_needed(
            shape,
            KvKind::Split,
            num_blocks,
            shape.segment_bytes(),
            view_offset,
        );
        u64::from(count) * per
    }

    /// Split K/V planes one after another in `memory` (block stride = one segment).
    pub fn in_one(
        device: Arc<dyn Device>,
        memory: DeviceBuffer,
        shape: KvShape,
        num_blocks: u32,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let stride = shape.segment_bytes();
        let (count, per) =
            Self::buffers_needed(shape, KvKind::Split, num_blocks, stride, view_offset);
        let spans = (0..u64::from(count))
            .map(|i| Span {
                ptr: memory.ptr() + i * per,
                len: per,
            })
            .collect();
        Self::over(
            device,
            shape,
            KvKind::Split,
            num_blocks,
            stride,
            view_offset,
            spans,
            vec![memory],
        )
    }

    /// Where the first plane buffer starts (the allocation of [`DeviceKv::alloc_in_one`]).
    pub fn base(&self) -> u64 {
        self.buffers.first().map_or(0, |b| b.ptr)
    }

    /// [`DeviceKv::spec`] with every address made an offset from `base`.
    pub fn spec_from(&self, base: u64) -> KvLayoutSpec {
        let mut spec = self.spec();
        for layer in &mut spec.layers {
            match layer {
                LayerLayout::Split { k_base, v_base } => {
                    *k_base -= base;
                    *v_base -= base;
                }
                LayerLayout::Contiguous { base: b, .. } => *b -= base,
            }
        }
        spec
    }

    /// How many plane buffers of how many bytes a KV of this geometry takes.
    fn buffers_needed(
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
    ) -> (u32, u64) {
        let plane = u64::from(num_blocks) * block_stride;
        match kind {
            KvKind::Split => (
                shape.layers() * shape.segments(),
                view_offset + plane + TAIL,
            ),
            KvKind::Contiguous => (
                shape.layers(),
                view_offset + u64::from(shape.segments()) * plane + TAIL,
            ),
            KvKind::FlashInfer => (shape.layers(), view_offset + plane + TAIL),
            KvKind::CrossLayer => (1, view_offset + plane + TAIL),
        }
    }

    /// The KV over plane buffers `spans` (owned by `memory`), every byte set to the canary.
    #[allow(clippy::too_many_arguments)]
    fn over(
        device: Arc<dyn Device>,
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
        spans: Vec<Span>,
        memory: Vec<DeviceBuffer>,
    ) -> Result<Self, DeviceError> {
        let kv = Self {
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            buffers: spans,
            plane: u64::from(num_blocks) * block_stride,
            _memory: memory,
        };
        kv.reset()?;
        Ok(kv)
    }

    /// The layout to register (the view starts `view_offset` into each buffer).
    pub fn spec(&self) -> KvLayoutSpec {
        let layers = (0..self.shape.layers() as usize)
            .map(|l| match self.kind {
                KvKind::Split => LayerLayout::Split {
                    k_base: self.buffers[2 * l].ptr(),
                    v_base: self.buffers[2 * l + 1].ptr(),
                },
                KvKind::Contiguous => LayerLayout::Contiguous {
                    base: self.buffers[l].ptr(),
                    kv_stride: self.plane,
                },
                KvKind::FlashInfer => LayerLayout::Contiguous {
                    base: self.buffers[l].ptr(),
                    kv_stride: self.shape.segment_bytes(),
                },
                KvKind::CrossLayer => LayerLayout::Contiguous {
                    base: self.buffers[0].ptr()
                        + l as u64 * u64::from(self.shape.segments()) * self.shape.segment_bytes(),
                    kv_stride: self.shape.segment_bytes(),
                },
            })
            .collect();
        KvLayoutSpec {
            kind: match self.kind {
                KvKind::CrossLayer => GroupKind::CrossLayer,
                _ => GroupKind::Attention,
            },
            layers,
            block_stride: self.block_stride,
            num_blocks: self.num_blocks,
            view_offset: self.view_offset,
        }
    }

    /// Buffer index and byte offset of one segment of one block.
    fn locate(&self, layer: u32, seg: u32, block: u32) -> (usize, u64) {
        let at = self.view_offset + u64::from(block) * self.block_stride;
        let seg_bytes = self.shape.segment_bytes();
        match self.kind {
            KvKind::Split => ((layer * self.shape.segments() + seg) as usize, at),
            KvKind::Contiguous => (layer as usize, at + u64::from(seg) * self.plane),
            KvKind::FlashInfer => (layer as usize, at + u64::from(seg) * seg_bytes),
            KvKind::CrossLayer => (
                0,
                at + u64::from(layer * self.shape.segments() + seg) * seg_bytes,
            ),
        }
    }

    /// Each layer's planes as (buffer index, offset of block 0 inside that buffer, the view
    /// offset included): the regions of a registration where every buffer is its own memory.
    pub fn placements(&self) -> Vec<RegionLayer> {
        let at = |layer, seg| {
            let (buffer, offset) = self.locate(layer, seg, 0);
            PlanePlacement {
                region: buffer as u32,
                offset,
            }
        };
        (0..self.shape.layers())
            .map(|l| RegionLayer {
                k: at(l, 0),
                v: (self.shape.segments() == 2).then(|| at(l, 1)),
            })
            .collect()
    }

    /// The bytes of each buffer.
    pub fn buffer_lens(&self) -> Vec<u64> {
        self.buffers.iter().map(Span::len).collect()
    }

    /// Where each buffer starts.
    pub fn buffer_ptrs(&self) -> Vec<u64> {
        self.buffers.iter().map(Span::ptr).collect()
    }

    /// The registration of this KV as `rank` of `instance` (model `model`, dtype bf16), its
    /// planes at the device addresses of [`DeviceKv::spec`].
    pub fn register_request(
        &self,
        instance: &InstanceId,
        model: &str,
        rank: u32,
    ) -> RegisterInstance {
        RegisterInstance {
            instance: instance.clone(),
            model: model.into(),
            dtype: "bf16".into(),
            shape: self.shape,
            rank,
            device: self.device.ordinal(),
            layout: self.spec(),
        }
    }

    /// Sets every byte back to [`CANARY`] (between loads that reuse the destinations).
    pub fn reset(&self) -> Result<(), DeviceError> {
        for b in &self.buffers {
            self.device
                .write(b.ptr(), &vec![CANARY; b.len() as usize])?;
        }
        Ok(())
    }

    /// Checks that every byte outside the segments of `blocks` still holds [`CANARY`]
    /// (after a failed load: whatever it wrote, it wrote only into its destinations).
    pub fn untouched_outside(&self, blocks: &[u32]) -> Result<(), String> {
        let seg = self.shape.segment_bytes() as usize;
        for (bi, b) in self.buffers.iter().enumerate() {
            let mut img = vec![0u8; b.len() as usize];
            self.device
                .read(b.ptr(), &mut img)
                .map_err(|e| e.to_string())?;
            for &dst in blocks {
                for layer in 0..self.shape.layers() {
                    for s in 0..self.shape.segments() {
                        let (buf, off) = self.locate(layer, s, dst);
                        if buf == bi {
                            img[off as usize..off as usize + seg].fill(CANARY);
                        }
                    }
                }
            }
            if let Some(i) = img.iter().position(|x| *x != CANARY) {
                return Err(format!(
                    "buffer {bi} byte {i} written outside the destinations"
                ));
            }
        }
        Ok(())
    }

    /// Writes the pattern of `block` for `rank` into device block `dst` (to be saved).
    pub fn write_block(&self, dst: u32, block: u64, rank: u32) -> Result<(), DeviceError> {
        let mut buf = vec![0u8; self.shape.segment_bytes() as usize];
        for layer in 0..self.shape.layers() {
            for seg in 0..self.shape.segments() {
                fill_segment(&mut buf, block, rank, layer, seg);
                let (b, off) = self.locate(layer, seg, dst);
                self.device.write(self.buffers[b].ptr() + off, &buf)?;
            }
        }
        Ok(())
    }

    /// Checks every byte of every buffer: the segments of `expected` `(device block,
    /// pattern block)` hold that block's pattern for `rank`; every other byte is a canary.
    /// Returns the bytes of pattern checked.
    pub fn verify(&self, expected: &[(u32, u64)], rank: u32) -> Result<u64, String> {
        let seg = self.shape.segment_bytes() as usize;
        let mut images: Vec<Vec<u8>> = Vec::with_capacity(self.buffers.len());
        for b in &self.buffers {
            let mut img = vec![0u8; b.len() as usize];
            self.device
                .read(b.ptr(), &mut img)
                .map_err(|e| e.to_string())?;
            images.push(img);
        }
        let mut want = vec![0u8; seg];
        let mut checked = 0u64;
        for &(dst, block) in expected {
            for layer in 0..self.shape.layers() {
                for s in 0..self.shape.segments() {
                    fill_segment(&mut want, block, rank, layer, s);
                    let (b, off) = self.locate(layer, s, dst);
                    let off = off as usize;
                    let got = &images[b][off..off + seg];
                    if got != &want[..] {
                        let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                        return Err(format!(
                            "device block {dst} (pattern block {block}) layer {layer} segment {s}: \
                             byte {i} is {:#04x}, expected {:#04x}",
                            got[i], want[i]
                        ));
                    }
                    // Checked: reset to canary so the sweep below flags only stray writes.
                    images[b][off..off + seg].fill(CANARY);
                    checked += seg as u64;
                }
            }
        }
        for (bi, img) in images.iter().enumerate() {
            if let Some(i) = img.iter().position(|b| *b != CANARY) {
                return Err(format!(
                    "buffer {bi} byte {i} was overwritten ({:#04x}): a write outside the destinations",
                    img[i]
                ));
            }
        }
        Ok(checked)
    }
}
