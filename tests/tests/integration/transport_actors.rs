//! The NIC actors end to end: byte-for-byte reads with canaries through a `NicWorker` over the
//! loopback and tcp providers, batches larger than the send window, a completion error
//! injected at the Nth request (typed error, drained QP, gauges back to zero, next read
//! works), `MrRegistry` coalescing and deferred deregistration while reads are in flight.
//! The verbs wiring without a NIC: the host pool registered on a (fake) RDMA NIC at start,
//! split at the configured size, failures typed and counted; a node whose config asks for
//! verbs on a host without RDMA refuses `direct_gpu` naming why; the NIC metrics
//! (registrations, QPs by state, completion errors) move under injected faults and the QP
//! gauges return to zero after the drain.

use kvferry_harness::{self as harness, rt};
use kvferry_testkit::CANARY;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_actors::nic::{
    parse_nics, BatchResult, Connect, Gauges, NicRuntime, NicSection, NicSectionError, PostReads,
    RdmaSlot, RegionHandles, RegionSpec, RegisterRegion, RegistryError, RegistryGauges,
    VerbsSection, WorkerError, WorkerGaugeValues,
};
use kvferry_actors::{metrics, DirectGrant};
use kvferry_transport::fault::{Fault, FaultKind, FaultyConnector};
use kvferry_transport::loopback::LoopbackConnector;
use kvferry_transport::tcp::{TcpConnector, TcpOwner};
use kvferry_transport::verbs::gid::{Gid, Mtu};
use kvferry_transport::verbs::registration::{Chunk, NicKeys};
use kvferry_transport::verbs::{ChunkMr, PortAddress, RdmaNic, RegistrarError};
use kvferry_transport::{
    Access, CompletionStatus, Connector, DeviceSink, HostRegion, LocalSegment, MrHandle, MrTable,
    NicConfig, NicId, NodeId, ProviderKind, QueueFault, ReadRequest, RemoteDescriptor, SinkError,
};
use tokio::sync::oneshot;

