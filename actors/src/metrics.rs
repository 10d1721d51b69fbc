//! The node's metrics, through the `metrics` facade into a Prometheus recorder of
//! `metrics-exporter-prometheus`. [`describe`] names every family once; [`Counters`] records
//! what happens (transfers, queries) as it happens; [`render`] adds the values sampled at
//! scrape time (gauges of the actors, the NIC runtime, the directory, the engine service)
//! and lets the exporter write the text format. `Node::stats` reads the plain counters.
//!
//! One recorder per node, not the process-wide one: several nodes run in one process (the
//! in-process cluster, tests, an engine embedding two), and `Node::metrics_text` must show
//! one node's numbers. Each [`Counters`] owns a recorder and records through
//! [`metrics::with_local_recorder`], so nothing here installs or reads the global recorder
//! (an embedding application keeps its own). What belongs to the process rather than a node
//! — the Redis directory's call latencies — goes to one process recorder ([`directory_call`]),
//! shown in the scrape of every node that uses a networked directory.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use ::metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use ::metrics::{with_local_recorder, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::api::{Stats, TransferReport};

/// Upper bounds (seconds) of the stage and directory-call histograms: 10 us to 10 s.
/// Explicit, so the exporter renders histograms (without buckets it renders summaries,
/// which cannot be aggregated across nodes).
pub const STAGE_BUCKETS: [f64; 13] = [
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 1.0, 10.0,
];

// Family names. Operators scrape these: they are the names the hand-written renderer used.
pub const LEASES_LIVE: &str = "kvferry_leases_live";
pub const BLOCKS: &str = "kvferry_blocks";
pub const BLOCKS_SEALED: &str = "kvferry_blocks_sealed";
pub const PINNED_BLOCKS: &str = "kvferry_pinned_blocks";
pub const PINS: &str = "kvferry_pins";
pub const POOL_SLOTS: &str = "kvferry_pool_slots";
pub const INSTANCES: &str = "kvferry_instances";
pub const TRANSFERS_IN_FLIGHT: &str = "kvferry_transfers_in_flight";
pub const PEER_PINS: &str = "kvferry_peer_pins";
pub const LEASES_EXPIRED: &str = "kvferry_leases_expired_total";
pub const EVICTIONS: &str = "kvferry_evictions_total";
pub const QUERIES: &str = "kvferry_queries_total";
pub const QUERY_BLOCKS: &str = "kvferry_query_blocks_total";
pub const ABANDONED: &str = "kvferry_abandoned_total";
pub const LOADS: &str = "kvferry_loads_total";
pub const BYTES: &str = "kvferry_bytes_total";
pub const STAGE_SECONDS: &str = "kvferry_stage_seconds";
pub const DIRECTORY_OPERATIONS: &str = "kvferry_directory_operations_total";
pub const DIRECTORY_BREAKER_OPEN: &str = "kvferry_directory_breaker_open";
pub const DIRECTORY_BREAKER_TRIPS: &str = "kvferry_directory_breaker_trips_total";
pub const DIRECTORY_LOOKUPS_SKIPPED: &str = "kvferry_directory_lookups_skipped_total";
pub const DIRECTORY_REANNOUNCES: &str = "kvferry_directory_reannounces_total";
pub const DIRECTORY_FAILURES: &str = "kvferry_directory_failures_total";
pub const DIRECTORY_PENDING: &str = "kvferry_directory_pending_updates";
pub const DIRECTORY_CALL_SECONDS: &str = "kvferry_directory_call_seconds";
/// Metric names of the NIC actors.
pub const MR_REGISTRATIONS: &str = "kvferry_mr_registrations_total";
pub const MR_REGISTRATION_FAILURES: &str = "kvferry_mr_registration_failures_total";
pub const MRS_REGISTERED: &str = "kvferry_mrs_registered";
pub const QPS: &str = "kvferry_qps";
pub const COMPLETION_ERRORS: &str = "kvferry_completion_errors_total";
pub const ENGINE_SESSIONS: &str = "kvferry_engine_sessions";
pub const ENGINE_MEMORY_HANDLES: &str = "kvferry_engine_memory_handles";
pub const ENGINE_LOADS_PENDING: &str = "kvferry_engine_loads_pending";
pub const ENGINE_COMPLETIONS_RETAINED: &str = "kvferry_engine_completions_retained";
pub const ENGINE_COMPLETIONS_DROPPED: &str = "kvferry_engine_completions_dropped_total";
pub const ENGINE_MAILBOXES: &str = "kvferry_engine_mailboxes";
pub const ENGINE_MAILBOX_REQUESTS: &str = "kvferry_engine_mailbox_requests_total";
/// The SSD tier's families (`ssd::SsdStats`).
pub const SSD_BLOCKS: &str = "kvferry_ssd_blocks";
pub const SSD_CAPACITY_BLOCKS: &str = "kvferry_ssd_capacity_blocks";
pub const SSD_HELD_BLOCKS: &str = "kvferry_ssd_held_blocks";
pub const SSD_STAGING_SLOTS: &str = "kvferry_ssd_staging_slots";
pub const SSD_EVICTIONS: &str = "kvferry_ssd_evictions_total";
pub const SSD_WRITES: &str = "kvferry_ssd_writes_total";
pub const SSD_WRITE_BYTES: &str = "kvferry_ssd_write_bytes_total";
pub const SSD_WRITE_ERRORS: &str = "kvferry_ssd_write_errors_total";
pub const SSD_DISK_FULL: &str = "kvferry_ssd_disk_full_total";
pub const SSD_WRITES_SKIPPED: &str = "kvferry_ssd_writes_skipped_total";
pub const SSD_WRITE_BACKLOG_BYTES: &str = "kvferry_ssd_write_backlog_bytes";
pub const SSD_WRITE_BACKLOG_PEAK_BYTES: &str = "kvferry_ssd_write_backlog_peak_bytes";
pub const SSD_WRITE_BACKLOG_LIMIT_BYTES: &str = "kvferry_ssd_write_backlog_limit_bytes";
pub const SSD_READS: &str = "kvferry_ssd_reads_total";
pub const SSD_READ_BYTES: &str = "kvferry_ssd_read_bytes_total";
pub const SSD_READ_ERRORS: &str = "kvferry_ssd_read_errors_total";
pub const SSD_PROMOTE_NO_ROOM: &str = "kvferry_ssd_promote_no_room_total";
pub const SSD_DAMAGED_BLOCKS: &str = "kvferry_ssd_damaged_blocks_total";
pub const SSD_HIT_BLOCKS: &str = "kvferry_ssd_hit_blocks_total";

