//! The NIC actors end to end: byte-for-byte reads with canaries through a `NicWorker` over the
//! loopback and tcp providers, batches larger than the send window, a completion error
//! injected at the Nth request (typed error, drained QP, gauges back to zero, next read
//! works), `MrRegistry` coalescing and deferred deregistration while reads are in flight.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_actors::nic::{
    parse_nics, BatchResult, Connect, Gauges, NicRuntime, NicSectionError, PostReads,
    RegionHandles, RegionSpec, RegisterRegion, RegistryError, RegistryGauges, WorkerError,
    WorkerGaugeValues,
};
use kvferry_transport::fault::{Fault, FaultKind, FaultyConnector};
use kvferry_transport::loopback::LoopbackConnector;
use kvferry_transport::tcp::{TcpConnector, TcpOwner};
use kvferry_transport::{
    Access, CompletionStatus, Connector, DeviceSink, HostRegion, LocalSegment, MrHandle, MrTable,
    NicConfig, NicId, NodeId, ProviderKind, QueueFault, ReadRequest, RemoteDescriptor, SinkError,
};
use tokio::sync::oneshot;

const CANARY: u8 = 0xA5;
const OWNER: NodeId = NodeId(100);
const ME: NodeId = NodeId(1);
const NIC: NicId = NicId(0);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn pat(seed: u8, off: u64) -> u8 {
    ((off.wrapping_mul(2_654_435_761) >> 11) as u8) ^ (off as u8) ^ seed
}

fn nic(name: &str, provider: ProviderKind, window: u32) -> NicConfig {
    NicConfig {
        name: name.into(),
        provider,
        qps_per_peer: 2,
        max_send_wr: window,
        max_rd_atomic: window.min(4),
        max_sge: 4,
        completion_timeout: Duration::from_secs(5),
    }
}

struct Owner {
    table: MrTable,
    region: Arc<HostRegion>,
    mr: MrHandle,
    seed: u8,
}

fn owner(seed: u8, len: usize) -> Owner {
    let table = MrTable::new();
    let region = Arc::new(HostRegion::memfd("kvf-nic-test", len).unwrap());
    let bytes: Vec<u8> = (0..len as u64).map(|o| pat(seed, o)).collect();
    region.write_at(0, &bytes).unwrap();
    let mr = table
        .register_host(region.clone(), Access::REMOTE_READ)
        .unwrap();
    Owner {
        table,
        region,
        mr,
        seed,
    }
}

/// `n` reads of `len` bytes from scattered source offsets, each split into two pieces with a
/// 64-byte canary gap between them in the destination. Returns the reads and, per read, its
/// (dst offset, src offset, len) pieces.
type Pieces = Vec<Vec<(u64, u64, u64)>>;

fn plan(
    src: &Owner,
    dst: &HostRegion,
    lkey: kvferry_transport::MrKey,
    n: usize,
    len: u64,
) -> (Vec<ReadRequest>, Pieces) {
    let src_len = src.region.len() as u64;
    let mut cursor = 64;
    let (mut reads, mut pieces) = (Vec::new(), Vec::new());
    for i in 0..n as u64 {
        let src_off = (i * 7919 * 61) % (src_len - len);
        let first = len / 3 + i % 5;
        let mut ps = Vec::new();
        let mut local = Vec::new();
        for (s, l) in [(0, first), (first, len - first)] {
            ps.push((cursor, src_off + s, l));
            local.push(LocalSegment {
                lkey,
                addr: dst.addr() + cursor,
                len: l,
            });
            cursor += l + 64;
        }
        assert!(cursor < dst.len() as u64);
        reads.push(ReadRequest {
            wr_id: 1000 + i,
            remote: RemoteDescriptor {
                addr: src.region.addr() + src_off,
                len,
                rkey: src.mr.key(),
            },
            local,
        });
        pieces.push(ps);
    }
    (reads, pieces)
}

