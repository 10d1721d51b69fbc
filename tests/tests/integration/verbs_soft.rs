//! Nodes reading each other's pools over the verbs provider on the software verbs device
//! (`[[nic]] name = "soft_mlx5_N"`, every build): the same provider, worker, handshake and
//! load path as on RDMA NICs, with the device's rules enforced. Staged and direct loads are
//! checked byte for byte with canaries; after each test the leak gauges are back to zero.

use std::sync::Arc;

use kvferry_actors::nic::{NicSection, VerbsSection};
use kvferry_actors::peer;
use kvferry_actors::peer::{Directory, DirectoryStats, LocalCluster, Provider};
use kvferry_actors::{BlockHash, Clock, Namespace, Node};
use kvferry_gpu::{Device, KvShape};
use kvferry_harness::*;
use kvferry_testkit::{DeviceKv, KvKind};
use kvferry_transport::verbs::work::wc;
use kvferry_transport::verbs::{SoftFault, SoftOps};

const TOKEN: &str = "soft-verbs";
const SLOT: u64 = 64 << 10;
const SLOTS: u64 = 32;

fn shape() -> KvShape {
    KvShape::new(3, 1, 2, 1024).unwrap()
}

fn with_nics(node_id: &str, nics: &[&str], verbs: VerbsSection) -> kvferry_actors::NodeConfig {
    let mut cfg = config(SLOT, SLOTS);
    cfg.node_id = node_id.into();
    cfg.nic = nics
        .iter()
        .map(|n| NicSection {
            name: (*n).into(),
            provider: "verbs".into(),
            ..NicSection::default()
        })
        .collect();
    cfg.verbs = Some(verbs);
    cfg
}

/// An owner node over soft NICs, serving Peer on 127.0.0.1:0, holding blocks `ids`.
struct Owner {
    node: Node,
    server: PeerServer,
    addr: std::net::SocketAddr,
    _dev: Arc<dyn Device>,
    _kv: DeviceKv,
}

impl Owner {
    async fn start(
        id: &str,
        nics: &[&str],
        verbs: VerbsSection,
        ids: std::ops::Range<u64>,
    ) -> Self {
        Self::start_serving(id, nics, verbs, ids, |_, b| b).await
    }

    /// As [`Owner::start`], the Peer service's backend passed through `serve` first.
    async fn start_serving(
        id: &str,
        nics: &[&str],
        verbs: VerbsSection,
        ids: std::ops::Range<u64>,
        serve: impl FnOnce(&Node, peer::PeerBackend) -> peer::PeerBackend,
    ) -> Self {
        let s = shape();
        let (node, dev) = start(
            with_nics(id, nics, verbs),
            Clock::system(),
            None::<Arc<LocalCluster>>,
        );
        assert!(
            node.nics().unwrap().pool.is_ok(),
            "pool registered on {nics:?}"
        );
        assert!(
            node.nics().unwrap().responder.is_some(),
            "the owner serves verbs handshakes"
        );
        let kv = register(&node, &dev, "eng", s, 0, KvKind::Split, 16, 0).await;
        put(&node, "eng", &s, 0, ids).await;
        let server = PeerServer::start(serve(&node, node.peer_backend()), TOKEN).await;
        Owner {
            addr: server.addr,
            node,
            server,
            _dev: dev,
            _kv: kv,
        }
    }

    /// Waits until the requester's unpins have arrived (fire-and-forget RPCs, sent as its
    /// transfers finish): call while the requester still runs.
    async fn settle(&self) {
        settled_with_peers(&self.node).await;
    }

    async fn stop(self) {
        self.server.stop().await;
        self.node.shutdown();
    }
}

/// Which owner holds which block: blocks below `split` on the first owner, the rest on the
/// second.
#[derive(Debug)]
struct SplitDirectory {
    owners: Vec<String>,
    first: Vec<BlockHash>,
}

