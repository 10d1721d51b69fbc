//! The owner side of `kvferry.v1.Peer` over real gRPC on loopback TCP: Hello, Handshake,
//! PinBlocks (prefix order, shortened hits, addresses inside the pool), Unpin, and the
//! refusals (bad token, malformed input) that must leave the owner unchanged. The verbs
//! endpoint exchange: every field of a `VerbsEndpoint` checked on receipt, a node without a
//! usable RDMA NIC refusing verbs handshakes with the reason, and (with a responder that
//! stands in for the NIC) an answer a requester can bring its QPs to RTR/RTS against. The
//! last test runs the owner in a child process (this binary re-executed) and pins from the
//! parent.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use kvferry_actors::peer::client::PeerInfo;
use kvferry_actors::peer::endpoint::{endpoints_from_proto, Role};
use kvferry_actors::peer::{
    DataEndpoint, NicRegistration, PeerBackend, PeerClient, PeerClientError,
};
use kvferry_actors::peer::{Provider, VerbsPeerEndpoint, VerbsResponder};
use kvferry_actors::service::{self, proto, Code};
use kvferry_actors::{BlockHash, Clock, Namespace, Node};
use kvferry_gpu::{Device, KvShape};
use kvferry_harness::*;
use kvferry_testkit::{DeviceKv, KvKind};

const TOKEN: &str = "cluster-secret";
const SLOT: u64 = 64 << 10;
const SLOTS: u64 = 32;
const CHILD_ENV: &str = "KVFERRY_PEER_RPC_CHILD";

fn shape() -> KvShape {
    KvShape::new(3, 1, 2, 1024).unwrap()
}

/// A node holding blocks 0..6 of one namespace, serving Peer on 127.0.0.1:0.
struct Owner {
    node: Node,
    _dev: std::sync::Arc<dyn Device>,
    _kv: DeviceKv,
    ns: Namespace,
    addr: SocketAddr,
    pool: (u64, u64),
    server: PeerServer,
}

impl Owner {
    async fn start(token: &str) -> Self {
        Self::start_with(token, |b| b).await
    }

    async fn start_with(token: &str, backend: impl FnOnce(PeerBackend) -> PeerBackend) -> Self {
        Self::start_full(token, Clock::system(), backend).await
    }

    async fn start_full(
        token: &str,
        clock: Clock,
        backend: impl FnOnce(PeerBackend) -> PeerBackend,
    ) -> Self {
        let (node, dev) = node(SLOT, SLOTS, clock);
        let s = shape();
        let kv = register(&node, &dev, "eng", s, 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &s, 0, 0..6).await;
        let ns = Namespace::new("m", "bf16", &s.fingerprint()).unwrap();
        let backend = backend(node.peer_backend());
        let pool = backend.pool();
        let server = PeerServer::start(backend, token).await;
        Self {
            node,
            _dev: dev,
            _kv: kv,
            ns,
            addr: server.addr,
            pool,
            server,
        }
    }

    async fn client(&self, token: &str) -> PeerClient {
        PeerClient::connect(self.addr.to_string(), token)
            .await
            .unwrap()
    }

    /// No peer pin and no pinned block on the owner.
    async fn unchanged(&self) {
        assert_eq!(self.node.peer_pins().await.unwrap(), 0);
        settled(&self.node).await;
    }

    /// Stops the server gracefully (clients must be dropped first) and the node.
    async fn stop(self) {
        self.server.stop().await;
        self.node.shutdown();
    }
}

fn me() -> PeerInfo {
    PeerInfo::local("requester", &[Provider::Tcp], &[])
}

fn code(r: Result<impl std::fmt::Debug, PeerClientError>) -> Code {
    r.unwrap_err().code().expect("a gRPC status")
}

fn hashes_bytes(ids: &[u64]) -> Vec<Vec<u8>> {
    ids.iter()
        .map(|i| BlockHash::from_u64(*i).as_bytes().to_vec())
        .collect()
}

#[test]
fn hello_returns_node_id_and_version() {
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        let c = o.client(TOKEN).await;
        let info = c.hello(me()).await.unwrap();
        assert_eq!(info.node_id, "test");
        assert_eq!(info.version, service::VERSION);
        assert_eq!(info.protocol, service::PROTOCOL);
        assert!(info.capabilities.iter().any(|c| c == "pin-blocks"));
        // No data path added: none is announced.
        assert!(info.providers.is_empty());

        // Another protocol revision is refused, not silently accepted.
        let mut old = me();
        old.protocol = service::PROTOCOL + 1;
        assert_eq!(code(c.hello(old).await), Code::FailedPrecondition);
        // Hello without node info is malformed.
        let r = c
            .raw()
            .hello(proto::HelloRequest {
                token: TOKEN.into(),
                node: None,
            })
            .await;
        assert_eq!(r.unwrap_err().code(), Code::InvalidArgument);
        drop(c);
        o.stop().await;
    });
}