/// Every successful read's bytes match the source; a failed or flushed read's destination
/// holds either its source bytes or canary (it may have executed before the error was
/// noticed), and every byte outside the destinations is canary.
fn verify(src: &Owner, dst: &HostRegion, pieces: &Pieces, ok: &[bool]) {
    let got = dst.to_vec();
    let mut covered = vec![false; got.len()];
    for (i, (ps, ok)) in pieces.iter().zip(ok).enumerate() {
        for &(d, s, l) in ps {
            for j in 0..l {
                let at = (d + j) as usize;
                covered[at] = true;
                let want = pat(src.seed, s + j);
                if *ok {
                    assert_eq!(got[at], want, "read {i} byte {j} of piece at {d}");
                } else {
                    assert!(
                        got[at] == want || got[at] == CANARY,
                        "failed read {i} wrote garbage"
                    );
                }
            }
        }
    }
    for (i, b) in got.iter().enumerate() {
        if !covered[i] {
            assert_eq!(*b, CANARY, "byte {i} outside every destination was written");
        }
    }
}

async fn post(rt: &NicRuntime, reads: Vec<ReadRequest>) -> BatchResult {
    let (tx, rx) = oneshot::channel();
    rt.workers[0]
        .send(PostReads {
            peer: OWNER,
            reads,
            reply: tx,
        })
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), rx)
        .await
        .expect("batch answered")
        .expect("reply sent")
}

async fn register_dst(rt: &NicRuntime, len: usize) -> (Arc<HostRegion>, RegionHandles) {
    let dst = Arc::new(HostRegion::anonymous(len).unwrap());
    dst.fill(CANARY).unwrap();
    let h = rt
        .registry
        .send(RegisterRegion {
            spec: RegionSpec::Host {
                region: dst.clone(),
                access: Access::LOCAL_WRITE,
            },
        })
        .await
        .unwrap()
        .unwrap();
    (dst, h)
}

async fn gauges(rt: &NicRuntime) -> WorkerGaugeValues {
    rt.workers[0].send(Gauges).await.unwrap()
}

