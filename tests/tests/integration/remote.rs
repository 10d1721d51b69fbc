//! Remote suffixes across in-process nodes: the worked example (B holds 0–3, A 4–7, C 8–11;
//! B queries 0–11) on every provider, direct and staged, byte for byte with canaries, and
//! the pin lifecycle around it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_actors::peer::{
    BreakerState, Directory, LocalCluster, Peers, Provider, RedisDirectory, RedisOptions,
};
use kvferry_actors::tls::{TlsContext, TlsSide};
use kvferry_actors::{Clock, DirectGrant, Node, NodeError};
use kvferry_gpu::{Device, HostDevice, KvShape};
use kvferry_harness::*;
use kvferry_testkit::{DeviceKv, KvKind};

fn shape(tp: u32) -> KvShape {
    KvShape::new(3, tp, 2, 1024).unwrap()
}

/// Nodes 0 = B, 1 = A, 2 = C; every node registers rank parts of `tp` ranks and holds its
/// third of the 12 blocks. Returns B's device KV per rank.
async fn worked_example(c: &Cluster, tp: u32) -> Vec<DeviceKv> {
    let s = shape(tp);
    let mut b_kv = Vec::new();
    for (i, range) in [(0usize, 0u64..4), (1, 4..8), (2, 8..12)] {
        let kv = register_ranks(c.node(i), c.dev(i), "eng", s, KvKind::Split, 16, 128, range).await;
        if i == 0 {
            b_kv = kv;
        } else {
            std::mem::forget(kv); // owners' KV stays allocated for the test's life
        }
    }
    b_kv
}

const DEST: [u32; 12] = [15, 0, 3, 4, 9, 1, 2, 12, 11, 6, 7, 14];

fn run_worked_example(provider: Provider) {
    rt().block_on(async {
        let c = Cluster::new(provider, &["b", "a", "c"]);
        let kv = worked_example(&c, 1).await;
        for direct in [true, false] {
            kv[0].reset().unwrap();
            let q = query(c.node(0), "eng", 0..12, direct).await;
            assert_eq!(
                (q.local_blocks, q.remote_blocks),
                (4, 8),
                "{provider:?} direct={direct}"
            );
            assert_eq!(q.direct.is_granted(), direct);
            let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
            let what = format!("{provider:?} direct={direct}");
            let r = load_and_verify(c.node(0), &kv[0], req, 0, &what).await;
            assert_eq!(r.path, if direct { "direct" } else { "staged" });
            assert_eq!(r.bytes, 12 * shape(1).rank_bytes());
            let want: &[&str] = if direct {
                &["plan", "pin", "h2d", "register", "post", "wire", "fence"]
            } else {
                &["plan", "pin", "h2d", "post", "wire"]
            };
            for name in want {
                assert!(r.stage(name).is_some(), "stage {name} missing: {r:?}");
            }
            // The local prefix and the remote suffix ran at once (their destinations are
            // disjoint): the suffix started before the prefix's copies ended, and the other
            // way round; prefix order is the plan's order, not a reason to serialise.
            let (local, remote) = (r.span("local").unwrap(), r.span("remote").unwrap());
            assert!(
                remote.start < local.end && local.start < remote.end,
                "{provider:?} direct={direct}: parts did not overlap: {:?}",
                r.spans
            );
            c.settled().await;
            let stats = c.node(0).stats().await.unwrap();
            if direct {
                // Direct destinations are never inserted into the host cache.
                assert_eq!(stats.blocks, 4, "direct load inserted blocks");
            } else {
                // Staged copies are inserted (reclaimable) and advertised.
                assert_eq!(stats.blocks, 12);
                assert_eq!(c.node(0).drop_reclaimable().await.unwrap(), 8);
            }
        }
    });
}

#[test]
fn worked_example_loopback() {
    run_worked_example(Provider::Loopback);
}

#[test]
fn worked_example_shm() {
    run_worked_example(Provider::Shm);
}

#[test]
fn worked_example_with_the_redis_directory() {
    let server = RedisServer::start();
    let dir = kvferry_actors::peer::RedisDirectory::connect(&server.addr, "kvf-test").unwrap();
    let dir: Arc<dyn kvferry_actors::peer::Directory> = Arc::new(dir);
    rt().block_on(async {
        let c = Cluster::with(
            LocalCluster::with_directory(Provider::Shm, Arc::clone(&dir)),
            &["b", "a", "c"],
        );
        let kv = worked_example(&c, 1).await;
        // Publishing is asynchronous: written within a round trip, not by the put.
        dir.flush().await;
        for direct in [true, false] {
            kv[0].reset().unwrap();
            let q = query(c.node(0), "eng", 0..12, direct).await;
            assert_eq!((q.local_blocks, q.remote_blocks), (4, 8));
            let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
            load_and_verify(c.node(0), &kv[0], req, 0, &format!("direct={direct}")).await;
            c.settled().await;
            c.node(0).drop_reclaimable().await.unwrap();
        }
        // A node that leaves is withdrawn from the shared directory.
        c.node(2).shutdown();
        dir.flush().await;
        let q = query(c.node(0), "eng", 0..12, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 4));
        c.node(0).release(q.lease.unwrap()).await.unwrap();
    });
    drop(server);
}