#[test]
fn handshake_answers_the_served_provider_only() {
    rt().block_on(async {
        let auth = kvferry_transport::DataAuth::new();
        let served = auth.clone();
        let o = Owner::start_with(TOKEN, move |b| {
            b.with_endpoint(DataEndpoint {
                auth: Some(served),
                provider: Provider::Tcp,
                endpoint: "127.0.0.1:7000".into(),
                nics: vec![
                    NicRegistration {
                        nic: "tcp0".into(),
                        rkey: 7,
                    },
                    NicRegistration {
                        nic: "tcp1".into(),
                        rkey: 9,
                    },
                ],
            })
        })
        .await;
        let c = o.client(TOKEN).await;
        let info = c.hello(me()).await.unwrap();
        assert_eq!(info.providers, vec!["tcp".to_string()]);
        assert_eq!(info.nics, vec!["tcp0".to_string(), "tcp1".to_string()]);

        let h = c.handshake("requester", Provider::Tcp).await.unwrap();
        assert_eq!(h.endpoint, "127.0.0.1:7000");
        // A tcp handshake authorises one data link for the requester; another handshake
        // replaces it (the first is revoked), so the owner holds one per requester.
        let first = h
            .grant
            .clone()
            .expect("a tcp handshake authorises a data link");
        assert_eq!(auth.grants(), 1);
        let again = c.handshake("requester", Provider::Tcp).await.unwrap();
        let second = again.grant.expect("a data link");
        assert_ne!(second.link, first.link);
        assert_ne!(second.secret, first.secret);
        assert_eq!(auth.grants(), 1);
        assert_eq!(h.regions.len(), 2);
        for (r, (nic, rkey)) in h.regions.iter().zip([("tcp0", 7), ("tcp1", 9)]) {
            assert_eq!((r.nic.as_str(), r.rkey), (nic, rkey));
            assert_eq!((r.addr, r.len), o.pool);
        }
        assert_eq!(o.pool.1, SLOT * SLOTS);

        assert_eq!(
            code(c.handshake("requester", Provider::Shm).await),
            Code::FailedPrecondition
        );
        let r = c
            .raw()
            .handshake(proto::HandshakeRequest {
                token: TOKEN.into(),
                node_id: "requester".into(),
                provider: "carrier-pigeon".into(),
                ..Default::default()
            })
            .await;
        assert_eq!(r.unwrap_err().code(), Code::InvalidArgument);
        drop(c);
        o.stop().await;
    });
}

#[test]
fn pin_blocks_prefix_in_order_and_unpin_releases() {
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        let c = o.client(TOKEN).await;
        let (base, len) = o.pool;

        let all = c.pin_blocks(&o.ns, &hashes(0..4)).await.unwrap();
        assert_ne!(all.pin_id, 0);
        assert_eq!(all.ttl, Duration::from_secs(120));
        assert_eq!(
            all.blocks.iter().map(|b| b.hash).collect::<Vec<_>>(),
            hashes(0..4)
        );
        let mut addrs = Vec::new();
        for b in &all.blocks {
            assert_eq!(b.len, SLOT);
            assert!(
                b.addr >= base && b.addr + b.len <= base + len,
                "{b:?} outside the pool {base:#x}+{len}"
            );
            assert_eq!((b.addr - base) % SLOT, 0, "{b:?} is not a slot start");
            addrs.push(b.addr);
        }
        addrs.sort_unstable();
        addrs.dedup();
        assert_eq!(addrs.len(), 4, "every block has its own slot");
        assert_eq!(o.node.peer_pins().await.unwrap(), 1);

        // The owner holds 0..6: asking for 0..10 is shortened to the present prefix.
        let longer = c.pin_blocks(&o.ns, &hashes(0..10)).await.unwrap();
        assert_eq!(
            longer.blocks.iter().map(|b| b.hash).collect::<Vec<_>>(),
            hashes(0..6)
        );
        // Same blocks, same addresses as the first pin.
        assert_eq!(
            longer.blocks[..4]
                .iter()
                .map(|b| b.addr)
                .collect::<Vec<_>>(),
            all.blocks.iter().map(|b| b.addr).collect::<Vec<_>>()
        );
        // A hole stops the prefix.
        let holed = [0u64, 1, 99, 3].map(BlockHash::from_u64);
        let short = c.pin_blocks(&o.ns, &holed).await.unwrap();
        assert_eq!(short.blocks.len(), 2);
        // A miss at the front pins nothing.
        let none = c
            .pin_blocks(&o.ns, &[BlockHash::from_u64(99), BlockHash::from_u64(0)])
            .await
            .unwrap();
        assert_eq!((none.pin_id, none.blocks.len()), (0, 0));
        // Another namespace holds nothing.
        let other = Namespace::new("m", "fp8", &shape().fingerprint()).unwrap();
        assert!(c
            .pin_blocks(&other, &hashes(0..4))
            .await
            .unwrap()
            .blocks
            .is_empty());
        assert_eq!(o.node.peer_pins().await.unwrap(), 3);

        for p in [&all, &longer, &short] {
            c.unpin(p.pin_id).await.unwrap();
        }
        // Unpinning twice, or an unknown id, is not an error.
        c.unpin(all.pin_id).await.unwrap();
        c.unpin(0).await.unwrap();
        o.unchanged().await;
        drop(c);
        o.stop().await;
    });
}

