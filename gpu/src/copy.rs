//! Copy lists: the unit a device executes as one batch.

/// One contiguous copy; addresses are host virtual addresses or device pointers depending on
/// the batch's [`crate::CopyDirection`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// An ordered list of copies that merges a range into the previous one when the two are
/// adjacent on both sides, so contiguous runs cost one driver call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyList {
    ops: Vec<CopyOp>,
    bytes: u64,
}

impl CopyList {
    pub fn with_capacity(n: usize) -> Self {
        Self {
            ops: Vec::with_capacity(n),
            bytes: 0,
        }
    }

    /// Appends a copy, merging it into the last one where both sides continue it.
    pub fn push(&mut self, src: u64, dst: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.bytes += len;
        if let Some(last) = self.ops.last_mut() {
            if last.src + last.len == src && last.dst + last.len == dst {
                last.len += len;
                return;
            }
        }
        self.ops.push(CopyOp { src, dst, len });
    }

    pub fn ops(&self) -> &[CopyOp] {
        &self.ops
    }

    /// Total bytes the list moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of copies after merging.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Splits the list, in order, into lists of at least `bytes` each (the last one may be
    /// smaller), cutting only between copies. An empty list gives one empty list.
    pub fn split_by_bytes(self, bytes: u64) -> Vec<CopyList> {
        self.split_ramped(bytes, bytes)
    }

    /// [`Self::split_by_bytes`] with parts growing from `first` bytes, doubling up to `max`:
    /// the device starts on a small first part while the larger ones are planned.
    pub fn split_ramped(self, first: u64, max: u64) -> Vec<CopyList> {
        let mut want = first.min(max);
        if self.bytes <= want {
            return vec![self];
        }
        let mut out = Vec::new();
        let mut cur = CopyList::default();
        for op in self.ops {
            cur.bytes += op.len;
            cur.ops.push(op);
            if cur.bytes >= want {
                out.push(std::mem::take(&mut cur));
                want = want.saturating_mul(2).min(max);
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ramped_parts_double_up_to_the_cap() {
        let mut l = CopyList::default();
        for i in 0..40u64 {
            // Gaps on both sides: nothing merges.
            l.push(i * 20, 10_000 + i * 20, 10);
        }
        let sizes: Vec<u64> = l
            .clone()
            .split_ramped(20, 80)
            .iter()
            .map(|p| p.bytes())
            .collect();
        assert_eq!(sizes, [20, 40, 80, 80, 80, 80, 20]);
        let parts = l.clone().split_ramped(20, 80);
        let ops: Vec<CopyOp> = parts.into_iter().flat_map(|p| p.ops().to_vec()).collect();
        assert_eq!(ops, l.ops(), "in order, nothing lost");
        assert_eq!(l.clone().split_ramped(400, 800).len(), 1);
        assert_eq!(
            l.split_ramped(100, 50).len(),
            8,
            "the cap bounds the first part too"
        );
    }

    #[test]
    fn merges_only_when_adjacent_on_both_sides() {
        let mut l = CopyList::default();
        l.push(0, 1000, 10);
        l.push(10, 1010, 5); // adjacent both sides: merged
        l.push(15, 2000, 5); // src adjacent, dst not
        l.push(100, 2005, 5); // dst adjacent, src not
        l.push(105, 2010, 0); // empty: ignored
        assert_eq!(
            l.ops(),
            &[
                CopyOp {
                    src: 0,
                    dst: 1000,
                    len: 15
                },
                CopyOp {
                    src: 15,
                    dst: 2000,
                    len: 5
                },
                CopyOp {
                    src: 100,
                    dst: 2005,
                    len: 5
                },
            ]
        );
        assert_eq!(l.bytes(), 25);
        assert_eq!(l.len(), 3);
    }

    #[test]
    fn splits_in_order_between_copies() {
        let mut l = CopyList::default();
        for i in 0..10u64 {
            l.push(i * 100, i * 1000, 10 + i);
        }
        let whole = l.clone();
        let parts = l.split_by_bytes(40);
        // 10+11+12+13 = 46, 14+15+16 = 45, 17+18+19 = 54.
        assert_eq!(
            parts.iter().map(CopyList::len).collect::<Vec<_>>(),
            [4, 3, 3]
        );
        assert_eq!(
            parts.iter().map(CopyList::bytes).collect::<Vec<_>>(),
            [46, 45, 54]
        );
        let joined: Vec<CopyOp> = parts.iter().flat_map(|p| p.ops().to_vec()).collect();
        assert_eq!(joined, whole.ops());
        // Small enough, or empty: one list.
        assert_eq!(whole.clone().split_by_bytes(1 << 20), vec![whole]);
        assert_eq!(CopyList::default().split_by_bytes(1).len(), 1);
        // A trailing remainder is kept.
        let mut l = CopyList::default();
        l.push(0, 0, 50);
        l.push(500, 500, 5);
        assert_eq!(
            l.split_by_bytes(40)
                .iter()
                .map(CopyList::bytes)
                .collect::<Vec<_>>(),
            [50, 5]
        );
    }
}