#[test]
fn worked_example_tcp() {
    run_worked_example(Provider::Tcp);
}

/// A tcp cluster whose data plane is mutual TLS (one lab certificate naming b, a and c, the
/// process's identity), its TLS context, and the directory of its files.
fn tls_cluster(what: &str) -> (Arc<LocalCluster>, TlsContext, std::path::PathBuf) {
    let dir =
        std::env::temp_dir().join(format!("kvferry-remote-tls-{what}-{}", std::process::id()));
    let ca = kvferry_testkit::LabCa::new(&dir, "remote test CA").unwrap();
    let tls = TlsContext::load(tls_files(ca.issue("nodes", &["b", "a", "c"]).unwrap())).unwrap();
    let cluster = LocalCluster::with_tls(Provider::Tcp, tls.clone()).unwrap();
    (cluster, tls, dir)
}

/// A tcp cluster, in clear or over TLS; the TLS context, if any, and its files.
fn tcp_cluster(
    tls: bool,
    what: &str,
) -> (Arc<LocalCluster>, Option<(TlsContext, std::path::PathBuf)>) {
    match tls {
        false => (LocalCluster::new(Provider::Tcp), None),
        true => {
            let (c, t, d) = tls_cluster(what);
            (c, Some((t, d)))
        }
    }
}