#[test]
fn bad_token_is_unauthenticated_and_pins_nothing() {
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        let bad = o.client("not-the-token").await;
        assert_eq!(
            code(bad.pin_blocks(&o.ns, &hashes(0..4)).await),
            Code::Unauthenticated
        );
        assert_eq!(code(bad.hello(me()).await), Code::Unauthenticated);
        assert_eq!(
            code(bad.handshake("requester", Provider::Tcp).await),
            Code::Unauthenticated
        );
        let empty = o.client("").await;
        assert_eq!(
            code(empty.pin_blocks(&o.ns, &hashes(0..4)).await),
            Code::Unauthenticated
        );
        o.unchanged().await;

        // A wrong token cannot release someone else's pin either.
        let good = o.client(TOKEN).await;
        let pin = good.pin_blocks(&o.ns, &hashes(0..2)).await.unwrap();
        assert_eq!(code(bad.unpin(pin.pin_id).await), Code::Unauthenticated);
        assert_eq!(o.node.peer_pins().await.unwrap(), 1);
        good.unpin(pin.pin_id).await.unwrap();
        o.unchanged().await;
        drop((bad, empty, good));
        o.stop().await;
    });
}

#[test]
fn empty_configured_token_accepts_any() {
    rt().block_on(async {
        let o = Owner::start("").await;
        let c = o.client("whatever").await;
        let pin = c.pin_blocks(&o.ns, &hashes(0..3)).await.unwrap();
        assert_eq!(pin.blocks.len(), 3);
        c.unpin(pin.pin_id).await.unwrap();
        o.unchanged().await;
        drop(c);
        o.stop().await;
    });
}

#[test]
fn malformed_requests_are_invalid_and_change_nothing() {
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        let c = o.client(TOKEN).await;
        let ns = o.ns.as_str().to_string();
        let pin = |namespace: String, hashes: Vec<Vec<u8>>| {
            let mut raw = c.raw();
            async move {
                raw.pin_blocks(proto::PinBlocksRequest {
                    token: TOKEN.into(),
                    namespace,
                    hashes,
                })
                .await
            }
        };
        // A valid prefix followed by an empty hash: the whole request is refused.
        let mut h = hashes_bytes(&[0, 1]);
        h.push(Vec::new());
        let e = pin(ns.clone(), h).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("#2"), "{}", e.message());
        // 33 bytes.
        let mut h = hashes_bytes(&[0]);
        h.push(vec![1; 33]);
        let e = pin(ns.clone(), h).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        // Namespaces that are not model/dtype/fingerprint[/tenant], each word once in the message.
        for bad in ["", "m/bf16", "m/bf16/x/y/z", "m/bf16/x/a b", "m/b f16/x"] {
            let e = pin(bad.into(), hashes_bytes(&[0])).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}");
            assert!(
                e.message().starts_with("PinBlocks: namespace ")
                    && !e.message().contains("namespace namespace"),
                "{}",
                e.message()
            );
        }
        // Too many hashes: over a limit, not malformed.
        let many = (0..service::MAX_PIN_HASHES as u64 + 1).collect::<Vec<_>>();
        let e = pin(ns.clone(), hashes_bytes(&many)).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        assert!(e.message().contains("4096"), "{}", e.message());
        // A request over the size limit: RESOURCE_EXHAUSTED, as the Engine service says.
        let e = pin(
            "m".repeat(service::MAX_PEER_REQUEST_BYTES),
            hashes_bytes(&[0]),
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        // Bodies that do not decode, on every method.
        for method in ["Hello", "Handshake", "PinBlocks", "Unpin"] {
            let path: &'static str = Box::leak(format!("/kvferry.v1.Peer/{method}").into());
            let got =
                raw::unary_code(&o.addr.to_string(), TOKEN, path, raw::GARBLED.to_vec()).await;
            assert_eq!(got, Code::InvalidArgument, "{method}");
        }
        o.unchanged().await;
        // The limit itself is fine (the present prefix is pinned).
        let most = (0..service::MAX_PIN_HASHES as u64).collect::<Vec<_>>();
        let ok = pin(ns.clone(), hashes_bytes(&most))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ok.blocks.len(), 6);
        assert_eq!(o.node.peer_pins().await.unwrap(), 1);
        c.unpin(ok.pin_id).await.unwrap();
        o.unchanged().await;
        drop(c);
        o.stop().await;
    });
}

