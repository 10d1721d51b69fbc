//! What this process's nodes hold, and the changes not yet written: plain state, locked by
//! the callers (who record) and the directory's thread (which writes and reconciles).

use std::collections::{HashMap, HashSet};

use crate::model::{BlockHash, Namespace};

/// Queued block updates past which the queue is dropped and a full re-announce owed
/// instead (a directory down for long must not grow memory without bound).
const MAX_PENDING: usize = 1 << 20;

/// What this process's nodes hold (the truth a re-announce writes), and the changes not
/// yet written.
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) held: HashMap<String, HashSet<(Namespace, BlockHash)>>,
    pub(super) pending: Vec<Update>,
    pub(super) pending_hashes: usize,
    /// Nodes that left: their entries on the server are to be removed.
    pub(super) departed: HashSet<String>,
    /// Every node re-announces all it holds at the next chance.
    pub(super) reannounce: bool,
    /// The server's sets are compared with `held` at the next chance.
    pub(super) reconcile: bool,
    /// Bumped by every change; a flush waits for a round that started after it.
    pub(super) changes: u64,
}

pub(super) struct Update {
    pub(super) add: bool,
    pub(super) node: String,
    pub(super) ns: Namespace,
    pub(super) hashes: Vec<BlockHash>,
}

impl Ledger {
    pub(super) fn queue(&mut self, update: Update) {
        let held = self.held.entry(update.node.clone()).or_default();
        for h in &update.hashes {
            if update.add {
                held.insert((update.ns.clone(), *h));
            } else {
                held.remove(&(update.ns.clone(), *h));
            }
        }
        self.changes += 1;
        if self.pending_hashes + update.hashes.len() > MAX_PENDING {
            // The ledger has it all: a re-announce writes it in one go later.
            self.drop_pending();
            return;
        }
        self.pending_hashes += update.hashes.len();
        self.pending.push(update);
    }

    /// Queued updates are given up on; a full re-announce (with its reconcile, which also
    /// removes what was withdrawn meanwhile) replaces them.
    pub(super) fn drop_pending(&mut self) {
        if !self.pending.is_empty() {
            self.reannounce = true;
        }
        self.pending.clear();
        self.pending_hashes = 0;
    }

    pub(super) fn entries(&self) -> usize {
        self.held.values().map(HashSet::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(add: bool, node: &str, hashes: &[u64]) -> Update {
        Update {
            add,
            node: node.into(),
            ns: Namespace::new("m", "bf16", "f").unwrap(),
            hashes: hashes.iter().map(|h| BlockHash::from_u64(*h)).collect(),
        }
    }

    /// What is held follows every change at once; the changes stay queued in order until
    /// dropped, and dropping a non-empty queue owes a re-announce (an empty one does not).
    #[test]
    fn held_follows_changes_and_a_dropped_queue_owes_a_reannounce() {
        let mut l = Ledger::default();
        l.drop_pending();
        assert!(!l.reannounce);
        l.queue(update(true, "a", &[1, 2, 3]));
        l.queue(update(false, "a", &[2]));
        l.queue(update(true, "b", &[1]));
        assert_eq!((l.entries(), l.pending.len(), l.pending_hashes), (3, 3, 5));
        assert_eq!(l.changes, 3);
        assert!(!l.pending[1].add);
        l.drop_pending();
        assert!(l.reannounce);
        assert_eq!((l.entries(), l.pending.len(), l.pending_hashes), (3, 0, 0));
    }
}