/// Over TLS, a fault of the link is not a TLS failure: nothing counted on either side.
fn no_tls_failures(tls: &Option<(TlsContext, std::path::PathBuf)>) {
    if let Some((t, dir)) = tls {
        for side in [TlsSide::Data, TlsSide::DataClient] {
            assert_eq!(t.stats().handshake_failures(side), 0, "{}", side.as_str());
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The worked example over the tcp data plane with mutual TLS, direct and staged.
#[test]
fn worked_example_tcp_over_tls() {
    let (cluster, tls, dir) = tls_cluster("worked");
    rt().block_on(async {
        let c = Cluster::with(cluster, &["b", "a", "c"]);
        let kv = worked_example(&c, 1).await;
        for direct in [true, false] {
            kv[0].reset().unwrap();
            let q = query(c.node(0), "eng", 0..12, direct).await;
            assert_eq!((q.local_blocks, q.remote_blocks), (4, 8));
            let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
            load_and_verify(c.node(0), &kv[0], req, 0, &format!("tls direct={direct}")).await;
            c.settled().await;
            c.node(0).drop_reclaimable().await.unwrap();
        }
    });
    no_tls_failures(&Some((tls, dir)));
}

#[test]
fn owner_killed_after_pinning_fails_a_tcp_load_hard() {
    owner_killed_after_pinning(false);
}

/// The same with the data plane over mutual TLS.
#[test]
fn owner_killed_after_pinning_fails_a_tls_load_hard() {
    owner_killed_after_pinning(true);
}

fn owner_killed_after_pinning(tls: bool) {
    for direct in [true, false] {
        let (cluster, tls) = tcp_cluster(tls, &format!("killed-{direct}"));
        rt().block_on(async {
            let c = Cluster::with(cluster, &["b", "a", "c"]);
            let kv = worked_example(&c, 1).await;
            let q = query(c.node(0), "eng", 0..12, direct).await;
            assert_eq!(q.remote_blocks, 8);
            // C's data path dies after the query pinned its blocks.
            c.cluster.kill_server("c");
            let err = load(c.node(0), q.lease.unwrap(), "eng", 0, &DEST).await
                .unwrap_err();
            // Typed: the link to the dead owner failed (rebuilt on its next use), not a
            // refusal and not a local resource.
            assert!(
                matches!(err, NodeError::Remote { ref peer, ref source } if peer == "c" && source.is_link_failure()),
                "{err}"
            );
            // A hard error, never a fallback; nothing written outside the destinations.
            kv[0].untouched_outside(&DEST).unwrap();
            let s = settled(c.node(0)).await;
            assert_eq!(s.loads_failed, 1);
            // C goes away for good: the next query ends the suffix where C's blocks were,
            // and the next load works.
            c.node(2).shutdown();
            c.node(0).drop_reclaimable().await.unwrap();
            let q = query(c.node(0), "eng", 0..12, direct).await;
            assert_eq!((q.local_blocks, q.remote_blocks), (4, 4));
            kv[0].reset().unwrap();
            let req = load_request(q.lease.unwrap(), "eng", 0, &DEST[..8]);
            load_and_verify(c.node(0), &kv[0], req, 0, "the next load").await;
            settled(c.node(0)).await;
            assert_eq!(c.node(1).peer_pins().await.unwrap(), 0);
        });
        no_tls_failures(&tls);
    }
}

/// The transport fault matrix, end to end through a load over tcp: each fault makes the
/// load fail with a typed error (or, for a delay, only slows it), writes nothing outside the
/// destinations, leaves every gauge at zero, and the next load works.
#[test]
fn transport_fault_matrix_end_to_end() {
    transport_fault_matrix(false);
}

/// The fault matrix with the data plane over mutual TLS: the faults wrap the TLS connection
/// as they wrap the plain one, and each ends the same way.
#[test]
fn transport_fault_matrix_end_to_end_over_tls() {
    transport_fault_matrix(true);
}

fn transport_fault_matrix(tls: bool) {
    use kvferry_transport::fault::{Fault, FaultKind};
    use kvferry_transport::CompletionStatus;
    // Each failure with the kind its caller reacts to: a broken link ("remote": the QP went
    // to error and is rebuilt, a failed post included). A read the owner refused is
    // "remote_refused" when its own batch reports first; the QP's error flushes the reads
    // posted beside it, and a flushed batch awaited first reports the link ("remote").
    let cases: Vec<(&str, FaultKind, Option<&str>)> = vec![
        ("failed post", FaultKind::FailPost, Some("remote")),
        (
            "remote access error",
            FaultKind::CompletionError(CompletionStatus::RemoteAccessError),
            Some("remote_refused|remote"),
        ),
        (
            "transport error",
            FaultKind::CompletionError(CompletionStatus::TransportError),
            Some("remote"),
        ),
        ("connection drop", FaultKind::DropConnection, Some("remote")),
        ("delay", FaultKind::Delay(Duration::from_millis(30)), None),
    ];
    for (name, kind, want) in cases {
        let fails = want.is_some();
        for direct in [true, false] {
            let (cluster, tls) = tcp_cluster(tls, &format!("matrix-{direct}"));
            rt().block_on(async {
                // The third read to A (block 6) hits the fault.
                cluster.inject_faults("a", vec![Fault { at: 3, kind }]);
                let c = Cluster::with(cluster, &["b", "a", "c"]);
                let kv = worked_example(&c, 1).await;
                let q = query(c.node(0), "eng", 0..12, direct).await;
                let r = load(c.node(0), q.lease.unwrap(), "eng", 0, &DEST).await;
                match (fails, r) {
                    (true, Err(NodeError::Remote { peer, source })) => {
                        assert_eq!(peer, "a", "{name}");
                        let want = want.unwrap_or_default();
                        assert!(
                            want.split('|').any(|k| k == source.kind()),
                            "{name}: {} is not {want}: {source}",
                            source.kind()
                        );
                    }
                    (false, Ok(_)) => {
                        kv[0].verify(&expected(&DEST, 0), 0).unwrap();
                    }
                    (_, other) => panic!("{name} direct={direct}: {other:?}"),
                }
                kv[0]
                    .untouched_outside(&DEST)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                c.settled().await;
                c.node(0).drop_reclaimable().await.unwrap();
                // The next load works: the worker drained, reset and reconnected the QP.
                kv[0].reset().unwrap();
                let q = query(c.node(0), "eng", 0..12, direct).await;
                assert_eq!(q.remote_blocks, 8, "{name}");
                let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
                let what = format!("{name} direct={direct}: next load");
                load_and_verify(c.node(0), &kv[0], req, 0, &what).await;
                c.settled().await;
            });
            no_tls_failures(&tls);
        }
    }
}

/// A staged load whose first chunk fails returns only once the reads of its other chunk have
/// been reported (their completions come late here): nothing the load posted may still land
/// in pool slots it gave back, which the next load takes. Fixed batches of 8 kept A's four
/// blocks in one chunk; cut over two QPs they are two chunks read side by side.
#[test]
fn a_failed_staged_load_returns_after_every_read_it_posted() {
    use kvferry_transport::fault::{Fault, FaultKind};
    rt().block_on(async {
        let cluster = LocalCluster::new(Provider::Tcp);
        // The warm-up load reads A's four blocks (requests 1-4). With the link connected, the
        // next load's chunks go out in order: the first chunk's reads (5, 6) fail at 5, the
        // second chunk's (7, 8) are reported `late` after landing.
        let late = Duration::from_millis(300);
        cluster.inject_faults(
            "a",
            vec![
                Fault {
                    at: 5,
                    kind: FaultKind::FailPost,
                },
                Fault {
                    at: 7,
                    kind: FaultKind::Delay(late),
                },
                Fault {
                    at: 8,
                    kind: FaultKind::Delay(late),
                },
            ],
        );
        let c = Cluster::with(cluster, &["b", "a", "c"]);
        let kv = worked_example(&c, 1).await;
        let next = |what: &'static str| {
            let (c, kv) = (&c, &kv);
            async move {
                c.settled().await;
                c.node(0).drop_reclaimable().await.unwrap();
                kv[0].reset().unwrap();
                let q = query(c.node(0), "eng", 0..12, false).await;
                assert_eq!(q.remote_blocks, 8, "{what}");
                q.lease.unwrap()
            }
        };
        let q = query(c.node(0), "eng", 0..12, false).await;
        let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
        load_and_verify(c.node(0), &kv[0], req, 0, "warm-up").await;

        let lease = next("failing").await;
        let t = Instant::now();
        let r = load(c.node(0), lease, "eng", 0, &DEST).await;
        let took = t.elapsed();
        match r {
            Err(NodeError::Remote { peer, .. }) => assert_eq!(peer, "a"),
            other => panic!("{other:?}"),
        }
        assert!(
            took >= late,
            "the load failed after {took:?}, before its other chunk's reads were reported"
        );
        kv[0].untouched_outside(&DEST).unwrap();

        let lease = next("next").await;
        let req = load_request(lease, "eng", 0, &DEST);
        load_and_verify(c.node(0), &kv[0], req, 0, "the next load").await;
        c.settled().await;
    });
}

/// A staged load reserves every pool slot its parts use once, before any part starts: where
/// the pool cannot hold its whole suffix it fails typed without reading a block (none of
/// the suffix is fetched into B's pool), writes nothing outside its destinations, leaks
/// nothing, and a load the pool can hold then lands byte for byte. B's 10 slots: its own 4
/// blocks pinned by the lease, 6 free against the suffix's 8 (reserved a segment at a time,
/// as before, A's 4 would have been read and then evicted for C's).
#[test]
fn a_staged_suffix_the_pool_cannot_hold_fails_before_any_read() {
    rt().block_on(async {
        let cluster = LocalCluster::new(Provider::Tcp);
        let configs = [("b", 10), ("a", 32), ("c", 32)]
            .into_iter()
            .map(|(n, slots)| {
                let mut cfg = kvferry_harness::config(64 << 10, slots);
                cfg.node_id = n.into();
                cfg
            })
            .collect();
        let c = Cluster::of(cluster, configs);
        let kv = worked_example(&c, 1).await;
        let q = query(c.node(0), "eng", 0..12, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 8));
        let r = load(c.node(0), q.lease.unwrap(), "eng", 0, &DEST).await;
        assert!(matches!(r, Err(NodeError::Cache(_))), "{r:?}");
        kv[0].untouched_outside(&DEST).unwrap();
        c.settled().await;
        let q = query(c.node(0), "eng", 4..12, false).await;
        assert_eq!(
            (q.local_blocks, q.remote_blocks),
            (0, 8),
            "nothing was fetched"
        );
        c.node(0).release(q.lease.unwrap()).await.unwrap();

        // Four remote blocks fit beside the four local ones.
        kv[0].reset().unwrap();
        let q = query(c.node(0), "eng", 0..8, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 4));
        let req = load_request(q.lease.unwrap(), "eng", 0, &DEST[..8]);
        load_and_verify(c.node(0), &kv[0], req, 0, "a load the pool holds").await;
        c.settled().await;
    });
}

