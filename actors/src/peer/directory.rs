//! The directory: which nodes hold which blocks. A lookup answers, for a hash list, the
//! ordered segments and their candidate owners; a node never lists itself.
//!
//! Nothing here may stall a node: `publish`, `withdraw` and `withdraw_node` never wait on the
//! network (a networked backend queues them and writes them in batches on its own thread),
//! and a lookup answers within the backend's bound, with empty owner lists ("nobody else
//! holds anything") when the directory cannot answer in time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use ::metrics::{counter, gauge};

use crate::metrics::{
    DIRECTORY_BREAKER_OPEN, DIRECTORY_BREAKER_TRIPS, DIRECTORY_FAILURES, DIRECTORY_LOOKUPS_SKIPPED,
    DIRECTORY_OPERATIONS, DIRECTORY_PENDING, DIRECTORY_REANNOUNCES, STAGE_BUCKETS,
};
use crate::model::{BlockHash, Namespace};
use crate::peer::breaker::BreakerState;
use crate::peer::link::BoxFut;

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
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DirectoryStats {
    pub publishes: u64,
    pub withdraws: u64,
    pub lookups: u64,
    /// Block entries: every block of the directory (embedded), or the blocks this
    /// process's nodes have announced (Redis: the server is not asked for a count).
    pub entries: usize,
    /// How a directory across the network is doing; None for in-process ones.
    pub health: Option<DirectoryHealth>,
}

/// A networked directory's breaker, failures and call latencies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DirectoryHealth {
    pub breaker: BreakerState,
    /// Times the breaker opened.
    pub trips: u64,
    /// Lookups answered without asking, the breaker being open.
    pub lookups_skipped: u64,
    /// Calls that failed or missed their deadline, by kind.
    pub lookup_failures: u64,
    pub write_failures: u64,
    pub probe_failures: u64,
    /// Times every node of this process re-announced all it holds (the directory came
    /// back after an outage, or restarted).
    pub reannounces: u64,
    /// Block updates queued and not yet written.
    pub pending: usize,
    pub lookup_seconds: LatencyHistogram,
    pub write_seconds: LatencyHistogram,
    pub last_error: Option<String>,
}

/// Seconds per call over [`STAGE_BUCKETS`] (cumulative, as Prometheus wants them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatencyHistogram {
    pub buckets: [u64; STAGE_BUCKETS.len()],
    pub sum: f64,
    pub count: u64,
}

impl LatencyHistogram {
    pub fn observe(&mut self, seconds: f64) {
        for (b, le) in self.buckets.iter_mut().zip(STAGE_BUCKETS) {
            if seconds <= le {
                *b += 1;
            }
        }
        self.sum += seconds;
        self.count += 1;
    }
}

/// A directory backend.
pub trait Directory: Send + Sync + std::fmt::Debug {
    /// `node` holds these blocks now. Never waits on the network.
    fn publish(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]);
    /// `node` no longer holds these blocks. Never waits on the network.
    fn withdraw(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]);
    /// Owners per hash, excluding `exclude`, for the whole list (an empty list for a miss).
    /// Answers within the backend's bound: a directory that cannot answer in time answers
    /// empty lists.
    fn owners(
        &self,
        ns: &Namespace,
        hashes: &[BlockHash],
        exclude: &str,
    ) -> BoxFut<Vec<Vec<String>>>;
    /// Removes every entry of a node (it left the cluster). Never waits on the network.
    fn withdraw_node(&self, node: &str);
    /// Counters only: never asks the network.
    fn stats(&self) -> DirectoryStats;

    /// Resolves once what was queued before the call is written (or given up on, the
    /// directory being down), within the backend's write deadline. In-process backends
    /// write at once.
    fn flush(&self) -> BoxFut<()> {
        Box::pin(std::future::ready(()))
    }

    /// Ordered segments from the first hash on, stopping at the first hash nobody else holds.
    fn lookup(&self, ns: &Namespace, hashes: &[BlockHash], exclude: &str) -> BoxFut<Vec<Segment>> {
        let owners = self.owners(ns, hashes, exclude);
        Box::pin(async move { segments(&owners.await) })
    }
}

