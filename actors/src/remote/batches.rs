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

use std::ops::Range;

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

    #[test]
    fn small_plans_and_one_lane_keep_the_old_cut() {
        assert_eq!(even_batches(3, 4, 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(even_batches(16, 1, 8), vec![0..8, 8..16]);
        assert_eq!(even_batches(0, 2, 8), Vec::<Range<usize>>::new());
        // Degenerate arguments are taken as one.
        assert_eq!(even_batches(2, 0, 0), vec![0..1, 1..2]);
    }
}