/// `cluster.data-lanes` sets how many connections a tcp link opens to an owner (each read
/// by its own thread; over TLS each encrypts on its own core): a direct load cut over four
/// lanes lands byte for byte over four connections to each owner, and the default is two.
#[test]
fn a_tcp_link_reads_over_as_many_connections_as_its_data_lanes() {
    rt().block_on(async {
        for (lanes, expect) in [(None, 2usize), (Some(4usize), 4)] {
            let cluster = LocalCluster::new(Provider::Tcp);
            if let Some(n) = lanes {
                cluster.set_data_lanes(n);
            }
            let c = Cluster::with(Arc::clone(&cluster), &["b", "a", "c"]);
            let kv = worked_example(&c, 1).await;
            let q = query(c.node(0), "eng", 0..12, false).await;
            assert_eq!(q.remote_blocks, 8);
            let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
            load_and_verify(c.node(0), &kv[0], req, 0, "a load over the lanes").await;
            // The worked example's suffix comes from both owners, each over its own link.
            for owner in ["a", "c"] {
                let served = cluster.data_connections(owner);
                assert_eq!(served, expect, "owner {owner}, lanes {lanes:?}");
            }
            c.settled().await;
        }
    });
}

#[test]
fn staged_copies_are_advertised_and_then_hit_locally() {
    rt().block_on(async {
        let c = Cluster::new(Provider::Loopback, &["b", "a", "c", "d"]);
        let _kv = worked_example(&c, 1).await;
        let q = query(c.node(0), "eng", 0..12, false).await;
        load(c.node(0), q.lease.unwrap(), "eng", 0, &DEST)
            .await
            .unwrap();
        c.settled().await;
        // B now holds all 12 locally (fetched copies), so its next query is all local...
        let q = query(c.node(0), "eng", 0..12, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (12, 0));
        c.node(0).release(q.lease.unwrap()).await.unwrap();
        // ...and a fourth node finds B among the owners of 4–11.
        let d_kv = register(
            c.node(3),
            c.dev(3),
            "eng",
            shape(1),
            0,
            KvKind::Split,
            16,
            0,
        )
        .await;
        let dir = c.cluster.directory();
        let owners = dir.owners(&q.namespace, &hashes(4..5), "d").await;
        assert!(owners[0].contains(&"b".to_string()), "{owners:?}");
        let q = query(c.node(3), "eng", 0..12, true).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (0, 12));
        let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
        load_and_verify(c.node(3), &d_kv, req, 0, "D reading B's copies").await;
        c.settled().await;
    });
}

