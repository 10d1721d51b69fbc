//! KV layouts: where one rank's segment of one block lives in device memory.

use thiserror::Error;

use crate::{Device, KvShape};

/// The kind of KV group an engine registers. Every attention group whose planes reduce to
/// "plane base + block stride" can be loaded; recurrent state is recognised so the refusal
/// can name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// Attention with one tensor (or K/V pair) per layer: FlashAttention, FlashInfer, MLA.
    Attention,
    /// Attention whose blocks hold every layer's K and V (vLLM's cross-layer KV): planes
    /// per layer with the whole block as stride, so one block is one contiguous range.
    CrossLayer,
    /// Recurrent / hybrid state groups (Mamba-style): refused.
    Recurrent,
}

impl GroupKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            GroupKind::Attention => "attention",
            GroupKind::CrossLayer => "cross-layer",
            GroupKind::Recurrent => "recurrent",
        }
    }
}

/// One layer's placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerLayout {
    /// K plane then V plane in one allocation, `kv_stride` bytes apart (with one segment per
    /// layer, `kv_stride` is unused).
    Contiguous { base: u64, kv_stride: u64 },
    /// K and V in separate tensors.
    Split { k_base: u64, v_base: u64 },
}

/// What an engine worker registers for one rank, before validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayoutSpec {
    pub kind: GroupKind,
    pub layers: Vec<LayerLayout>,
    /// Bytes between consecutive blocks within one plane.
    pub block_stride: u64,
    pub num_blocks: u32,
    /// Offset of the view inside each tensor (a tensor that is a view into a larger one).
    pub view_offset: u64,
}

impl KvLayoutSpec {
    /// vLLM FlashAttention: one tensor per layer shaped `(2, num_blocks, block_size, heads,
    /// head_dim)` at `bases[layer]`, the K plane then the V plane; `segment_bytes` is one
    /// block of one plane.
    pub fn flash_attn(bases: &[u64], num_blocks: u32, segment_bytes: u64) -> Self {
        let kv_stride = u64::from(num_blocks).saturating_mul(segment_bytes);
        Self::per_layer(bases, num_blocks, segment_bytes, kv_stride)
    }

    /// FlashInfer: one tensor per layer shaped `(num_blocks, 2, block_size, heads, head_dim)`:
    /// K and V interleaved per block.
    pub fn flashinfer(bases: &[u64], num_blocks: u32, segment_bytes: u64) -> Self {
        Self::per_layer(
            bases,
            num_blocks,
            segment_bytes.saturating_mul(2),
            segment_bytes,
        )
    }

    /// MLA: one tensor per layer shaped `(num_blocks, block_size, head_dim)`, one segment.
    pub fn mla(bases: &[u64], num_blocks: u32, segment_bytes: u64) -> Self {
        Self::per_layer(bases, num_blocks, segment_bytes, 0)
    }

    /// vLLM cross-layer blocks: one tensor shaped `(num_blocks, layers, segments, block_size,
    /// heads, head_dim)` at `base`. A block is one contiguous range in the order the host pool
    /// keeps a rank's part (layer, then K/V), so a load copies it in one piece.
    pub fn cross_layer(
        base: u64,
        layers: u32,
        segments: u32,
        num_blocks: u32,
        segment_bytes: u64,
    ) -> Self {
        let per_layer = u64::from(segments).saturating_mul(segment_bytes);
        Self {
            kind: GroupKind::CrossLayer,
            layers: (0..u64::from(layers))
                .map(|l| LayerLayout::Contiguous {
                    base: base.saturating_add(l.saturating_mul(per_layer)),
                    kv_stride: segment_bytes,
                })
                .collect(),
            block_stride: per_layer.saturating_mul(u64::from(layers)),
            num_blocks,
            view_offset: 0,
        }
    }