#[test]
fn unreleased_pins_expire_after_the_announced_ttl() {
    rt().block_on(async {
        let (clock, hand) = Clock::manual();
        let o = Owner::start_full(TOKEN, clock, |b| b).await;
        let c = o.client(TOKEN).await;
        let pin = c.pin_blocks(&o.ns, &hashes(0..3)).await.unwrap();
        assert_eq!(o.node.peer_pins().await.unwrap(), 1);
        hand.advance(pin.ttl - Duration::from_secs(1));
        assert_eq!(o.node.sweep_peer_pins().await.unwrap(), 0);
        hand.advance(Duration::from_secs(2));
        assert_eq!(o.node.sweep_peer_pins().await.unwrap(), 1);
        o.unchanged().await;
        // The requester's late Unpin of the expired pin is harmless.
        c.unpin(pin.pin_id).await.unwrap();
        o.unchanged().await;
        drop(c);
        o.stop().await;
    });
}

#[test]
fn a_silent_peer_fails_calls_at_the_deadline() {
    rt().block_on(async {
        // Accepts connections and never speaks HTTP/2.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let deadline = Duration::from_millis(300);
        let ns = Namespace::new("m", "bf16", &shape().fingerprint()).unwrap();
        let started = std::time::Instant::now();
        let r = async {
            let c = PeerClient::connect_with_deadline(addr.to_string(), TOKEN, deadline).await?;
            c.pin_blocks(&ns, &hashes(0..1)).await
        }
        .await;
        let took = started.elapsed();
        let e = r.unwrap_err();
        assert!(
            matches!(e, PeerClientError::ConnectTimeout { .. })
                || matches!(
                    e.code(),
                    Some(Code::DeadlineExceeded | Code::Cancelled | Code::Unavailable)
                ),
            "{e:?}"
        );
        assert!(took < Duration::from_secs(3), "gave up after {took:?}");
        hold.abort();
    });
}

#[test]
fn concurrent_pins_over_one_connection_all_release() {
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        let c = o.client(TOKEN).await;
        let tasks: Vec<_> = (0..32u64)
            .map(|i| {
                let c = c.clone();
                let ns = o.ns.clone();
                tokio::spawn(async move {
                    let pin = c.pin_blocks(&ns, &hashes(0..1 + i % 6)).await.unwrap();
                    assert_eq!(pin.blocks.len() as u64, 1 + i % 6);
                    pin.pin_id
                })
            })
            .collect();
        let mut ids = Vec::new();
        for t in tasks {
            ids.push(t.await.unwrap());
        }
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 32, "every pin has its own id");
        assert_eq!(o.node.peer_pins().await.unwrap(), 32);
        for id in ids {
            c.unpin(id).await.unwrap();
        }
        o.unchanged().await;
        drop(c);
        o.stop().await;
    });
}

#[test]
fn a_stopped_node_answers_unavailable() {
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        let c = o.client(TOKEN).await;
        o.node.shutdown();
        assert_eq!(
            code(c.pin_blocks(&o.ns, &hashes(0..2)).await),
            Code::Unavailable
        );
        assert_eq!(code(c.unpin(1).await), Code::Unavailable);
        drop(c);
        o.stop().await;
    });
}

/// The owner role of `cross_process_pin`: runs only when re-executed with `CHILD_ENV`.
/// Prints its address and pool, serves until stdin closes, then checks that every pin the
/// parent took was released.
#[test]
#[ignore = "runs only as the owner child process started by cross_process_pin"]
fn child_owner() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "started by cross_process_pin"
    );
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        println!("PEER_ADDR={}", o.addr);
        println!("PEER_POOL={} {}", o.pool.0, o.pool.1);
        std::io::stdout().flush().unwrap();
        stdin_closed().await;
        o.unchanged().await;
        println!("PEER_CHILD_OK");
        std::io::stdout().flush().unwrap();
        o.stop().await;
    });
}