/// For each node owning the first hash, how many leading hashes it owns, from per-hash owner
/// lists (as [`Directory::owners`] answers them); longest prefix first, then by node id.
pub fn prefix_per_node(per_hash: &[Vec<String>]) -> Vec<(String, usize)> {
    let Some(first) = per_hash.first() else {
        return Vec::new();
    };
    let mut out: Vec<(String, usize)> = first
        .iter()
        .map(|node| {
            let n = per_hash
                .iter()
                .take_while(|owners| owners.contains(node))
                .count();
            (node.clone(), n)
        })
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out.dedup_by(|a, b| a.0 == b.0);
    out
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

    fn owners(
        &self,
        ns: &Namespace,
        hashes: &[BlockHash],
        exclude: &str,
    ) -> BoxFut<Vec<Vec<String>>> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let m = self.lock();
        let owners = hashes
            .iter()
            .map(|h| {
                m.get(&(ns.clone(), *h))
                    .map(|o| o.iter().filter(|n| *n != exclude).cloned().collect())
                    .unwrap_or_default()
            })
            .collect();
        Box::pin(std::future::ready(owners))
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
            health: None,
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

    fn owners(
        &self,
        _: &Namespace,
        hashes: &[BlockHash],
        exclude: &str,
    ) -> BoxFut<Vec<Vec<String>>> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let owners: Vec<String> = self
            .peers
            .iter()
            .filter(|p| *p != exclude)
            .cloned()
            .collect();
        Box::pin(std::future::ready(vec![owners; hashes.len()]))
    }

    fn withdraw_node(&self, _: &str) {}

    fn stats(&self) -> DirectoryStats {
        DirectoryStats {
            lookups: self.lookups.load(Ordering::Relaxed),
            ..Default::default()
        }
    }
}

impl crate::metrics::Sampled for DirectoryStats {
    fn record(&self) {
        for (op, n) in [
            ("publish", self.publishes),
            ("withdraw", self.withdraws),
            ("lookup", self.lookups),
        ] {
            counter!(DIRECTORY_OPERATIONS, "op" => op).absolute(n);
        }
        let Some(h) = &self.health else {
            return;
        };
        let open = h.breaker != BreakerState::Closed;
        gauge!(DIRECTORY_BREAKER_OPEN).set(if open { 1.0 } else { 0.0 });
        counter!(DIRECTORY_BREAKER_TRIPS).absolute(h.trips);
        counter!(DIRECTORY_LOOKUPS_SKIPPED).absolute(h.lookups_skipped);
        counter!(DIRECTORY_REANNOUNCES).absolute(h.reannounces);
        for (op, n) in [
            ("lookup", h.lookup_failures),
            ("write", h.write_failures),
            ("probe", h.probe_failures),
        ] {
            counter!(DIRECTORY_FAILURES, "op" => op).absolute(n);
        }
        gauge!(DIRECTORY_PENDING).set(h.pending as f64);
    }

    /// Only a directory across the network reports health, and has call latencies.
    fn with_process_latencies(&self) -> bool {
        self.health.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_prefix_of_each_node() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let per_hash = vec![o(&["b", "a"]), o(&["a", "b"]), o(&["a"]), o(&["a", "c"])];
        assert_eq!(
            prefix_per_node(&per_hash),
            vec![("a".to_string(), 4), ("b".to_string(), 2)],
            "c holds a later block but not the first: no prefix"
        );
        assert!(prefix_per_node(&[]).is_empty());
        assert!(prefix_per_node(&[o(&[]), o(&["a"])]).is_empty());
    }

    fn ns() -> Namespace {
        Namespace::new("m", "bf16", "x").unwrap()
    }

    /// The in-process backends answer at once: one poll resolves their futures.
    fn now<T>(mut f: BoxFut<T>) -> T {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => v,
            std::task::Poll::Pending => panic!("an in-process directory future was pending"),
        }
    }

    #[test]
    fn segments_follow_common_owners_and_stop_at_a_gap() {
        let d = EmbeddedDirectory::new();
        let h: Vec<BlockHash> = (0..12).map(BlockHash::from_u64).collect();
        d.publish("b", &ns(), &h[0..4]);
        d.publish("a", &ns(), &h[4..8]);
        d.publish("c", &ns(), &h[8..12]);
        d.publish("c", &ns(), &h[6..8]); // a and c both hold 6..8
        let segs = now(d.lookup(&ns(), &h[4..], "b"));
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
        assert!(now(d.lookup(&ns(), &h[0..4], "b")).is_empty());
        // A hole ends the lookup.
        d.withdraw("a", &ns(), &h[5..6]);
        let segs = now(d.lookup(&ns(), &h[4..], "b"));
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

    #[test]
    fn a_static_directory_lists_every_peer_but_the_asker() {
        let d = StaticDirectory::new(vec!["a".into(), "b".into()]);
        let h: Vec<BlockHash> = (0..3).map(BlockHash::from_u64).collect();
        d.publish("a", &ns(), &h);
        assert_eq!(
            now(d.owners(&ns(), &h, "b")),
            vec![vec!["a".to_string()]; 3]
        );
        assert_eq!(
            now(d.lookup(&ns(), &h, "c")),
            vec![Segment {
                start: 0,
                len: 3,
                owners: vec!["a".into(), "b".into()]
            }]
        );
        now(d.flush());
        assert_eq!((d.stats().lookups, d.stats().health), (2, None));
    }
}