impl Directory for SplitDirectory {
    fn publish(&self, _: &str, _: &Namespace, _: &[BlockHash]) {}

    fn withdraw(&self, _: &str, _: &Namespace, _: &[BlockHash]) {}

    fn owners(
        &self,
        _: &Namespace,
        hashes: &[BlockHash],
        _exclude: &str,
    ) -> kvferry_actors::peer::link::BoxFut<Vec<Vec<String>>> {
        let out = hashes
            .iter()
            .map(|h| {
                let i = usize::from(!self.first.contains(h));
                vec![self.owners[i.min(self.owners.len() - 1)].clone()]
            })
            .collect();
        Box::pin(std::future::ready(out))
    }

    fn withdraw_node(&self, _: &str) {}

    fn stats(&self) -> DirectoryStats {
        DirectoryStats::default()
    }
}

fn requester(
    id: &str,
    nics: &[&str],
    verbs: VerbsSection,
    owners: &[(&str, std::net::SocketAddr)],
) -> (Node, Arc<dyn Device>) {
    requester_with(id, nics, verbs, owners, None)
}

fn requester_with(
    id: &str,
    nics: &[&str],
    verbs: VerbsSection,
    owners: &[(&str, std::net::SocketAddr)],
    directory: Option<Arc<dyn Directory>>,
) -> (Node, Arc<dyn Device>) {
    let owners: Vec<(&str, String)> = owners.iter().map(|(n, a)| (*n, a.to_string())).collect();
    let peers = grpc_peers(id, Provider::Verbs, TOKEN, &owners, directory);
    start(with_nics(id, nics, verbs), Clock::system(), Some(peers))
}

/// Queries `ids` for "eng" (all of them remote, and direct granted where asked), loads them
/// into `dest`; the load's path.
async fn query_and_load(
    node: &Node,
    ids: std::ops::Range<u64>,
    direct: bool,
    dest: &[u32],
) -> String {
    try_query_and_load(node, ids, direct, dest).await.unwrap()
}

async fn try_query_and_load(
    node: &Node,
    ids: std::ops::Range<u64>,
    direct: bool,
    dest: &[u32],
) -> Result<String, kvferry_actors::NodeError> {
    let q = query(node, "eng", ids.clone(), direct).await;
    assert_eq!(q.remote_blocks, ids.clone().count(), "{q:?}");
    if direct {
        assert!(q.direct.is_granted(), "{:?}", q.direct);
    }
    let r = load(node, q.lease.unwrap(), "eng", 0, dest).await?;
    Ok(r.path.to_string())
}

/// Two nodes over two soft NICs: the requester reads the owner's blocks staged (into its
/// pool, then to its KV) and direct (host memory standing in for the GPU: the NIC writes the
/// KV planes), each byte for byte with the canaries around every destination intact; the
/// owner's pool is registered in 68 KiB chunks and the reads of blocks across a chunk edge
/// are cut there.
#[test]
fn remote_suffix_over_soft_verbs_staged_and_direct() {
    let verbs = VerbsSection {
        // Slots are 64 KiB apart: the pool's MR edge at 68 KiB cuts slot 1's block in two.
        registration_chunk: 68 << 10,
        ..VerbsSection::default()
    };
    rt().block_on(async {
        let owner = Owner::start("a", &["soft_mlx5_40"], verbs.clone(), 0..12).await;
        let (node, dev) = requester("b", &["soft_mlx5_41"], verbs, &[("a", owner.addr)]);
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 0).await;
        let before = SoftOps::global().reads("soft_mlx5_41");
        let dest = [5, 0, 3, 9, 1, 12];
        assert_eq!(query_and_load(&node, 0..6, false, &dest).await, "staged");
        kv.verify(&expected(&dest, 0), 0).unwrap();
        assert!(
            SoftOps::global().reads("soft_mlx5_41") > before,
            "read over the soft NIC"
        );
        // Blocks the requester does not hold yet (a staged load caches what it read).
        let dest2 = [2, 4, 6, 8, 10, 11];
        assert_eq!(query_and_load(&node, 6..12, true, &dest2).await, "direct");
        let mut both = expected(&dest, 0);
        both.extend(expected(&dest2, 6));
        kv.verify(&both, 0).unwrap();
        let text = node.metrics_text().await.unwrap();
        assert!(
            text.contains("kvferry_qps{nic=\"soft_mlx5_41\",state=\"rts\"}"),
            "{text}"
        );
        settled(&node).await;
        owner.settle().await;
        node.shutdown();
        owner.stop().await;
    });
}