async fn settled(rt: &NicRuntime) -> WorkerGaugeValues {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let g = gauges(rt).await;
        if g.qp.outstanding == 0 && g.qp.in_flight == 0 && g.qp.in_error == 0 && g.batches == 0
            || Instant::now() > end
        {
            return g;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn reads_through_worker(provider: ProviderKind) {
    let src = owner(0x31, 1 << 20);
    let _tcp_owner;
    let connector: Arc<dyn Connector> = match provider {
        ProviderKind::Tcp => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let o = TcpOwner::spawn(l, OWNER, src.table.clone()).unwrap();
            let c = TcpConnector::new(ME, OWNER, o.local_addr())
                .with_io_timeout(Duration::from_secs(3));
            _tcp_owner = Some(o);
            Arc::new(c)
        }
        _ => {
            _tcp_owner = None;
            Arc::new(LoopbackConnector::new(OWNER, src.table.clone()))
        }
    };
    // A window of 8 and batches of 40: the worker must keep the QP fed past the window.
    let rt = NicRuntime::start(vec![nic("lo0", provider, 8)]).unwrap();
    let keys = rt.workers[0]
        .send(Connect {
            peer: OWNER,
            connector,
            qps: None,
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(keys.len(), 2);
    assert!(keys.iter().all(|k| k.peer == OWNER && k.nic == NIC));
    assert_ne!(keys[0].qp, keys[1].qp);

    let (dst, h) = register_dst(&rt, 4 << 20).await;
    let (reads, pieces) = plan(&src, &dst, h.key(NIC).unwrap(), 40, 20_000);
    let ids: Vec<u64> = reads.iter().map(|r| r.wr_id).collect();
    let done = post(&rt, reads).await.unwrap();
    // In post order, every one complete.
    assert_eq!(done.iter().map(|c| c.wr_id).collect::<Vec<_>>(), ids);
    assert!(done
        .iter()
        .all(|c| c.status.is_success() && c.bytes == 20_000));
    verify(&src, &dst, &pieces, &[true; 40]);

    let g = settled(&rt).await;
    assert_eq!(
        (g.qp.outstanding, g.qp.in_flight, g.batches),
        (0, 0, 0),
        "{g:?}"
    );
    assert_eq!((g.ready, g.qp.qps), (2, 2), "{g:?}");
    drop(h);
    let mg = rt.registry.send(RegistryGauges).await.unwrap();
    assert_eq!(mg.per_nic[0].registered, 0, "{mg:?}");
    assert_eq!(mg.per_nic[0].uses, 0, "{mg:?}");
    assert_eq!(src.table.gauges().uses, 0);
}

#[test]
fn loopback_reads_byte_for_byte_past_the_window() {
    rt().block_on(reads_through_worker(ProviderKind::Loopback));
}

#[test]
fn tcp_reads_byte_for_byte_past_the_window() {
    rt().block_on(reads_through_worker(ProviderKind::Tcp));
}

#[test]
fn completion_error_drains_then_recovers() {
    rt().block_on(async {
        let src = owner(0x47, 1 << 20);
        let faulty = Arc::new(FaultyConnector::new(
            LoopbackConnector::new(OWNER, src.table.clone()),
            OWNER,
        ));
        let rt = NicRuntime::start(vec![nic("lo0", ProviderKind::Loopback, 4)]).unwrap();
        rt.workers[0]
            .send(Connect {
                peer: OWNER,
                connector: faulty.clone(),
                qps: Some(1),
            })
            .await
            .unwrap()
            .unwrap();
        let (dst, h) = register_dst(&rt, 4 << 20).await;
        faulty.inject(Fault {
            at: 3,
            kind: FaultKind::CompletionError(CompletionStatus::RemoteAccessError),
        });
        let (reads, pieces) = plan(&src, &dst, h.key(NIC).unwrap(), 12, 10_000);
        let err = post(&rt, reads).await.unwrap_err();
        let WorkerError::ReadFailed {
            wr_id,
            status,
            fault,
            completions,
            ..
        } = err
        else {
            panic!("expected a read failure, got {err:?}");
        };
        assert_eq!((wr_id, status), (1002, CompletionStatus::RemoteAccessError));
        assert_eq!(
            fault,
            Some(QueueFault::Completion {
                wr_id: 1002,
                status: CompletionStatus::RemoteAccessError
            })
        );
        // Every request reported, in order; nothing after the error executed.
        assert_eq!(completions.len(), 12);
        let ok: Vec<bool> = completions.iter().map(|c| c.status.is_success()).collect();
        assert!(ok[..2].iter().all(|b| *b), "{completions:?}");
        assert!(!ok[2]);
        assert!(completions[3..]
            .iter()
            .all(|c| c.status == CompletionStatus::Flushed || c.status.is_success()));
        verify(&src, &dst, &pieces, &ok);

        // Drained and rebuilt: gauges back to zero, the QP ready again.
        let g = settled(&rt).await;
        assert_eq!(
            (g.qp.outstanding, g.qp.in_flight, g.qp.in_error, g.batches),
            (0, 0, 0, 0),
            "{g:?}"
        );
        assert_eq!(g.reconnects, 1, "{g:?}");
        assert_eq!(g.ready, 1, "{g:?}");
        let mg = rt.registry.send(RegistryGauges).await.unwrap();
        assert_eq!(mg.per_nic[0].uses, 0, "{mg:?}");
        assert_eq!(src.table.gauges().uses, 0);

        // The next read works.
        dst.fill(CANARY).unwrap();
        let (reads, pieces) = plan(&src, &dst, h.key(NIC).unwrap(), 6, 10_000);
        let done = post(&rt, reads).await.unwrap();
        assert!(done.iter().all(|c| c.status.is_success()));
        verify(&src, &dst, &pieces, &[true; 6]);
        assert_eq!(faulty.fired(), 1);
    });
}

#[test]
fn registry_coalesces_concurrent_registrations() {
    rt().block_on(async {
        let rt = NicRuntime::start(vec![
            nic("nic0", ProviderKind::Loopback, 8),
            nic("nic1", ProviderKind::Loopback, 8),
        ])
        .unwrap();
        let region = Arc::new(HostRegion::anonymous(1 << 16).unwrap());
        let spec = || RegisterRegion {
            spec: RegionSpec::Host {
                region: region.clone(),
                access: Access::LOCAL_WRITE.union(Access::REMOTE_READ),
            },
        };
        let (a, b) = tokio::join!(rt.registry.send(spec()), rt.registry.send(spec()));
        let (a, b) = (a.unwrap().unwrap(), b.unwrap().unwrap());
        assert_eq!(a.keys(), b.keys());
        assert_eq!(a.keys().len(), 2);
        let g = rt.registry.send(RegistryGauges).await.unwrap();
        assert_eq!(
            g.per_nic.iter().map(|t| t.registered).collect::<Vec<_>>(),
            [1, 1]
        );
        assert_eq!((g.live, g.coalesced), (1, 1));
        for (t, k) in rt.tables.iter().zip(a.keys()) {
            assert!(t.is_registered(k));
        }

        // The registration lives until the last user drops.
        let keys = a.keys();
        drop(a);
        assert!(rt.tables[0].is_registered(keys[0]));
        drop(b);
        for (t, k) in rt.tables.iter().zip(&keys) {
            assert!(!t.is_registered(*k));
        }
        // A later registration of the same allocation is a new one.
        let c = rt.registry.send(spec()).await.unwrap().unwrap();
        assert_ne!(c.keys(), keys);

        // Failures are typed and counted.
        let e = rt
            .registry
            .send(RegisterRegion {
                spec: RegionSpec::Host {
                    region: region.clone(),
                    access: Access::LOCAL_WRITE,
                },
            })
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, RegistryError::Conflict { .. }), "{e}");
        let sink: Arc<dyn DeviceSink> = Arc::new(NullSink);
        let e = rt
            .registry
            .send(RegisterRegion {
                spec: RegionSpec::Device {
                    base: 0x1000,
                    len: 4096,
                    sink: sink.clone(),
                    access: Access::REMOTE_READ,
                },
            })
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, RegistryError::DeviceRemoteRead { .. }), "{e}");
        let e = rt
            .registry
            .send(RegisterRegion {
                spec: RegionSpec::Device {
                    base: u64::MAX - 10,
                    len: 4096,
                    sink,
                    access: Access::LOCAL_WRITE,
                },
            })
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, RegistryError::BadRange { .. }), "{e}");
        let g = rt.registry.send(RegistryGauges).await.unwrap();
        assert_eq!(
            (
                g.failures.conflict,
                g.failures.device_remote_read,
                g.failures.bad_range,
                g.failures.total()
            ),
            (1, 1, 1, 3)
        );
        drop(c);
        let g = rt.registry.send(RegistryGauges).await.unwrap();
        assert_eq!(g.live, 0);
        assert!(g.per_nic.iter().all(|t| t.registered == 0));
    });
}

