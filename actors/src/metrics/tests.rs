use ::metrics::{with_local_recorder, Unit};

use super::counters::{record_query, record_query_blocks, record_transfer};
use super::registry::{record_directory_call, Registry, UPKEEP_EVERY};
use super::render::render_with;
use super::scrape::record_scrape;
use super::*;
use crate::api::Stage;
use crate::api::{Stats, TransferReport};
use crate::nic::NicMetrics;
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
        let gone =
            crate::error::NodeError::remote("b", crate::peer::RemoteError::lost("a read", "gone"));
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
            sampled: vec![Box::new(crate::tier::ssd::SsdStats {
                blocks: 5,
                capacity_blocks: 64,
                write_bytes: 4096,
                damaged: [0, 0, 1],
                hits_ssd: 3,
                ..Default::default()
            })],
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
            sampled: vec![Box::new(nic_metrics())],
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
        sampled: vec![Box::new(directory_stats())],
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
        sampled: vec![Box::new(DirectoryStats::default())],
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
                engine: Some(EngineGauges {
                    sessions: 1,
                    completions_dropped: 3,
                    ..Default::default()
                }),
                sampled: vec![
                    Box::new(directory_stats()),
                    Box::new(nic_metrics()),
                    Box::new(crate::tier::ssd::SsdStats {
                        blocks: 5,
                        damaged: [0, 0, 1],
                        hits_ssd: 3,
                        ..Default::default()
                    }),
                    Box::new({
                        let tls = crate::tls::TlsStats::default();
                        tls.handshake_failed(crate::tls::TlsSide::DataClient);
                        tls.set_cert_not_after(i64::MAX);
                        tls.sample()
                    }),
                ],
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
        (
            TLS_HANDSHAKE_FAILURES,
            (MetricKind::Counter, &["listener"][..]),
        ),
        (TLS_RELOADS, (MetricKind::Counter, &["result"][..])),
        (TLS_CERT_EXPIRY, (MetricKind::Gauge, &[][..])),
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