#[test]
fn tp2_each_rank_reads_its_own_part() {
    rt().block_on(async {
        let c = Cluster::new(Provider::Shm, &["b", "a", "c"]);
        let kv = worked_example(&c, 2).await;
        for direct in [true, false] {
            for k in &kv {
                k.reset().unwrap();
            }
            let q = query(c.node(0), "eng", 0..12, direct).await;
            assert_eq!((q.local_blocks, q.remote_blocks), (4, 8));
            for rank in [1, 0] {
                load(c.node(0), q.lease.unwrap(), "eng", rank, &DEST)
                    .await
                    .unwrap();
            }
            for rank in 0..2 {
                kv[rank as usize].verify(&expected(&DEST, 0), rank).unwrap();
            }
            c.settled().await;
            c.node(0).drop_reclaimable().await.unwrap();
        }
    });
}

#[test]
fn owner_eviction_between_lookup_and_pin_shortens_the_hit() {
    rt().block_on(async {
        let c = Cluster::new(Provider::Loopback, &["b", "a", "c"]);
        let kv = worked_example(&c, 1).await;
        // A loses blocks 4–7 to eviction, but the directory still lists it: the race of a
        // lookup that happens before the eviction, then a pin after it.
        let s = shape(1);
        put(c.node(1), "eng", &s, 0, 100..132).await; // A's pool holds 32 slots
        let q0 = query(c.node(0), "eng", 0..12, false).await;
        assert_eq!(
            (q0.local_blocks, q0.remote_blocks),
            (4, 0),
            "A's copies are gone"
        );
        c.node(0).release(q0.lease.unwrap()).await.unwrap();
        c.cluster
            .directory()
            .publish("a", &q0.namespace, &hashes(4..8));
        let q = query(c.node(0), "eng", 0..12, true).await;
        // A answers its pin with nothing: the suffix stops after B's 4 local blocks.
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 0), "{q:?}");
        kv[0].reset().unwrap();
        let req = load_request(q.lease.unwrap(), "eng", 0, &DEST[..4]);
        load_and_verify(c.node(0), &kv[0], req, 0, "B's own blocks").await;
        c.settled().await;
    });
}

#[test]
fn lease_expiry_and_release_release_owner_pins() {
    rt().block_on(async {
        let c = Cluster::new(Provider::Shm, &["b", "a", "c"]);
        let _kv = worked_example(&c, 1).await;
        let q = query(c.node(0), "eng", 0..12, true).await;
        assert_eq!(c.node(1).peer_pins().await.unwrap(), 1);
        assert_eq!(c.node(2).peer_pins().await.unwrap(), 1);
        c.node(0).release(q.lease.unwrap()).await.unwrap();
        c.settled().await;
        // Expiry of the requester's lease unpins on the owners.
        let q = query(c.node(0), "eng", 0..12, false).await;
        assert_eq!(c.node(1).peer_pins().await.unwrap(), 1);
        c.hand.advance(Duration::from_secs(601));
        assert_eq!(c.node(0).sweep().await.unwrap(), 1);
        c.settled().await;
        let err = load(c.node(0), q.lease.unwrap(), "eng", 0, &DEST)
            .await
            .unwrap_err();
        assert!(matches!(err, NodeError::Lease(_)), "{err}");
        // Owner-side expiry: a requester that never unpins loses its pins after 120 s.
        let q = query(c.node(0), "eng", 0..12, false).await;
        c.hand.advance(Duration::from_secs(121));
        assert_eq!(c.node(1).sweep_peer_pins().await.unwrap(), 1);
        assert_eq!(c.node(1).peer_pins().await.unwrap(), 0);
        c.node(0).release(q.lease.unwrap()).await.unwrap();
        c.settled().await;
    });
}

