//! How one owner segment's reads are cut into batches for a link that runs several of them
//! side by side (a tcp connection or an RC QP each, its *lanes*).
//!
//! The NIC worker gives each batch, as it is posted, to the QP with the fewest outstanding
//! reads, so every QP's share of a load is fixed then, and the load ends when the QP with the
//! largest share does. Batches of a fixed size do not divide evenly: a direct load of 64
//! blocks is 56 reads (a read gathers up to `max_sge` pieces, across block boundaries where
//! the owner's blocks are adjacent), seven batches of eight, so one QP carried 32 reads and the
//! other 24 and then sat idle for a fifth of the load. Equal batches, as many per lane,
//! keep every lane busy to the end.
//!
//! The reads themselves are cut here too ([`even_reads`]): a run of pieces that lie back to
//! back on the owner (adjacent blocks) is read as equal reads, not as reads of `max_sge`
//! pieces and a short rest, or a direct load of two blocks is a 4 MiB and a 3 MiB read and
//! ends when the larger one does, where the staged load reads 3.5 MiB on each connection.

use std::ops::Range;

/// Most blocks per pipeline step of a staged load: reads of later chunks overlap the device
/// copy of earlier ones. A segment is cut into equal chunks, as many per lane of its link
/// ([`even_batches`]); a direct load's batches are as large, for the same spread over QPs.
pub const STAGED_CHUNK: usize = 8;

/// Cuts `0..n` into consecutive, non-empty ranges of at most `max` items, as many as a
/// multiple of `lanes` where `n` allows it (else one item each), their sizes differing by at
/// most one, the larger first. Posted in order to `lanes` queues that each take the next
/// range while they hold the fewest items, every queue gets the same number of items, to
/// within one.
pub fn even_batches(n: usize, lanes: usize, max: usize) -> Vec<Range<usize>> {
    if n == 0 {
        return Vec::new();
    }
    let (lanes, max) = (lanes.max(1), max.max(1));
    let rounds = n.div_ceil(lanes).div_ceil(max);
    let count = lanes.saturating_mul(rounds).min(n);
    let (base, extra) = (n / count, n % count);
    let mut out = Vec::with_capacity(count);
    let mut at = 0;
    for i in 0..count {
        let len = base + usize::from(i < extra);
        out.push(at..at + len);
        at += len;
    }
    out
}