#[test]
fn cross_process_pin() {
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_owner"),
        &[(CHILD_ENV, "1")],
    );
    let addr = child.wait_for("PEER_ADDR=");
    let pool = child.wait_for("PEER_POOL=");
    let (base, len) = pool.split_once(' ').unwrap();
    let (base, len): (u64, u64) = (base.parse().unwrap(), len.parse().unwrap());

    rt().block_on(async {
        let c = PeerClient::connect(addr.clone(), TOKEN).await.unwrap();
        let info = c.hello(me()).await.unwrap();
        assert_eq!(info.node_id, "test");
        let ns = Namespace::new("m", "bf16", &shape().fingerprint()).unwrap();
        let pin = c.pin_blocks(&ns, &hashes(0..9)).await.unwrap();
        assert_eq!(
            pin.blocks.iter().map(|b| b.hash).collect::<Vec<_>>(),
            hashes(0..6)
        );
        assert!(pin
            .blocks
            .iter()
            .all(|b| b.addr >= base && b.addr + b.len <= base + len));
        let bad = PeerClient::connect(addr, "nope").await.unwrap();
        assert_eq!(
            code(bad.pin_blocks(&ns, &hashes(0..2)).await),
            Code::Unauthenticated
        );
        c.unpin(pin.pin_id).await.unwrap();
    });

    // Closing stdin tells the child to check its gauges and stop.
    child.finish(Some("PEER_CHILD_OK"));
}

fn verbs_endpoint(nic: &str, qps: &[(u32, u32)]) -> proto::VerbsEndpoint {
    proto::VerbsEndpoint {
        nic: nic.into(),
        gid: vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7],
        lid: 0,
        mtu: 4096,
        responder_depth: 16,
        qps: qps
            .iter()
            .map(|(qpn, psn)| proto::QueuePair {
                qpn: *qpn,
                psn: *psn,
                slot: qpn % 64,
            })
            .collect(),
        regions: Vec::new(),
    }
}

fn requester_endpoints() -> Vec<VerbsPeerEndpoint> {
    endpoints_from_proto(
        &[verbs_endpoint("mlx5_0", &[(0x101, 11), (0x102, 12)])],
        Role::Request,
    )
    .unwrap()
}

/// Every malformed verbs endpoint is INVALID_ARGUMENT before anything is made, a provider
/// mismatch too; a node without a usable RDMA NIC refuses a well-formed verbs handshake
/// with FAILED_PRECONDITION naming why. Nothing changes on the owner.
#[test]
fn verbs_endpoints_are_checked_on_receipt() {
    rt().block_on(async {
        let o = Owner::start(TOKEN).await;
        let c = o.client(TOKEN).await;
        let hs = |provider: &str, verbs: Vec<proto::VerbsEndpoint>| {
            let mut raw = c.raw();
            let provider = provider.to_string();
            async move {
                raw.handshake(proto::HandshakeRequest {
                    token: TOKEN.into(),
                    node_id: "requester".into(),
                    provider,
                    verbs,
                })
                .await
            }
        };
        let good = verbs_endpoint("mlx5_0", &[(0x101, 11)]);
        let mut cases: Vec<(proto::VerbsEndpoint, &str)> = Vec::new();
        let mut e = good.clone();
        e.gid = vec![1; 15];
        cases.push((e, "gid is 15 bytes"));
        let mut e = good.clone();
        e.gid = vec![0; 16];
        cases.push((e, "no address"));
        let mut e = good.clone();
        e.lid = 1 << 16;
        cases.push((e, "lid"));
        let mut e = good.clone();
        e.mtu = 9000;
        cases.push((e, "mtu 9000"));
        let mut e = good.clone();
        e.responder_depth = 0;
        cases.push((e, "responder depth 0"));
        let mut e = good.clone();
        e.qps[0].qpn = 0;
        cases.push((e, "qp number 0"));
        let mut e = good.clone();
        e.qps[0].qpn = 1 << 24;
        cases.push((e, "wider than 24 bits"));
        let mut e = good.clone();
        e.qps[0].psn = 1 << 24;
        cases.push((e, "psn"));
        let mut e = good.clone();
        e.qps.push(e.qps[0]);
        cases.push((e, "appears twice"));
        let mut e = good.clone();
        e.qps.clear();
        cases.push((e, "0 qps"));
        let mut e = good.clone();
        e.nic = "mlx5/0".into();
        cases.push((e, "nic name"));
        let mut e = good.clone();
        e.regions.push(proto::PoolRegion {
            nic: "mlx5_0".into(),
            addr: 0x1000,
            len: 0x1000,
            rkey: 1,
        });
        cases.push((e, "none outside an answer"));
        for (bad, says) in cases {
            let s = hs("verbs", vec![bad]).await.unwrap_err();
            assert_eq!(s.code(), Code::InvalidArgument, "{says}: {s:?}");
            assert!(s.message().contains(says), "{says}: {}", s.message());
        }
        let s = hs("verbs", vec![good.clone(), good.clone()])
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().contains("named twice"), "{}", s.message());
        let s = hs("verbs", vec![]).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument);
        let s = hs("tcp", vec![good.clone()]).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().contains("provider tcp"), "{}", s.message());

        // Hello: announced ports are checked too (no QPs in Hello).
        let mut with_qps = me();
        with_qps.verbs = requester_endpoints();
        let r = c.hello(with_qps).await;
        assert_eq!(code(r), Code::InvalidArgument);
        let mut port = me();
        port.verbs =
            endpoints_from_proto(&[verbs_endpoint("mlx5_0", &[])], Role::Announce).unwrap();
        assert!(c.hello(port).await.unwrap().verbs.is_empty());

        // Well formed, but this owner has no usable RDMA NIC: refused with the reason.
        let e = c
            .handshake_verbs("requester", &requester_endpoints())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
        assert!(e.to_string().contains("no usable RDMA nic"), "{e}");
        o.unchanged().await;
        drop(c);
        o.stop().await;
    });
}