struct NullSink;

impl DeviceSink for NullSink {
    fn write(&self, _dst: u64, _data: &[u8]) -> Result<(), SinkError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), SinkError> {
        Ok(())
    }
}

#[test]
fn deregistration_waits_for_reads_in_flight() {
    rt().block_on(async {
        let src = owner(0x58, 1 << 20);
        let faulty = Arc::new(FaultyConnector::new(
            LoopbackConnector::new(OWNER, src.table.clone()),
            OWNER,
        ));
        let rt = NicRuntime::start(vec![nic("lo0", ProviderKind::Loopback, 4)]).unwrap();
        rt.workers[0]
            .send(Connect {
                peer: OWNER,
                connector: faulty.clone(),
                qps: Some(1),
            })
            .await
            .unwrap()
            .unwrap();
        let (dst, h) = register_dst(&rt, 1 << 20).await;
        let key = h.key(NIC).unwrap();
        faulty.inject(Fault {
            at: 1,
            kind: FaultKind::Delay(Duration::from_millis(200)),
        });
        let (reads, pieces) = plan(&src, &dst, key, 4, 10_000);
        let (tx, rx) = oneshot::channel();
        rt.workers[0]
            .send(PostReads {
                peer: OWNER,
                reads,
                reply: tx,
            })
            .await
            .unwrap();
        // The last handle drops while the reads are in flight: deregistration is deferred.
        drop(h);
        let table = &rt.tables[0];
        assert!(table.is_registered(key));
        assert_eq!(table.gauges().deferred, 1);
        let done = rx.await.unwrap().unwrap();
        assert!(done.iter().all(|c| c.status.is_success()));
        verify(&src, &dst, &pieces, &[true; 4]);
        // Reported and released: the deregistration completed.
        assert!(!table.is_registered(key));
        let g = table.gauges();
        assert_eq!(
            (g.registered, g.deferred, g.uses, g.deregistered),
            (0, 0, 0, 1)
        );
    });
}