#[test]
fn unregister_during_50_in_flight_remote_loads() {
    rt().block_on(async {
        let c = Cluster::new(Provider::Loopback, &["b", "a", "c"]);
        let _kv = worked_example(&c, 1).await;
        let mut pending = Vec::new();
        for i in 0..50 {
            let q = query(c.node(0), "eng", 0..12, i % 2 == 0).await;
            let rx = c
                .node(0)
                .start_load(load_request(q.lease.unwrap(), "eng", 0, &DEST))
                .await
                .unwrap();
            pending.push(rx);
        }
        c.node(0).unregister_instance(id("eng")).await.unwrap();
        assert_eq!(c.node(0).stats().await.unwrap().transfers_in_flight, 0);
        for rx in pending {
            rx.await.unwrap().unwrap();
        }
        c.settled().await;
    });
}

#[test]
fn direct_is_refused_without_peers_and_granted_with_them() {
    rt().block_on(async {
        let (node, dev) = node(64 << 10, 8, Clock::system());
        let _kv = register(&node, &dev, "eng", shape(1), 0, KvKind::Split, 16, 0).await;
        put(&node, "eng", &shape(1), 0, 0..2).await;
        let q = query(&node, "eng", 0..2, true).await;
        assert!(
            matches!(q.direct, DirectGrant::Refused { ref reason } if reason.contains("no peers"))
        );
        node.release(q.lease.unwrap()).await.unwrap();
    });
}

const OWNER_ENV: &str = "KVFERRY_REMOTE_OWNER";
const OWNER_TP_ENV: &str = "KVFERRY_REMOTE_OWNER_TP";

/// The owner half of the two-process tests: this binary re-executed with `OWNER_ENV` set.
#[test]
#[ignore = "runs only as the owner child process started by two_processes_over_*"]
fn child_owner_process() {
    let provider = std::env::var(OWNER_ENV).expect("started by a two-process test");
    let tp = std::env::var(OWNER_TP_ENV).map_or(1, |t| t.parse().unwrap());
    kvferry_harness::run_owner_process(kvferry_harness::OwnerSpec {
        node_id: "a".into(),
        model: "m".into(),
        provider: Provider::parse(&provider).unwrap(),
        shape: shape(tp),
        blocks: 4..12,
        token: "t0ken".into(),
    })
    .unwrap();
}

/// Starts this binary as an owner process (node "a", blocks 4..12 of `tp` ranks) and
/// returns it with a requester node "b" that reaches it through its Peer service.
fn owner_process_and_requester(
    provider: Provider,
    tp: u32,
    devices: Vec<Arc<dyn Device>>,
) -> (ChildTest, Node) {
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_owner_process"),
        &[
            (OWNER_ENV, provider.as_str()),
            (OWNER_TP_ENV, &tp.to_string()),
        ],
    );
    let addr = child.wait_for("READY ");
    let peers = grpc_peers("b", provider, "t0ken", &[("a", addr)], None);
    let mut cfg = config(64 << 10, 32);
    cfg.node_id = "b".into();
    let node = Node::start_in(cfg, devices, Clock::system(), Some(peers)).unwrap();
    (child, node)
}

/// A real owner process: the requester pins through its Peer service and reads its pool
/// over the provider, direct and staged, byte for byte.
fn two_processes(provider: Provider) {
    let dev: Arc<dyn Device> = HostDevice::new(0);
    let (child, node) = owner_process_and_requester(provider, 1, vec![Arc::clone(&dev)]);
    rt().block_on(async {
        let kv = register(&node, &dev, "eng", shape(1), 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &shape(1), 0, 0..4).await;
        for direct in [true, false] {
            kv.reset().unwrap();
            let q = query(&node, "eng", 0..12, direct).await;
            assert_eq!(
                (q.local_blocks, q.remote_blocks),
                (4, 8),
                "{provider:?} direct={direct}"
            );
            let req = load_request(q.lease.unwrap(), "eng", 0, &DEST);
            let what = format!("{provider:?} direct={direct}");
            let r = load_and_verify(&node, &kv, req, 0, &what).await;
            assert_eq!(r.path, if direct { "direct" } else { "staged" });
            settled(&node).await;
            node.drop_reclaimable().await.unwrap();
        }
    });
    node.shutdown();
    child.finish(None);
}