/// Stands in for the owner's NIC: answers each requester QP with an owner QP and the pool
/// registered as two MRs; `short` answers one QP too few (a broken responder).
#[derive(Debug)]
struct FakeResponder {
    pool: (u64, u64),
    short: bool,
}

impl VerbsResponder for FakeResponder {
    fn ports(&self) -> Vec<VerbsPeerEndpoint> {
        endpoints_from_proto(&[verbs_endpoint("mlx5_0", &[])], Role::Announce).unwrap()
    }

    fn accept(
        &self,
        _peer: &str,
        request: &[VerbsPeerEndpoint],
    ) -> Result<Vec<VerbsPeerEndpoint>, String> {
        let half = self.pool.1 / 2;
        Ok(request
            .iter()
            .map(|r| {
                let mut qps: Vec<(u32, u32)> = r
                    .qps
                    .iter()
                    .enumerate()
                    .map(|(i, _)| (0x900 + i as u32, 0x40 + i as u32))
                    .collect();
                if self.short {
                    qps.pop();
                }
                let mut e = verbs_endpoint(&r.nic, &qps);
                for (i, (addr, len)) in [(self.pool.0, half), (self.pool.0 + half, half)]
                    .into_iter()
                    .enumerate()
                {
                    e.regions.push(proto::PoolRegion {
                        nic: r.nic.clone(),
                        addr,
                        len,
                        rkey: 0x77 + i as u64,
                    });
                }
                endpoints_from_proto(&[e], Role::Answer).unwrap().remove(0)
            })
            .collect())
    }
}

/// A node serving its pool over verbs: Hello announces the provider and the port; a verbs
/// handshake answers owner QPs (as many as offered) and the pool's MRs with their rkeys,
/// from which the requester builds its RTR/RTS transitions and read keys. A responder whose
/// answer does not match the request is caught by the owner before anything is sent.
#[test]
fn verbs_handshake_answers_owner_qps_and_pool_rkeys() {
    use kvferry_transport::verbs::qp_attrs::{connect_transitions, ReadDepthLimits};
    use kvferry_transport::verbs::{PortAddress, VerbsConfig};
    rt().block_on(async {
        let o = Owner::start_with(TOKEN, |b| {
            let pool = b.pool();
            b.with_verbs(std::sync::Arc::new(FakeResponder { pool, short: false }))
        })
        .await;
        let c = o.client(TOKEN).await;
        let info = c.hello(me()).await.unwrap();
        assert_eq!(info.providers, vec!["verbs".to_string()]);
        assert_eq!(info.nics, vec!["mlx5_0".to_string()]);
        assert_eq!(info.verbs.len(), 1);
        assert!(info.verbs[0].qps.is_empty());

        let mine = requester_endpoints();
        let h = c.handshake_verbs("requester", &mine).await.unwrap();
        assert_eq!(h.provider, Provider::Verbs);
        assert_eq!(h.verbs.len(), 1);
        let owner = &h.verbs[0];
        assert_eq!(owner.qps, vec![(0x900, 0x40), (0x901, 0x41)]);
        let keys = owner.key_map();
        assert_eq!(keys.remote_key(o.pool.0 + 64, 4096), Ok(0x77));
        assert_eq!(keys.remote_key(o.pool.0 + o.pool.1 - 64, 64), Ok(0x78));
        assert!(keys.remote_key(o.pool.0 + o.pool.1 / 2 - 8, 16).is_err());
        assert_eq!(h.regions.len(), 2);
        // The requester's QP 1 goes to RTR against owner QP 1 and starts sending at its own
        // PSN.
        let local = PortAddress {
            port: 1,
            gid_index: 3,
            gid: mine[0].gid,
            lid: 0,
            global: true,
            mtu: mine[0].mtu,
        };
        let steps = connect_transitions(
            &VerbsConfig::default(),
            16,
            ReadDepthLimits {
                initiator: 16,
                responder: 16,
            },
            &local,
            &owner.qp_endpoint(1).unwrap(),
            mine[0].qps[1].1,
            0,
        );
        assert_eq!((steps[1].dest_qpn, steps[1].rq_psn), (0x901, 0x41));
        assert_eq!(steps[2].sq_psn, 12);
        drop(c);
        o.stop().await;

        let o = Owner::start_with(TOKEN, |b| {
            let pool = b.pool();
            b.with_verbs(std::sync::Arc::new(FakeResponder { pool, short: true }))
        })
        .await;
        let c = o.client(TOKEN).await;
        let e = c.handshake_verbs("requester", &mine).await.unwrap_err();
        assert_eq!(e.code(), Some(Code::Internal), "{e}");
        drop(c);
        o.stop().await;
    });
}