/// Cuts a run of pieces that are contiguous at the source (`sizes`, in bytes, in order) into
/// consecutive, non-empty reads of at most `max_pieces` pieces. As many reads as the piece
/// limit, `max_bytes` per read and `min_reads` ask for, whichever is most, rounded up to a
/// multiple of `lanes` where that is more than one read, and each piece goes to the read its
/// middle byte falls in, so reads carry equal bytes to within a piece. Pieces are never
/// split: a piece larger than `max_bytes` is a read of its own. With `min_reads` of 1, one
/// read where one is enough (a block's rank part that fits): runs of one block among others
/// stay a read each, as staged reads are.
pub fn even_reads(
    sizes: &[u64],
    lanes: usize,
    max_pieces: usize,
    max_bytes: u64,
    min_reads: usize,
) -> Vec<Range<usize>> {
    let n = sizes.len();
    if n == 0 {
        return Vec::new();
    }
    let (lanes, max_pieces, max_bytes) = (lanes.max(1), max_pieces.max(1), max_bytes.max(1));
    let total: u128 = sizes.iter().map(|&s| u128::from(s)).sum();
    let by_bytes = usize::try_from(total.div_ceil(u128::from(max_bytes))).unwrap_or(usize::MAX);
    let mut count = n.div_ceil(max_pieces).max(by_bytes).max(min_reads).max(1);
    if count > 1 {
        count = count.saturating_add(lanes - 1) / lanes * lanes;
    }
    let count = count.min(n) as u128;
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut before = 0u128;
    let mut current = 0u128;
    let mut start = 0;
    for (i, &s) in sizes.iter().enumerate() {
        // Empty pieces (total 0) are spread by index instead.
        let read = if total == 0 {
            (i as u128 * count) / n as u128
        } else {
            ((2 * before + u128::from(s)) * count / (2 * total)).min(count - 1)
        };
        if read != current {
            if i > start {
                out.push(start..i);
            }
            (start, current) = (i, read);
        }
        before += u128::from(s);
    }
    out.push(start..n);
    // Uneven pieces can crowd one read past the limit: cut it again.
    out.into_iter()
        .flat_map(|r| {
            (r.start..r.end)
                .step_by(max_pieces)
                .map(move |a| a..(a + max_pieces).min(r.end))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the NIC worker does with posted batches: each goes to the lane holding the fewest
    /// items (the first of equals).
    fn assign(batches: &[Range<usize>], lanes: usize) -> Vec<usize> {
        let mut load = vec![0usize; lanes.max(1)];
        for b in batches {
            let i = (0..load.len()).min_by_key(|&i| load[i]).unwrap_or(0);
            load[i] += b.len();
        }
        load
    }

    #[test]
    fn every_item_once_in_order_no_batch_over_max_and_lanes_even() {
        for n in 0..200 {
            for lanes in 1..6 {
                for max in 1..12 {
                    let b = even_batches(n, lanes, max);
                    let flat: Vec<usize> = b.iter().cloned().flatten().collect();
                    assert_eq!(flat, (0..n).collect::<Vec<_>>(), "n={n} lanes={lanes}");
                    assert!(b.iter().all(|r| !r.is_empty() && r.len() <= max));
                    let (lo, hi) = (
                        b.iter().map(|r| r.len()).min().unwrap_or(0),
                        b.iter().map(|r| r.len()).max().unwrap_or(0),
                    );
                    assert!(hi - lo <= 1, "n={n} lanes={lanes} max={max}: {b:?}");
                    // As many rounds over the lanes as `max` needs, or one item each.
                    let rounds = n.div_ceil(lanes).div_ceil(max);
                    if lanes * rounds <= n {
                        assert_eq!(b.len(), lanes * rounds, "n={n} lanes={lanes} max={max}");
                    } else {
                        assert_eq!(b.len(), n, "n={n} lanes={lanes} max={max}");
                    }
                    let load = assign(&b, lanes);
                    let spread = load.iter().max().unwrap() - load.iter().min().unwrap();
                    assert!(spread <= 1, "n={n} lanes={lanes} max={max}: {load:?}");
                }
            }
        }
    }

    #[test]
    fn a_direct_load_of_56_reads_splits_evenly_over_two_qps() {
        // Fixed batches of 8 gave 7 batches: 32 reads on one QP, 24 on the other.
        let fixed: Vec<Range<usize>> = (0..56).step_by(8).map(|s| s..s + 8).collect();
        assert_eq!(assign(&fixed, 2), vec![32, 24]);
        let b = even_batches(56, 2, 8);
        assert_eq!(b.len(), 8);
        assert!(b.iter().all(|r| r.len() == 7));
        assert_eq!(assign(&b, 2), vec![28, 28]);
    }

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;

    /// Bytes per lane when a run's reads are batched and posted as a direct load does.
    fn lane_bytes(sizes: &[u64], lanes: usize, max_pieces: usize) -> Vec<u64> {
        let reads = even_reads(sizes, lanes, max_pieces, 4 * MIB, 1);
        let mut load = vec![0u64; lanes];
        for b in even_batches(reads.len(), lanes, 8) {
            let bytes: u64 = reads[b].iter().flat_map(|r| &sizes[r.clone()]).sum();
            let i = (0..lanes).min_by_key(|&i| load[i]).unwrap_or(0);
            load[i] += bytes;
        }
        load
    }

    #[test]
    fn reads_cover_every_piece_once_within_limits() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for case in 0..3000 {
            let n = (next() % 300) as usize;
            let sizes: Vec<u64> = (0..n)
                .map(|_| match case % 3 {
                    0 => 64 * KIB,
                    1 => next() % (6 * MIB),
                    _ => [0, 1, 3 * MIB, 9 * MIB][(next() % 4) as usize],
                })
                .collect();
            let lanes = 1 + (next() % 4) as usize;
            let max_pieces = 1 + (next() % 70) as usize;
            let min_reads = 1 + (next() % 3) as usize;
            let r = even_reads(&sizes, lanes, max_pieces, 4 * MIB, min_reads);
            let flat: Vec<usize> = r.iter().cloned().flatten().collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>(), "case {case}");
            assert!(r.iter().all(|r| !r.is_empty() && r.len() <= max_pieces));
            // As many reads as the limits and the lanes ask for; uneven pieces may need a
            // further cut of a crowded read, at most one per `max_pieces` pieces.
            let total: u64 = sizes.iter().sum();
            let need = n
                .div_ceil(max_pieces)
                .max(total.div_ceil(4 * MIB) as usize)
                .max(min_reads);
            let count = if need > 1 {
                need.next_multiple_of(lanes).min(n)
            } else {
                need.min(n)
            };
            let slack = if case % 3 == 0 {
                0
            } else {
                n.div_ceil(max_pieces)
            };
            assert!(r.len() <= count + slack, "case {case}: {} reads", r.len());
        }
    }

    #[test]
    fn equal_pieces_make_reads_of_equal_bytes_and_as_many_per_lane() {
        for lanes in 1..5 {
            for blocks in 1..80u64 {
                // 28 layers of split K/V, 64 KiB segments: 56 pieces per 3.5 MiB block.
                let sizes = vec![64 * KIB; 56 * blocks as usize];
                let r = even_reads(&sizes, lanes, 64, 4 * MIB, 1);
                let lens: Vec<usize> = r.iter().map(|r| r.len()).collect();
                let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
                assert!(hi - lo <= 1, "lanes {lanes} blocks {blocks}: {lens:?}");
                assert!(*hi <= 64);
                if blocks > 1 {
                    assert_eq!(r.len() % lanes, 0, "lanes {lanes} blocks {blocks}");
                } else {
                    // A block's rank part that fits one read stays one.
                    assert_eq!(r.len(), 1);
                }
            }
        }
    }

    #[test]
    fn adjacent_blocks_load_every_connection_equally() {
        // The bench's direct loads over two connections, blocks adjacent at the owner: cut at
        // 64 pieces, 2 blocks were a 4 MiB and a 3 MiB read (one per connection), 4 blocks
        // 8 MiB against 6, 8 blocks 16 against 12.
        let piece = 64 * KIB;
        for (blocks, reads) in [(2u64, 2usize), (4, 4), (8, 8), (64, 56)] {
            let sizes = vec![piece; 56 * blocks as usize];
            assert_eq!(
                even_reads(&sizes, 2, 64, 4 * MIB, 1).len(),
                reads,
                "{blocks} blocks"
            );
            let load = lane_bytes(&sizes, 2, 64);
            assert_eq!(load[0], load[1], "{blocks} blocks: {load:?}");
            assert_eq!(load[0] + load[1], blocks * 56 * piece);
        }
        // One piece per block (cross-layer layouts): reads of whole blocks, at most 4 MiB
        // where blocks are small, so 64 adjacent blocks are not one read on one connection.
        let sizes = vec![MIB; 64];
        let r = even_reads(&sizes, 2, 64, 4 * MIB, 1);
        assert_eq!(r.len(), 16);
        assert!(r.iter().all(|r| r.len() == 4));
        assert_eq!(lane_bytes(&sizes, 2, 64), vec![32 * MIB, 32 * MIB]);
        // A lone block asked to fill the lanes: one read per lane, equal halves.
        let one = vec![piece; 56];
        assert_eq!(even_reads(&one, 2, 64, 4 * MIB, 2), vec![0..28, 28..56]);
        assert_eq!(even_reads(&one, 2, 64, 4 * MIB, 1), vec![0..56]);
        assert_eq!(even_reads(&one[..1], 2, 64, 4 * MIB, 2), vec![0..1]);
        // A piece over the byte limit is a read of its own, never split.
        let r = even_reads(&[9 * MIB, MIB, 9 * MIB], 2, 64, 4 * MIB, 1);
        assert_eq!(r, vec![0..1, 1..2, 2..3]);
        assert_eq!(
            even_reads(&[], 2, 64, 4 * MIB, 1),
            Vec::<Range<usize>>::new()
        );
        assert_eq!(even_reads(&[0, 0, 0], 2, 2, 4 * MIB, 1), vec![0..2, 2..3]);
    }

    #[test]
    fn small_plans_and_one_lane_keep_the_old_cut() {
        assert_eq!(even_batches(3, 4, 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(even_batches(16, 1, 8), vec![0..8, 8..16]);
        assert_eq!(even_batches(0, 2, 8), Vec::<Range<usize>>::new());
        // Degenerate arguments are taken as one.
        assert_eq!(even_batches(2, 0, 0), vec![0..1, 1..2]);
    }
}
