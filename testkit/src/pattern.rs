//! Deterministic KV contents: every byte a load writes is predictable from (block, rank,
//! layer, segment, offset), and every byte it must not write holds [`CANARY`].

use kvferry_gpu::KvShape;

/// The byte every untouched device byte holds.
pub const CANARY: u8 = 0xA5;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with the pattern of one segment (offsets are multiples of 8 within it).
pub fn fill_segment(out: &mut [u8], block: u64, rank: u32, layer: u32, seg: u32) {
    let seed =
        mix(block ^ (u64::from(rank) << 48) ^ (u64::from(layer) << 32) ^ (u64::from(seg) << 24));
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = mix(seed ^ i as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// One rank's part of a block in host layout (layer → segment), as `PutBlocks` takes it.
pub fn rank_part(shape: &KvShape, block: u64, rank: u32) -> Vec<u8> {
    let seg = shape.segment_bytes() as usize;
    let mut out = vec![0u8; shape.rank_bytes() as usize];
    for layer in 0..shape.layers() {
        for s in 0..shape.segments() {
            let i = (layer * shape.segments() + s) as usize;
            fill_segment(&mut out[i * seg..(i + 1) * seg], block, rank, layer, s);
        }
    }
    out
}
