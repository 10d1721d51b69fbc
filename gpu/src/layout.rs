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
mod tests;
