//! The tcp data plane between two nodes linked through the Peer service: a client without
//! the handshake's secret, with a stale one, or guessing keys reads nothing and is
//! disconnected; the owner's `kvferry_data_rejected_total` shows each; the authorised
//! requester's loads go on, byte for byte.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_actors::peer::{PeerClient, Provider};
use kvferry_actors::{Clock, Node};
use kvferry_gpu::KvShape;
use kvferry_harness::*;
use kvferry_testkit::KvKind;
use kvferry_transport::tcp::TcpConnector;
use kvferry_transport::{
    Access, CompletionQueue, CompletionStatus, ConnectionError, HostRegion, LinkGrant, LinkSecret,
    LocalSegment, MrHandle, MrKey, MrTable, NicId, NodeId, Qp, QpError, QpGauges, QpKey, QpNum,
    QueueLimits, ReadRequest, RemoteDescriptor,
};

const CANARY: u8 = 0x5a;

/// A stranger's view of the owner's data port: its own memory and one QP.
struct Stranger {
    table: MrTable,
    dest: Arc<HostRegion>,
    lkey: MrKey,
    _mr: MrHandle,
    cq: Arc<CompletionQueue>,
    owner: NodeId,
    me: NodeId,
    addr: SocketAddr,
}

impl Stranger {
    fn new(me: &str, addr: SocketAddr) -> Stranger {
        let table = MrTable::new();
        let dest = Arc::new(HostRegion::anonymous(1 << 20).unwrap());
        dest.fill(CANARY).unwrap();
        let mr = table
            .register_host(dest.clone(), Access::LOCAL_WRITE)
            .unwrap();
        Stranger {
            table,
            dest,
            lkey: mr.key(),
            _mr: mr,
            cq: Arc::new(CompletionQueue::new(64)),
            owner: kvferry_actors::peer::cluster::transport_id("a"),
            me: kvferry_actors::peer::cluster::transport_id(me),
            addr,
        }
    }

    fn qp(&self, grant: LinkGrant) -> Result<Qp, QpError> {
        let mut qp = Qp::new(
            QpKey::new(self.owner, NicId(0), QpNum(1)),
            QueueLimits {
                max_send_wr: 8,
                max_rd_atomic: 4,
                max_sge: 4,
                ..QueueLimits::default()
            },
            self.table.clone(),
            Arc::new(QpGauges::default()),
        );
        let c = TcpConnector::new(self.me, self.owner, self.addr, grant)
            .with_connect_timeout(Duration::from_secs(2));
        qp.connect(&c, self.cq.clone())?;
        Ok(qp)
    }

    /// Reads `len` bytes at `addr` with `rkey`; the completion's status.
    fn read(&self, qp: &mut Qp, addr: u64, len: u64, rkey: MrKey) -> CompletionStatus {
        let read = ReadRequest {
            wr_id: 1,
            remote: RemoteDescriptor { addr, len, rkey },
            local: vec![LocalSegment {
                lkey: self.lkey,
                addr: self.dest.addr(),
                len,
            }],
        };
        qp.post(&[read], Instant::now()).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let (mut raw, mut done) = (Vec::new(), Vec::new());
        while done.is_empty() {
            assert!(Instant::now() < end, "no completion");
            raw.clear();
            self.cq.wait(&mut raw, 8, Duration::from_millis(10));
            for wc in &raw {
                let _ = qp.handle_completion(wc, Instant::now());
            }
            qp.poll_completions(&mut done);
        }
        done[0].status
    }

    fn untouched(&self) -> bool {
        self.dest.to_vec().iter().all(|b| *b == CANARY)
    }
}

fn refused(r: Result<Qp, QpError>) -> bool {
    matches!(
        r,
        Err(QpError::Connect {
            source: ConnectionError::Unauthorized { .. },
            ..
        })
    )
}

