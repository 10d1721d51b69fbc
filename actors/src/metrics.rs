//! Counters, gauges and stage histograms shared by the actors. `Node::stats` reads the
//! gauges; [`render`] writes everything in the Prometheus text format for `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::api::{Stats, TransferReport};

/// Upper bounds (seconds) of the stage histograms: 10 us to 10 s.
pub const STAGE_BUCKETS: [f64; 13] = [
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 1.0, 10.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    buckets: [u64; STAGE_BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (b, le) in self.buckets.iter_mut().zip(STAGE_BUCKETS) {
            if v <= le {
                *b += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

#[derive(Debug, Default)]
pub struct Counters {
    pub transfers_in_flight: AtomicUsize,
    pub loads_ok: AtomicU64,
    pub loads_failed: AtomicU64,
    pub bytes_loaded: AtomicU64,
    /// (path, status) → loads; path → bytes; (path, stage) → seconds; result → queries.
    loads: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    bytes: Mutex<BTreeMap<&'static str, u64>>,
    stages: Mutex<BTreeMap<(&'static str, &'static str), Histogram>>,
    queries: Mutex<BTreeMap<&'static str, u64>>,
}

fn bump<K: Ord>(m: &Mutex<BTreeMap<K, u64>>, k: K, by: u64) {
    let mut g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *g.entry(k).or_default() += by;
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
        match out {
            Ok(r) => {
                bump(&self.loads, (path, "ok"), 1);
                bump(&self.bytes, path, r.bytes);
                let mut h = self
                    .stages
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for s in &r.stages {
                    h.entry((path, s.name)).or_default().observe(s.seconds);
                }
            }
            Err(()) => bump(&self.loads, (path, "error"), 1),
        }
    }

    /// Records a query by result: `local`, `remote` (some blocks from peers) or `miss`.
    pub fn query(&self, result: &'static str) {
        bump(&self.queries, result, 1);
    }
}

/// Counts one transfer in flight for as long as it lives.
#[derive(Debug)]
pub struct InFlight(pub(crate) std::sync::Arc<Counters>);

impl InFlight {
    pub fn new(c: std::sync::Arc<Counters>) -> Self {
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
    pub directory: Option<crate::remote::directory::DirectoryStats>,
    /// The node's `[[nic]]` runtime, when it has one.
    pub nic: Option<NicMetrics>,
    /// The engine service, while one serves this node.
    pub engine: Option<EngineGauges>,
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
}

/// Where a node's scrape reads the engine service's gauges from.
pub trait EngineProbe: Send + Sync {
    fn engine_gauges(&self) -> EngineGauges;
}

fn render_engine(o: &mut String, g: &EngineGauges) {
    for (name, help, v) in [
        (
            "kvferry_engine_sessions",
            "Open engine sessions (each unregisters its instances when it ends).",
            g.sessions,
        ),
        (
            "kvferry_engine_memory_handles",
            "Client memory (memfd or DMA-BUF) passed on the fd socket and held.",
            g.memory_handles,
        ),
        (
            "kvferry_engine_loads_pending",
            "Engine loads accepted and not yet completed.",
            g.loads_pending,
        ),
        (
            "kvferry_engine_completions_retained",
            "Load completions waiting for a stream or poll.",
            g.completions_retained,
        ),
    ] {
        family(o, name, "gauge", help);
        sample(o, name, "", v);
    }
    family(
        o,
        "kvferry_engine_completions_dropped_total",
        "counter",
        "Load completions dropped uncollected, over the retention bound.",
    );
    sample(
        o,
        "kvferry_engine_completions_dropped_total",
        "",
        g.completions_dropped,
    );
}

/// What the NIC actors report for a scrape: memory registrations by NIC, kind and failure
/// reason; each NIC worker's QPs by state and completion errors by status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicMetrics {
    pub registry: crate::nic::RegistryCounts,
    /// (nic, its worker's gauges).
    pub workers: Vec<(String, crate::nic::WorkerGaugeValues)>,
}

/// Metric names of the NIC actors.
pub const MR_REGISTRATIONS: &str = "kvferry_mr_registrations_total";
pub const MR_REGISTRATION_FAILURES: &str = "kvferry_mr_registration_failures_total";
pub const MRS_REGISTERED: &str = "kvferry_mrs_registered";
pub const QPS: &str = "kvferry_qps";
pub const COMPLETION_ERRORS: &str = "kvferry_completion_errors_total";

fn render_nic(o: &mut String, m: &NicMetrics) {
    family(
        o,
        MR_REGISTRATIONS,
        "counter",
        "Memory registrations made, by nic and kind (host, device).",
    );
    for (nic, kind, n) in &m.registry.made {
        sample(
            o,
            MR_REGISTRATIONS,
            &format!("nic=\"{nic}\",kind=\"{kind}\""),
            n,
        );
    }
    family(
        o,
        MR_REGISTRATION_FAILURES,
        "counter",
        "Memory registrations refused, by nic, kind and reason.",
    );
    for (nic, kind, reason, n) in &m.registry.failed {
        sample(
            o,
            MR_REGISTRATION_FAILURES,
            &format!("nic=\"{nic}\",kind=\"{kind}\",reason=\"{reason}\""),
            n,
        );
    }
    family(
        o,
        MRS_REGISTERED,
        "gauge",
        "Registrations in each nic's MR table (deferred deregistrations included).",
    );
    for (nic, n) in &m.registry.registered {
        sample(o, MRS_REGISTERED, &format!("nic=\"{nic}\""), n);
    }
    family(
        o,
        QPS,
        "gauge",
        "Queue pairs by nic and state (reset, init, rtr, rts, error).",
    );
    for (nic, g) in &m.workers {
        for (state, n) in g.states.labelled() {
            sample(o, QPS, &format!("nic=\"{nic}\",state=\"{state}\""), n);
        }
    }
    family(
        o,
        COMPLETION_ERRORS,
        "counter",
        "Reads reported with an error, by nic and completion status (flushes included).",
    );
    for (nic, g) in &m.workers {
        for (status, n) in g.completion_errors.labelled() {
            sample(
                o,
                COMPLETION_ERRORS,
                &format!("nic=\"{nic}\",status=\"{status}\""),
                n,
            );
        }
    }
}

/// A directory across the network: its breaker, failed calls and call latencies.
fn render_directory_health(o: &mut String, h: &crate::remote::DirectoryHealth) {
    use crate::remote::BreakerState;
    family(
        o,
        "kvferry_directory_breaker_open",
        "gauge",
        "1 while the directory's breaker is open or half-open: queries plan without it.",
    );
    let open = u8::from(h.breaker != BreakerState::Closed);
    sample(o, "kvferry_directory_breaker_open", "", open);
    for (name, help, v) in [
        (
            "kvferry_directory_breaker_trips_total",
            "Times the directory's breaker opened.",
            h.trips,
        ),
        (
            "kvferry_directory_lookups_skipped_total",
            "Lookups answered without the directory, its breaker being open.",
            h.lookups_skipped,
        ),
        (
            "kvferry_directory_reannounces_total",
            "Times this process's nodes re-announced all they hold (after an outage or a restart of the directory).",
            h.reannounces,
        ),
    ] {
        family(o, name, "counter", help);
        sample(o, name, "", v);
    }
    family(
        o,
        "kvferry_directory_failures_total",
        "counter",
        "Directory calls that failed or missed their deadline, by op.",
    );
    for (op, n) in [
        ("lookup", h.lookup_failures),
        ("write", h.write_failures),
        ("probe", h.probe_failures),
    ] {
        sample(
            o,
            "kvferry_directory_failures_total",
            &format!("op=\"{op}\""),
            n,
        );
    }
    family(
        o,
        "kvferry_directory_pending_updates",
        "gauge",
        "Block updates queued for the directory and not yet written.",
    );
    sample(o, "kvferry_directory_pending_updates", "", h.pending);
    family(
        o,
        "kvferry_directory_call_seconds",
        "histogram",
        "Seconds per directory call (lookup; write: one pipeline), failed ones included.",
    );
    for (op, hist) in [("lookup", &h.lookup_seconds), ("write", &h.write_seconds)] {
        let base = format!("op=\"{op}\"");
        for (n, le) in hist.buckets.iter().zip(STAGE_BUCKETS) {
            sample(
                o,
                "kvferry_directory_call_seconds_bucket",
                &format!("{base},le=\"{le}\""),
                n,
            );
        }
        sample(
            o,
            "kvferry_directory_call_seconds_bucket",
            &format!("{base},le=\"+Inf\""),
            hist.count,
        );
        sample(o, "kvferry_directory_call_seconds_sum", &base, hist.sum);
        sample(o, "kvferry_directory_call_seconds_count", &base, hist.count);
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, v: impl std::fmt::Display) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {v}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {v}");
    }
}

/// The Prometheus text exposition of a node. Labels are low-cardinality only (path,
/// status, stage, result, nic, kind, reason, state).
pub fn render(stats: &Stats, c: &Counters, extra: Extra) -> String {
    let mut o = String::with_capacity(4096);
    let gauges: [(&str, &str, u64); 8] = [
        (
            "kvferry_leases_live",
            "Leases not yet consumed, released or expired.",
            stats.leases_live as u64,
        ),
        (
            "kvferry_blocks",
            "Blocks held in the host pool (sealed or being written).",
            stats.blocks as u64,
        ),
        (
            "kvferry_blocks_sealed",
            "Blocks every TP rank has written.",
            stats.sealed_blocks as u64,
        ),
        (
            "kvferry_pinned_blocks",
            "Blocks pinned by leases, transfers or peers.",
            stats.pinned_blocks as u64,
        ),
        ("kvferry_pins", "Pins held on blocks.", stats.pins),
        (
            "kvferry_pool_slots",
            "Slots in the host pool.",
            stats.pool_slots as u64,
        ),
        (
            "kvferry_instances",
            "Registered engine instances.",
            stats.instances as u64,
        ),
        (
            "kvferry_transfers_in_flight",
            "Loads and saves whose copies have not drained.",
            stats.transfers_in_flight as u64,
        ),
    ];
    for (name, help, v) in gauges {
        family(&mut o, name, "gauge", help);
        sample(&mut o, name, "", v);
    }
    family(
        &mut o,
        "kvferry_peer_pins",
        "gauge",
        "Pins this node holds for peers.",
    );
    sample(&mut o, "kvferry_peer_pins", "", extra.peer_pins);
    family(
        &mut o,
        "kvferry_leases_expired_total",
        "counter",
        "Leases removed by expiry.",
    );
    sample(
        &mut o,
        "kvferry_leases_expired_total",
        "",
        stats.leases_expired,
    );
    family(
        &mut o,
        "kvferry_evictions_total",
        "counter",
        "Blocks evicted from the host pool.",
    );
    sample(&mut o, "kvferry_evictions_total", "", stats.evictions);

    family(
        &mut o,
        "kvferry_queries_total",
        "counter",
        "Queries by result (local, remote, miss).",
    );
    for (result, n) in c
        .queries
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        sample(
            &mut o,
            "kvferry_queries_total",
            &format!("result=\"{result}\""),
            n,
        );
    }
    family(
        &mut o,
        "kvferry_loads_total",
        "counter",
        "Transfers by path (local, direct, staged, save) and status.",
    );
    for ((path, status), n) in c
        .loads
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        sample(
            &mut o,
            "kvferry_loads_total",
            &format!("path=\"{path}\",status=\"{status}\""),
            n,
        );
    }
    family(
        &mut o,
        "kvferry_bytes_total",
        "counter",
        "Bytes moved by successful transfers, by path.",
    );
    for (path, n) in c
        .bytes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        sample(
            &mut o,
            "kvferry_bytes_total",
            &format!("path=\"{path}\""),
            n,
        );
    }
    family(
        &mut o,
        "kvferry_stage_seconds",
        "histogram",
        "Seconds per transfer stage (plan, pin, register, post, wire, h2d, d2h, fence).",
    );
    for ((path, stage), h) in c
        .stages
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        let base = format!("path=\"{path}\",stage=\"{stage}\"");
        for (n, le) in h.buckets.iter().zip(STAGE_BUCKETS) {
            sample(
                &mut o,
                "kvferry_stage_seconds_bucket",
                &format!("{base},le=\"{le}\""),
                n,
            );
        }
        sample(
            &mut o,
            "kvferry_stage_seconds_bucket",
            &format!("{base},le=\"+Inf\""),
            h.count,
        );
        sample(&mut o, "kvferry_stage_seconds_sum", &base, h.sum);
        sample(&mut o, "kvferry_stage_seconds_count", &base, h.count);
    }
    if let Some(d) = &extra.directory {
        family(
            &mut o,
            "kvferry_directory_operations_total",
            "counter",
            "Directory operations by kind.",
        );
        for (op, n) in [
            ("publish", d.publishes),
            ("withdraw", d.withdraws),
            ("lookup", d.lookups),
        ] {
            sample(
                &mut o,
                "kvferry_directory_operations_total",
                &format!("op=\"{op}\""),
                n,
            );
        }
    }
    if let Some(h) = extra.directory.as_ref().and_then(|d| d.health.as_ref()) {
        render_directory_health(&mut o, h);
    }
    if let Some(m) = &extra.nic {
        render_nic(&mut o, m);
    }
    if let Some(g) = &extra.engine {
        render_engine(&mut o, g);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Stage;

    #[test]
    fn renders_families_histograms_and_labels() {
        let c = Counters::default();
        let r = TransferReport {
            path: "direct",
            blocks: 2,
            bytes: 4096,
            copies: 2,
            seconds: 0.002,
            stages: vec![
                Stage {
                    name: "wire",
                    seconds: 0.0015,
                },
                Stage {
                    name: "plan",
                    seconds: 2e-6,
                },
            ],
        };
        c.transfer("direct", Ok(&r));
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
        assert!(text.contains("kvferry_leases_live 3\n"), "{text}");
        assert!(text.contains("kvferry_loads_total{path=\"direct\",status=\"ok\"} 1\n"));
        assert!(text.contains("kvferry_loads_total{path=\"direct\",status=\"error\"} 1\n"));
        assert!(text.contains("kvferry_bytes_total{path=\"direct\"} 4096\n"));
        // 1.5 ms falls in the 2.5 ms bucket and above, not the 1 ms one.
        assert!(text.contains(
            "kvferry_stage_seconds_bucket{path=\"direct\",stage=\"wire\",le=\"0.001\"} 0\n"
        ));
        assert!(text.contains(
            "kvferry_stage_seconds_bucket{path=\"direct\",stage=\"wire\",le=\"0.0025\"} 1\n"
        ));
        assert!(text.contains("kvferry_stage_seconds_count{path=\"direct\",stage=\"wire\"} 1\n"));
        assert!(text.contains("kvferry_queries_total{result=\"remote\"} 1\n"));
        // Every sample's family is declared once.
        let types = text
            .lines()
            .filter(|l| l.starts_with("# TYPE kvferry_stage_seconds "))
            .count();
        assert_eq!(types, 1);
    }

    #[test]
    fn renders_nic_families_once_with_low_cardinality_labels() {
        use crate::nic::{RegistryCounts, WorkerGaugeValues};
        let mut w = WorkerGaugeValues::default();
        w.states.rts = 2;
        w.states.error = 1;
        w.completion_errors.flushed = 5;
        let m = NicMetrics {
            registry: RegistryCounts {
                made: vec![("mlx5_0".into(), "host", 1)],
                failed: vec![("mlx5_1".into(), "host", "nic_unavailable", 1)],
                registered: vec![("mlx5_0".into(), 1), ("mlx5_1".into(), 0)],
            },
            workers: vec![("mlx5_0".into(), w), ("mlx5_1".into(), Default::default())],
        };
        let text = render(
            &Stats::default(),
            &Counters::default(),
            Extra {
                nic: Some(m),
                ..Extra::default()
            },
        );
        for line in [
            "kvferry_mr_registrations_total{nic=\"mlx5_0\",kind=\"host\"} 1\n",
            "kvferry_mr_registration_failures_total{nic=\"mlx5_1\",kind=\"host\",reason=\"nic_unavailable\"} 1\n",
            "kvferry_mrs_registered{nic=\"mlx5_1\"} 0\n",
            "kvferry_qps{nic=\"mlx5_0\",state=\"rts\"} 2\n",
            "kvferry_qps{nic=\"mlx5_0\",state=\"error\"} 1\n",
            "kvferry_qps{nic=\"mlx5_1\",state=\"reset\"} 0\n",
            "kvferry_completion_errors_total{nic=\"mlx5_0\",status=\"flushed\"} 5\n",
            "kvferry_completion_errors_total{nic=\"mlx5_1\",status=\"remote_access_error\"} 0\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        for name in [
            MR_REGISTRATIONS,
            MR_REGISTRATION_FAILURES,
            MRS_REGISTERED,
            QPS,
            COMPLETION_ERRORS,
        ] {
            let help = format!("# HELP {name} ");
            let ty = format!("# TYPE {name} ");
            assert_eq!(text.matches(&help).count(), 1, "{name}");
            assert_eq!(text.matches(&ty).count(), 1, "{name}");
        }
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
        use crate::remote::{BreakerState, DirectoryHealth, DirectoryStats};
        let mut h = DirectoryHealth {
            breaker: BreakerState::HalfOpen,
            trips: 2,
            lookups_skipped: 7,
            lookup_failures: 3,
            write_failures: 1,
            reannounces: 1,
            pending: 5,
            ..Default::default()
        };
        h.lookup_seconds.observe(0.003);
        h.lookup_seconds.observe(0.2);
        let text = render(
            &Stats::default(),
            &Counters::default(),
            Extra {
                directory: Some(DirectoryStats {
                    lookups: 9,
                    health: Some(h),
                    ..Default::default()
                }),
                ..Extra::default()
            },
        );
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
            "kvferry_directory_call_seconds_count{op=\"write\"} 0\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        // In-process directories have no breaker to show.
        let text = render(
            &Stats::default(),
            &Counters::default(),
            Extra {
                directory: Some(DirectoryStats::default()),
                ..Extra::default()
            },
        );
        assert!(text.contains("kvferry_directory_operations_total"));
        assert!(!text.contains("kvferry_directory_breaker_open"));
    }
}