#[test]
fn unknown_peer_is_a_typed_error() {
    rt().block_on(async {
        let rt = NicRuntime::start(vec![nic("lo0", ProviderKind::Loopback, 4)]).unwrap();
        let err = post(&rt, Vec::new()).await.unwrap_err();
        assert!(matches!(err, WorkerError::UnknownPeer { .. }), "{err}");
    });
}

#[test]
fn nic_sections_parse_with_defaults_and_refuse_unknown_keys() {
    let nics =
        parse_nics("[[nic]]\nname = \"lo0\"\nprovider = \"tcp\"\nmax-send-wr = 64\n").unwrap();
    let d = NicConfig::default();
    assert_eq!(nics.len(), 1);
    assert_eq!(nics[0].name, "lo0");
    assert_eq!(nics[0].provider, ProviderKind::Tcp);
    assert_eq!(nics[0].max_send_wr, 64);
    assert_eq!(
        (nics[0].qps_per_peer, nics[0].max_rd_atomic, nics[0].max_sge),
        (d.qps_per_peer, d.max_rd_atomic, d.max_sge)
    );

    let e = parse_nics("[[nic]]\nname = \"lo0\"\nmax-send-wrs = 64\n").unwrap_err();
    assert!(
        matches!(&e, NicSectionError::Parse { message } if message.contains("max-send-wrs") && message.contains("line 3")),
        "{e}"
    );
    let e =
        parse_nics("[[nic]]\nname = \"lo0\"\nmax-send-wr = 2\nmax-rd-atomic = 8\n").unwrap_err();
    assert!(
        matches!(
            &e,
            NicSectionError::Invalid {
                key: "max-rd-atomic",
                ..
            }
        ),
        "{e}"
    );
    let e = parse_nics("[[nic]]\nname = \"lo0\"\nmax-sge = 0\n").unwrap_err();
    assert!(
        matches!(&e, NicSectionError::Invalid { key: "max-sge", .. }),
        "{e}"
    );
    let e = parse_nics("[[nic]]\nname = \"lo0\"\nprovider = \"carrier-pigeon\"\n").unwrap_err();
    assert!(
        matches!(
            &e,
            NicSectionError::Invalid {
                key: "provider",
                ..
            }
        ),
        "{e}"
    );
    let e = parse_nics("[[nic]]\nname = \"a b\"\n").unwrap_err();
    assert!(
        matches!(&e, NicSectionError::Invalid { key: "name", .. }),
        "{e}"
    );
}