/// Describes every family this crate exports to the recorder in effect (one HELP line
/// each; the exporter writes the TYPE from how a family is recorded).
pub fn describe() {
    for (name, help) in [
        (LEASES_LIVE, "Leases not yet consumed, released or expired."),
        (
            BLOCKS,
            "Blocks held in the host pool (sealed or being written).",
        ),
        (BLOCKS_SEALED, "Blocks every TP rank has written."),
        (
            PINNED_BLOCKS,
            "Blocks pinned by leases, transfers or peers.",
        ),
        (PINS, "Pins held on blocks."),
        (POOL_SLOTS, "Slots in the host pool."),
        (INSTANCES, "Registered engine instances."),
        (
            TRANSFERS_IN_FLIGHT,
            "Loads and saves whose copies have not drained.",
        ),
        (PEER_PINS, "Pins this node holds for peers."),
        (
            DIRECTORY_BREAKER_OPEN,
            "1 while the directory's breaker is open or half-open: queries plan without it.",
        ),
        (
            DIRECTORY_PENDING,
            "Block updates queued for the directory and not yet written.",
        ),
        (
            MRS_REGISTERED,
            "Registrations in each nic's MR table (deferred deregistrations included).",
        ),
        (
            QPS,
            "Queue pairs by nic and state (reset, init, rtr, rts, error).",
        ),
        (
            ENGINE_SESSIONS,
            "Open engine sessions (each unregisters its instances when it ends).",
        ),
        (
            ENGINE_MEMORY_HANDLES,
            "Client memory (memfd or DMA-BUF) passed on the fd socket and held.",
        ),
        (
            ENGINE_LOADS_PENDING,
            "Engine loads accepted and not yet completed.",
        ),
        (
            ENGINE_COMPLETIONS_RETAINED,
            "Load completions waiting for a stream or poll.",
        ),
        (
            ENGINE_MAILBOXES,
            "Request mailboxes attached to engine sessions (a node thread each).",
        ),
        (SSD_BLOCKS, "Blocks held on SSD."),
        (SSD_CAPACITY_BLOCKS, "Block slots of the SSD directories."),
        (
            SSD_HELD_BLOCKS,
            "SSD blocks held for leases (not evictable until the lease is gone).",
        ),
        (
            SSD_STAGING_SLOTS,
            "Pool slots lent to loads for their SSD reads.",
        ),
    ] {
        describe_gauge!(name, help);
    }
    for (name, help) in [
        (LEASES_EXPIRED, "Leases removed by expiry."),
        (EVICTIONS, "Blocks evicted from the host pool."),
        (QUERIES, "Queries by result (local, remote, miss)."),
        (
            ABANDONED,
            "Requests whose client gave up before they took effect, by op: saves and puts \
             whose blocks were discarded unsealed, queries whose lease was released.",
        ),
        (
            QUERY_BLOCKS,
            "Queried blocks by where they were found (ram, ssd, remote, miss); they sum to the hashes queried.",
        ),
        (
            LOADS,
            "Transfers by path (local, direct, staged, save) and status.",
        ),
        (DIRECTORY_OPERATIONS, "Directory operations by kind."),
        (
            DIRECTORY_BREAKER_TRIPS,
            "Times the directory's breaker opened.",
        ),
        (
            DIRECTORY_LOOKUPS_SKIPPED,
            "Lookups answered without the directory, its breaker being open.",
        ),
        (
            DIRECTORY_REANNOUNCES,
            "Times this process's nodes re-announced all they hold (after an outage or a restart of the directory).",
        ),
        (
            DIRECTORY_FAILURES,
            "Directory calls that failed or missed their deadline, by op.",
        ),
        (
            MR_REGISTRATIONS,
            "Memory registrations made, by nic and kind (host, device).",
        ),
        (
            MR_REGISTRATION_FAILURES,
            "Memory registrations refused, by nic, kind and reason.",
        ),
        (
            COMPLETION_ERRORS,
            "Reads reported with an error, by nic and completion status (flushes included).",
        ),
        (
            ENGINE_COMPLETIONS_DROPPED,
            "Load completions dropped uncollected, over the retention bound.",
        ),
        (
            ENGINE_MAILBOX_REQUESTS,
            "Query and Load requests served from request mailboxes.",
        ),
        (SSD_EVICTIONS, "Blocks evicted from SSD by capacity."),
        (SSD_WRITES, "Blocks written to SSD."),
        (
            SSD_WRITE_ERRORS,
            "SSD block writes that failed (disk full included).",
        ),
        (SSD_DISK_FULL, "SSD block writes refused for lack of space."),
        (
            SSD_WRITES_SKIPPED,
            "SSD block writes not made, by reason: busy (every SSD slot was being read, written or held), backlog (the write backlog was full: a block evicted from RAM that left the node).",
        ),
        (
            SSD_READS,
            "Blocks read from SSD (into staging slots for loads, into RAM for peers).",
        ),
        (
            SSD_READ_ERRORS,
            "SSD block reads that failed with an I/O error.",
        ),
        (
            SSD_PROMOTE_NO_ROOM,
            "Peer pins of SSD-held blocks cut short: no RAM slot to read them into.",
        ),
        (
            SSD_DAMAGED_BLOCKS,
            "Blocks read from SSD that were torn or corrupt (a miss, never served), by damage (header, key, checksum).",
        ),
        (
            SSD_HIT_BLOCKS,
            "Blocks of the local prefix by tier (ram, ssd).",
        ),
    ] {
        describe_counter!(name, help);
    }
    describe_counter!(
        SSD_WRITE_BYTES,
        Unit::Bytes,
        "Bytes written to SSD (headers and padding included)."
    );
    describe_counter!(SSD_READ_BYTES, Unit::Bytes, "Block bytes read from SSD.");
    for (name, help) in [
        (
            SSD_WRITE_BACKLOG_BYTES,
            "Memory held by copies of blocks queued for the SSD directories.",
        ),
        (
            SSD_WRITE_BACKLOG_PEAK_BYTES,
            "The most memory the SSD write backlog ever held.",
        ),
        (
            SSD_WRITE_BACKLOG_LIMIT_BYTES,
            "The SSD write backlog's bound (ssd.write-backlog).",
        ),
    ] {
        describe_gauge!(name, Unit::Bytes, help);
    }
    describe_counter!(
        BYTES,
        Unit::Bytes,
        "Bytes moved by successful transfers, by path."
    );
    describe_histogram!(
        STAGE_SECONDS,
        Unit::Seconds,
        "Seconds per transfer stage (plan, pin, register, post, wire, h2d, d2h, fence)."
    );
    describe_histogram!(
        DIRECTORY_CALL_SECONDS,
        Unit::Seconds,
        "Seconds per directory call (lookup; write: one pipeline), failed ones included."
    );
}

