//! KV events: what this node stores and drops, per namespace and tier, for cache-aware
//! routers. [`log::EventLog`] is the plain ring; [`EventHub`] shares it between the block
//! store (which records, from one hook) and its readers: the ZMQ publisher
//! ([`publisher`], vLLM's `KVEventBatch` wire format from [`wire`]) and the engine's
//! `Events` call. Recording takes a lock for a few pushes and wakes the publisher; nothing
//! on the data path waits for a subscriber.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use tokio::sync::Notify;

use crate::model::{BlockHash, Namespace};

pub mod config;
pub mod log;
pub mod publisher;
pub mod wire;

pub use config::EventsConfig;
pub use log::{EventKind, EventLog, Medium, NodeEvent, Since};
pub use publisher::{EventPublisher, PublisherError};

/// The event log of one node, shared by the store (writer) and the readers.
#[derive(Debug)]
pub struct EventHub {
    log: Mutex<EventLog>,
    wake: Notify,
    stats: EventStats,
}

/// The hub's totals, sampled at scrape time.
#[derive(Debug, Default)]
pub struct EventStats {
    /// Events recorded.
    pub recorded: AtomicU64,
    /// Events the publisher could not send: the ring let them go before it got to them
    /// (or the socket failed a send, which zeromq 0.4's PUB never does: it drops a message
    /// for a subscriber whose queue is full without a word, so those drops are not counted;
    /// the subscriber sees the gap in the sequence numbers and replays).
    pub dropped: AtomicU64,
    /// Events sent on the PUB socket.
    pub published: AtomicU64,
    /// Replay requests answered, and those refused as malformed.
    pub replays: AtomicU64,
    pub replays_refused: AtomicU64,
}

impl EventHub {
    /// A hub whose ring keeps `capacity` events.
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            log: Mutex::new(EventLog::new(capacity)),
            wake: Notify::new(),
            stats: EventStats::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, EventLog> {
        // A reader that panicked left the ring consistent (every method is one push or
        // one read): keep using it.
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records events for `hashes` and wakes the publisher.
    pub fn record(
        &self,
        now: SystemTime,
        namespace: &Namespace,
        kind: EventKind,
        medium: Medium,
        hashes: &[BlockHash],
    ) {
        if hashes.is_empty() {
            return;
        }
        let (before, after) = {
            let mut log = self.lock();
            let before = log.next_seq();
            log.record(now, namespace, kind, medium, hashes);
            (before, log.next_seq())
        };
        self.stats.recorded.fetch_add(after - before, Relaxed);
        self.wake.notify_one();
    }

    /// Records that every block this node advertised is gone ([`EventKind::AllCleared`]):
    /// the node calls it once, first, as it starts.
    pub fn record_cleared(&self, now: SystemTime) {
        self.lock().record_cleared(now);
        self.stats.recorded.fetch_add(1, Relaxed);
        self.wake.notify_one();
    }

    /// See [`EventLog::since`].
    pub fn since(&self, from: u64, namespace: Option<&Namespace>, max: usize) -> Since {
        self.lock().since(from, namespace, max)
    }

    pub fn next_seq(&self) -> u64 {
        self.lock().next_seq()
    }

    /// Resolves after the next [`Self::record`] (or at once if one came since the last
    /// wait).
    pub async fn changed(&self) {
        self.wake.notified().await
    }

    pub fn stats(&self) -> &EventStats {
        &self.stats
    }
}

/// A snapshot of [`EventStats`] for a scrape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventTotals {
    pub recorded: u64,
    pub dropped: u64,
    pub published: u64,
    pub replays: u64,
    pub replays_refused: u64,
}

impl EventStats {
    pub fn totals(&self) -> EventTotals {
        EventTotals {
            recorded: self.recorded.load(Relaxed),
            dropped: self.dropped.load(Relaxed),
            published: self.published.load(Relaxed),
            replays: self.replays.load(Relaxed),
            replays_refused: self.replays_refused.load(Relaxed),
        }
    }
}

impl crate::metrics::Sampled for EventTotals {
    fn record(&self) {
        use crate::metrics::{EVENTS_DROPPED, EVENTS_PUBLISHED, EVENTS_RECORDED, EVENTS_REPLAYS};
        use ::metrics::counter;
        counter!(EVENTS_RECORDED).absolute(self.recorded);
        counter!(EVENTS_DROPPED).absolute(self.dropped);
        counter!(EVENTS_PUBLISHED).absolute(self.published);
        counter!(EVENTS_REPLAYS, "status" => "ok").absolute(self.replays);
        counter!(EVENTS_REPLAYS, "status" => "refused").absolute(self.replays_refused);
    }
}
