//! What a scrape samples from outside the counters (the actors, the NIC runtime, the
//! directory, the engine service, the SSD tier), and how each area is recorded.

use ::metrics::{counter, gauge};

use crate::api::Stats;
use crate::metrics::names::*;

/// Values that live outside the counters, gathered by the node for a scrape.
#[derive(Clone, Debug, Default)]
pub struct Extra {
    pub peer_pins: usize,
    pub directory: Option<crate::peer::directory::DirectoryStats>,
    /// The node's `[[nic]]` runtime, when it has one.
    pub nic: Option<NicMetrics>,
    /// The engine service, while one serves this node.
    pub engine: Option<EngineGauges>,
    /// The SSD tier, when the node has one.
    pub ssd: Option<crate::tier::ssd::SsdStats>,
}

/// What the engine service holds for its clients, as a scrape sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineGauges {
    pub sessions: u64,
    pub memory_handles: u64,
    /// Loads accepted whose completion has not come yet.
    pub loads_pending: u64,
    /// Completions kept for a stream or poll to collect.
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

/// What the NIC actors report for a scrape: memory registrations by NIC, kind and failure
/// reason; each NIC worker's QPs by state and completion errors by status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicMetrics {
    pub registry: crate::nic::RegistryCounts,
    /// (nic, its worker's gauges).
    pub workers: Vec<(String, crate::nic::WorkerGaugeValues)>,
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

fn record_directory(d: &crate::peer::directory::DirectoryStats) {
    for (op, n) in [
        ("publish", d.publishes),
        ("withdraw", d.withdraws),
        ("lookup", d.lookups),
    ] {
        counter!(DIRECTORY_OPERATIONS, "op" => op).absolute(n);
    }
    let Some(h) = &d.health else {
        return;
    };
    let open = h.breaker != crate::peer::BreakerState::Closed;
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

/// The kinds of memory a NIC registers (`nic::mr_registry`'s `MrKind`).
const MR_KINDS: [&str; 2] = ["host", "device"];

fn record_nic(m: &NicMetrics) {
    // Every NIC's registration series exist from its first scrape, at 0 until one is made,
    // so that `rate()` and alerts see the first registration.
    for (nic, _) in &m.registry.registered {
        for kind in MR_KINDS {
            counter!(MR_REGISTRATIONS, "nic" => nic.clone(), "kind" => kind).absolute(0);
        }
    }
    for (nic, kind, n) in &m.registry.made {
        counter!(MR_REGISTRATIONS, "nic" => nic.clone(), "kind" => *kind).absolute(*n);
    }
    for (nic, kind, reason, n) in &m.registry.failed {
        counter!(MR_REGISTRATION_FAILURES, "nic" => nic.clone(), "kind" => *kind, "reason" => *reason)
            .absolute(*n);
    }
    for (nic, n) in &m.registry.registered {
        gauge!(MRS_REGISTERED, "nic" => nic.clone()).set(*n as f64);
    }
    for (nic, g) in &m.workers {
        for (state, n) in g.states.labelled() {
            gauge!(QPS, "nic" => nic.clone(), "state" => state).set(n as f64);
        }
        for (status, n) in g.completion_errors.labelled() {
            counter!(COMPLETION_ERRORS, "nic" => nic.clone(), "status" => status).absolute(n);
        }
    }
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

fn record_ssd(s: &crate::tier::ssd::SsdStats) {
    gauge!(SSD_BLOCKS).set(s.blocks as f64);
    gauge!(SSD_CAPACITY_BLOCKS).set(s.capacity_blocks as f64);
    gauge!(SSD_HELD_BLOCKS).set(s.held_blocks as f64);
    gauge!(SSD_STAGING_SLOTS).set(s.staging_slots as f64);
    gauge!(SSD_WRITE_BACKLOG_BYTES).set(s.write_backlog_bytes as f64);
    gauge!(SSD_WRITE_BACKLOG_PEAK_BYTES).set(s.write_backlog_peak_bytes as f64);
    gauge!(SSD_WRITE_BACKLOG_LIMIT_BYTES).set(s.write_backlog_limit_bytes as f64);
    for (name, v) in [
        (SSD_EVICTIONS, s.evictions),
        (SSD_WRITES, s.writes),
        (SSD_WRITE_BYTES, s.write_bytes),
        (SSD_WRITE_ERRORS, s.write_errors),
        (SSD_DISK_FULL, s.disk_full),
        (SSD_READS, s.reads),
        (SSD_READ_BYTES, s.read_bytes),
        (SSD_READ_ERRORS, s.read_errors),
        (SSD_PROMOTE_NO_ROOM, s.promote_no_room),
    ] {
        counter!(name).absolute(v);
    }
    for (damage, v) in ["header", "key", "checksum"].into_iter().zip(s.damaged) {
        counter!(SSD_DAMAGED_BLOCKS, "damage" => damage).absolute(v);
    }
    counter!(SSD_WRITES_SKIPPED, "reason" => "busy").absolute(s.writes_skipped);
    counter!(SSD_WRITES_SKIPPED, "reason" => "backlog").absolute(s.writes_skipped_backlog);
    counter!(SSD_HIT_BLOCKS, "tier" => "ram").absolute(s.hits_ram);
    counter!(SSD_HIT_BLOCKS, "tier" => "ssd").absolute(s.hits_ssd);
}

/// Records a scrape's sampled values into the recorder in effect.
pub(super) fn record_scrape(stats: &Stats, extra: &Extra) {
    record_stats(stats, extra.peer_pins);
    if let Some(d) = &extra.directory {
        record_directory(d);
    }
    if let Some(m) = &extra.nic {
        record_nic(m);
    }
    if let Some(g) = &extra.engine {
        record_engine(g);
    }
    if let Some(s) = &extra.ssd {
        record_ssd(s);
    }
}