/// Histogram samples wait in the recorder until a scrape or an upkeep folds them into
/// buckets; a node nobody scrapes folds them every this many samples, so they stay bounded.
const UPKEEP_EVERY: u64 = 4096;

/// A Prometheus recorder and its handle: what one node (or the process) records into.
struct Registry {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    samples: AtomicU64,
}

impl Registry {
    fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(STAGE_SECONDS.into()), &STAGE_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(DIRECTORY_CALL_SECONDS.into()),
                    &STAGE_BUCKETS,
                )
            })
            // Only fails for an empty bucket list; STAGE_BUCKETS is a non-empty constant.
            .expect("STAGE_BUCKETS is not empty")
            .build_recorder();
        let handle = recorder.handle();
        with_local_recorder(&recorder, describe);
        Self {
            recorder,
            handle,
            samples: AtomicU64::new(0),
        }
    }

    fn record<T>(&self, f: impl FnOnce() -> T) -> T {
        with_local_recorder(&self.recorder, f)
    }

    /// Counts histogram samples just recorded, folding them in now and then.
    fn sampled(&self, n: u64) {
        let before = self.samples.fetch_add(n, Ordering::Relaxed);
        if before / UPKEEP_EVERY != (before + n) / UPKEEP_EVERY {
            self.handle.run_upkeep();
        }
    }

    fn render(&self) -> String {
        self.handle.render()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// The process's recorder: what belongs to no single node.
fn process() -> &'static Registry {
    static PROCESS: OnceLock<Registry> = OnceLock::new();
    PROCESS.get_or_init(Registry::new)
}

