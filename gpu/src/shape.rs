//! The shape of one token block of KV and its rank-major host layout.

use thiserror::Error;

/// Shape of a KV block: layers, tensor-parallel size, one (MLA-style KV) or two (K and V)
/// segments per layer, and the bytes of one segment for one rank.
///
/// The host layout is rank-major, `rank → layer → segment`, so one rank's part of one block is
/// one contiguous range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvShape {
    layers: u32,
    tp_size: u32,
    segments: u32,
    segment_bytes: u64,
}

#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShapeError {
    #[error("a KV shape needs at least one layer")]
    NoLayers,
    #[error("tp size must be 1..=64, got {0}")]
    TpSize(u32),
    #[error("segments per layer must be 1 (KV) or 2 (K and V), got {0}")]
    Segments(u32),
    #[error("segment bytes must be nonzero and a multiple of 64, got {0}")]
    SegmentBytes(u64),
    #[error("block of {layers} layers x {segments} segments x {segment_bytes} bytes x tp {tp} overflows")]
    Overflow {
        layers: u32,
        segments: u32,
        segment_bytes: u64,
        tp: u32,
    },
}

/// Largest TP world a lease can track (one bit per rank).
pub const MAX_TP: u32 = 64;

impl KvShape {
    pub fn new(
        layers: u32,
        tp_size: u32,
        segments: u32,
        segment_bytes: u64,
    ) -> Result<Self, ShapeError> {
        if layers == 0 {
            return Err(ShapeError::NoLayers);
        }
        if tp_size == 0 || tp_size > MAX_TP {
            return Err(ShapeError::TpSize(tp_size));
        }
        if !(1..=2).contains(&segments) {
            return Err(ShapeError::Segments(segments));
        }
        if segment_bytes == 0 || !segment_bytes.is_multiple_of(64) {
            return Err(ShapeError::SegmentBytes(segment_bytes));
        }
        let total = u64::from(layers)
            .checked_mul(u64::from(segments))
            .and_then(|v| v.checked_mul(segment_bytes))
            .and_then(|v| v.checked_mul(u64::from(tp_size)))
            .filter(|v| *v <= (1 << 40));
        if total.is_none() {
            return Err(ShapeError::Overflow {
                layers,
                segments,
                segment_bytes,
                tp: tp_size,
            });
        }
        Ok(Self {
            layers,
            tp_size,
            segments,
            segment_bytes,
        })
    }

    pub fn layers(&self) -> u32 {
        self.layers
    }

    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }

    pub fn segments(&self) -> u32 {
        self.segments
    }

    pub fn segment_bytes(&self) -> u64 {
        self.segment_bytes
    }

    /// Bytes of one rank's part of one block.
    pub fn rank_bytes(&self) -> u64 {
        u64::from(self.layers) * u64::from(self.segments) * self.segment_bytes
    }

    /// Bytes of one whole host block (every rank).
    pub fn block_bytes(&self) -> u64 {
        self.rank_bytes() * u64::from(self.tp_size)
    }

    /// Offset of `rank`'s part inside a host block.
    pub fn rank_offset(&self, rank: u32) -> u64 {
        u64::from(rank) * self.rank_bytes()
    }

    /// Offset of one segment inside a host block.
    pub fn segment_offset(&self, rank: u32, layer: u32, segment: u32) -> u64 {
        self.rank_offset(rank)
            + (u64::from(layer) * u64::from(self.segments) + u64::from(segment))
                * self.segment_bytes
    }

    /// A short stable string naming the shape, used in namespace fingerprints.
    pub fn fingerprint(&self) -> String {
        format!(
            "l{}-tp{}-s{}-b{}",
            self.layers, self.tp_size, self.segments, self.segment_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_major_offsets() {
        let s = KvShape::new(4, 2, 2, 128).unwrap();
        assert_eq!(s.rank_bytes(), 4 * 2 * 128);
        assert_eq!(s.block_bytes(), 2 * 4 * 2 * 128);
        assert_eq!(s.segment_offset(0, 0, 1), 128);
        assert_eq!(s.segment_offset(0, 3, 1), 7 * 128);
        // rank 1 starts right after rank 0's last segment: one contiguous range per rank
        assert_eq!(s.segment_offset(1, 0, 0), s.segment_offset(0, 3, 1) + 128);
    }

    #[test]
    fn refuses_bad_shapes() {
        assert_eq!(KvShape::new(0, 1, 2, 64), Err(ShapeError::NoLayers));
        assert_eq!(KvShape::new(1, 0, 2, 64), Err(ShapeError::TpSize(0)));
        assert_eq!(KvShape::new(1, 65, 2, 64), Err(ShapeError::TpSize(65)));
        assert_eq!(KvShape::new(1, 1, 3, 64), Err(ShapeError::Segments(3)));
        assert_eq!(
            KvShape::new(1, 1, 2, 100),
            Err(ShapeError::SegmentBytes(100))
        );
        assert!(matches!(
            KvShape::new(1 << 20, 64, 2, 1 << 20),
            Err(ShapeError::Overflow { .. })
        ));
    }
}
