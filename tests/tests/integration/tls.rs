//! Issue 29: `kvferry.v1.Engine` and `kvferry.v1.Peer` over TLS on loopback, with
//! certificates made here. The Rust engine client over TLS (CA only, and with a client
//! certificate where the node requires one); clients that are refused — plaintext, another
//! CA, no certificate — see a connect or Unavailable error and the node counts them; the
//! Peer service over mutual TLS keeps answering calls on an open connection while its
//! certificate is rotated, and new connections get the new one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvferry_actors::peer::client::PeerInfo;
use kvferry_actors::peer::{PeerClient, PeerClientError, Provider};
use kvferry_actors::service::{Code, EngineOptions};
use kvferry_actors::tls::{
    peer_server_name, ClientAuth, TlsContext, TlsDial, TlsFiles, TlsServing, TlsSide, ALPN_H2,
};
use kvferry_actors::Clock;
use kvferry_client::{EngineClient, EngineClientError, EngineTls};
use kvferry_harness::*;

/// The testkit's lab CA in `dir`; each certificate names one node (and localhost), written
/// as `<name>.pem` / `.key`.
struct Ca(kvferry_testkit::LabCa);

impl Ca {
    fn new(dir: &Path) -> Self {
        Self(kvferry_testkit::LabCa::new(dir, "tls test CA").unwrap())
    }

    fn ca(&self) -> PathBuf {
        self.0.ca()
    }

    fn issue(&self, name: &str) -> TlsFiles {
        tls_files(self.0.issue(name, &[name]).unwrap())
    }
}

fn temp(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvferry-tls-it-{what}-{}", std::process::id()))
}

fn serving(ctx: &TlsContext, auth: ClientAuth, side: TlsSide) -> TlsServing {
    TlsServing {
        config: ctx.server_config(auth, &[ALPN_H2]).unwrap(),
        side,
        handshake_timeout: Duration::from_secs(2),
        stats: Arc::clone(ctx.stats()),
    }
}

async fn failures_reach(ctx: &TlsContext, side: TlsSide, n: u64) {
    for _ in 0..300 {
        if ctx.stats().handshake_failures(side) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{} {} failures, expected {n}",
        ctx.stats().handshake_failures(side),
        side.as_str()
    );
}

/// What tonic reports for a connection the server's TLS closed: no answer, a transport
/// failure — Unavailable, or (a plaintext client reading the server's TLS alert as HTTP/2)
/// Unknown "transport error" or Internal "h2 protocol error", depending on what it read
/// before the close.
fn transport_failure(code: Code, message: &str) {
    let transport = match code {
        // A request already written when the server drops the refused connection is
        // reported cancelled by the client (seen on a loaded machine).
        Code::Unavailable | Code::Cancelled => true,
        Code::Unknown => message.contains("transport error"),
        Code::Internal => message.contains("h2 protocol error"),
        _ => false,
    };
    assert!(transport, "{code:?}: {message}");
}

/// A refused engine client: the connect fails, or (a plaintext channel connects lazily; TLS
/// 1.3 judges the client's certificate after the client's side is done) its first call
/// fails in transport.
async fn refused_engine(addr: &str, tls: Option<&EngineTls>) {
    match EngineClient::connect_tls(addr, None, "", tls).await {
        Err(EngineClientError::Connect { .. }) => {}
        Err(e) => panic!("unexpected error: {e:?}"),
        Ok(c) => match c.health().await.unwrap_err() {
            EngineClientError::Call { code, message, .. } => transport_failure(code, &message),
            other => panic!("unexpected error: {other:?}"),
        },
    }
}