/// One call to a networked directory (`op`: `lookup`, or `write` for one pipeline), failed
/// ones included. The directory is shared by this process's nodes, so its latencies are the
/// process's.
pub fn directory_call(op: &'static str, seconds: f64) {
    let p = process();
    p.record(|| record_directory_call(op, seconds));
    p.sampled(1);
}

fn record_directory_call(op: &'static str, seconds: f64) {
    histogram!(DIRECTORY_CALL_SECONDS, "op" => op).record(seconds);
}

/// How often one kind of failed transfer is logged per path.
pub const FAILURE_LOG_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);
static FAILURES: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(FAILURE_LOG_PERIOD);
static ABANDONS: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(FAILURE_LOG_PERIOD);

/// What a node counts as it happens: the plain counters `Node::stats` reads, and the
/// families of its own recorder.
#[derive(Debug)]
pub struct Counters {
    pub transfers_in_flight: AtomicUsize,
    pub loads_ok: AtomicU64,
    pub loads_failed: AtomicU64,
    pub bytes_loaded: AtomicU64,
    registry: Registry,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            transfers_in_flight: AtomicUsize::new(0),
            loads_ok: AtomicU64::new(0),
            loads_failed: AtomicU64::new(0),
            bytes_loaded: AtomicU64::new(0),
            registry: Registry::new(),
        }
    }
}