/// Every other fault kind: typed error naming the failed request, the batch answered only
/// after the drain, gauges back to zero, the QP rebuilt, and the next read works.
#[test]
fn fault_matrix_drains_then_recovers() {
    let kinds = [
        FaultKind::FailPost,
        FaultKind::DropConnection,
        FaultKind::Delay(Duration::from_millis(400)),
    ];
    for kind in kinds {
        rt().block_on(async {
            let src = owner(0x63, 1 << 20);
            let faulty = Arc::new(FaultyConnector::new(
                LoopbackConnector::new(OWNER, src.table.clone()),
                OWNER,
            ));
            let mut cfg = nic("lo0", ProviderKind::Loopback, 4);
            cfg.completion_timeout = Duration::from_millis(60);
            let rt = NicRuntime::start(vec![cfg]).unwrap();
            rt.workers[0]
                .send(Connect {
                    peer: OWNER,
                    connector: faulty.clone(),
                    qps: Some(1),
                })
                .await
                .unwrap()
                .unwrap();
            let (dst, h) = register_dst(&rt, 4 << 20).await;
            faulty.inject(Fault { at: 3, kind });
            let (reads, pieces) = plan(&src, &dst, h.key(NIC).unwrap(), 12, 10_000);
            let err = post(&rt, reads).await.unwrap_err();
            let WorkerError::ReadFailed {
                fault, completions, ..
            } = err
            else {
                panic!("{kind:?}: expected a read failure, got {err:?}");
            };
            let ctx = format!("{kind:?}: {fault:?} {completions:?}");
            match kind {
                FaultKind::FailPost => {
                    assert!(
                        matches!(fault, Some(QueueFault::PostFailed { wr_id: 1002 })),
                        "{ctx}"
                    )
                }
                FaultKind::Delay(_) => {
                    assert!(matches!(fault, Some(QueueFault::Timeout { .. })), "{ctx}")
                }
                _ => assert!(fault.is_some(), "{ctx}"),
            }
            assert_eq!(completions.len(), 12, "{ctx}");
            let ok: Vec<bool> = completions.iter().map(|c| c.status.is_success()).collect();
            verify(&src, &dst, &pieces, &ok);

            let g = settled(&rt).await;
            assert_eq!(
                (g.qp.outstanding, g.qp.in_flight, g.qp.in_error, g.batches),
                (0, 0, 0, 0),
                "{ctx} {g:?}"
            );
            assert_eq!((g.reconnects, g.ready), (1, 1), "{ctx} {g:?}");
            assert_eq!(src.table.gauges().uses, 0, "{ctx}");

            dst.fill(CANARY).unwrap();
            let (reads, pieces) = plan(&src, &dst, h.key(NIC).unwrap(), 6, 10_000);
            let done = post(&rt, reads).await.unwrap();
            assert!(done.iter().all(|c| c.status.is_success()), "{ctx}");
            verify(&src, &dst, &pieces, &[true; 6]);
            assert_eq!(faulty.fired(), 1, "{ctx}");
            drop(h);
            let mg = rt.registry.send(RegistryGauges).await.unwrap();
            assert_eq!(
                (mg.per_nic[0].registered, mg.per_nic[0].uses),
                (0, 0),
                "{ctx}"
            );
        });
    }
}

/// A dead peer: the batch fails and drains, reconnects fail with a typed error until the
/// peer comes back, then reads work again.
#[test]
fn peer_death_then_revival() {
    rt().block_on(async {
        let src = owner(0x71, 1 << 20);
        let faulty = Arc::new(FaultyConnector::new(
            LoopbackConnector::new(OWNER, src.table.clone()),
            OWNER,
        ));
        let rt = NicRuntime::start(vec![nic("lo0", ProviderKind::Loopback, 4)]).unwrap();
        rt.workers[0]
            .send(Connect {
                peer: OWNER,
                connector: faulty.clone(),
                qps: Some(1),
            })
            .await
            .unwrap()
            .unwrap();
        let (dst, h) = register_dst(&rt, 4 << 20).await;
        faulty.inject(Fault {
            at: 2,
            kind: FaultKind::PeerDeath,
        });
        let (reads, pieces) = plan(&src, &dst, h.key(NIC).unwrap(), 8, 10_000);
        let err = post(&rt, reads).await.unwrap_err();
        let WorkerError::ReadFailed { completions, .. } = err else {
            panic!("expected a read failure, got {err:?}");
        };
        let ok: Vec<bool> = completions.iter().map(|c| c.status.is_success()).collect();
        verify(&src, &dst, &pieces, &ok);
        let g = settled(&rt).await;
        assert_eq!(
            (g.qp.outstanding, g.qp.in_error, g.batches),
            (0, 0, 0),
            "{g:?}"
        );

        let (reads, _) = plan(&src, &dst, h.key(NIC).unwrap(), 2, 10_000);
        let err = post(&rt, reads).await.unwrap_err();
        assert!(matches!(err, WorkerError::Reconnect { .. }), "{err}");

        faulty.revive();
        dst.fill(CANARY).unwrap();
        let (reads, pieces) = plan(&src, &dst, h.key(NIC).unwrap(), 4, 10_000);
        let done = post(&rt, reads).await.unwrap();
        assert!(done.iter().all(|c| c.status.is_success()));
        verify(&src, &dst, &pieces, &[true; 4]);
        let g = settled(&rt).await;
        assert_eq!((g.qp.outstanding, g.ready, g.waiting), (0, 1, 0), "{g:?}");
    });
}