/// Three nodes: the requester's remote suffix lies on two owners (blocks 0..6 on `a`, 6..12
/// on `c`), read over verbs from both in one load, staged then direct, byte for byte; every
/// node's gauges back to zero.
#[test]
fn three_nodes_over_soft_verbs() {
    rt().block_on(async {
        let v = VerbsSection::default();
        let a = Owner::start("a", &["soft_mlx5_60"], v.clone(), 0..6).await;
        let c = Owner::start("c", &["soft_small_61"], v.clone(), 6..12).await;
        let dir: Arc<dyn Directory> = Arc::new(SplitDirectory {
            owners: vec!["a".into(), "c".into()],
            first: hashes(0..6),
        });
        let (node, dev) = requester_with(
            "b",
            &["soft_mlx5_62"],
            v,
            &[("a", a.addr), ("c", c.addr)],
            Some(dir),
        );
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 32, 0).await;
        let dest: Vec<u32> = (0..12).map(|i| 31 - 2 * i).collect();
        assert_eq!(query_and_load(&node, 0..12, true, &dest).await, "direct");
        kv.verify(&expected(&dest, 0), 0).unwrap();
        settled(&node).await;
        a.settle().await;
        c.settle().await;
        // The NIC worker admits reads against the CQ the device really made (defect 3): the
        // small profile's 4096 entries, not the 64 windows of max-send-wr it was asked for.
        let g = c.node.nics().unwrap().runtime.workers[0]
            .send(kvferry_actors::nic::Gauges)
            .await
            .unwrap();
        assert_eq!(g.cq_depth, 4096, "{g:?}");
        let g = node.nics().unwrap().runtime.workers[0]
            .send(kvferry_actors::nic::Gauges)
            .await
            .unwrap();
        assert!(g.cq_depth > 4096, "the mlx5 profile's CQ is larger: {g:?}");
        node.shutdown();
        a.stop().await;
        c.stop().await;
    });
}

/// Two direct loads into one rank at once: both register the rank's KV planes on the NIC
/// and share one registration (defect 2: the second used to fail on the overlap, and its
/// cleanup removed the first one's keys).
#[test]
fn concurrent_direct_loads_into_one_rank() {
    rt().block_on(async {
        let v = VerbsSection::default();
        let owner = Owner::start("a", &["soft_mlx5_63"], v.clone(), 0..12).await;
        let (node, dev) = requester("b", &["soft_mlx5_64"], v, &[("a", owner.addr)]);
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 0).await;
        let (d1, d2) = ([1, 3, 5, 7, 9, 11], [0, 2, 4, 6, 8, 10]);
        let (r1, r2) = tokio::join!(
            query_and_load(&node, 0..6, true, &d1),
            query_and_load(&node, 6..12, true, &d2)
        );
        assert_eq!((r1.as_str(), r2.as_str()), ("direct", "direct"));
        let mut both = expected(&d1, 0);
        both.extend(expected(&d2, 6));
        kv.verify(&both, 0).unwrap();
        settled(&node).await;
        owner.settle().await;
        node.shutdown();
        owner.stop().await;
    });
}