impl Counters {
    pub fn load(&self, ok: bool, bytes: u64) {
        if ok {
            self.loads_ok.fetch_add(1, Ordering::Relaxed);
            self.bytes_loaded.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.loads_failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records one finished transfer: by path and status, its bytes and its stages.
    pub fn transfer(&self, path: &'static str, out: Result<&TransferReport, ()>) {
        let stages = self.registry.record(|| record_transfer(path, out));
        self.registry.sampled(stages as u64);
    }

    /// Logs a failed transfer with its kind (the error's variant): at most one line per
    /// path and kind every [`FAILURE_LOG_PERIOD`], saying how many it stands for, since a
    /// fault (a peer gone, a full pool) fails every load until it clears.
    pub fn log_failure(&self, path: &'static str, e: &crate::error::NodeError) {
        let debug = format!("{e:?}");
        let kind = debug
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .next()
            .unwrap_or("");
        if let Some(held_back) = FAILURES.allow(&format!("{path}/{kind}")) {
            tracing::warn!(path, kind, error = %e, held_back, "transfer failed");
        }
    }

    /// Records a query by result: `local`, `remote` (some blocks from peers) or `miss`.
    pub fn query(&self, result: &'static str) {
        self.registry.record(|| record_query(result));
    }

    /// Counts a request discarded because its client's fence passed (`op`: save,
    /// put_blocks, query) and logs it, at most one line per op every
    /// [`FAILURE_LOG_PERIOD`].
    pub fn abandoned(&self, op: &'static str, blocks: usize, late: std::time::Duration) {
        self.registry
            .record(|| counter!(ABANDONED, "op" => op).increment(1));
        if let Some(held_back) = ABANDONS.allow(op) {
            tracing::warn!(
                op,
                blocks,
                late_ms = late.as_millis() as u64,
                held_back,
                "the client gave up before the request took effect; discarded"
            );
        }
    }

    /// Records where a query's blocks were found: this node's RAM or SSD, a peer, nowhere.
    pub fn query_blocks(&self, ram: usize, ssd: usize, remote: usize, miss: usize) {
        self.registry
            .record(|| record_query_blocks(ram, ssd, remote, miss));
    }
}

/// Returns the stage samples recorded.
fn record_transfer(path: &'static str, out: Result<&TransferReport, ()>) -> usize {
    match out {
        Ok(r) => {
            counter!(LOADS, "path" => path, "status" => "ok").increment(1);
            counter!(BYTES, "path" => path).increment(r.bytes);
            for s in &r.stages {
                histogram!(STAGE_SECONDS, "path" => path, "stage" => s.name.as_str())
                    .record(s.seconds);
            }
            r.stages.len()
        }
        Err(()) => {
            counter!(LOADS, "path" => path, "status" => "error").increment(1);
            0
        }
    }
}

fn record_query(result: &'static str) {
    counter!(QUERIES, "result" => result).increment(1);
}

fn record_query_blocks(ram: usize, ssd: usize, remote: usize, miss: usize) {
    for (tier, n) in [
        ("ram", ram),
        ("ssd", ssd),
        ("remote", remote),
        ("miss", miss),
    ] {
        counter!(QUERY_BLOCKS, "tier" => tier).increment(n as u64);
    }
}

/// Counts one transfer in flight for as long as it lives.
#[derive(Debug)]
pub struct InFlight(pub(crate) Arc<Counters>);

impl InFlight {
    pub fn new(c: Arc<Counters>) -> Self {
        c.transfers_in_flight.fetch_add(1, Ordering::Relaxed);
        Self(c)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.transfers_in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

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
fn record_scrape(stats: &Stats, extra: &Extra) {
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

/// The Prometheus text exposition of a node: its own recorder after this scrape's values,
/// then, for a node whose directory is across the network, the process's directory call
/// latencies. Labels are low-cardinality only (path, status, stage, result, op, nic, kind,
/// reason, state).
pub fn render(stats: &Stats, c: &Counters, extra: Extra) -> String {
    render_with(stats, c, &extra, process())
}

fn render_with(stats: &Stats, c: &Counters, extra: &Extra, process: &Registry) -> String {
    c.registry.record(|| record_scrape(stats, extra));
    let mut text = c.registry.render();
    if extra.directory.as_ref().is_some_and(|d| d.health.is_some()) {
        text.push_str(&process.render());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Stage;
    use crate::peer::{BreakerState, DirectoryHealth, DirectoryStats};

    fn report() -> TransferReport {
        TransferReport {
            spans: Vec::new(),
            path: crate::api::TransferPath::Direct,
            blocks: 2,
            bytes: 4096,
            copies: 2,
            seconds: 0.002,
            stages: vec![
                Stage {
                    name: crate::api::StageName::Wire,
                    seconds: 0.0015,
                },
                Stage {
                    name: crate::api::StageName::Plan,
                    seconds: 2e-6,
                },
            ],
        }
    }

    fn nic_metrics() -> NicMetrics {
        use crate::nic::{RegistryCounts, WorkerGaugeValues};
        let mut w = WorkerGaugeValues::default();
        w.states.rts = 2;
        w.states.error = 1;
        w.completion_errors.flushed = 5;
        NicMetrics {
            registry: RegistryCounts {
                made: vec![("mlx5_0".into(), "host", 1)],
                failed: vec![("mlx5_1".into(), "host", "nic_unavailable", 1)],
                registered: vec![("mlx5_0".into(), 1), ("mlx5_1".into(), 0)],
            },
            workers: vec![("mlx5_0".into(), w), ("mlx5_1".into(), Default::default())],
        }
    }

    fn directory_stats() -> DirectoryStats {
        DirectoryStats {
            lookups: 9,
            health: Some(DirectoryHealth {
                breaker: BreakerState::HalfOpen,
                trips: 2,
                lookups_skipped: 7,
                lookup_failures: 3,
                write_failures: 1,
                reannounces: 1,
                pending: 5,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Every family in one scrape: each declared once, with HELP and TYPE.
    fn assert_declared_once(text: &str) {
        let mut names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(n, names.len(), "a family declared twice:\n{text}");
        for name in names {
            assert!(text.contains(&format!("# HELP {name} ")), "{name}:\n{text}");
        }
    }

    #[test]
    fn renders_families_histograms_and_labels() {
        let c = Counters::default();
        c.transfer("direct", Ok(&report()));
        c.transfer("direct", Err(()));
        c.query("remote");
        let text = render(
            &Stats {
                leases_live: 3,
                ..Default::default()
            },
            &c,
            Extra::default(),
        );
        for line in [
            "kvferry_leases_live 3\n",
            "kvferry_loads_total{path=\"direct\",status=\"ok\"} 1\n",
            "kvferry_loads_total{path=\"direct\",status=\"error\"} 1\n",
            "kvferry_bytes_total{path=\"direct\"} 4096\n",
            // 1.5 ms falls in the 2.5 ms bucket and above, not the 1 ms one.
            "kvferry_stage_seconds_bucket{path=\"direct\",stage=\"wire\",le=\"0.001\"} 0\n",
            "kvferry_stage_seconds_bucket{path=\"direct\",stage=\"wire\",le=\"0.0025\"} 1\n",
            "kvferry_stage_seconds_bucket{path=\"direct\",stage=\"wire\",le=\"+Inf\"} 1\n",
            "kvferry_stage_seconds_count{path=\"direct\",stage=\"wire\"} 1\n",
            "kvferry_queries_total{result=\"remote\"} 1\n",
            "# TYPE kvferry_stage_seconds histogram\n",
            "# TYPE kvferry_loads_total counter\n",
            "# TYPE kvferry_leases_live gauge\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        assert_declared_once(&text);
        // A second scrape shows the same totals: sampled values are not added twice.
        let text = render(&Stats::default(), &c, Extra::default());
        assert!(text.contains("kvferry_loads_total{path=\"direct\",status=\"ok\"} 1\n"));
        assert!(text.contains("kvferry_stage_seconds_count{path=\"direct\",stage=\"wire\"} 1\n"));
        assert!(text.contains("kvferry_leases_live 0\n"), "{text}");
    }

    /// A fault that fails every load is logged once per path and kind, not once per load.
    #[test]
    fn failed_transfers_are_logged_once_per_path_and_kind() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .finish();
        let c = Counters::default();
        tracing::subscriber::with_default(subscriber, || {
            let gone = crate::error::NodeError::remote(
                "b",
                crate::peer::RemoteError::lost("a read", "gone"),
            );
            for _ in 0..5 {
                c.log_failure("test-staged", &gone);
            }
            c.log_failure(
                "test-staged",
                &crate::error::NodeError::Stopped { what: "test" },
            );
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].contains("kind=\"Remote\"") || lines[0].contains("kind=Remote"),
            "{text}"
        );
        assert!(
            lines[0].contains("peer b: the link broke during a read"),
            "{text}"
        );
        assert!(lines[1].contains("Stopped"), "{text}");
    }

    /// The SSD tier's families in a node's scrape, with the names its own renderer had.
    #[test]
    fn renders_the_ssd_tier() {
        let text = render(
            &Stats::default(),
            &Counters::default(),
            Extra {
                ssd: Some(crate::tier::ssd::SsdStats {
                    blocks: 5,
                    capacity_blocks: 64,
                    write_bytes: 4096,
                    damaged: [0, 0, 1],
                    hits_ssd: 3,
                    ..Default::default()
                }),
                ..Extra::default()
            },
        );
        for line in [
            "kvferry_ssd_blocks 5\n",
            "kvferry_ssd_capacity_blocks 64\n",
            "kvferry_ssd_write_bytes_total 4096\n",
            "kvferry_ssd_damaged_blocks_total{damage=\"checksum\"} 1\n",
            "kvferry_ssd_damaged_blocks_total{damage=\"header\"} 0\n",
            "kvferry_ssd_hit_blocks_total{tier=\"ssd\"} 3\n",
            "kvferry_ssd_hit_blocks_total{tier=\"ram\"} 0\n",
            "# TYPE kvferry_ssd_reads_total counter\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        assert_declared_once(&text);
        // A node without the tier shows none of it.
        let text = render(&Stats::default(), &Counters::default(), Extra::default());
        assert!(!text.contains("kvferry_ssd_"), "{text}");
    }

    /// Two nodes in one process (the in-process cluster) keep their own numbers.
    #[test]
    fn each_node_renders_its_own_numbers() {
        let (a, b) = (Counters::default(), Counters::default());
        a.query("local");
        a.query("local");
        b.query("miss");
        let ta = render(&Stats::default(), &a, Extra::default());
        let tb = render(&Stats::default(), &b, Extra::default());
        assert!(
            ta.contains("kvferry_queries_total{result=\"local\"} 2\n"),
            "{ta}"
        );
        assert!(!ta.contains("result=\"miss\""), "{ta}");
        assert!(
            tb.contains("kvferry_queries_total{result=\"miss\"} 1\n"),
            "{tb}"
        );
        assert!(!tb.contains("result=\"local\""), "{tb}");
    }

    /// Histogram samples of a node nobody scrapes are folded in as they come.
    #[test]
    fn unscraped_stage_samples_stay_bounded_and_are_all_counted() {
        let c = Counters::default();
        let r = report();
        let n = UPKEEP_EVERY as usize + 10;
        for _ in 0..n / 2 + 1 {
            c.transfer("direct", Ok(&r));
        }
        let text = render(&Stats::default(), &c, Extra::default());
        let want = format!(
            "kvferry_stage_seconds_count{{path=\"direct\",stage=\"wire\"}} {}\n",
            n / 2 + 1
        );
        assert!(text.contains(&want), "{want}{text}");
    }

    #[test]
    fn renders_nic_families_once_with_low_cardinality_labels() {
        let text = render(
            &Stats::default(),
            &Counters::default(),
            Extra {
                nic: Some(nic_metrics()),
                ..Extra::default()
            },
        );
        for line in [
            "kvferry_mr_registrations_total{nic=\"mlx5_0\",kind=\"host\"} 1\n",
            "kvferry_mr_registration_failures_total{nic=\"mlx5_1\",kind=\"host\",reason=\"nic_unavailable\"} 1\n",
            "kvferry_mrs_registered{nic=\"mlx5_1\"} 0\n",
            "kvferry_mr_registrations_total{nic=\"mlx5_1\",kind=\"device\"} 0\n",
            "kvferry_qps{nic=\"mlx5_0\",state=\"rts\"} 2\n",
            "kvferry_qps{nic=\"mlx5_0\",state=\"error\"} 1\n",
            "kvferry_qps{nic=\"mlx5_1\",state=\"reset\"} 0\n",
            "kvferry_completion_errors_total{nic=\"mlx5_0\",status=\"flushed\"} 5\n",
            "kvferry_completion_errors_total{nic=\"mlx5_1\",status=\"remote_access_error\"} 0\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        assert_declared_once(&text);
        // Five states per nic, six error statuses per nic.
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("kvferry_qps{"))
                .count(),
            10
        );
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("kvferry_completion_errors_total{"))
                .count(),
            12
        );
    }

    #[test]
    fn renders_the_directory_breaker_failures_and_latency() {
        let process = Registry::new();
        process.record(|| {
            record_directory_call("lookup", 0.003);
            record_directory_call("lookup", 0.2);
            record_directory_call("write", 0.0001);
        });
        let extra = Extra {
            directory: Some(directory_stats()),
            ..Extra::default()
        };
        let text = render_with(&Stats::default(), &Counters::default(), &extra, &process);
        for line in [
            "kvferry_directory_operations_total{op=\"lookup\"} 9\n",
            "kvferry_directory_breaker_open 1\n",
            "kvferry_directory_breaker_trips_total 2\n",
            "kvferry_directory_lookups_skipped_total 7\n",
            "kvferry_directory_reannounces_total 1\n",
            "kvferry_directory_failures_total{op=\"lookup\"} 3\n",
            "kvferry_directory_failures_total{op=\"write\"} 1\n",
            "kvferry_directory_pending_updates 5\n",
            "kvferry_directory_call_seconds_bucket{op=\"lookup\",le=\"0.005\"} 1\n",
            "kvferry_directory_call_seconds_bucket{op=\"lookup\",le=\"1\"} 2\n",
            "kvferry_directory_call_seconds_count{op=\"write\"} 1\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        assert_declared_once(&text);
        // In-process directories have no breaker and no call latencies to show.
        let extra = Extra {
            directory: Some(DirectoryStats::default()),
            ..Extra::default()
        };
        let text = render_with(&Stats::default(), &Counters::default(), &extra, &process);
        assert!(text.contains("kvferry_directory_operations_total"));
        assert!(!text.contains("kvferry_directory_breaker_open"));
        assert!(!text.contains("kvferry_directory_call_seconds"));
    }

    /// The names, kinds, units and labels this crate exports, as a recorder sees them: a
    /// renamed family or a new label fails here before an operator's dashboard does.
    #[test]
    fn exported_names_kinds_and_labels_through_the_debugging_recorder() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        use metrics_util::MetricKind;
        use std::collections::{BTreeMap, BTreeSet};

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        with_local_recorder(&recorder, || {
            describe();
            record_transfer("staged", Ok(&report()));
            record_transfer("staged", Err(()));
            record_query("miss");
            record_query_blocks(3, 1, 0, 2);
            record_directory_call("write", 0.01);
            record_scrape(
                &Stats {
                    pins: 4,
                    evictions: 2,
                    ..Default::default()
                },
                &Extra {
                    peer_pins: 1,
                    directory: Some(directory_stats()),
                    nic: Some(nic_metrics()),
                    engine: Some(EngineGauges {
                        sessions: 1,
                        completions_dropped: 3,
                        ..Default::default()
                    }),
                    ssd: Some(crate::tier::ssd::SsdStats {
                        blocks: 5,
                        damaged: [0, 0, 1],
                        hits_ssd: 3,
                        ..Default::default()
                    }),
                },
            );
        });
        let mut seen: BTreeMap<String, (MetricKind, BTreeSet<String>)> = BTreeMap::new();
        let mut described = BTreeSet::new();
        for (key, unit, help, value) in snapshotter.snapshot().into_vec() {
            let (kind, key) = key.into_parts();
            let name = key.name().to_owned();
            if help.is_some() {
                described.insert(name.clone());
            }
            match (&value, kind) {
                (DebugValue::Counter(_), MetricKind::Counter)
                | (DebugValue::Gauge(_), MetricKind::Gauge)
                | (DebugValue::Histogram(_), MetricKind::Histogram) => {}
                _ => panic!("{name}: {kind:?} with {value:?}"),
            }
            if kind == MetricKind::Histogram {
                assert_eq!(unit, Some(Unit::Seconds), "{name}");
            }
            let entry = seen.entry(name).or_insert_with(|| (kind, BTreeSet::new()));
            assert_eq!(entry.0, kind, "one kind per family");
            entry.1.extend(key.labels().map(|l| l.key().to_owned()));
        }
        let want: BTreeMap<&str, (MetricKind, &[&str])> = [
            (LEASES_LIVE, (MetricKind::Gauge, &[][..])),
            (BLOCKS, (MetricKind::Gauge, &[][..])),
            (BLOCKS_SEALED, (MetricKind::Gauge, &[][..])),
            (PINNED_BLOCKS, (MetricKind::Gauge, &[][..])),
            (PINS, (MetricKind::Gauge, &[][..])),
            (POOL_SLOTS, (MetricKind::Gauge, &[][..])),
            (INSTANCES, (MetricKind::Gauge, &[][..])),
            (TRANSFERS_IN_FLIGHT, (MetricKind::Gauge, &[][..])),
            (PEER_PINS, (MetricKind::Gauge, &[][..])),
            (LEASES_EXPIRED, (MetricKind::Counter, &[][..])),
            (EVICTIONS, (MetricKind::Counter, &[][..])),
            (QUERIES, (MetricKind::Counter, &["result"][..])),
            (QUERY_BLOCKS, (MetricKind::Counter, &["tier"][..])),
            (LOADS, (MetricKind::Counter, &["path", "status"][..])),
            (BYTES, (MetricKind::Counter, &["path"][..])),
            (
                STAGE_SECONDS,
                (MetricKind::Histogram, &["path", "stage"][..]),
            ),
            (DIRECTORY_OPERATIONS, (MetricKind::Counter, &["op"][..])),
            (DIRECTORY_BREAKER_OPEN, (MetricKind::Gauge, &[][..])),
            (DIRECTORY_BREAKER_TRIPS, (MetricKind::Counter, &[][..])),
            (DIRECTORY_LOOKUPS_SKIPPED, (MetricKind::Counter, &[][..])),
            (DIRECTORY_REANNOUNCES, (MetricKind::Counter, &[][..])),
            (DIRECTORY_FAILURES, (MetricKind::Counter, &["op"][..])),
            (DIRECTORY_PENDING, (MetricKind::Gauge, &[][..])),
            (DIRECTORY_CALL_SECONDS, (MetricKind::Histogram, &["op"][..])),
            (
                MR_REGISTRATIONS,
                (MetricKind::Counter, &["kind", "nic"][..]),
            ),
            (
                MR_REGISTRATION_FAILURES,
                (MetricKind::Counter, &["kind", "nic", "reason"][..]),
            ),
            (MRS_REGISTERED, (MetricKind::Gauge, &["nic"][..])),
            (QPS, (MetricKind::Gauge, &["nic", "state"][..])),
            (
                COMPLETION_ERRORS,
                (MetricKind::Counter, &["nic", "status"][..]),
            ),
            (ENGINE_SESSIONS, (MetricKind::Gauge, &[][..])),
            (ENGINE_MEMORY_HANDLES, (MetricKind::Gauge, &[][..])),
            (ENGINE_LOADS_PENDING, (MetricKind::Gauge, &[][..])),
            (ENGINE_COMPLETIONS_RETAINED, (MetricKind::Gauge, &[][..])),
            (ENGINE_COMPLETIONS_DROPPED, (MetricKind::Counter, &[][..])),
            (ENGINE_MAILBOXES, (MetricKind::Gauge, &[][..])),
            (ENGINE_MAILBOX_REQUESTS, (MetricKind::Counter, &[][..])),
            (SSD_BLOCKS, (MetricKind::Gauge, &[][..])),
            (SSD_CAPACITY_BLOCKS, (MetricKind::Gauge, &[][..])),
            (SSD_HELD_BLOCKS, (MetricKind::Gauge, &[][..])),
            (SSD_STAGING_SLOTS, (MetricKind::Gauge, &[][..])),
            (SSD_EVICTIONS, (MetricKind::Counter, &[][..])),
            (SSD_WRITES, (MetricKind::Counter, &[][..])),
            (SSD_WRITE_BYTES, (MetricKind::Counter, &[][..])),
            (SSD_WRITE_ERRORS, (MetricKind::Counter, &[][..])),
            (SSD_DISK_FULL, (MetricKind::Counter, &[][..])),
            (SSD_WRITES_SKIPPED, (MetricKind::Counter, &["reason"][..])),
            (SSD_WRITE_BACKLOG_BYTES, (MetricKind::Gauge, &[][..])),
            (SSD_WRITE_BACKLOG_PEAK_BYTES, (MetricKind::Gauge, &[][..])),
            (SSD_WRITE_BACKLOG_LIMIT_BYTES, (MetricKind::Gauge, &[][..])),
            (SSD_READS, (MetricKind::Counter, &[][..])),
            (SSD_READ_BYTES, (MetricKind::Counter, &[][..])),
            (SSD_READ_ERRORS, (MetricKind::Counter, &[][..])),
            (SSD_PROMOTE_NO_ROOM, (MetricKind::Counter, &[][..])),
            (SSD_DAMAGED_BLOCKS, (MetricKind::Counter, &["damage"][..])),
            (SSD_HIT_BLOCKS, (MetricKind::Counter, &["tier"][..])),
        ]
        .into_iter()
        .collect();
        let got: BTreeMap<&str, (MetricKind, Vec<&str>)> = seen
            .iter()
            .map(|(n, (k, l))| (n.as_str(), (*k, l.iter().map(String::as_str).collect())))
            .collect();
        let want: BTreeMap<&str, (MetricKind, Vec<&str>)> = want
            .into_iter()
            .map(|(n, (k, l))| (n, (k, l.to_vec())))
            .collect();
        assert_eq!(got, want);
        for name in got.keys() {
            assert!(name.starts_with("kvferry_"), "{name}");
            assert!(described.contains(*name), "{name} has no describe()");
            let counter = got[name].0 == MetricKind::Counter;
            assert_eq!(
                counter,
                name.ends_with("_total"),
                "{name}: counters end in _total"
            );
        }
    }
}