#[test]
fn the_engine_service_over_tls_serves_the_rust_client_and_refuses_the_rest() {
    let dir = temp("engine");
    let ca = Ca::new(&dir.join("ca"));
    let node_files = ca.issue("node");
    let node_tls = TlsContext::load(node_files).unwrap();
    let engine_files = ca.issue("engine");
    rt().block_on(async {
        let srv = EngineServer::start(EngineOptions {
            tls: Some(serving(&node_tls, ClientAuth::Optional, TlsSide::Engine)),
            ..Default::default()
        })
        .await;
        let port = srv.addr.rsplit_once(':').unwrap().1.to_owned();
        // The address is 127.0.0.1; the certificate names "node" and localhost.
        let by_ca = EngineTls::from_files(&ca.ca(), "node", None).unwrap();
        let c = EngineClient::connect_tls(&srv.addr, None, "", Some(&by_ca))
            .await
            .unwrap();
        assert!(c.capabilities().await.unwrap().protocol >= 6);
        c.health().await.unwrap();
        // The host part of the address is the default name.
        let localhost = EngineTls::from_files(&ca.ca(), "", None).unwrap();
        let c2 = EngineClient::connect_tls(format!("localhost:{port}"), None, "", Some(&localhost))
            .await
            .unwrap();
        c2.health().await.unwrap();

        // Plaintext to a TLS listener; a client trusting another CA; a wrong name.
        let before = node_tls.stats().handshake_failures(TlsSide::Engine);
        refused_engine(&srv.addr, None).await;
        failures_reach(&node_tls, TlsSide::Engine, before + 1).await;
        let other = Ca::new(&dir.join("other"));
        let by_other = EngineTls::from_files(&other.ca(), "node", None).unwrap();
        refused_engine(&srv.addr, Some(&by_other)).await;
        let wrong_name = EngineTls::from_files(&ca.ca(), "someone-else", None).unwrap();
        refused_engine(&srv.addr, Some(&wrong_name)).await;
        // The clients that connected are still served.
        c.health().await.unwrap();
        c2.health().await.unwrap();
        drop((c, c2));
        srv.stop().await;

        // Client certificates required: one of the CA is served, none or another CA's is not.
        let srv = EngineServer::start(EngineOptions {
            tls: Some(serving(&node_tls, ClientAuth::Required, TlsSide::Engine)),
            ..Default::default()
        })
        .await;
        let with_cert = EngineTls::from_files(
            &ca.ca(),
            "node",
            Some((&engine_files.cert, &engine_files.key)),
        )
        .unwrap();
        let c = EngineClient::connect_tls(&srv.addr, None, "", Some(&with_cert))
            .await
            .unwrap();
        c.health().await.unwrap();
        let before = node_tls.stats().handshake_failures(TlsSide::Engine);
        refused_engine(&srv.addr, Some(&by_ca)).await;
        let stranger = other.issue("engine");
        let with_other_cert =
            EngineTls::from_files(&ca.ca(), "node", Some((&stranger.cert, &stranger.key))).unwrap();
        refused_engine(&srv.addr, Some(&with_other_cert)).await;
        failures_reach(&node_tls, TlsSide::Engine, before + 2).await;
        c.health().await.unwrap();
        drop(c);
        srv.stop().await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}

fn me() -> PeerInfo {
    PeerInfo::local("member", &[Provider::Tcp], &[])
}

#[test]
fn peer_calls_over_mutual_tls_go_on_through_a_rotation() {
    let dir = temp("peer");
    let ca = Ca::new(&dir.join("ca"));
    let owner_tls = TlsContext::load(ca.issue("owner")).unwrap();
    let member_tls = TlsContext::load(ca.issue("member")).unwrap();
    let (node, _dev) = node(64 << 10, 16, Clock::system());
    rt().block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(kvferry_actors::peer::serve_with_tls(
            listener,
            node.peer_backend(),
            "t0ken".into(),
            Some(serving(&owner_tls, ClientAuth::Required, TlsSide::Peer)),
            async move {
                let _ = stopped.await;
            },
        ));
        let dial = |ctx: &TlsContext, name: &str| TlsDial {
            config: ctx.client_config(&[ALPN_H2]).unwrap(),
            server_name: peer_server_name(name).unwrap(),
            stats: Arc::clone(ctx.stats()),
            side: TlsSide::PeerClient,
        };
        let connect = |d: TlsDial| {
            PeerClient::connect_over(addr.clone(), "t0ken", Duration::from_secs(5), Some(d))
        };
        let member = connect(dial(&member_tls, "owner")).await.unwrap();
        assert_eq!(member.hello(me()).await.unwrap().node_id, "test");

        // A peer of another CA is refused by the owner; a plaintext one too.
        let other = Ca::new(&dir.join("other"));
        let mut stranger_files = other.issue("member");
        stranger_files.ca = ca.ca();
        let stranger = TlsContext::load(stranger_files).unwrap();
        let before = owner_tls.stats().handshake_failures(TlsSide::Peer);
        match connect(dial(&stranger, "owner")).await {
            Err(PeerClientError::Connect { .. }) => {}
            Err(e) => panic!("{e:?}"),
            Ok(c) => match c.hello(me()).await {
                Err(PeerClientError::Call { code, message, .. }) => {
                    transport_failure(code, &message)
                }
                other => panic!("a stranger was answered: {other:?}"),
            },
        }
        match PeerClient::connect(addr.clone(), "t0ken").await {
            Err(PeerClientError::Connect { .. }) => {}
            Err(e) => panic!("{e:?}"),
            Ok(c) => match c.hello(me()).await {
                Err(PeerClientError::Call { code, message, .. }) => {
                    transport_failure(code, &message)
                }
                other => panic!("a plaintext peer was answered: {other:?}"),
            },
        }
        failures_reach(&owner_tls, TlsSide::Peer, before + 2).await;
        // The member refuses an owner whose certificate names another node.
        let before = member_tls.stats().handshake_failures(TlsSide::PeerClient);
        assert!(matches!(
            connect(dial(&member_tls, "someone-else")).await,
            Err(PeerClientError::Connect { .. })
        ));
        assert_eq!(
            member_tls.stats().handshake_failures(TlsSide::PeerClient),
            before + 1
        );

        // Calls on the open connection while the owner's certificate is rotated: none fails.
        let calls = {
            let member = member.clone();
            tokio::spawn(async move {
                let mut ok = 0u32;
                for _ in 0..200 {
                    member.hello(me()).await.unwrap();
                    ok += 1;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                ok
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let old = owner_tls.certified_key().cert[0].clone();
        ca.issue("owner");
        owner_tls.reload().unwrap();
        assert_ne!(owner_tls.certified_key().cert[0], old);
        // A new connection handshakes against the new certificate and is served.
        let fresh = connect(dial(&member_tls, "owner")).await.unwrap();
        assert_eq!(fresh.hello(me()).await.unwrap().node_id, "test");
        assert_eq!(calls.await.unwrap(), 200);
        member.hello(me()).await.unwrap();
        drop((member, fresh));
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    });
    node.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Peers of `node_id` over tcp with `[tls] listeners = ["data"]`: its data port over mutual
/// TLS, and its reads from `owners` over TLS expecting each owner's node id.
fn tls_data_peers(
    node_id: &str,
    tls: TlsContext,
    owners: &[(&str, String)],
) -> Arc<kvferry_actors::peer::GrpcPeers> {
    use kvferry_actors::peer::{GrpcPeers, GrpcPeersConfig, StaticDirectory};
    let directory = Arc::new(StaticDirectory::new(
        owners.iter().map(|(n, _)| (*n).to_string()).collect(),
    ));
    let cfg = GrpcPeersConfig {
        node_id: node_id.into(),
        provider: Provider::Tcp,
        token: "t".into(),
        peers: owners
            .iter()
            .map(|(n, a)| ((*n).to_string(), a.clone()))
            .collect(),
        shm_dir: temp(node_id),
        data_listen: "127.0.0.1:0".into(),
        data_lanes: kvferry_actors::config::DEFAULT_DATA_LANES,
    };
    GrpcPeers::new_secured(cfg, directory, tls, false, true).unwrap()
}

#[test]
fn two_nodes_load_over_the_tls_data_plane_byte_exact() {
    use kvferry_gpu::KvShape;
    use kvferry_testkit::KvKind;
    let dir = temp("data");
    let ca = Ca::new(&dir.join("ca"));
    let a_tls = TlsContext::load(ca.issue("a")).unwrap();
    let b_tls = TlsContext::load(ca.issue("b")).unwrap();
    rt().block_on(async {
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        let owner_peers = tls_data_peers("a", a_tls.clone(), &[]);
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "a".into();
        let (owner, owner_dev) = start(cfg, Clock::system(), Some(Arc::clone(&owner_peers)));
        let _okv =
            register_ranks(&owner, &owner_dev, "eng", shape, KvKind::Split, 8, 0, 0..6).await;
        let backend = owner
            .peer_backend()
            .with_endpoint(owner_peers.data_endpoint().expect("a tcp data side"));
        let server = PeerServer::start(backend, "t").await;
        let peers = tls_data_peers("b", b_tls.clone(), &[("a", server.addr.to_string())]);
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "b".into();
        let (node, dev) = start(cfg, Clock::system(), Some(peers));
        let kv = register(&node, &dev, "eng", shape, 0, KvKind::Split, 16, 0).await;
        let q = query(&node, "eng", 0..6, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (0, 6));
        load(&node, q.lease.unwrap(), "eng", 0, &[9, 2, 5, 0, 7, 8])
            .await
            .unwrap();
        kv.verify(&expected(&[9, 2, 5, 0, 7, 8], 0), 0).unwrap();
        settled(&node).await;
        settled_with_peers(&owner).await;
        // Nothing was refused on either side.
        assert_eq!(a_tls.stats().handshake_failures(TlsSide::Data), 0);
        use kvferry_actors::peer::Peers;
        let refused = owner_peers.data_rejections("a").expect("a tcp data server");
        assert_eq!(refused.get(kvferry_transport::Reject::Tls), 0);
        node.shutdown();
        server.stop().await;
        owner.shutdown();
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Owner "a" over tcp with its data port over mutual TLS, holding blocks 0..6, and its Peer
/// service (plaintext: these tests are about the data plane).
struct TlsOwner {
    node: kvferry_actors::Node,
    peers: Arc<kvferry_actors::peer::GrpcPeers>,
    server: PeerServer,
    /// The tcp data port.
    data: std::net::SocketAddr,
    _kv: Vec<kvferry_testkit::DeviceKv>,
}

fn data_shape() -> kvferry_gpu::KvShape {
    kvferry_gpu::KvShape::new(2, 1, 2, 1024).unwrap()
}

impl TlsOwner {
    async fn start(tls: TlsContext) -> Self {
        let peers = tls_data_peers("a", tls, &[]);
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "a".into();
        let (node, dev) = start(cfg, Clock::system(), Some(Arc::clone(&peers)));
        let kv = register_ranks(
            &node,
            &dev,
            "eng",
            data_shape(),
            kvferry_testkit::KvKind::Split,
            8,
            0,
            0..6,
        )
        .await;
        let endpoint = peers.data_endpoint().expect("a tcp data side");
        let data = endpoint.endpoint.parse().unwrap();
        let server = PeerServer::start(node.peer_backend().with_endpoint(endpoint), "t").await;
        Self {
            node,
            peers,
            server,
            data,
            _kv: kv,
        }
    }

    fn rejected(&self, why: kvferry_transport::Reject) -> u64 {
        use kvferry_actors::peer::Peers;
        self.peers.data_rejections("a").unwrap().get(why)
    }

    async fn stop(self) {
        settled_with_peers(&self.node).await;
        self.server.stop().await;
        self.node.shutdown();
    }
}

/// A requester `name` of `owner` over the TLS data plane with `tls`, its KV registered.
async fn tls_requester(
    name: &str,
    tls: TlsContext,
    owner: &TlsOwner,
) -> (kvferry_actors::Node, kvferry_testkit::DeviceKv) {
    let peers = tls_data_peers(name, tls, &[("a", owner.server.addr.to_string())]);
    let mut cfg = config(64 << 10, 16);
    cfg.node_id = name.into();
    let (node, dev) = start(cfg, Clock::system(), Some(peers));
    let kv = register(
        &node,
        &dev,
        "eng",
        data_shape(),
        0,
        kvferry_testkit::KvKind::Split,
        16,
        0,
    )
    .await;
    (node, kv)
}

const DATA_DEST: [u32; 6] = [9, 2, 5, 0, 7, 8];

/// Queries blocks 0..6 (all on the owner), loads them into [`DATA_DEST`] and checks every
/// byte of `kv`; then drops the staged copies, so the next load reads the owner again.
async fn load_remote_exact(
    node: &kvferry_actors::Node,
    kv: &kvferry_testkit::DeviceKv,
    what: &str,
) {
    kv.reset().unwrap();
    let q = query(node, "eng", 0..6, false).await;
    assert_eq!((q.local_blocks, q.remote_blocks), (0, 6), "{what}");
    let req = load_request(q.lease.unwrap(), "eng", 0, &DATA_DEST);
    load_and_verify(node, kv, req, 0, what).await;
    node.drop_reclaimable().await.unwrap();
}

/// Whether a TLS failure of the data connection is somewhere in `e`'s causes.
fn tls_failure_in(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(e) = at {
        if matches!(
            e.downcast_ref::<kvferry_transport::ConnectionError>(),
            Some(kvferry_transport::ConnectionError::Tls { .. })
        ) {
            return true;
        }
        at = e.source();
    }
    false
}

/// Issue 29, the requester's side: a requester that does not trust the owner's certificate,
/// and one whose certificate the owner does not trust, each fail their load with a link
/// failure whose cause is the data connection's TLS, count it as `data-client` on their own
/// node (the owner counts its side as `data`), write nothing, and leave nothing held; an
/// authorised requester's loads go on byte-exact.
#[test]
fn a_requester_refused_on_the_tls_data_plane_counts_it_and_fails_typed() {
    let dir = temp("data-client");
    let ca = Ca::new(&dir.join("ca"));
    let other = Ca::new(&dir.join("other"));
    let a_tls = TlsContext::load(ca.issue("a")).unwrap();
    let b_tls = TlsContext::load(ca.issue("b")).unwrap();
    // A certificate of the cluster, but trusting another CA: it refuses the owner.
    let mut wary = ca.issue("w");
    wary.ca = other.ca();
    // Another CA's certificate, trusting the cluster's: the owner refuses it.
    let mut stranger = other.issue("s");
    stranger.ca = ca.ca();
    rt().block_on(async {
        let owner = TlsOwner::start(a_tls.clone()).await;
        let (b, b_kv) = tls_requester("b", b_tls.clone(), &owner).await;
        load_remote_exact(&b, &b_kv, "b before").await;
        for (name, files, refused_by) in [("w", wary, "requester"), ("s", stranger, "owner")] {
            let tls = TlsContext::load(files).unwrap();
            let owner_saw = a_tls.stats().handshake_failures(TlsSide::Data);
            let (node, kv) = tls_requester(name, tls.clone(), &owner).await;
            let q = query(&node, "eng", 0..6, false).await;
            assert_eq!(q.remote_blocks, 6, "{name}");
            let e = load(&node, q.lease.unwrap(), "eng", 0, &DATA_DEST)
                .await
                .unwrap_err();
            assert!(
                matches!(&e, kvferry_actors::NodeError::Remote { peer, source } if peer == "a" && source.is_link_failure()),
                "{name} (refused by the {refused_by}): {e}"
            );
            assert!(tls_failure_in(&e), "{name}: not a TLS failure: {e:?}");
            assert!(
                tls.stats().handshake_failures(TlsSide::DataClient) >= 1,
                "{name}: the requester did not count its failed handshake"
            );
            failures_reach(&a_tls, TlsSide::Data, owner_saw + 1).await;
            kv.untouched_outside(&[]).unwrap();
            let s = settled(&node).await;
            assert_eq!(s.loads_failed, 1, "{name}");
            node.shutdown();
        }
        // The owner's own reads (none) and the authorised requester: no client failures,
        // and its loads go on.
        assert_eq!(b_tls.stats().handshake_failures(TlsSide::DataClient), 0);
        load_remote_exact(&b, &b_kv, "b after the refusals").await;
        settled(&b).await;
        b.shutdown();
        owner.stop().await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 29's bad input on the TLS data port: garbage, a TLS record header that promises
/// more than ever comes, and a client sending one byte a second. Garbage is closed at once
/// and counted as a TLS failure; the other two when the hello deadline passes (5 s), counted
/// as hello timeouts; meanwhile an authorised requester's loads on the same owner are
/// byte-exact, and after them too.
#[test]
fn garbage_truncated_records_and_slowloris_on_the_tls_data_port_are_closed_and_counted() {
    use kvferry_transport::Reject;
    use std::io::{Read, Write};
    let dir = temp("data-bad");
    let ca = Ca::new(&dir.join("ca"));
    let a_tls = TlsContext::load(ca.issue("a")).unwrap();
    let b_tls = TlsContext::load(ca.issue("b")).unwrap();
    let deadline = kvferry_transport::tcp::HELLO_DEADLINE;
    rt().block_on(async {
        let owner = TlsOwner::start(a_tls.clone()).await;
        let (b, b_kv) = tls_requester("b", b_tls.clone(), &owner).await;
        load_remote_exact(&b, &b_kv, "b before").await;
        let (tls_before, timeouts_before) = (
            owner.rejected(Reject::Tls),
            owner.rejected(Reject::TlsTimeout),
        );
        let failures_before = a_tls.stats().handshake_failures(TlsSide::Data);
        // Each bad client on a thread of its own: how long until the owner closed it.
        let bad = |send: &'static [u8], trickle: bool| {
            let addr = owner.data;
            std::thread::spawn(move || {
                let s = std::net::TcpStream::connect(addr).unwrap();
                let started = std::time::Instant::now();
                let mut rx = s.try_clone().unwrap();
                let closed = std::thread::spawn(move || {
                    let mut buf = [0u8; 512];
                    // An alert may come before the close.
                    while matches!(rx.read(&mut buf), Ok(n) if n > 0) {}
                    started.elapsed()
                });
                let mut tx = s;
                if trickle {
                    for b in send {
                        if closed.is_finished() || tx.write_all(&[*b]).is_err() {
                            break;
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                } else {
                    let _ = tx.write_all(send);
                }
                closed.join().unwrap()
            })
        };
        let garbage = bad(&[0xff; 64], false);
        // A handshake record of 16 KiB of which 3 bytes come.
        let truncated = bad(&[0x16, 0x03, 0x01, 0x40, 0x00, 0x01, 0x00, 0x3f], false);
        // A ClientHello's first bytes, one a second, for longer than the deadline.
        let slow = bad(
            &[
                0x16, 0x03, 0x01, 0x00, 0xc8, 0x01, 0x00, 0x00, 0xc4, 0x03, 0x03, 0x00,
            ],
            true,
        );
        // Authorised loads go on while they hold their connections.
        for i in 0..3 {
            load_remote_exact(&b, &b_kv, &format!("b during bad clients, {i}")).await;
        }
        let waited = |h: std::thread::JoinHandle<Duration>| h.join().unwrap();
        let g = tokio::task::spawn_blocking(move || waited(garbage))
            .await
            .unwrap();
        assert!(
            g < Duration::from_secs(1),
            "garbage held its connection {g:?}"
        );
        for (what, h) in [("truncated record", truncated), ("slowloris", slow)] {
            let t = tokio::task::spawn_blocking(move || waited(h))
                .await
                .unwrap();
            assert!(
                t >= deadline - Duration::from_millis(500) && t < deadline + Duration::from_secs(2),
                "{what} closed after {t:?}, the deadline being {deadline:?}"
            );
        }
        assert_eq!(owner.rejected(Reject::Tls), tls_before + 1);
        // Handshakes that ran out of time are TLS failures too, as on the gRPC listeners.
        assert_eq!(owner.rejected(Reject::TlsTimeout), timeouts_before + 2);
        assert_eq!(owner.rejected(Reject::HelloTimeout), 0);
        assert_eq!(
            a_tls.stats().handshake_failures(TlsSide::Data),
            failures_before + 3
        );
        load_remote_exact(&b, &b_kv, "b after bad clients").await;
        settled(&b).await;
        b.shutdown();
        owner.stop().await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// The certificate the server at `addr` presents on a new TLS connection, dialled with
/// `ctx`'s client config as `name`.
fn presented_certificate(
    addr: std::net::SocketAddr,
    ctx: &TlsContext,
    name: &str,
) -> rustls::pki_types::CertificateDer<'static> {
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut conn = rustls::ClientConnection::new(
        ctx.client_config(&[]).unwrap(),
        peer_server_name(name).unwrap(),
    )
    .unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).unwrap();
    }
    conn.peer_certificates().unwrap()[0].clone().into_owned()
}

/// Issue 29's rotation on the data plane: loads run back to back over the TLS data plane
/// while the owner's and the requester's certificates are replaced (new keys, the same CA)
/// and reloaded; none fails and every byte of each is checked. Afterwards the data port
/// presents the new certificate to a new connection, and a requester that connects only
/// now loads byte-exact.
#[test]
fn loads_over_the_tls_data_plane_lose_nothing_across_a_rotation() {
    let dir = temp("data-rotate");
    let ca = Ca::new(&dir.join("ca"));
    let a_tls = TlsContext::load(ca.issue("a")).unwrap();
    let b_tls = TlsContext::load(ca.issue("b")).unwrap();
    rt().block_on(async {
        let owner = TlsOwner::start(a_tls.clone()).await;
        let old = a_tls.certified_key().cert[0].clone();
        assert_eq!(presented_certificate(owner.data, &b_tls, "a"), old);
        let (b, b_kv) = tls_requester("b", b_tls.clone(), &owner).await;
        let b = Arc::new(b);
        let done = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let loads = {
            let (b, done) = (Arc::clone(&b), Arc::clone(&done));
            tokio::spawn(async move {
                for i in 0..24 {
                    load_remote_exact(&b, &b_kv, &format!("load {i}")).await;
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                b_kv
            })
        };
        while done.load(std::sync::atomic::Ordering::Relaxed) < 6 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        ca.issue("a");
        ca.issue("b");
        a_tls.reload().unwrap();
        b_tls.reload().unwrap();
        let rotated_at = done.load(std::sync::atomic::Ordering::Relaxed);
        let _b_kv = loads.await.unwrap();
        assert!(rotated_at < 24, "the rotation came after every load");
        assert_eq!(a_tls.stats().reloads(), (1, 0));
        // New connections get the new certificate; the old one is gone from the port.
        let new = a_tls.certified_key().cert[0].clone();
        assert_ne!(new, old);
        assert_eq!(presented_certificate(owner.data, &b_tls, "a"), new);
        // A requester that connects only now handshakes against it and is served.
        let c_tls = TlsContext::load(ca.issue("c")).unwrap();
        let (c, c_kv) = tls_requester("c", c_tls.clone(), &owner).await;
        load_remote_exact(&c, &c_kv, "c after the rotation").await;
        for side in [TlsSide::Data, TlsSide::DataClient] {
            assert_eq!(
                a_tls.stats().handshake_failures(side),
                0,
                "{}",
                side.as_str()
            );
        }
        assert_eq!(b_tls.stats().handshake_failures(TlsSide::DataClient), 0);
        settled(&b).await;
        settled(&c).await;
        c.shutdown();
        b.shutdown();
        owner.stop().await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}