/// A rank's planes are registered with the NIC by its first direct load and kept for its
/// later ones (each registration pins and maps a whole plane on real hardware): a second load
/// leaves the MRs alive on the requester's NIC as they were, and unregistering the rank
/// deregisters them. Loaded the old way, every load registered the planes and undid them as
/// it ended.
#[test]
fn a_ranks_planes_are_registered_once_and_go_with_the_rank() {
    rt().block_on(async {
        let v = VerbsSection::default();
        let owner = Owner::start("a", &["soft_mlx5_91"], v.clone(), 0..12).await;
        let (node, dev) = requester("b", &["soft_mlx5_92"], v, &[("a", owner.addr)]);
        let ops = SoftOps::global();
        let mrs = || ops.live("soft_mlx5_92").1;
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 0).await;
        let before = mrs();
        let (d1, d2) = ([1, 3, 5, 7, 9, 11], [0, 2, 4, 6, 8, 10]);
        assert_eq!(query_and_load(&node, 0..6, true, &d1).await, "direct");
        settled(&node).await;
        // Three layers, split K/V: six planes, each one MR.
        assert_eq!(mrs(), before + 6, "the first load's registrations are kept");
        assert_eq!(query_and_load(&node, 6..12, true, &d2).await, "direct");
        settled(&node).await;
        assert_eq!(mrs(), before + 6, "the second load made none");
        let mut both = expected(&d1, 0);
        both.extend(expected(&d2, 6));
        kv.verify(&both, 0).unwrap();
        // A staged load needs none.
        assert_eq!(query_and_load(&node, 0..6, false, &d1).await, "staged");
        settled(&node).await;
        assert_eq!(mrs(), before + 6);
        node.unregister_instance(id("eng")).await.unwrap();
        assert_eq!(
            mrs(),
            before,
            "unregistering the rank deregistered its planes"
        );
        owner.settle().await;
        node.shutdown();
        owner.stop().await;
    });
}

/// Defect 5: a small direct load (one NIC carries it) goes through the NIC the routing
/// chose (here by override), not the first link.
#[test]
fn a_small_direct_load_uses_the_routed_nic() {
    rt().block_on(async {
        let v = VerbsSection::default();
        let owner = Owner::start("a", &["soft_mlx5_65"], v.clone(), 0..6).await;
        let routed = VerbsSection {
            nic_override: vec!["soft_mlx5_67".into()],
            ..VerbsSection::default()
        };
        let (node, dev) = requester(
            "b",
            &["soft_mlx5_66", "soft_mlx5_67"],
            routed,
            &[("a", owner.addr)],
        );
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 0).await;
        let ops = SoftOps::global();
        let (first, chosen) = (ops.reads("soft_mlx5_66"), ops.reads("soft_mlx5_67"));
        let dest = [4, 5, 6, 7, 8, 9];
        assert_eq!(query_and_load(&node, 0..6, true, &dest).await, "direct");
        kv.verify(&expected(&dest, 0), 0).unwrap();
        assert!(
            ops.reads("soft_mlx5_67") > chosen,
            "read through the routed nic"
        );
        assert_eq!(
            ops.reads("soft_mlx5_66"),
            first,
            "nothing through the first link"
        );
        settled(&node).await;
        owner.settle().await;
        node.shutdown();
        owner.stop().await;
    });
}