#[test]
fn two_processes_over_shm() {
    two_processes(Provider::Shm);
}

#[test]
fn two_processes_over_tcp() {
    two_processes(Provider::Tcp);
}

/// Two GPUs of one host: TP 2 with one rank per GPU, the owner a second process over shm.
/// Direct and staged loads into both ranks at once, byte for byte with canaries; memory of
/// one GPU registered under the other's ordinal is refused; DMA-BUF export on each GPU.
/// Runs on the two-GPU machine with `--ignored` (see the README's GPU section).
#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_tp2_two_processes_over_shm() {
    let devs: Vec<Arc<dyn Device>> = (0..2)
        .map(|o| kvferry_gpu::open_device("cuda", o).expect("two CUDA GPUs"))
        .collect();
    let (child, node) = owner_process_and_requester(Provider::Shm, 2, devs.clone());
    let s = shape(2);
    rt().block_on(async {
        // GPU 1's memory under ordinal 0: refused by name, nothing registered.
        let foreign =
            DeviceKv::alloc(Arc::clone(&devs[1]), s, KvKind::Split, 16, 1024, 128).unwrap();
        let err = node
            .register_instance(kvferry_actors::RegisterInstance {
                instance: id("eng"),
                model: "m".into(),
                dtype: "bf16".into(),
                shape: s,
                rank: 0,
                device: 0,
                layout: foreign.spec(),
            })
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("device memory of ordinal 1, expected 0"),
            "unexpected error: {msg}"
        );
        assert_eq!(node.stats().await.unwrap().instances, 0, "{msg}");
        drop(foreign);

        let mut kvs = Vec::new();
        for rank in 0..2u32 {
            let dev = &devs[rank as usize];
            kvs.push(register(&node, dev, "eng", s, rank, KvKind::Split, 16, 128).await);
            put(&node, "eng", &s, rank, 0..4).await;
        }
        for direct in [true, false] {
            for kv in &kvs {
                kv.reset().unwrap();
            }
            let q = query(&node, "eng", 0..12, direct).await;
            assert_eq!((q.local_blocks, q.remote_blocks), (4, 8), "direct={direct}");
            assert_eq!(q.direct.is_granted(), direct, "{:?}", q.direct);
            let lease = q.lease.unwrap();
            let load = |rank: u32| node.load(load_request(lease, "eng", rank, &DEST));
            let (r0, r1) = tokio::join!(load(0), load(1));
            for (rank, r) in [r0, r1].into_iter().enumerate() {
                let r = r.unwrap_or_else(|e| panic!("rank {rank} direct={direct}: {e}"));
                assert_eq!(r.path, if direct { "direct" } else { "staged" });
                let checked = kvs[rank]
                    .verify(&expected(&DEST, 0), rank as u32)
                    .unwrap_or_else(|e| panic!("rank {rank} direct={direct}: {e}"));
                assert_eq!(checked, 12 * s.rank_bytes());
                eprintln!(
                    "two GPUs: rank {rank} on GPU {rank}, {}: {} bytes in {:.3} ms",
                    r.path,
                    r.bytes,
                    r.seconds * 1e3
                );
            }
            settled(&node).await;
            node.drop_reclaimable().await.unwrap();
        }
        for (o, dev) in devs.iter().enumerate() {
            let buf = dev.alloc(2 << 20).unwrap();
            let dmabuf = dev
                .export_dmabuf(buf.ptr(), buf.len())
                .unwrap_or_else(|e| panic!("DMA-BUF export on GPU {o}: {e}"));
            assert_eq!(dmabuf.ordinal(), o as u32);
            assert!(dmabuf.offset_of(buf.ptr(), buf.len()).is_some());
        }
        node.unregister_instance(id("eng")).await.unwrap();
        assert_eq!(node.stats().await.unwrap().instances, 0);
    });
    node.shutdown();
    child.finish(None);
}

/// Directory options for the outage tests: a query waits on Redis at most `lookup_timeout`.
fn outage_options(reconcile: Duration) -> RedisOptions {
    RedisOptions {
        connect_timeout: Duration::from_millis(500),
        lookup_timeout: Duration::from_millis(200),
        write_timeout: Duration::from_millis(500),
        breaker_failures: 3,
        probe_interval: Duration::from_millis(100),
        reconcile_interval: reconcile,
    }
}

async fn query_range(node: &Node, ids: std::ops::Range<u64>) -> kvferry_actors::QueryResponse {
    let q = query(node, "eng", ids, false).await;
    if let Some(l) = q.lease {
        node.release(l).await.unwrap();
    }
    q
}