    fn per_layer(bases: &[u64], num_blocks: u32, block_stride: u64, kv_stride: u64) -> Self {
        Self {
            kind: GroupKind::Attention,
            layers: bases
                .iter()
                .map(|&base| LayerLayout::Contiguous { base, kv_stride })
                .collect(),
            block_stride,
            num_blocks,
            view_offset: 0,
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutError {
    #[error(
        "{group} KV groups cannot be loaded: only attention layouts (plane base + block stride) \
         are supported"
    )]
    Unsupported { group: &'static str },
    #[error("layout has {got} layers, the shape has {expected}")]
    LayerCount { expected: u32, got: usize },
    #[error("layout has no blocks")]
    NoBlocks,
    #[error("layout has {layers} layers; at most {max} are accepted")]
    TooManyLayers { layers: usize, max: u32 },
    #[error("layer {layer}: split K/V needs two segments per layer, the shape has {segments}")]
    SplitNeedsTwoSegments { layer: u32, segments: u32 },
    #[error("layer {layer}: block stride {stride} is smaller than a segment ({segment} bytes)")]
    StrideTooSmall {
        layer: u32,
        stride: u64,
        segment: u64,
    },
    #[error("layer {layer}: addresses overflow")]
    Overflow { layer: u32 },
    #[error("layer {first} {first_seg} overlaps layer {second} {second_seg}")]
    Overlap {
        first: u32,
        first_seg: &'static str,
        second: u32,
        second_seg: &'static str,
    },
    #[error("layer {layer} {segment}: {source}")]
    Memory {
        layer: u32,
        segment: &'static str,
        #[source]
        source: crate::DeviceError,
    },
    #[error("destination block {block} is out of range (the instance has {num_blocks} blocks)")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    #[error("destination block {block} is listed twice")]
    DuplicateBlock { block: u32 },
}

/// A validated layout for one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    layers: Vec<LayerLayout>,
    block_stride: u64,
    num_blocks: u32,
    view_offset: u64,
    segments: u32,
    segment_bytes: u64,
}

/// One segment's plane: the bytes that segment `seg` of layer `layer` spans over all blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plane {
    pub layer: u32,
    pub segment: u32,
    pub start: u64,
    pub extent: u64,
}

fn seg_name(segments: u32, seg: u32) -> &'static str {
    match (segments, seg) {
        (1, _) => "KV",
        (_, 0) => "K",
        _ => "V",
    }
}

impl KvLayout {
    /// Most layers a layout may have. Validation costs O(P log P) in the planes
    /// (`layers x segments`); real models have a few hundred layers at most.
    pub const MAX_LAYERS: u32 = 512;

    /// Validates a spec against the shape (without touching memory).
    pub fn new(spec: KvLayoutSpec, shape: &KvShape) -> Result<Self, LayoutError> {
        Self::validate(spec, shape).map(|(layout, _)| layout)
    }

    /// [`Self::new`], also returning the planes it checked.
    fn validate(spec: KvLayoutSpec, shape: &KvShape) -> Result<(Self, Vec<Plane>), LayoutError> {
        let max = Self::MAX_LAYERS;
        if spec.layers.len() > max as usize || shape.layers() > max {
            return Err(LayoutError::TooManyLayers {
                layers: spec.layers.len().max(shape.layers() as usize),
                max,
            });
        }
        if spec.kind == GroupKind::Recurrent {
            return Err(LayoutError::Unsupported {
                group: spec.kind.as_str(),
            });
        }
        if spec.layers.len() != shape.layers() as usize {
            return Err(LayoutError::LayerCount {
                expected: shape.layers(),
                got: spec.layers.len(),
            });
        }
        if spec.num_blocks == 0 {
            return Err(LayoutError::NoBlocks);
        }
        let seg = shape.segment_bytes();
        let plane = (u64::from(spec.num_blocks) - 1)
            .checked_mul(spec.block_stride)
            .and_then(|v| v.checked_add(seg));
        for (i, l) in spec.layers.iter().enumerate() {
            let layer = i as u32;
            if spec.block_stride < seg {
                return Err(LayoutError::StrideTooSmall {
                    layer,
                    stride: spec.block_stride,
                    segment: seg,
                });
            }
            if plane.is_none() {
                return Err(LayoutError::Overflow { layer });
            }
            // A K/V distance below one plane (FlashInfer interleaves K and V per block) is
            // fine as long as no byte is shared: the overlap check below decides.
            if matches!(l, LayerLayout::Split { .. }) && shape.segments() != 2 {
                return Err(LayoutError::SplitNeedsTwoSegments {
                    layer,
                    segments: shape.segments(),
                });
            }
        }
        let layout = Self {
            layers: spec.layers,
            block_stride: spec.block_stride,
            num_blocks: spec.num_blocks,
            view_offset: spec.view_offset,
            segments: shape.segments(),
            segment_bytes: seg,
        };
        let planes = layout.planes()?;
        layout.check_overlaps(&planes)?;
        Ok((layout, planes))
    }

