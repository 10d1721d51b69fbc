//! `EventLog`: what this node stored and dropped, per namespace and tier, as a bounded ring of
//! events with a global sequence number. Plain state: the store's hook appends (passing the
//! wall-clock time in), the publisher and the `Events` call read. No lock, no clock, no I/O
//! here; [`super::EventHub`] shares it.
//!
//! Rules:
//! - Every event gets the next sequence number, from 0, without gaps; an event names one
//!   namespace, one kind and one medium, and holds at most [`MAX_HASHES_PER_EVENT`] hashes
//!   (a longer batch is cut), so the ring's memory is bounded by its capacity.
//! - [`EventKind::AllCleared`] names no namespace and no hash: every block this node
//!   advertised before is gone. The node records it first (sequence 0) when it starts, so a
//!   router that held a view of an earlier incarnation of the node drops it; what a warm
//!   restart finds on disk is stored after it.
//! - The ring keeps the newest `capacity` events. A reader asking for events the ring no
//!   longer has learns how many it missed ([`Since::missed`]) and gets the oldest kept on.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::model::{BlockHash, Namespace};

/// Hashes one event holds at most; a longer batch becomes several events.
pub const MAX_HASHES_PER_EVENT: usize = 64;

/// Where a block is (or was): this node's tiers, named as vLLM's `medium` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The host RAM pool: vLLM's `"CPU"`.
    Ram,
    /// The SSD tier: `"DISK"`.
    Disk,
}

impl Medium {
    /// The `medium` string of vLLM's events.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Ram => "CPU",
            Medium::Disk => "DISK",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The blocks are readable from this node's `medium` now.
    Stored,
    /// The blocks left `medium` (they may still be in the other tier).
    Removed,
    /// Every block of every namespace and medium is gone (vLLM's `AllBlocksCleared`): the
    /// node started. Such an event has no namespace and no hashes.
    AllCleared,
}

/// One event of the log.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeEvent {
    pub seq: u64,
    /// Seconds since the Unix epoch (vLLM's `ts`).
    pub ts: f64,
    /// None for [`EventKind::AllCleared`], which is about every namespace.
    pub namespace: Option<Namespace>,
    pub kind: EventKind,
    /// Unused for [`EventKind::AllCleared`].
    pub medium: Medium,
    pub hashes: Vec<BlockHash>,
}

/// What a reader gets from [`EventLog::since`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Since {
    /// In sequence order.
    pub events: Vec<NodeEvent>,
    /// Events asked for that the ring no longer holds (0: none lost).
    pub missed: u64,
    /// Where the next read starts: one past the last event read (or scanned, with a
    /// namespace filter).
    pub next: u64,
}

#[derive(Debug)]
pub struct EventLog {
    ring: VecDeque<NodeEvent>,
    capacity: usize,
    next_seq: u64,
}

