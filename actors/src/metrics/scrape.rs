//! What a scrape samples from outside the counters: the node's stats and the engine
//! service's gauges recorded here, and the other areas' totals through [`Sampled`], which
//! each area implements beside its own stats.

use ::metrics::{counter, gauge};

use crate::api::Stats;
use crate::metrics::names::*;

/// Values that live outside the counters, gathered by the node for a scrape.
#[derive(Debug, Default)]
pub struct Extra {
    pub peer_pins: usize,
    /// The engine service, while one serves this node.
    pub engine: Option<EngineGauges>,
    /// The other areas' totals (the directory, the node's `[[nic]]` runtime, the SSD tier),
    /// each recorded by the area's own code.
    pub sampled: Vec<Box<dyn Sampled>>,
}

/// Totals an area keeps and a scrape samples, recorded by the area that knows them, so this
/// module names no area's types (the areas import it, not the other way round).
pub trait Sampled: Send + Sync + std::fmt::Debug {
    /// Records these totals into the recorder in effect: counters with `absolute`, gauges
    /// with `set`.
    fn record(&self);

    /// The scrape should also carry the process's call latencies of this area (a directory
    /// across the network); none by default.
    fn with_process_latencies(&self) -> bool {
        false
    }
}

/// What the engine service holds for its clients, as a scrape sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineGauges {
    pub sessions: u64,
    pub memory_handles: u64,
    /// Loads accepted whose completion has not come yet.
    pub loads_pending: u64,
    /// Completions kept for a poll to collect.
    pub completions_retained: u64,
    /// Completions dropped uncollected (over the retention bound).
    pub completions_dropped: u64,
    /// Request mailboxes attached (a node thread each).
    pub mailboxes: u64,
    /// Requests served from mailboxes.
    pub mailbox_requests: u64,
}

/// Where a node's scrape reads the engine service's gauges from.
pub trait EngineProbe: Send + Sync {
    fn engine_gauges(&self) -> EngineGauges;
}

// Values sampled at scrape time are totals kept elsewhere: counters take them with
// `absolute` (the exporter keeps the larger, so a total never goes back), gauges with `set`.
// `as f64`: gauges are small counts, exact in an f64.

fn record_stats(stats: &Stats, peer_pins: usize) {
    for (name, v) in [
        (LEASES_LIVE, stats.leases_live),
        (BLOCKS, stats.blocks),
        (BLOCKS_SEALED, stats.sealed_blocks),
        (PINNED_BLOCKS, stats.pinned_blocks),
        (POOL_SLOTS, stats.pool_slots),
        (INSTANCES, stats.instances),
        (TRANSFERS_IN_FLIGHT, stats.transfers_in_flight),
        (PEER_PINS, peer_pins),
    ] {
        gauge!(name).set(v as f64);
    }
    gauge!(PINS).set(stats.pins as f64);
    counter!(LEASES_EXPIRED).absolute(stats.leases_expired);
    counter!(EVICTIONS).absolute(stats.evictions);
}

fn record_engine(g: &EngineGauges) {
    for (name, v) in [
        (ENGINE_SESSIONS, g.sessions),
        (ENGINE_MEMORY_HANDLES, g.memory_handles),
        (ENGINE_LOADS_PENDING, g.loads_pending),
        (ENGINE_COMPLETIONS_RETAINED, g.completions_retained),
        (ENGINE_MAILBOXES, g.mailboxes),
    ] {
        gauge!(name).set(v as f64);
    }
    counter!(ENGINE_COMPLETIONS_DROPPED).absolute(g.completions_dropped);
    counter!(ENGINE_MAILBOX_REQUESTS).absolute(g.mailbox_requests);
}

/// Records a scrape's sampled values into the recorder in effect.
pub(super) fn record_scrape(stats: &Stats, extra: &Extra) {
    record_stats(stats, extra.peer_pins);
    if let Some(g) = &extra.engine {
        record_engine(g);
    }
    for s in &extra.sampled {
        s.record();
    }
}
