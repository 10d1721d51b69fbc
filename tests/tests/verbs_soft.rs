//! Nodes reading each other's pools over the verbs provider on the software verbs device
//! (`[[nic]] name = "soft_mlx5_N"`, every build): the same provider, worker, handshake and
//! load path as on RDMA NICs, with the device's rules enforced. Staged and direct loads are
//! checked byte for byte with canaries; after each test the leak gauges are back to zero.

use std::sync::Arc;

use kvferry_actors::nic::{NicSection, VerbsSection};
use kvferry_actors::remote::{GrpcPeers, GrpcPeersConfig, Provider, StaticDirectory};
use kvferry_actors::rpc;
use kvferry_actors::{Clock, LoadRequest, Node, QueryRequest};
use kvferry_gpu::{Device, KvShape};
use kvferry_testkit::{DeviceKv, KvKind};
use kvferry_tests::*;
use kvferry_transport::verbs::SoftOps;
use tokio::sync::oneshot;

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
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<Result<(), rpc::PeerServeError>>>,
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
        let s = shape();
        let dev: Arc<dyn Device> = kvferry_gpu::HostDevice::new(0);
        let node = Node::start_with(
            with_nics(id, nics, verbs),
            vec![Arc::clone(&dev)],
            Clock::system(),
        )
        .unwrap();
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
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(rpc::serve(
            listener,
            node.peer_backend(),
            TOKEN.into(),
            async move {
                let _ = stopped.await;
            },
        ));
        Owner {
            node,
            addr,
            stop: Some(stop),
            server: Some(server),
            _dev: dev,
            _kv: kv,
        }
    }

    async fn stop(mut self) {
        settled(&self.node).await;
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(s) = self.server.take() {
            let _ = s.await;
        }
        self.node.shutdown();
    }
}

fn requester(
    id: &str,
    nics: &[&str],
    verbs: VerbsSection,
    owners: &[(&str, std::net::SocketAddr)],
) -> (Node, Arc<dyn Device>) {
    let peers = GrpcPeers::new(
        GrpcPeersConfig {
            node_id: id.into(),
            provider: Provider::Verbs,
            token: TOKEN.into(),
            peers: owners
                .iter()
                .map(|(n, a)| ((*n).to_string(), a.to_string()))
                .collect(),
            shm_dir: std::env::temp_dir(),
            data_listen: "127.0.0.1:0".into(),
        },
        Arc::new(StaticDirectory::new(
            owners.iter().map(|(n, _)| (*n).to_string()).collect(),
        )),
    );
    let dev: Arc<dyn Device> = kvferry_gpu::HostDevice::new(0);
    let node = Node::start_in(
        with_nics(id, nics, verbs),
        vec![Arc::clone(&dev)],
        Clock::system(),
        Some(peers),
    )
    .unwrap();
    (node, dev)
}

async fn load(node: &Node, ids: std::ops::Range<u64>, direct: bool, dest: &[u32]) -> String {
    let q = node
        .query(QueryRequest {
            instance: id("eng"),
            hashes: hashes(ids.clone()),
            direct_gpu: direct,
        })
        .await
        .unwrap();
    assert_eq!(q.remote_blocks, ids.clone().count(), "{q:?}");
    if direct {
        assert!(q.direct.is_granted(), "{:?}", q.direct);
    }
    let r = node
        .load(LoadRequest {
            lease: q.lease.unwrap(),
            instance: id("eng"),
            rank: 0,
            dest_blocks: dest.to_vec(),
        })
        .await
        .unwrap();
    r.path.to_string()
}

fn expect(dest: &[u32], first: u64) -> Vec<(u32, u64)> {
    dest.iter()
        .enumerate()
        .map(|(i, d)| (*d, first + i as u64))
        .collect()
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
        assert_eq!(load(&node, 0..6, false, &dest).await, "staged");
        kv.verify(&expect(&dest, 0), 0).unwrap();
        assert!(
            SoftOps::global().reads("soft_mlx5_41") > before,
            "read over the soft NIC"
        );
        // Blocks the requester does not hold yet (a staged load caches what it read).
        let dest2 = [2, 4, 6, 8, 10, 11];
        assert_eq!(load(&node, 6..12, true, &dest2).await, "direct");
        let mut both = expect(&dest, 0);
        both.extend(expect(&dest2, 6));
        kv.verify(&both, 0).unwrap();
        let text = node.metrics_text().await.unwrap();
        assert!(
            text.contains("kvferry_qps{nic=\"soft_mlx5_41\",state=\"rts\"}"),
            "{text}"
        );
        settled(&node).await;
        node.shutdown();
        owner.stop().await;
    });
}