/// Polls `found` every 20 ms until it holds, for at most `within`; the time it took.
async fn found_within<F, Fut>(within: Duration, what: &str, mut found: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while !found().await {
        assert!(t.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed()
}

/// Redis hung with SIGSTOP: queries answer from local blocks within the lookup bound (and
/// at once once the breaker is open), Health and Stats answer at once, puts that evict
/// do not wait; once Redis answers again, what was sealed meanwhile is found by a peer.
#[test]
fn a_hung_redis_directory_never_stalls_a_node() {
    let mut server = RedisServer::start();
    let o = outage_options(Duration::from_secs(600));
    let dir = Arc::new(RedisDirectory::connect_with(&server.addr, "kvf-hung", o.clone()).unwrap());
    rt().block_on(async {
        let c = Cluster::with(
            LocalCluster::with_directory(Provider::Shm, Arc::clone(&dir) as Arc<dyn Directory>),
            &["b", "a", "c"],
        );
        worked_example(&c, 1).await;
        dir.flush().await;
        let q = query_range(c.node(0), 0..12).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 8));

        server.hang();
        let slack = Duration::from_millis(250);
        let mut slowest = Duration::ZERO;
        for _ in 0..10 {
            let t = Instant::now();
            let q = query_range(c.node(0), 0..12).await;
            slowest = slowest.max(t.elapsed());
            assert_eq!((q.local_blocks, q.remote_blocks), (4, 0));
            // Health is the node's stats; the scrape reads the directory's counters only.
            let t = Instant::now();
            c.node(0).stats().await.unwrap();
            let text = c.node(0).metrics_text().await.unwrap();
            assert!(
                t.elapsed() < slack,
                "stats and a scrape took {:?}",
                t.elapsed()
            );
            assert!(text.contains("kvferry_directory_breaker_open"));
        }
        assert!(
            slowest <= o.lookup_timeout + slack,
            "a query took {slowest:?}"
        );
        assert_eq!(dir.breaker(), BreakerState::Open);
        assert!(c
            .node(0)
            .metrics_text()
            .await
            .unwrap()
            .contains("kvferry_directory_breaker_open 1\n"));
        // A's pool holds 32 slots: 64 puts evict 32 (and 4–7), each eviction a withdraw.
        let t = Instant::now();
        put(c.node(1), "eng", &shape(1), 0, 100..164).await;
        let took = t.elapsed();
        assert!(took < o.write_timeout, "evicting puts took {took:?}");
        assert!(c.node(1).stats().await.unwrap().evictions >= 32);

        server.resume();
        // A's newest blocks, sealed during the hang, are found once the directory is back.
        let took = found_within(
            Duration::from_secs(5),
            "blocks sealed while hung",
            || async { query_range(c.node(0), 132..164).await.remote_blocks == 32 },
        )
        .await;
        assert_eq!(dir.breaker(), BreakerState::Closed, "found after {took:?}");
        // What A evicted meanwhile is withdrawn: B's query stops after its own blocks.
        let q = query_range(c.node(0), 0..12).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 0));
        assert!(query_range(c.node(2), 100..132).await.remote_blocks == 0);
        c.settled().await;
    });
}

/// Redis killed and restarted empty: every block a node holds is found by a peer again
/// within the reconcile interval, and so is a block sealed during the outage.
#[test]
fn a_restarted_redis_directory_is_told_everything_again() {
    let server = RedisServer::start();
    let o = outage_options(Duration::from_secs(3));
    let dir =
        Arc::new(RedisDirectory::connect_with(&server.addr, "kvf-restart", o.clone()).unwrap());
    rt().block_on(async {
        let c = Cluster::with(
            LocalCluster::with_directory(Provider::Shm, Arc::clone(&dir) as Arc<dyn Directory>),
            &["b", "a", "c"],
        );
        worked_example(&c, 1).await;
        dir.flush().await;
        assert_eq!(query_range(c.node(0), 0..12).await.remote_blocks, 8);

        let mut server = server;
        server.kill();
        // Sealed on C while the directory is down.
        put(c.node(2), "eng", &shape(1), 0, 12..16).await;
        let t = Instant::now();
        let q = query_range(c.node(0), 0..16).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 0));
        assert!(t.elapsed() <= o.lookup_timeout + Duration::from_millis(250));

        let server = server.restart();
        let took = found_within(o.reconcile_interval, "every block found again", || async {
            query_range(c.node(0), 0..16).await.remote_blocks == 12
        })
        .await;
        // C found by A too, past B's blocks: every holder was re-announced.
        let q = query_range(c.node(1), 8..16).await;
        assert_eq!(q.remote_blocks, 8, "after {took:?}");
        assert!(dir.stats().health.unwrap().reannounces >= 1);
        c.settled().await;
        drop(server);
    });
}
