//! The directory: which nodes hold which blocks. A lookup answers, for a hash list, the
//! ordered segments and their candidate owners; a node never lists itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::model::{BlockHash, Namespace};

/// A run of consecutive hashes that every listed owner holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the first hash in the looked-up list.
    pub start: usize,
    pub len: usize,
    /// Candidate owners, best first.
    pub owners: Vec<String>,
}

/// Directory operations counted for operators.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectoryStats {
    pub publishes: u64,
    pub withdraws: u64,
    pub lookups: u64,
    pub entries: usize,
}

/// A directory backend. Calls are short and synchronous: the embedded backend is a map, the
/// Redis backend one pipelined round trip on loopback.
pub trait Directory: Send + Sync + std::fmt::Debug {
    fn publish(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]);
    fn withdraw(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]);
    /// Owners per hash, excluding `exclude`, for the whole list (an empty list for a miss).
    fn owners(&self, ns: &Namespace, hashes: &[BlockHash], exclude: &str) -> Vec<Vec<String>>;
    /// Removes every entry of a node (it left the cluster).
    fn withdraw_node(&self, node: &str);
    fn stats(&self) -> DirectoryStats;

    /// Ordered segments from the first hash on, stopping at the first hash nobody else holds.
    fn lookup(&self, ns: &Namespace, hashes: &[BlockHash], exclude: &str) -> Vec<Segment> {
        segments(&self.owners(ns, hashes, exclude))
    }
}

/// Groups per-hash owner lists into maximal runs that share at least one owner, keeping the
/// owners common to the whole run (in the first hash's order).
pub fn segments(per_hash: &[Vec<String>]) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for (i, owners) in per_hash.iter().enumerate() {
        if owners.is_empty() {
            break;
        }
        if let Some(seg) = out.last_mut() {
            let common: Vec<String> = seg
                .owners
                .iter()
                .filter(|o| owners.contains(o))
                .cloned()
                .collect();
            if !common.is_empty() {
                seg.owners = common;
                seg.len += 1;
                continue;
            }
        }
        out.push(Segment {
            start: i,
            len: 1,
            owners: owners.clone(),
        });
    }
    out
}

/// The in-process directory (the default; shared by every node of one process).
#[derive(Debug, Default)]
pub struct EmbeddedDirectory {
    map: Mutex<HashMap<(Namespace, BlockHash), Vec<String>>>,
    publishes: AtomicU64,
    withdraws: AtomicU64,
    lookups: AtomicU64,
}

impl EmbeddedDirectory {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Namespace, BlockHash), Vec<String>>> {
        match self.map.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

impl Directory for EmbeddedDirectory {
    fn publish(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]) {
        self.publishes
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        let mut m = self.lock();
        for h in hashes {
            let owners = m.entry((ns.clone(), *h)).or_default();
            if !owners.iter().any(|o| o == node) {
                owners.push(node.to_owned());
            }
        }
    }

    fn withdraw(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]) {
        self.withdraws
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        let mut m = self.lock();
        for h in hashes {
            let key = (ns.clone(), *h);
            if let Some(owners) = m.get_mut(&key) {
                owners.retain(|o| o != node);
                if owners.is_empty() {
                    m.remove(&key);
                }
            }
        }
    }

    fn owners(&self, ns: &Namespace, hashes: &[BlockHash], exclude: &str) -> Vec<Vec<String>> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let m = self.lock();
        hashes
            .iter()
            .map(|h| {
                m.get(&(ns.clone(), *h))
                    .map(|o| o.iter().filter(|n| *n != exclude).cloned().collect())
                    .unwrap_or_default()
            })
            .collect()
    }

    fn withdraw_node(&self, node: &str) {
        let mut m = self.lock();
        m.retain(|_, owners| {
            owners.retain(|o| o != node);
            !owners.is_empty()
        });
    }

    fn stats(&self) -> DirectoryStats {
        DirectoryStats {
            publishes: self.publishes.load(Ordering::Relaxed),
            withdraws: self.withdraws.load(Ordering::Relaxed),
            lookups: self.lookups.load(Ordering::Relaxed),
            entries: self.lock().len(),
        }
    }
}

/// A static peer list as a directory: every configured peer is a candidate owner of every
/// block, and the plan asks them in order (their pins say what they really hold).
/// Publishing and withdrawing are local no-ops: nothing is shared.
#[derive(Debug, Default)]
pub struct StaticDirectory {
    peers: Vec<String>,
    lookups: AtomicU64,
}

impl StaticDirectory {
    pub fn new(peers: Vec<String>) -> Self {
        Self {
            peers,
            lookups: AtomicU64::new(0),
        }
    }
}

impl Directory for StaticDirectory {
    fn publish(&self, _: &str, _: &Namespace, _: &[BlockHash]) {}

    fn withdraw(&self, _: &str, _: &Namespace, _: &[BlockHash]) {}

    fn owners(&self, _: &Namespace, hashes: &[BlockHash], exclude: &str) -> Vec<Vec<String>> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let owners: Vec<String> = self
            .peers
            .iter()
            .filter(|p| *p != exclude)
            .cloned()
            .collect();
        vec![owners; hashes.len()]
    }

    fn withdraw_node(&self, _: &str) {}

    fn stats(&self) -> DirectoryStats {
        DirectoryStats {
            lookups: self.lookups.load(Ordering::Relaxed),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace::new("m", "bf16", "x").unwrap()
    }

    #[test]
    fn segments_follow_common_owners_and_stop_at_a_gap() {
        let d = EmbeddedDirectory::new();
        let h: Vec<BlockHash> = (0..12).map(BlockHash::from_u64).collect();
        d.publish("b", &ns(), &h[0..4]);
        d.publish("a", &ns(), &h[4..8]);
        d.publish("c", &ns(), &h[8..12]);
        d.publish("c", &ns(), &h[6..8]); // a and c both hold 6..8
        let segs = d.lookup(&ns(), &h[4..], "b");
        assert_eq!(
            segs,
            vec![
                Segment {
                    start: 0,
                    len: 4,
                    owners: vec!["a".into()]
                },
                Segment {
                    start: 4,
                    len: 4,
                    owners: vec!["c".into()]
                },
            ]
        );
        // A node never lists itself.
        assert!(d.lookup(&ns(), &h[0..4], "b").is_empty());
        // A hole ends the lookup.
        d.withdraw("a", &ns(), &h[5..6]);
        let segs = d.lookup(&ns(), &h[4..], "b");
        assert_eq!(
            segs,
            vec![Segment {
                start: 0,
                len: 1,
                owners: vec!["a".into()]
            }]
        );
        d.withdraw_node("c");
        assert_eq!(d.stats().entries, 7);
    }
}