const OWNER: NodeId = NodeId(100);
const ME: NodeId = NodeId(1);
const NIC: NicId = NicId(0);

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
        let idle = g.qp.outstanding == 0 && g.qp.in_flight == 0 && g.qp.in_error == 0;
        // A QP rebuilt after a drain connects off the worker's thread: settled once it is back.
        if idle && g.batches == 0 && g.connecting == 0 || Instant::now() > end {
            return g;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An owner of 1 MiB of pattern `seed` behind a fault-injecting loopback connector, and a
/// NIC runtime (one loopback NIC, a window of 4, completions timing out after `timeout`)
/// with one QP connected to it.
async fn faulty_owner(
    seed: u8,
    timeout: Duration,
) -> (Owner, Arc<FaultyConnector<LoopbackConnector>>, NicRuntime) {
    let src = owner(seed, 1 << 20);
    let faulty = Arc::new(FaultyConnector::new(
        LoopbackConnector::new(OWNER, src.table.clone()),
        OWNER,
    ));
    let mut cfg = nic("lo0", ProviderKind::Loopback, 4);
    cfg.completion_timeout = timeout;
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
    (src, faulty, rt)
}

async fn reads_through_worker(provider: ProviderKind) {
    let src = owner(0x31, 1 << 20);
    let _tcp_owner;
    let connector: Arc<dyn Connector> = match provider {
        ProviderKind::Tcp => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let auth = kvferry_transport::DataAuth::new();
            let grant = auth.issue(ME).unwrap();
            let o = TcpOwner::spawn(l, OWNER, src.table.clone(), auth).unwrap();
            let c = TcpConnector::new(ME, OWNER, o.local_addr(), grant)
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
        let (src, faulty, rt) = faulty_owner(0x47, Duration::from_secs(5)).await;
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
        let (src, faulty, rt) = faulty_owner(0x58, Duration::from_secs(5)).await;
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
            let (src, faulty, rt) = faulty_owner(0x63, Duration::from_millis(60)).await;
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
        let (src, faulty, rt) = faulty_owner(0x71, Duration::from_secs(5)).await;
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

/// An RDMA NIC without hardware: registrations are recorded (and undone on drop), and the
/// `fail_at`th chunk is refused the way `ibv_reg_mr` would refuse it.
struct FakeNic {
    name: String,
    next: std::sync::atomic::AtomicU32,
    fail_at: Option<u32>,
    live: Arc<std::sync::Mutex<Vec<Chunk>>>,
}

struct Registered(Arc<std::sync::Mutex<Vec<Chunk>>>, Chunk);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.lock().unwrap().retain(|c| *c != self.1);
    }
}

impl FakeNic {
    fn new(name: &str, fail_at: Option<u32>) -> Arc<Self> {
        Arc::new(FakeNic {
            name: name.into(),
            next: Default::default(),
            fail_at,
            live: Default::default(),
        })
    }

    fn live(&self) -> Vec<Chunk> {
        self.live.lock().unwrap().clone()
    }
}

impl RdmaNic for FakeNic {
    fn name(&self) -> &str {
        &self.name
    }

    fn address(&self) -> PortAddress {
        PortAddress {
            port: 1,
            gid_index: 3,
            gid: Gid([7; 16]),
            lid: 0,
            global: true,
            mtu: Mtu::M4096,
        }
    }

    fn register_chunk(
        &self,
        region: &Arc<HostRegion>,
        chunk: Chunk,
    ) -> Result<ChunkMr, RegistrarError> {
        kvferry_transport::verbs::nic::check_chunk(&self.name, region, chunk)?;
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if Some(n) == self.fail_at {
            return Err(RegistrarError::Register {
                nic: self.name.clone(),
                addr: chunk.addr,
                len: chunk.len,
                source: std::io::Error::from_raw_os_error(12),
            });
        }
        self.live.lock().unwrap().push(chunk);
        Ok(ChunkMr::new(
            chunk,
            NicKeys {
                lkey: 0x100 + n,
                rkey: 0x200 + n,
            },
            Registered(self.live.clone(), chunk),
        ))
    }
}

fn metric(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
}

/// The pool registered at start on every NIC, through the registry: on RDMA NICs also with
/// the NIC itself, split at the configured size; an RDMA NIC refusing a chunk or missing
/// altogether fails the registration with a typed, counted error, undoing the partial work.
#[test]
fn pool_registered_on_every_nic_split_and_failures_counted() {
    rt().block_on(async {
        let page = 4096u64;
        let pool = Arc::new(HostRegion::anonymous(10 * page as usize).unwrap());
        let spec = || RegionSpec::Host {
            region: pool.clone(),
            access: Access::LOCAL_WRITE.union(Access::REMOTE_READ),
        };
        let good = FakeNic::new("mlx5_0", None);
        let (rt, mut regs) = NicRuntime::start_registered(
            vec![
                nic("mlx5_0", ProviderKind::Verbs, 8),
                nic("lo0", ProviderKind::Loopback, 8),
            ],
            vec![RdmaSlot::Open(good.clone()), RdmaSlot::None],
            4 * page,
            vec![spec()],
        )
        .unwrap();
        let h = regs.pop().unwrap().unwrap();
        // Both tables hold the pool; the RDMA NIC holds it as three MRs of at most 4 pages.
        assert!(rt.tables.iter().zip(h.keys()).all(|(t, k)| t.is_registered(k)));
        let mr = h.rdma(NicId(0)).expect("registered on the rdma nic");
        let adv = mr.advertised();
        assert_eq!(
            adv.iter().map(|(c, _)| c.len).collect::<Vec<_>>(),
            [4 * page, 4 * page, 2 * page]
        );
        assert_eq!(adv[0].0.addr, pool.addr());
        assert_eq!(mr.key_map().unwrap().remote_key(pool.addr() + 5 * page, 8), Ok(0x201));
        assert!(h.rdma(NicId(1)).is_none());
        assert_eq!(good.live().len(), 3);
        // A local-write-only region (a destination) is not handed to the NIC for peers.
        let (_dst, dh) = register_dst(&rt, 1 << 16).await;
        assert!(dh.rdma(NicId(0)).is_none());
        assert_eq!(good.live().len(), 3);
        drop(dh);

        let m = rt.metrics().await;
        let text = metrics::render(&Default::default(), &Default::default(), metrics::Extra {
            sampled: vec![Box::new(m)],
            ..Default::default()
        });
        assert_eq!(
            metric(&text, "kvferry_mr_registrations_total{nic=\"mlx5_0\",kind=\"host\"}"),
            Some(2.0),
            "{text}"
        );
        assert_eq!(metric(&text, "kvferry_mrs_registered{nic=\"mlx5_0\"}"), Some(1.0));
        drop(h);
        assert!(good.live().is_empty(), "deregistered with the last handle");
        drop(rt);

        // The NIC refuses the third chunk: typed, counted, nothing left registered.
        let bad = FakeNic::new("mlx5_1", Some(2));
        let (rt, mut regs) = NicRuntime::start_registered(
            vec![nic("mlx5_1", ProviderKind::Verbs, 8)],
            vec![RdmaSlot::Open(bad.clone())],
            4 * page,
            vec![spec()],
        )
        .unwrap();
        let e = regs.pop().unwrap().unwrap_err();
        assert!(
            matches!(&e, RegistryError::Rdma { nic, kind: "nic_refused", .. } if nic == "mlx5_1"),
            "{e}"
        );
        assert!(bad.live().is_empty(), "partial registration undone");
        assert!(!rt.tables[0].is_registered(kvferry_transport::MrKey(0)));
        let g = rt.registry.send(RegistryGauges).await.unwrap();
        assert_eq!((g.failures.rdma, g.per_nic[0].registered), (1, 0), "{g:?}");
        let text = metrics::render(&Default::default(), &Default::default(), metrics::Extra {
            sampled: vec![Box::new(rt.metrics().await)],
            ..Default::default()
        });
        assert_eq!(
            metric(
                &text,
                "kvferry_mr_registration_failures_total{nic=\"mlx5_1\",kind=\"host\",reason=\"nic_refused\"}"
            ),
            Some(1.0),
            "{text}"
        );
        drop(rt);

        // A verbs NIC that could not be opened: the registration fails with its reason.
        let (rt, mut regs) = NicRuntime::start_registered(
            vec![nic("mlx5_2", ProviderKind::Verbs, 8)],
            vec![RdmaSlot::Unavailable {
                reason: "no RDMA device on this node".into(),
            }],
            4 * page,
            vec![spec()],
        )
        .unwrap();
        let e = regs.pop().unwrap().unwrap_err();
        assert!(
            matches!(&e, RegistryError::Rdma { kind: "nic_unavailable", reason, .. } if reason.contains("no RDMA device")),
            "{e}"
        );
        let g = rt.registry.send(RegistryGauges).await.unwrap();
        assert_eq!(g.failures.rdma, 1);
    });
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../transport/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// A node whose config asks for verbs on a host without a usable RDMA device (every machine
/// here): it starts, its pool registration on the verbs NIC fails with the reason and is
/// counted, and Query refuses `direct_gpu` naming why; non-direct queries are unaffected.
#[test]
fn verbs_without_a_device_refuses_direct_gpu_with_the_reason() {
    rt().block_on(async {
        let mut cfg = harness::config(64 << 10, 4);
        cfg.nic = vec![NicSection {
            name: "mlx5_0".into(),
            provider: "verbs".into(),
            ..NicSection::default()
        }];
        cfg.verbs = Some(VerbsSection {
            sysfs_root: fixture("sysfs-no-rdma"),
            ..VerbsSection::default()
        });
        let (node, dev) = harness::start(
            cfg,
            kvferry_actors::Clock::system(),
            None::<Arc<kvferry_actors::peer::LocalCluster>>,
        );
        let nics = node.nics().expect("the [[nic]] actors run");
        let e = nics.pool.as_ref().unwrap_err();
        assert!(matches!(e, RegistryError::Rdma { kind: "nic_unavailable", .. }), "{e}");
        let shape = kvferry_gpu::KvShape::new(1, 1, 2, 1024).unwrap();
        let _kv = harness::register(
            &node,
            &dev,
            "d",
            shape,
            0,
            kvferry_testkit::KvKind::Split,
            4,
            0,
        )
        .await;
        harness::put(&node, "d", &shape, 0, 0..1).await;
        let q = harness::query(&node, "d", 0..1, true).await;
        let DirectGrant::Refused { reason } = &q.direct else {
            panic!("direct granted without a usable RDMA device: {:?}", q.direct);
        };
        assert!(
            reason.contains("direct GPU loads over verbs are unavailable"),
            "{reason}"
        );
        // The probe's reason: no device here, or no provider in this build.
        assert!(
            reason.contains("no RDMA device") || reason.contains("`verbs` feature"),
            "{reason}"
        );
        node.release(q.lease.unwrap()).await.unwrap();
        let q = harness::query(&node, "d", 0..1, false).await;
        assert_eq!(q.direct, DirectGrant::NotRequested);
        node.release(q.lease.unwrap()).await.unwrap();
        let text = node.metrics_text().await.unwrap();
        assert_eq!(
            metric(
                &text,
                "kvferry_mr_registration_failures_total{nic=\"mlx5_0\",kind=\"host\",reason=\"nic_unavailable\"}"
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            metric(&text, "kvferry_qps{nic=\"mlx5_0\",state=\"rts\"}"),
            Some(0.0)
        );
        harness::settled(&node).await;
        node.shutdown();
    });
}

/// The NIC metrics under injected faults through the actor path: a completion error and a
/// timeout count completion errors by status (flushes included), the QP is seen in the error
/// state while it drains, and after the drain the error gauge is back to zero with the QP
/// ready again; after a peer death the QP waits in reset until the peer is back.
#[test]
fn nic_metrics_move_under_faults_and_qp_gauges_return_after_drain() {
    rt().block_on(async {
        let (src, faulty, rt) = faulty_owner(0x5a, Duration::from_millis(60)).await;
        let scrape = |m| {
            metrics::render(
                &Default::default(),
                &Default::default(),
                metrics::Extra {
                    sampled: vec![Box::new(m)],
                    ..Default::default()
                },
            )
        };
        let text = scrape(rt.metrics().await);
        assert_eq!(
            metric(&text, "kvferry_qps{nic=\"lo0\",state=\"rts\"}"),
            Some(1.0)
        );
        assert_eq!(
            metric(&text, "kvferry_qps{nic=\"lo0\",state=\"error\"}"),
            Some(0.0)
        );
        assert_eq!(
            metric(
                &text,
                "kvferry_completion_errors_total{nic=\"lo0\",status=\"remote_access_error\"}"
            ),
            Some(0.0)
        );
        let (dst, h) = register_dst(&rt, 4 << 20).await;

        // A completion error at the 3rd of 12 reads: one remote access error, the rest that
        // had not executed flushed.
        faulty.inject(Fault {
            at: 3,
            kind: FaultKind::CompletionError(CompletionStatus::RemoteAccessError),
        });
        let (reads, _) = plan(&src, &dst, h.key(NIC).unwrap(), 12, 10_000);
        let WorkerError::ReadFailed { completions, .. } = post(&rt, reads).await.unwrap_err()
        else {
            panic!("expected a read failure");
        };
        let flushed = completions
            .iter()
            .filter(|c| c.status == CompletionStatus::Flushed)
            .count();
        let g = settled(&rt).await;
        assert_eq!(g.completion_errors.remote_access_error, 1, "{g:?}");
        assert_eq!(g.completion_errors.flushed as usize, flushed, "{g:?}");
        assert_eq!((g.states.error, g.states.rts), (0, 1), "{g:?}");

        // A read stuck past the timeout: the QP sits in error until the stuck read drains.
        dst.fill(CANARY).unwrap();
        faulty.inject(Fault {
            at: faulty.issued() + 2,
            kind: FaultKind::Delay(Duration::from_millis(600)),
        });
        let (reads, _) = plan(&src, &dst, h.key(NIC).unwrap(), 4, 10_000);
        let (tx, rx) = oneshot::channel();
        rt.workers[0]
            .send(PostReads {
                peer: OWNER,
                reads,
                reply: tx,
            })
            .await
            .unwrap();
        let mut seen_error = false;
        let end = Instant::now() + Duration::from_secs(5);
        while !seen_error && Instant::now() < end {
            let text = scrape(rt.metrics().await);
            seen_error = metric(&text, "kvferry_qps{nic=\"lo0\",state=\"error\"}") == Some(1.0);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(seen_error, "the QP was never reported in the error state");
        assert!(rx.await.unwrap().is_err());
        let g = settled(&rt).await;
        assert!(g.completion_errors.timed_out >= 1, "{g:?}");
        assert_eq!(
            (g.states.error, g.states.rts, g.qp.in_error),
            (0, 1, 0),
            "{g:?}"
        );
        let text = scrape(rt.metrics().await);
        assert_eq!(
            metric(&text, "kvferry_qps{nic=\"lo0\",state=\"error\"}"),
            Some(0.0)
        );
        assert!(
            metric(
                &text,
                "kvferry_completion_errors_total{nic=\"lo0\",status=\"timed_out\"}"
            ) >= Some(1.0),
            "{text}"
        );

        // The peer dies: after the drain the QP cannot reconnect and waits in reset.
        faulty.inject(Fault {
            at: faulty.issued() + 2,
            kind: FaultKind::PeerDeath,
        });
        let (reads, _) = plan(&src, &dst, h.key(NIC).unwrap(), 4, 10_000);
        assert!(post(&rt, reads).await.is_err());
        let g = settled(&rt).await;
        assert_eq!((g.states.error, g.states.rts), (0, 0), "{g:?}");
        faulty.revive();
        let (reads, _) = plan(&src, &dst, h.key(NIC).unwrap(), 2, 10_000);
        post(&rt, reads).await.unwrap();
        let g = settled(&rt).await;
        assert_eq!(
            (
                g.states.error,
                g.states.reset,
                g.states.rts,
                g.qp.outstanding
            ),
            (0, 0, 1, 0),
            "{g:?}"
        );
        drop(h);
    });
}

#[test]
fn node_config_takes_nic_and_verbs_sections_and_names_bad_keys() {
    use kvferry_actors::config::ConfigError;
    use kvferry_actors::NodeConfig;
    let cfg = NodeConfig::from_toml(
        "[[nic]]\nname = \"mlx5_0\"\nprovider = \"verbs\"\nqps-per-peer = 4\n\
         [[nic]]\nname = \"mlx5_1\"\nprovider = \"verbs\"\n\
         [verbs]\nregistration-chunk = 1073741824\nnic-override = [\"mlx5_1\"]\n\
         gpu-pci = [\"0000:19:00.0\"]\n",
        "n.toml",
    )
    .unwrap();
    assert_eq!(cfg.nic.len(), 2);
    assert_eq!(cfg.nic[0].qps_per_peer, 4);
    let v = cfg.verbs.as_ref().unwrap();
    assert_eq!(v.registration_chunk, 1 << 30);
    assert_eq!(v.nic_override, ["mlx5_1"]);
    assert_eq!(v.sysfs_root, "/sys");
    // Without the sections: no NIC actors, default verbs settings (4 GiB chunks).
    let plain = NodeConfig::from_toml("", "n.toml").unwrap();
    assert!(plain.nic.is_empty() && plain.verbs.is_none());
    assert_eq!(VerbsSection::default().registration_chunk, 4 << 30);

    for (text, key, says) in [
        ("[[nic]]\nname = \"a b\"\n", "nic", "name"),
        (
            "[[nic]]\nname = \"x\"\n[[nic]]\nname = \"x\"\n",
            "nic",
            "appears twice",
        ),
        ("[[nic]]\nname = \"x\"\nmax-sge = 0\n", "nic", "max-sge"),
        ("[verbs]\nretry-count = 9\n", "verbs", "retry-count"),
        (
            "[verbs]\nregistration-chunk = 4097\n",
            "verbs",
            "registration-chunk",
        ),
    ] {
        let e = NodeConfig::from_toml(text, "n.toml").unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
            "{text}: {e}"
        );
        let msg = format!("{e} {:?}", e);
        assert!(msg.contains(says), "{text}: {msg}");
    }
    let e = NodeConfig::from_toml("[verbs]\nretry = 1\n", "n.toml").unwrap_err();
    assert!(matches!(e, ConfigError::Parse { .. }), "{e}");
    assert!(
        e.to_string().contains("retry") && e.to_string().contains("line 2"),
        "{e}"
    );
}

/// The NIC families in a real node's scrape are valid Prometheus text (HELP and TYPE once per
/// family, counters named `_total`): `promtool check metrics` on a node with a verbs NIC that
/// could not be opened and a worker that saw faults.
#[test]
fn nic_metrics_pass_promtool() {
    rt().block_on(async {
        let mut cfg = harness::config(64 << 10, 4);
        cfg.nic = vec![
            NicSection {
                name: "mlx5_0".into(),
                provider: "verbs".into(),
                ..NicSection::default()
            },
            NicSection {
                name: "lo0".into(),
                provider: "loopback".into(),
                ..NicSection::default()
            },
        ];
        cfg.verbs = Some(VerbsSection {
            sysfs_root: fixture("sysfs-no-rdma"),
            ..VerbsSection::default()
        });
        let (node, _dev) = harness::start(
            cfg,
            kvferry_actors::Clock::system(),
            None::<Arc<kvferry_actors::peer::LocalCluster>>,
        );
        let text = node.metrics_text().await.unwrap();
        for family in [
            metrics::MR_REGISTRATIONS,
            metrics::MR_REGISTRATION_FAILURES,
            metrics::MRS_REGISTERED,
            metrics::QPS,
            metrics::COMPLETION_ERRORS,
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{family}:\n{text}"
            );
        }
        harness::promtool_check(&text);
        node.shutdown();
    });
}