/// Faults under a load over verbs: a completion error, the owner's NIC vanishing, the
/// requester's port going down. Each load fails typed and writes nothing outside its
/// destinations (the canaries hold), the gauges return to zero, and once the fault is gone
/// the next load works (the worker rebuilds its QPs through a new handshake).
#[test]
fn fault_matrix_over_soft_verbs() {
    rt().block_on(async {
        let v = VerbsSection::default();
        let (on, rn) = ("soft_mlx5_68", "soft_mlx5_69");
        let owner = Owner::start("a", &[on], v.clone(), 0..24).await;
        let (node, dev) = requester("b", &[rn], v, &[("a", owner.addr)]);
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 0).await;
        let ops = SoftOps::global();
        let faults = [
            (
                rn,
                SoftFault::CompletionError {
                    nth: 0,
                    status: wc::REM_ACCESS_ERR,
                },
            ),
            (on, SoftFault::Vanish),
            (rn, SoftFault::PortDown),
        ];
        let mut landed: Vec<(u32, u64)> = Vec::new();
        for (i, (dev_name, fault)) in faults.into_iter().enumerate() {
            let base = 6 * i as u64;
            let dest: Vec<u32> = (0..6).map(|k| (i as u32 * 5 + k) % 16).collect();
            ops.inject(dev_name, fault);
            let e = try_query_and_load(&node, base..base + 6, true, &dest)
                .await
                .expect_err("the load fails under the fault");
            assert!(!e.to_string().is_empty());
            settled(&node).await;
            ops.heal(dev_name);
            // Direct loads are not cached: the same blocks load again once healed.
            let mut ok = None;
            for _ in 0..250 {
                match try_query_and_load(&node, base..base + 6, true, &dest).await {
                    Ok(p) => {
                        ok = Some(p);
                        break;
                    }
                    // The first loads after the fault may still meet the QP being rebuilt.
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                }
            }
            assert_eq!(
                ok.as_deref(),
                Some("direct"),
                "{fault:?}: the next load works"
            );
            landed.retain(|(d, _)| !dest.contains(d));
            landed.extend(expected(&dest, base));
            kv.verify(&landed, 0).unwrap();
            settled(&node).await;
            owner.settle().await;
        }
        node.shutdown();
        owner.stop().await;
    });
}

/// The checked-in sample for the software device starts a node whose pool is registered on
/// the soft NIC (in 16 MiB MRs) and which grants direct loads over verbs.
#[test]
fn the_soft_verbs_sample_config_starts_a_serving_node() {
    let text = include_str!("../../../config/node-soft-verbs.toml");
    let cfg = kvferry_actors::NodeConfig::from_toml(text, "config/node-soft-verbs.toml").unwrap();
    let dev: Arc<dyn Device> = kvferry_gpu::HostDevice::new(0);
    let node = Node::start_with(cfg, vec![dev], Clock::system()).unwrap();
    let nics = node.nics().unwrap();
    let pool = nics.pool.as_ref().unwrap();
    let mr = pool.rdma(kvferry_transport::NicId(0)).unwrap();
    assert_eq!(mr.nic(), "soft_mlx5_0");
    assert_eq!(mr.chunks(), 4, "64 MiB in 16 MiB MRs");
    assert_eq!(nics.direct_refusal, None);
    assert!(nics.responder.is_some());
    node.shutdown();
}

const CHILD_ENV: &str = "KVFERRY_SOFT_VERBS_OWNER";

/// The owner half of `two_processes_over_soft_verbs`: this binary re-executed.
#[test]
#[ignore = "runs only as the owner child process started by two_processes_over_soft_verbs"]
fn child_soft_verbs_owner() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    rt().block_on(async {
        let owner = Owner::start("a", &["soft_mlx5_80"], VerbsSection::default(), 0..12).await;
        println!("READY {}", owner.addr);
        // Serves until the parent closes stdin, then checks its own gauges and stops.
        stdin_closed().await;
        owner.settle().await;
        owner.stop().await;
        println!("OWNER DONE");
    });
}