impl EventLog {
    /// A ring of `capacity` events (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            ring: VecDeque::with_capacity(capacity.min(4096)),
            capacity,
            next_seq: 0,
        }
    }

    /// Appends events for `hashes` (nothing for none), cut at [`MAX_HASHES_PER_EVENT`].
    /// Returns how many older events the ring let go to make room.
    pub fn record(
        &mut self,
        now: SystemTime,
        namespace: &Namespace,
        kind: EventKind,
        medium: Medium,
        hashes: &[BlockHash],
    ) -> u64 {
        let ts = now
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut let_go = 0;
        for chunk in hashes.chunks(MAX_HASHES_PER_EVENT) {
            let_go += self.push(NodeEvent {
                seq: self.next_seq,
                ts,
                namespace: Some(namespace.clone()),
                kind,
                medium,
                hashes: chunk.to_vec(),
            });
        }
        let_go
    }

    /// Appends an [`EventKind::AllCleared`]; returns how many older events the ring let go.
    pub fn record_cleared(&mut self, now: SystemTime) -> u64 {
        let ts = now
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.push(NodeEvent {
            seq: self.next_seq,
            ts,
            namespace: None,
            kind: EventKind::AllCleared,
            medium: Medium::Ram,
            hashes: Vec::new(),
        })
    }

    fn push(&mut self, e: NodeEvent) -> u64 {
        let mut let_go = 0;
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
            let_go = 1;
        }
        self.ring.push_back(e);
        self.next_seq += 1;
        let_go
    }

    /// The sequence number the next event gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The oldest sequence number still held (`next_seq` when empty).
    pub fn oldest_seq(&self) -> u64 {
        self.ring.front().map_or(self.next_seq, |e| e.seq)
    }

    /// Up to `max` events from `from` on, of `namespace` only when given (an
    /// [`EventKind::AllCleared`] is of every namespace). A `from` older than
    /// the ring is answered from the oldest kept, with the difference in `missed`; a `from`
    /// past the end reads nothing (`next` says where the log is).
    pub fn since(&self, from: u64, namespace: Option<&Namespace>, max: usize) -> Since {
        let oldest = self.oldest_seq();
        let start = from.max(oldest);
        let missed = oldest.saturating_sub(from);
        if start >= self.next_seq {
            return Since {
                events: Vec::new(),
                missed,
                next: self.next_seq.max(from),
            };
        }
        // Sequence numbers in the ring are consecutive: the start is an index.
        let skip = usize::try_from(start - oldest).unwrap_or(usize::MAX);
        let mut events = Vec::new();
        let mut next = start;
        for e in self.ring.iter().skip(skip).take(max) {
            next = e.seq + 1;
            if namespace.is_none_or(|ns| e.namespace.as_ref().is_none_or(|n| n == ns)) {
                events.push(e.clone());
            }
        }
        Since {
            events,
            missed,
            next,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ns(s: &str) -> Namespace {
        Namespace::new("m", "bf16", s).unwrap()
    }

    fn hashes(n: usize, base: u8) -> Vec<BlockHash> {
        (0..n)
            .map(|i| BlockHash::new(&[base, (i % 256) as u8, (i / 256) as u8]).unwrap())
            .collect()
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn sequence_numbers_are_global_and_consecutive() {
        let mut log = EventLog::new(100);
        let (a, b) = (ns("a"), ns("b"));
        log.record(at(10), &a, EventKind::Stored, Medium::Ram, &hashes(2, 1));
        log.record(at(11), &b, EventKind::Stored, Medium::Disk, &hashes(1, 2));
        log.record(at(12), &a, EventKind::Removed, Medium::Ram, &hashes(3, 1));
        let all = log.since(0, None, usize::MAX);
        assert_eq!(all.missed, 0);
        assert_eq!(all.next, 3);
        let seqs: Vec<u64> = all.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [0, 1, 2]);
        assert_eq!(all.events[1].namespace.as_ref(), Some(&b));
        assert_eq!(all.events[1].medium, Medium::Disk);
        assert_eq!(all.events[2].kind, EventKind::Removed);
        assert_eq!(all.events[2].hashes, hashes(3, 1));
        assert_eq!(all.events[0].ts, 10.0);
    }

    #[test]
    fn nothing_recorded_for_no_hashes() {
        let mut log = EventLog::new(4);
        log.record(at(1), &ns("f"), EventKind::Stored, Medium::Ram, &[]);
        assert_eq!(log.next_seq(), 0);
        assert!(log.since(0, None, 10).events.is_empty());
    }

    #[test]
    fn a_long_batch_is_cut_into_bounded_events() {
        let mut log = EventLog::new(100);
        let hs = hashes(MAX_HASHES_PER_EVENT * 2 + 1, 7);
        log.record(at(1), &ns("f"), EventKind::Stored, Medium::Ram, &hs);
        let all = log.since(0, None, usize::MAX);
        let lens: Vec<usize> = all.events.iter().map(|e| e.hashes.len()).collect();
        assert_eq!(lens, [MAX_HASHES_PER_EVENT, MAX_HASHES_PER_EVENT, 1]);
        let joined: Vec<BlockHash> = all.events.into_iter().flat_map(|e| e.hashes).collect();
        assert_eq!(joined, hs);
    }

    #[test]
    fn a_reader_that_fell_behind_learns_the_gap() {
        let mut log = EventLog::new(3);
        let a = ns("f");
        let mut let_go = 0;
        for i in 0..5u8 {
            let_go += log.record(at(1), &a, EventKind::Stored, Medium::Ram, &hashes(1, i));
        }
        assert_eq!(let_go, 2);
        assert_eq!(log.oldest_seq(), 2);
        let s = log.since(0, None, usize::MAX);
        assert_eq!(s.missed, 2);
        assert_eq!(s.events.first().map(|e| e.seq), Some(2));
        assert_eq!(s.next, 5);
        // Caught up: nothing missed, nothing new.
        let s = log.since(5, None, usize::MAX);
        assert_eq!((s.missed, s.events.len(), s.next), (0, 0, 5));
        // Past the end (a reader of an earlier node incarnation): nothing, no panic.
        let s = log.since(1_000, None, usize::MAX);
        assert_eq!((s.missed, s.events.len(), s.next), (0, 0, 1_000));
    }

    #[test]
    fn reads_are_bounded_and_resume_where_they_stopped() {
        let mut log = EventLog::new(100);
        let a = ns("f");
        for i in 0..10u8 {
            log.record(at(1), &a, EventKind::Stored, Medium::Ram, &hashes(1, i));
        }
        let first = log.since(0, None, 4);
        assert_eq!(first.events.len(), 4);
        assert_eq!(first.next, 4);
        let rest = log.since(first.next, None, 100);
        assert_eq!(rest.events.first().map(|e| e.seq), Some(4));
        assert_eq!(rest.next, 10);
    }

    #[test]
    fn a_namespace_filter_skips_other_tenants_but_advances() {
        let mut log = EventLog::new(100);
        let (a, b) = (ns("a"), ns("b"));
        log.record(at(1), &a, EventKind::Stored, Medium::Ram, &hashes(1, 1));
        log.record(at(1), &b, EventKind::Stored, Medium::Ram, &hashes(1, 2));
        log.record(at(1), &b, EventKind::Removed, Medium::Ram, &hashes(1, 2));
        log.record(at(1), &a, EventKind::Removed, Medium::Ram, &hashes(1, 1));
        let s = log.since(0, Some(&b), 100);
        let seqs: Vec<u64> = s.events.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2]);
        assert_eq!(s.next, 4);
        // `max` counts events scanned, so a filtered read is bounded in work too.
        let s = log.since(0, Some(&b), 1);
        assert!(s.events.is_empty());
        assert_eq!(s.next, 1);
    }

    #[test]
    fn a_clear_names_no_namespace_and_passes_every_filter() {
        let mut log = EventLog::new(100);
        let (a, b) = (ns("a"), ns("b"));
        assert_eq!(log.record_cleared(at(5)), 0);
        log.record(at(6), &a, EventKind::Stored, Medium::Disk, &hashes(2, 1));
        let all = log.since(0, None, usize::MAX);
        assert_eq!(all.events.len(), 2);
        let first = &all.events[0];
        assert_eq!(
            (first.seq, first.kind, first.namespace.as_ref(), first.ts),
            (0, EventKind::AllCleared, None, 5.0)
        );
        assert!(first.hashes.is_empty());
        // A reader of one namespace sees the clear too (its view is gone as well).
        let of_b = log.since(0, Some(&b), usize::MAX);
        let kinds: Vec<EventKind> = of_b.events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [EventKind::AllCleared]);
        // A full ring lets a clear go like any event.
        let mut small = EventLog::new(1);
        small.record_cleared(at(1));
        assert_eq!(small.record_cleared(at(2)), 1);
        assert_eq!(small.oldest_seq(), 1);
    }
}