/// An RDMA NIC without hardware whose `accept` hands out owner QP numbers (a counter) and
/// keeps count of the QPs alive, or refuses.
struct FakeNic {
    next_qpn: std::sync::atomic::AtomicU32,
    alive: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    refuse: bool,
}

struct FakeQp(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for FakeQp {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl kvferry_transport::verbs::RdmaNic for FakeNic {
    fn name(&self) -> &str {
        "mlx5_7"
    }

    fn address(&self) -> kvferry_transport::verbs::PortAddress {
        kvferry_transport::verbs::PortAddress {
            port: 1,
            gid_index: 3,
            gid: kvferry_transport::verbs::gid::Gid([9; 16]),
            lid: 0,
            global: true,
            mtu: kvferry_transport::verbs::gid::Mtu::M2048,
        }
    }

    fn register_chunk(
        &self,
        _region: &std::sync::Arc<kvferry_transport::HostRegion>,
        chunk: kvferry_transport::verbs::registration::Chunk,
    ) -> Result<kvferry_transport::verbs::ChunkMr, kvferry_transport::verbs::RegistrarError> {
        Err(kvferry_transport::verbs::RegistrarError::OutsideRegion {
            nic: "mlx5_7".into(),
            addr: chunk.addr,
            len: chunk.len,
        })
    }

    fn accept(
        self: std::sync::Arc<Self>,
        remote: kvferry_transport::verbs::QpEndpoint,
    ) -> Result<
        (
            kvferry_transport::verbs::QpEndpoint,
            Box<dyn std::any::Any + Send + Sync>,
        ),
        kvferry_transport::verbs::AcceptError,
    > {
        if self.refuse {
            return Err(kvferry_transport::verbs::AcceptError::Setup {
                nic: "mlx5_7".into(),
                what: "ibv_create_qp",
                reason: "out of QPs".into(),
            });
        }
        let qpn = self
            .next_qpn
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.alive.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let a = self.address();
        Ok((
            kvferry_transport::verbs::QpEndpoint {
                qpn,
                psn: remote.psn ^ 0x55,
                lid: a.lid,
                gid: a.gid,
                mtu: a.mtu,
                responder_depth: 8,
            },
            Box::new(FakeQp(std::sync::Arc::clone(&self.alive))),
        ))
    }
}

/// The node's own responder (`NicResponder`) over a NIC that stands in for hardware, and the
/// requester's `GrpcExchange` (what the transport's `VerbsConnector` calls while it brings a
/// QP up): one handshake per QP, the owner's QP and the pool's rkeys on its NIC come back,
/// the owner keeps its QP alive; a NIC that cannot make QPs is a typed handshake error.
#[test]
fn grpc_exchange_trades_one_qp_with_the_owner_responder() {
    use kvferry_actors::nic::{NicResponder, ServingNic};
    use kvferry_actors::peer::verbs::GrpcExchange;
    use kvferry_transport::verbs::registration::Chunk;
    use kvferry_transport::verbs::{EndpointExchange, QpEndpoint};
    use kvferry_transport::{ConnectionError, NicId, NodeId, QpKey, QpNum};
    use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
    use std::sync::Arc;
    for refuse in [false, true] {
        let alive = Arc::new(AtomicUsize::new(0));
        let (o, c, runtime) = {
            let rt = rt();
            let alive = Arc::clone(&alive);
            let (o, c) = rt.block_on(async {
                let o = Owner::start_with(TOKEN, |b| {
                    let (addr, len) = b.pool();
                    let nic = Arc::new(FakeNic {
                        next_qpn: AtomicU32::new(0x3000),
                        alive,
                        refuse,
                    });
                    let serving = ServingNic {
                        nic,
                        regions: vec![(Chunk { addr, len }, 0xabc)],
                        responder_depth: 16,
                    };
                    b.with_verbs(Arc::new(NicResponder::new(vec![serving]).unwrap()))
                })
                .await;
                let c = o.client(TOKEN).await;
                (o, c)
            });
            (o, c, rt)
        };
        let exchange = GrpcExchange {
            client: c.clone(),
            runtime: runtime.handle().clone(),
            node_id: "requester".into(),
            nic: "mlx5_0".into(),
            peer: NodeId(7),
        };
        let local = QpEndpoint {
            qpn: 0x42,
            psn: 0x1234,
            lid: 0,
            gid: kvferry_transport::verbs::gid::Gid([3; 16]),
            mtu: kvferry_transport::verbs::gid::Mtu::M4096,
            responder_depth: 16,
        };
        let key = QpKey::new(NodeId(7), NicId(0), QpNum(1));
        // Called from a plain thread, as a NIC worker connecting a QP would.
        let r = std::thread::spawn(move || {
            let a = exchange.exchange(key, local);
            let other = QpKey::new(NodeId(7), NicId(0), QpNum(2));
            let b = exchange.exchange(other, QpEndpoint { qpn: 0x43, ..local });
            (a, b)
        })
        .join()
        .unwrap();
        if refuse {
            let e = r.0.unwrap_err();
            assert!(
                matches!(&e, ConnectionError::Handshake { reason, .. } if reason.contains("out of QPs")),
                "{e}"
            );
            assert_eq!(alive.load(Ordering::SeqCst), 0);
        } else {
            let (remote, keys) = r.0.unwrap();
            assert_eq!((remote.qpn, remote.psn), (0x3000, 0x1234 ^ 0x55));
            assert_eq!(remote.mtu, kvferry_transport::verbs::gid::Mtu::M2048);
            assert_eq!(keys.remote_key(o.pool.0 + 100, 64), Ok(0xabc));
            let (second, _) = r.1.unwrap();
            assert_eq!(second.qpn, 0x3001);
            // The owner keeps a QP per requester QP.
            assert_eq!(alive.load(Ordering::SeqCst), 2);
        }
        drop(c);
        runtime.block_on(o.stop());
        // The responder (and its QPs) went with the server.
        assert_eq!(alive.load(Ordering::SeqCst), 0);
    }
}

/// Two nodes of this process over this host's first usable RDMA NIC: the owner registers
/// its pool on the NIC at start and answers verbs handshakes with QPs on it; the requester
/// reads the remote suffix over verbs (staged into its pool, then copied to its KV), byte
/// for byte.
#[test]
#[ignore = "needs an RDMA NIC"]
fn remote_suffix_over_verbs() {
    use kvferry_actors::nic::{NicSection, VerbsSection};
    use kvferry_actors::peer::LocalCluster;
    use kvferry_transport::verbs::{probe, Sysfs, VerbsCapability};
    use std::sync::Arc;

    let nic = match probe(&Sysfs::default()) {
        VerbsCapability::Usable { nics } => nics[0].clone(),
        VerbsCapability::Unusable { reason } => panic!("no usable RDMA NIC: {reason}"),
    };
    let with_nic = |node_id: &str| {
        let mut cfg = config(SLOT, SLOTS);
        cfg.node_id = node_id.into();
        cfg.nic = vec![NicSection {
            name: nic.clone(),
            provider: "verbs".into(),
            ..NicSection::default()
        }];
        cfg.verbs = Some(VerbsSection::default());
        cfg
    };
    rt().block_on(async {
        let s = shape();
        let (owner, owner_dev) = start(with_nic("a"), Clock::system(), None::<Arc<LocalCluster>>);
        assert!(
            owner.nics().unwrap().pool.is_ok(),
            "pool registered on {nic}"
        );
        let _okv = register(&owner, &owner_dev, "eng", s, 0, KvKind::Split, 16, 0).await;
        put(&owner, "eng", &s, 0, 0..6).await;
        let server = PeerServer::start(owner.peer_backend(), TOKEN).await;
        let peers = grpc_peers(
            "b",
            Provider::Verbs,
            TOKEN,
            &[("a", server.addr.to_string())],
            None,
        );
        let (node, dev) = start(with_nic("b"), Clock::system(), Some(peers));
        let kv = register(&node, &dev, "eng", s, 0, KvKind::Split, 16, 0).await;
        let q = query(&node, "eng", 0..6, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (0, 6));
        let dest: Vec<u32> = vec![5, 0, 3, 9, 1, 12];
        let req = load_request(q.lease.unwrap(), "eng", 0, &dest);
        let r = load_and_verify(&node, &kv, req, 0, "over verbs").await;
        assert_eq!(r.path, "staged");
        let text = node.metrics_text().await.unwrap();
        assert!(
            text.contains(&format!("kvferry_qps{{nic=\"{nic}\",state=\"rts\"}}")),
            "{text}"
        );
        settled(&node).await;
        node.shutdown();
        server.stop().await;
        owner.shutdown();
    });
}