/// `kvferry_data_rejected_total{reason}` in the node's scrape.
async fn rejected(node: &Node, reason: &str) -> u64 {
    let text = node.metrics_text().await.unwrap();
    let want = format!("kvferry_data_rejected_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&want).map(|v| v.trim().parse().unwrap()))
        .unwrap_or_else(|| panic!("no {want} in\n{text}"))
}

#[test]
fn strangers_read_nothing_while_the_linked_peer_loads() {
    rt().block_on(async {
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        // Owner "a" holds 0..8 and serves its pool over tcp.
        let owner_peers = grpc_peers("a", Provider::Tcp, "t", &[], None);
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "a".into();
        let (owner, owner_dev) = start(cfg, Clock::system(), Some(Arc::clone(&owner_peers)));
        let _okv =
            register_ranks(&owner, &owner_dev, "eng", shape, KvKind::Split, 8, 0, 0..8).await;
        let backend = owner
            .peer_backend()
            .with_endpoint(owner_peers.data_endpoint().expect("a tcp data side"));
        let server = PeerServer::start(backend, "t").await;
        // Requester "b" reads the remote suffix from it.
        let peers = grpc_peers(
            "b",
            Provider::Tcp,
            "t",
            &[("a", server.addr.to_string())],
            None,
        );
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "b".into();
        let (node, dev) = start(cfg, Clock::system(), Some(peers));
        let kv = register(&node, &dev, "eng", shape, 0, KvKind::Split, 16, 0).await;
        let q = query(&node, "eng", 0..4, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (0, 4));
        load(&node, q.lease.unwrap(), "eng", 0, &[9, 2, 5, 0])
            .await
            .unwrap();
        kv.verify(&expected(&[9, 2, 5, 0], 0), 0).unwrap();
        for r in ["unknown_link", "bad_proof", "stale_link", "bad_read"] {
            assert_eq!(rejected(&owner, r).await, 0, "{r}");
        }

        // Mallory holds the cluster token (so she learns the data port and the pool's key),
        // Eve only the data port.
        let mallory = PeerClient::connect(server.addr.to_string(), "t")
            .await
            .unwrap();
        let hs = mallory.handshake("mallory", Provider::Tcp).await.unwrap();
        let addr: SocketAddr = hs.endpoint.parse().unwrap();
        let region = hs.regions[0].clone();
        let first = hs.grant.clone().unwrap();
        let again = mallory.handshake("mallory", Provider::Tcp).await.unwrap();
        let current = again.grant.clone().unwrap();
        tokio::task::spawn_blocking(move || {
            let eve = Stranger::new("eve", addr);
            // No secret at all: a link id made up.
            let made_up = LinkGrant {
                link: 12345,
                secret: LinkSecret::from_bytes(&[1; 32]).unwrap(),
            };
            assert!(refused(eve.qp(made_up)));
            // Mallory's link id with a guessed secret.
            let guessed = LinkGrant {
                link: current.link,
                secret: LinkSecret::from_bytes(&[2; 32]).unwrap(),
            };
            let m = Stranger::new("mallory", addr);
            assert!(refused(m.qp(guessed)));
            // Mallory's first link: revoked by her second handshake.
            assert!(refused(m.qp(first)));
            // Her current link with a guessed key: one refusal, then the connection is closed.
            let mut qp = m.qp(current.clone()).unwrap();
            let guess = MrKey(region.rkey ^ 0x1);
            assert_eq!(
                m.read(&mut qp, region.addr, 4096, guess),
                CompletionStatus::RemoteAccessError
            );
            // An address outside the pool with the right key: refused too.
            let mut qp = m.qp(current).unwrap();
            assert_eq!(
                m.read(&mut qp, region.addr + region.len, 4096, MrKey(region.rkey)),
                CompletionStatus::RemoteAccessError
            );
            assert!(eve.untouched() && m.untouched());
        })
        .await
        .unwrap();
        assert!(rejected(&owner, "unknown_link").await >= 1);
        assert!(rejected(&owner, "bad_proof").await >= 1);
        assert!(rejected(&owner, "stale_link").await >= 1);
        assert_eq!(rejected(&owner, "bad_read").await, 2);

        // The linked requester's loads go on over its own link.
        let q = query(&node, "eng", 0..8, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 4));
        load(
            &node,
            q.lease.unwrap(),
            "eng",
            0,
            &[9, 2, 5, 0, 7, 8, 10, 11],
        )
        .await
        .unwrap();
        kv.verify(&expected(&[9, 2, 5, 0, 7, 8, 10, 11], 0), 0)
            .unwrap();
        settled(&node).await;
        settled_with_peers(&owner).await;
        drop(mallory);
        server.stop().await;
        node.shutdown();
        owner.shutdown();
    });
}

/// A requester whose link the owner revoked (here: its node id handshook again elsewhere)
/// fails the load that finds out, with nothing written outside the destination, and the next
/// plan links again with a fresh handshake and loads.
#[test]
fn a_revoked_link_is_made_again() {
    rt().block_on(async {
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        let owner_peers = grpc_peers("a", Provider::Tcp, "t", &[], None);
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "a".into();
        let (owner, owner_dev) = start(cfg, Clock::system(), Some(Arc::clone(&owner_peers)));
        let _okv =
            register_ranks(&owner, &owner_dev, "eng", shape, KvKind::Split, 8, 0, 0..8).await;
        let backend = owner
            .peer_backend()
            .with_endpoint(owner_peers.data_endpoint().expect("a tcp data side"));
        let server = PeerServer::start(backend, "t").await;
        let peers = grpc_peers(
            "b",
            Provider::Tcp,
            "t",
            &[("a", server.addr.to_string())],
            None,
        );
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "b".into();
        let (node, dev) = start(cfg, Clock::system(), Some(peers));
        let kv = register(&node, &dev, "eng", shape, 0, KvKind::Split, 16, 0).await;
        let q = query(&node, "eng", 0..4, false).await;
        load(&node, q.lease.unwrap(), "eng", 0, &[9, 2, 5, 0])
            .await
            .unwrap();
        kv.verify(&expected(&[9, 2, 5, 0], 0), 0).unwrap();
        settled(&node).await;
        node.drop_reclaimable().await.unwrap();

        // Another handshake in b's name revokes b's link.
        let other = PeerClient::connect(server.addr.to_string(), "t")
            .await
            .unwrap();
        other.handshake("b", Provider::Tcp).await.unwrap();
        // The next load through the old link fails (its connections are served no further
        // and cannot be rebuilt); loads after it link again.
        let mut ok = None;
        for attempt in 0..3 {
            kv.reset().unwrap();
            let q = query(&node, "eng", 4..8, false).await;
            if q.remote_blocks != 4 {
                continue;
            }
            match load(&node, q.lease.unwrap(), "eng", 0, &[1, 3, 6, 7]).await {
                Ok(_) => {
                    ok = Some(attempt);
                    break;
                }
                Err(_) => {
                    // Nothing of a failed load is outside its destination blocks.
                    settled(&node).await;
                }
            }
        }
        let attempt = ok.expect("a new link loads");
        assert!(attempt >= 1, "the revoked link should fail one load first");
        kv.verify(&expected(&[1, 3, 6, 7], 4), 0).unwrap();
        assert!(rejected(&owner, "stale_link").await >= 1);
        settled(&node).await;
        settled_with_peers(&owner).await;
        drop(other);
        server.stop().await;
        node.shutdown();
        owner.shutdown();
    });
}