    /// Validates the layout and checks every plane against the device's allocations.
    pub fn new_on(
        spec: KvLayoutSpec,
        shape: &KvShape,
        device: &dyn Device,
    ) -> Result<Self, LayoutError> {
        let (layout, planes) = Self::validate(spec, shape)?;
        for p in planes {
            device
                .check_range(p.start, p.extent)
                .map_err(|source| LayoutError::Memory {
                    layer: p.layer,
                    segment: seg_name(layout.segments, p.segment),
                    source,
                })?;
        }
        Ok(layout)
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    pub fn block_stride(&self) -> u64 {
        self.block_stride
    }

    pub fn segments(&self) -> u32 {
        self.segments
    }

    pub fn segment_bytes(&self) -> u64 {
        self.segment_bytes
    }

    pub fn num_layers(&self) -> u32 {
        self.layers.len() as u32
    }

    /// Start of segment `seg` of `layer` for block 0 (the view offset applied).
    fn plane_start(&self, layer: u32, seg: u32) -> Option<u64> {
        let base = match self.layers[layer as usize] {
            LayerLayout::Contiguous { base, kv_stride } => {
                base.checked_add(u64::from(seg).checked_mul(kv_stride)?)?
            }
            LayerLayout::Split { k_base, v_base } => {
                if seg == 0 {
                    k_base
                } else {
                    v_base
                }
            }
        };
        base.checked_add(self.view_offset)
    }

    /// Every plane with its byte extent.
    pub fn planes(&self) -> Result<Vec<Plane>, LayoutError> {
        let extent = (u64::from(self.num_blocks) - 1) * self.block_stride + self.segment_bytes;
        let mut out = Vec::with_capacity(self.layers.len() * self.segments as usize);
        for layer in 0..self.num_layers() {
            for segment in 0..self.segments {
                let start = self
                    .plane_start(layer, segment)
                    .filter(|s| s.checked_add(extent).is_some())
                    .ok_or(LayoutError::Overflow { layer })?;
                out.push(Plane {
                    layer,
                    segment,
                    start,
                    extent,
                });
            }
        }
        Ok(out)
    }

    /// Refuses the first pair of planes that share a byte, in O(P log P) for P planes.
    ///
    /// Every plane has the same stride `S`, segment length `L <= S` and block count `n`, so
    /// write a plane's start as `q*S + r` (`0 <= r < S`): its segment `i` covers
    /// `[r, r + L)` of stride cycle `q + i` (running past `S` into cycle `q + i + 1` when
    /// `r + L > S`). Two planes `(q, r) <= (q', r')` by residue share a byte iff
    /// - in one cycle: `r' - r < L` and `|q - q'| < n`, or
    /// - across a cycle boundary: the second runs past `S` onto the first one's next cycle,
    ///   `r + S - r' < L` and `|q - (q' + 1)| < n`.
    ///
    /// Giving each plane that runs past `S` a shadow at `(q + 1, r - S)` turns the second case
    /// into the first, so the test is: two points within `L` on the residue axis and within
    /// `n` on the cycle axis. Sweeping the points in residue order with a window of width
    /// `L`, the newcomer collides iff its nearest neighbour by cycle in the window does.
    /// (The window's cycles are distinct, or a collision was already found.)
    fn check_overlaps(&self, planes: &[Plane]) -> Result<(), LayoutError> {
        let stride = i128::from(self.block_stride);
        let seg = i128::from(self.segment_bytes);
        let blocks = i128::from(self.num_blocks);
        // (residue, cycle, plane index); a shadow has a negative residue.
        let mut points: Vec<(i128, i128, usize)> = Vec::with_capacity(planes.len() * 2);
        for (i, p) in planes.iter().enumerate() {
            let start = i128::from(p.start);
            let (q, r) = (start.div_euclid(stride), start.rem_euclid(stride));
            points.push((r, q, i));
            if r + seg > stride {
                points.push((r - stride, q + 1, i));
            }
        }
        points.sort_unstable();
        let mut window: std::collections::BTreeMap<i128, usize> = Default::default();
        let mut oldest = 0;
        for &(r, q, i) in &points {
            while points[oldest].0 <= r - seg {
                let (_, q_old, i_old) = points[oldest];
                if window.get(&q_old) == Some(&i_old) {
                    window.remove(&q_old);
                }
                oldest += 1;
            }
            let below = window.range(..=q).next_back();
            let above = window.range(q..).next();
            for (&q_other, &j) in below.into_iter().chain(above) {
                if (q_other - q).abs() < blocks && j != i {
                    return Err(self.overlap(&planes[i], &planes[j]));
                }
            }
            window.insert(q, i);
        }
        Ok(())
    }

    fn overlap(&self, a: &Plane, b: &Plane) -> LayoutError {
        let (x, y) = if (a.layer, a.segment) <= (b.layer, b.segment) {
            (a, b)
        } else {
            (b, a)
        };
        LayoutError::Overlap {
            first: x.layer,
            first_seg: seg_name(self.segments, x.segment),
            second: y.layer,
            second_seg: seg_name(self.segments, y.segment),
        }
    }

    /// Refuses destination lists with out-of-range or repeated blocks.
    pub fn check_blocks(&self, blocks: &[u32]) -> Result<(), LayoutError> {
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        for &block in blocks {
            if block >= self.num_blocks {
                return Err(LayoutError::BlockOutOfRange {
                    block,
                    num_blocks: self.num_blocks,
                });
            }
            if !seen.insert(block) {
                return Err(LayoutError::DuplicateBlock { block });
            }
        }
        Ok(())
    }

    /// Device address of segment `seg` of `layer` in block `block` (the block must have been
    /// checked with [`Self::check_blocks`]).
    pub fn segment_addr(&self, layer: u32, seg: u32, block: u32) -> u64 {
        // Validated at construction: planes do not overflow.
        self.plane_start(layer, seg).unwrap_or(0) + u64::from(block) * self.block_stride
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostDevice;

    fn shape(layers: u32, segs: u32) -> KvShape {
        KvShape::new(layers, 1, segs, 256).unwrap()
    }

    fn split_spec(layers: u32, stride: u64, blocks: u32) -> KvLayoutSpec {
        let plane = stride * u64::from(blocks);
        KvLayoutSpec {
            kind: GroupKind::Attention,
            layers: (0..u64::from(layers))
                .map(|l| LayerLayout::Split {
                    k_base: 0x10_0000 + 2 * l * plane,
                    v_base: 0x10_0000 + (2 * l + 1) * plane,
                })
                .collect(),
            block_stride: stride,
            num_blocks: blocks,
            view_offset: 0,
        }
    }

    #[test]
    fn split_and_contiguous_addresses() {
        let l = KvLayout::new(split_spec(2, 256, 8), &shape(2, 2)).unwrap();
        assert_eq!(l.segment_addr(0, 0, 0), 0x10_0000);
        assert_eq!(l.segment_addr(0, 1, 3), 0x10_0000 + 2048 + 3 * 256);
        assert_eq!(l.segment_addr(1, 1, 7), 0x10_0000 + 3 * 2048 + 7 * 256);

        let spec = KvLayoutSpec {
            kind: GroupKind::Attention,
            layers: vec![LayerLayout::Contiguous {
                base: 0x1000,
                kv_stride: 4096,
            }],
            block_stride: 512,
            num_blocks: 8,
            view_offset: 64,
        };
        let l = KvLayout::new(spec, &shape(1, 2)).unwrap();
        assert_eq!(l.segment_addr(0, 0, 2), 0x1000 + 64 + 1024);
        assert_eq!(l.segment_addr(0, 1, 2), 0x1000 + 64 + 4096 + 1024);
    }

    #[test]
    fn refuses_recurrent_by_name() {
        let mut spec = split_spec(1, 256, 4);
        spec.kind = GroupKind::Recurrent;
        let err = KvLayout::new(spec, &shape(1, 2)).unwrap_err();
        assert_eq!(err, LayoutError::Unsupported { group: "recurrent" });
        assert!(err.to_string().contains("recurrent"));
    }

    /// Every byte of `bytes` bytes from `base` belongs to exactly one (layer, segment, block),
    /// and the addresses are where the engine's tensor puts them.
    fn assert_tiles(l: &KvLayout, base: u64, bytes: u64, addr: impl Fn(u32, u32, u32) -> u64) {
        let mut seen = vec![false; (bytes / l.segment_bytes()) as usize];
        for layer in 0..l.num_layers() {
            for seg in 0..l.segments() {
                for block in 0..l.num_blocks() {
                    let a = l.segment_addr(layer, seg, block);
                    assert_eq!(
                        a,
                        addr(layer, seg, block),
                        "layer {layer} seg {seg} block {block}"
                    );
                    let i = ((a - base) / l.segment_bytes()) as usize;
                    assert!(!seen[i], "segment at {a:#x} addressed twice");
                    seen[i] = true;
                }
            }
        }
        assert!(
            seen.iter().all(|&s| s),
            "a segment of the tensor is never addressed"
        );
    }

    #[test]
    fn the_layouts_real_engines_allocate() {
        // 3 layers, 5 blocks, 128-byte segments (e.g. block_size 4 x 1 head x 16 dims x fp16).
        let (layers, blocks, seg) = (3u32, 5u32, 128u64);
        let per_layer = 2 * u64::from(blocks) * seg;
        // Per-layer tensors in separate allocations, far apart and out of order.
        let bases = [0x9_0000u64, 0x1_0000, 0x5_0000];
        let pos = |l: u32| bases[l as usize];

        // FlashAttention (2, blocks, ...): K plane, then V plane.
        let fa = KvLayout::new(
            KvLayoutSpec::flash_attn(&bases, blocks, seg),
            &shape_of(layers, 2, seg),
        )
        .unwrap();
        for (l, &b) in bases.iter().enumerate() {
            let one = KvLayout::new(
                KvLayoutSpec::flash_attn(&[b], blocks, seg),
                &shape_of(1, 2, seg),
            )
            .unwrap();
            assert_tiles(&one, b, per_layer, |_, s, k| {
                b + u64::from(s) * u64::from(blocks) * seg + u64::from(k) * seg
            });
            assert_eq!(fa.segment_addr(l as u32, 1, 2), one.segment_addr(0, 1, 2));
        }
        // FlashInfer (blocks, 2, ...): K and V interleaved per block.
        let fi = KvLayout::new(
            KvLayoutSpec::flashinfer(&bases, blocks, seg),
            &shape_of(layers, 2, seg),
        )
        .unwrap();
        assert_eq!(fi.segment_addr(2, 1, 4), pos(2) + (4 * 2 + 1) * seg);
        let one = KvLayout::new(
            KvLayoutSpec::flashinfer(&[bases[0]], blocks, seg),
            &shape_of(1, 2, seg),
        )
        .unwrap();
        assert_tiles(&one, bases[0], per_layer, |_, s, k| {
            bases[0] + (2 * u64::from(k) + u64::from(s)) * seg
        });
        // MLA (blocks, block_size, dim): one segment.
        let one = KvLayout::new(
            KvLayoutSpec::mla(&[bases[1]], blocks, seg),
            &shape_of(1, 1, seg),
        )
        .unwrap();
        assert_tiles(&one, bases[1], u64::from(blocks) * seg, |_, _, k| {
            bases[1] + u64::from(k) * seg
        });
        // Cross-layer (blocks, layers, 2, ...): a block is one contiguous range in host order.
        let cl = KvLayout::new(
            KvLayoutSpec::cross_layer(0x4000, layers, 2, blocks, seg),
            &shape_of(layers, 2, seg),
        )
        .unwrap();
        let block = u64::from(layers) * 2 * seg;
        assert_tiles(&cl, 0x4000, u64::from(blocks) * block, |l, s, k| {
            0x4000 + u64::from(k) * block + (u64::from(l) * 2 + u64::from(s)) * seg
        });
        let mut list = crate::CopyList::default();
        let shape = shape_of(layers, 2, seg);
        for (i, dst) in [3u32, 0, 4].into_iter().enumerate() {
            let src = 0x100_0000 + i as u64 * 0x10_0000;
            for layer in 0..layers {
                for s in 0..2 {
                    list.push(
                        src + shape.segment_offset(0, layer, s),
                        cl.segment_addr(layer, s, dst),
                        seg,
                    );
                }
            }
        }
        assert_eq!(list.len(), 3, "one copy per cross-layer block");
        assert_eq!(list.bytes(), 3 * block);
        // MLA cross-layer (one segment) is accepted too.
        assert!(KvLayout::new(
            KvLayoutSpec::cross_layer(0, layers, 1, blocks, seg),
            &shape_of(layers, 1, seg)
        )
        .is_ok());
        // A FlashInfer layer shifted by one segment into its neighbour's V: refused.
        let mut bad = KvLayoutSpec::flashinfer(&[0, 0], blocks, seg);
        bad.layers[1] = LayerLayout::Contiguous {
            base: seg,
            kv_stride: seg,
        };
        assert!(matches!(
            KvLayout::new(bad, &shape_of(2, 2, seg)),
            Err(LayoutError::Overlap { .. })
        ));
    }

    fn shape_of(layers: u32, segs: u32, seg: u64) -> KvShape {
        KvShape::new(layers, 1, segs, seg).unwrap()
    }

    #[test]
    fn refuses_small_strides_and_bad_counts() {
        let err = KvLayout::new(split_spec(1, 128, 4), &shape(1, 2)).unwrap_err();
        assert!(matches!(
            err,
            LayoutError::StrideTooSmall {
                layer: 0,
                stride: 128,
                segment: 256
            }
        ));
        let err = KvLayout::new(split_spec(2, 256, 4), &shape(3, 2)).unwrap_err();
        assert_eq!(
            err,
            LayoutError::LayerCount {
                expected: 3,
                got: 2
            }
        );
        let err = KvLayout::new(split_spec(1, 256, 0), &shape(1, 2)).unwrap_err();
        assert_eq!(err, LayoutError::NoBlocks);
        let err = KvLayout::new(split_spec(1, 256, 4), &shape(1, 1)).unwrap_err();
        assert!(matches!(err, LayoutError::SplitNeedsTwoSegments { .. }));
        // K and V planes 512 bytes apart with a 256-byte stride: block 2 of K is block 0 of V.
        let spec = KvLayoutSpec {
            kind: GroupKind::Attention,
            layers: vec![LayerLayout::Contiguous {
                base: 0x1000,
                kv_stride: 512,
            }],
            block_stride: 256,
            num_blocks: 4,
            view_offset: 0,
        };
        assert!(matches!(
            KvLayout::new(spec, &shape(1, 2)),
            Err(LayoutError::Overlap {
                first: 0,
                second: 0,
                ..
            })
        ));
    }

    #[test]
    fn overlap_detection_is_exact() {
        // Two layers interleaved inside one stride: legal (no byte shared).
        let spec = KvLayoutSpec {
            kind: GroupKind::Attention,
            layers: vec![
                LayerLayout::Split {
                    k_base: 0,
                    v_base: 256,
                },
                LayerLayout::Split {
                    k_base: 512,
                    v_base: 768,
                },
            ],
            block_stride: 1024,
            num_blocks: 16,
            view_offset: 0,
        };
        assert!(KvLayout::new(spec.clone(), &shape(2, 2)).is_ok());
        // Shift layer 1's K by 64 bytes into layer 0's V: refused, naming both.
        let mut bad = spec;
        bad.layers[1] = LayerLayout::Split {
            k_base: 256 + 64 + 1024 * 3,
            v_base: 768,
        };
        let err = KvLayout::new(bad, &shape(2, 2)).unwrap_err();
        assert_eq!(
            err,
            LayoutError::Overlap {
                first: 0,
                first_seg: "V",
                second: 1,
                second_seg: "K"
            }
        );
        // Same base for two layers.
        let err = KvLayout::new(
            KvLayoutSpec {
                kind: GroupKind::Attention,
                layers: vec![
                    LayerLayout::Contiguous {
                        base: 0,
                        kv_stride: 4096,
                    },
                    LayerLayout::Contiguous {
                        base: 4096 * 2 - 256,
                        kv_stride: 4096,
                    },
                ],
                block_stride: 256,
                num_blocks: 16,
                view_offset: 0,
            },
            &shape(2, 2),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                LayoutError::Overlap {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{err}"
        );
    }

    /// The pairwise definition the sweep must agree with: segments `a + i*S` and `c + j*S`
    /// (length `L`, `0 <= i, j < n`) overlap iff some `k = i - j` with `|k| < n` puts `k*S`
    /// strictly within `L` of `c - a`.
    fn pairwise_overlap(l: &KvLayout, planes: &[Plane]) -> bool {
        let (s, len, n) = (
            i128::from(l.block_stride),
            i128::from(l.segment_bytes),
            i128::from(l.num_blocks),
        );
        planes.iter().enumerate().any(|(x, a)| {
            planes[x + 1..].iter().any(|b| {
                let d = i128::from(b.start) - i128::from(a.start);
                let k0 = d.div_euclid(s);
                [k0, k0 + 1]
                    .iter()
                    .any(|&k| k.abs() < n && (k * s - d).abs() < len)
            })
        })
    }

    fn bare(stride: u64, seg: u64, blocks: u32) -> KvLayout {
        KvLayout {
            layers: Vec::new(),
            block_stride: stride,
            num_blocks: blocks,
            view_offset: 0,
            segments: 2,
            segment_bytes: seg,
        }
    }

    #[test]
    fn the_sweep_agrees_with_the_pairwise_definition() {
        // A small LCG: deterministic, no dependency.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let (mut overlapping, mut disjoint) = (0, 0);
        for _ in 0..20_000 {
            let seg = 1 + next(8);
            let stride = seg + next(24);
            let blocks = 1 + next(5) as u32;
            let l = bare(stride, seg, blocks);
            let count = 2 + next(6) as usize;
            let planes: Vec<Plane> = (0..count)
                .map(|i| Plane {
                    layer: i as u32 / 2,
                    segment: i as u32 % 2,
                    start: 1000 + next(stride * (u64::from(blocks) + 2)),
                    extent: 0,
                })
                .collect();
            let want = pairwise_overlap(&l, &planes);
            let got = l.check_overlaps(&planes).is_err();
            assert_eq!(
                got, want,
                "stride {stride} seg {seg} blocks {blocks}: {planes:?}"
            );
            if want {
                overlapping += 1;
            } else {
                disjoint += 1;
            }
        }
        assert!(
            overlapping > 1000 && disjoint > 1000,
            "{overlapping} {disjoint}"
        );
    }

    #[test]
    fn interleaved_planes_are_checked_in_n_log_n() {
        // 200,000 planes inside one stride, each a cross-layer layer: the pairwise sweep
        // compared every pair (2 x 10^10); this one sorts them.
        let planes = 200_000u64;
        let seg = 64;
        let l = bare(planes * seg, seg, 1 << 20);
        let mut ps: Vec<Plane> = (0..planes)
            .map(|i| Plane {
                layer: (i / 2) as u32,
                segment: (i % 2) as u32,
                start: i * seg,
                extent: 0,
            })
            .collect();
        let t = std::time::Instant::now();
        assert!(l.check_overlaps(&ps).is_ok());
        ps[planes as usize - 1].start -= 1;
        assert!(l.check_overlaps(&ps).is_err());
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn layer_counts_are_bounded() {
        let max = KvLayout::MAX_LAYERS;
        let seg = 256u64;
        let ok = KvLayoutSpec::cross_layer(0, max, 2, 64, seg);
        let t = std::time::Instant::now();
        assert!(KvLayout::new(ok, &shape(max, 2)).is_ok());
        assert!(
            t.elapsed() < std::time::Duration::from_secs(1),
            "{:?}",
            t.elapsed()
        );
        let over = KvLayoutSpec::cross_layer(0, max + 1, 2, 64, seg);
        assert_eq!(
            KvLayout::new(over, &shape(max + 1, 2)),
            Err(LayoutError::TooManyLayers {
                layers: max as usize + 1,
                max
            })
        );
    }

    #[test]
    fn blocks_checked() {
        let l = KvLayout::new(split_spec(1, 256, 4), &shape(1, 2)).unwrap();
        assert!(l.check_blocks(&[3, 0, 2]).is_ok());
        assert_eq!(
            l.check_blocks(&[4]),
            Err(LayoutError::BlockOutOfRange {
                block: 4,
                num_blocks: 4
            })
        );
        assert_eq!(
            l.check_blocks(&[1, 1]),
            Err(LayoutError::DuplicateBlock { block: 1 })
        );
    }

    #[test]
    fn memory_check_names_the_layer() {
        let dev = HostDevice::new(0);
        let k = dev.alloc(4 * 256).unwrap();
        let v = dev.alloc(4 * 256).unwrap();
        let spec = KvLayoutSpec {
            kind: GroupKind::Attention,
            layers: vec![
                LayerLayout::Split {
                    k_base: k.ptr(),
                    v_base: v.ptr(),
                },
                LayerLayout::Split {
                    k_base: k.ptr() + 0x100_0000_0000,
                    v_base: v.ptr() + 0x100_0000_0000,
                },
            ],
            block_stride: 256,
            num_blocks: 4,
            view_offset: 0,
        };
        let err = KvLayout::new_on(spec.clone(), &shape(2, 2), dev.as_ref()).unwrap_err();
        assert!(
            matches!(
                err,
                LayoutError::Memory {
                    layer: 1,
                    segment: "K",
                    ..
                }
            ),
            "{err}"
        );
        // A nonzero view that runs past the allocation is refused too.
        let mut one = spec;
        one.layers.truncate(1);
        one.view_offset = 64;
        let err = KvLayout::new_on(one, &shape(1, 2), dev.as_ref()).unwrap_err();
        assert!(matches!(err, LayoutError::Memory { layer: 0, .. }), "{err}");
    }
}