/// Two processes: the owner node in a child process, the requester here, each on its own
/// software NIC. The requester's NIC reads the owner's pool out of the owner's memory (its
/// memfd, mapped through the shared-memory fabric) after checking the owner's published QP
/// and MR state; staged and direct loads byte for byte with canaries; both sides' gauges
/// back to zero.
#[test]
fn two_processes_over_soft_verbs() {
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_soft_verbs_owner"),
        &[(CHILD_ENV, "1")],
    );
    let addr: std::net::SocketAddr = child.wait_for("READY ").parse().unwrap();
    let (node, dev) = requester(
        "b",
        &["soft_mlx5_81"],
        VerbsSection::default(),
        &[("a", addr)],
    );
    rt().block_on(async {
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 0).await;
        let before = SoftOps::global().reads("soft_mlx5_81");
        let d1 = [3, 1, 4, 15, 9, 2];
        assert_eq!(query_and_load(&node, 0..6, false, &d1).await, "staged");
        let d2 = [6, 5, 8, 7, 10, 11];
        assert_eq!(query_and_load(&node, 6..12, true, &d2).await, "direct");
        let mut both = expected(&d1, 0);
        both.extend(expected(&d2, 6));
        kv.verify(&both, 0).unwrap();
        assert!(SoftOps::global().reads("soft_mlx5_81") > before);
        settled(&node).await;
    });
    child.finish(Some("OWNER DONE"));
    node.shutdown();
}

/// An owner whose Handshake answers contradict the port it announced in Hello (a deeper read
/// depth, another MTU): the requester refuses the answer naming the field, brings no QP out of
/// reset and posts nothing; its load fails typed and its gauges return to zero.
#[test]
fn answers_contradicting_the_announced_port_are_refused_before_posting() {
    use kvferry_actors::peer::{VerbsPeerEndpoint, VerbsResponder};

    #[derive(Debug)]
    struct Tamper {
        inner: Arc<dyn VerbsResponder>,
        edit: fn(&mut VerbsPeerEndpoint),
    }

    impl VerbsResponder for Tamper {
        fn ports(&self) -> Vec<VerbsPeerEndpoint> {
            self.inner.ports()
        }

        fn accept(
            &self,
            peer: &str,
            request: &[VerbsPeerEndpoint],
        ) -> Result<Vec<VerbsPeerEndpoint>, String> {
            let mut a = self.inner.accept(peer, request)?;
            for e in &mut a {
                (self.edit)(e);
            }
            Ok(a)
        }
    }

    type Edit = fn(&mut VerbsPeerEndpoint);
    let cases: [(Edit, &str, &str); 2] = [
        (
            |e| e.responder_depth = 64,
            "responder depth 64",
            "soft_mlx5_82",
        ),
        (
            |e| e.mtu = kvferry_transport::verbs::gid::Mtu::M256,
            "mtu 256",
            "soft_mlx5_84",
        ),
    ];
    for (edit, says, owner_nic) in cases {
        rt().block_on(async {
            // The owner's own responder, its answers tampered with.
            let owner =
                Owner::start_serving("a", &[owner_nic], VerbsSection::default(), 0..6, |n, b| {
                    let inner: Arc<dyn VerbsResponder> =
                        n.nics().unwrap().responder.clone().unwrap();
                    b.with_verbs(Arc::new(Tamper { inner, edit }))
                })
                .await;
            let (node, dev) = requester(
                "b",
                &["soft_mlx5_83"],
                VerbsSection::default(),
                &[("a", owner.addr)],
            );
            let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 0).await;
            let before = SoftOps::global().reads("soft_mlx5_83");
            let q = query(&node, "eng", 0..6, false).await;
            assert_eq!(q.remote_blocks, 6, "{q:?}");
            let e = load(&node, q.lease.unwrap(), "eng", 0, &[0, 1, 2, 3, 4, 5])
                .await
                .expect_err("the contradicting answer is refused");
            // The reason travels in the error's sources.
            let mut text = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(x) = src {
                text.push_str(": ");
                text.push_str(&x.to_string());
                src = x.source();
            }
            assert!(
                text.contains(says) && text.contains("contradicts"),
                "{says}: {text}"
            );
            assert_eq!(
                SoftOps::global().reads("soft_mlx5_83"),
                before,
                "nothing posted"
            );
            settled(&node).await;
            owner.settle().await;
            node.shutdown();
            owner.stop().await;
        });
    }
}
