//! `kvferry.v1.Engine` over real gRPC on loopback TCP, with the test playing an engine
//! client without a GPU: its KV lives in a memfd it hands the node on the fd socket, loads
//! are started without waiting and their results taken by polls the node holds until they
//! end and by plain polling, and the bytes are checked in the memfd with canaries around them. Then the
//! session rule (closing it unregisters and releases) and the bad-input matrix: every
//! refusal has its status code, and the node's stats are exactly as before. The last test
//! runs the node in a child process (this binary re-executed), so the memfd really crosses
//! processes and the node's writes are seen through the client's own mapping.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvferry_actors::service::{self, proto, Code, EngineOptions};
use kvferry_actors::{Clock, DirectGrant, LeaseId, Node, PutBlocks};
use kvferry_client::KvFd;
use kvferry_client::{EngineClient, EngineClientError};
use kvferry_client::{LoadOptions, Registration};
use kvferry_gpu::{Device, HostDevice, KvShape, LayerLayout};
use kvferry_harness::*;
use kvferry_testkit::{DeviceKv, KvKind, MemfdRegionsKv};

const TOKEN: &str = "engine-secret";
const SLOT: u64 = 64 << 10;
const SLOTS: u64 = 32;
const WAIT: Duration = Duration::from_secs(10);
const CHILD_ENV: &str = "KVFERRY_ENGINE_RPC_CHILD";

fn shape() -> KvShape {
    KvShape::new(3, 1, 2, 1024).unwrap()
}

/// The engine service of a node, as most tests here want it: `TOKEN` required.
async fn with_token() -> EngineServer {
    EngineServer::start(EngineOptions {
        token: TOKEN.into(),
        ..Default::default()
    })
    .await
}

/// Puts pattern blocks `ids` of `shape` for rank 0 of `instance` over gRPC; something is
/// written.
async fn put_over_grpc(
    c: &EngineClient,
    shape: KvShape,
    instance: &str,
    ids: impl IntoIterator<Item = u64>,
) {
    let written = put_pattern_over(c, &id(instance), &shape, 0, ids)
        .await
        .unwrap();
    assert!(written > 0);
}

/// 16 blocks of memfd KV registered as rank 0 of "eng", and pattern blocks 0..4 put on the
/// node for it.
async fn four_blocks_on_the_node(c: &EngineClient) -> MemfdKv {
    let kv = MemfdKv::create(shape(), 16, 0).unwrap();
    kv.register_with(c, &id("eng"), "m", 0).await.unwrap();
    put_over_grpc(c, shape(), "eng", 0..4).await;
    kv
}

async fn lease_for(c: &EngineClient, instance: &str, ids: std::ops::Range<u64>) -> LeaseId {
    let n = (ids.end - ids.start) as u32;
    let q = c.query(&id(instance), &hashes(ids), false).await.unwrap();
    assert_eq!(q.local_blocks, n);
    q.lease.unwrap()
}

fn ok(c: &proto::LoadCompletion, blocks: u32) {
    assert_eq!(c.status, proto::LoadStatus::LoadOk as i32, "{c:?}");
    assert_eq!(c.blocks, blocks);
    assert_eq!(c.bytes, u64::from(blocks) * shape().rank_bytes());
    assert_eq!(c.path, "local");
    assert!(c.failed_blocks.is_empty() && c.error.is_empty());
    let stages: Vec<&str> = c.stages.iter().map(|s| s.name.as_str()).collect();
    assert!(stages.contains(&"plan"), "{stages:?}");
}

/// Waits until `f` holds for the node's stats over gRPC.
async fn stats_until(
    c: &EngineClient,
    what: &str,
    f: impl Fn(&proto::StatsResponse) -> bool,
) -> proto::StatsResponse {
    for _ in 0..500 {
        let s = c.stats().await.unwrap();
        if f(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: {:?}", c.stats().await.unwrap());
}

#[test]
fn memfd_kv_loads_with_completions_by_a_waiting_poll_and_by_polling() {
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let caps = c.capabilities().await.unwrap();
        assert_eq!(caps.protocol, service::ENGINE_PROTOCOL);
        assert_eq!(caps.version, service::VERSION);
        assert_eq!((caps.device_kind.as_str(), caps.device_count), ("host", 1));
        assert_eq!(caps.memory_kinds, vec!["memfd".to_string()]);
        assert_eq!(caps.fd_socket, srv.fd_path.display().to_string());
        assert!(!caps.direct_possible && !caps.direct_reason.is_empty());
        assert!(c.health().await.unwrap().serving);

        let kv = MemfdKv::create(shape(), 16, 128).unwrap();
        let ns = kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        assert_eq!(ns, format!("m/bf16/{}", shape().fingerprint()));
        assert_eq!(
            srv.dev.live_allocations(),
            1,
            "the memfd is device memory now"
        );
        let _session = c.open_session(&[id("eng")]).await.unwrap();
        put_over_grpc(&c, shape(), "eng", 0..6).await;

        // Completion by a poll the node holds until the load ends; the load call itself
        // returned at once with an id.
        let lease = lease_for(&c, "eng", 0..3).await;
        let first = c
            .load(
                &load_request(lease, "eng", 0, &[3, 5, 7]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        let t = std::time::Instant::now();
        let done = c.wait_load(first, WAIT).await.unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the wait ends with the load, not at its {} ms limit",
            service::MAX_POLL_WAIT_MS
        );
        ok(&done, 3);
        assert_eq!((done.instance.as_str(), done.rank), ("eng", 0));
        kv.verify(&[(3, 0), (5, 1), (7, 2)], 0).unwrap();
        let err = c.poll_load(first).await.unwrap_err();
        assert_eq!(err.code(), Some(Code::NotFound), "the wait consumed it");

        // Completion by polls that do not wait; a direct request is refused, not downgraded
        // silently.
        let q = c.query(&id("eng"), &hashes(0..6), true).await.unwrap();
        // Capabilities told the same reason before any query.
        assert_eq!(
            q.direct,
            DirectGrant::Refused {
                reason: caps.direct_reason.clone()
            }
        );
        let second = c
            .load(
                &load_request(q.lease.unwrap(), "eng", 0, &[10, 11, 12, 13, 14, 15]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        let done = polled(&c, second).await;
        ok(&done, 6);
        let expected: Vec<(u32, u64)> = (0..6).map(|i| (10 + i as u32, i)).collect();
        let mut all = vec![(3, 0), (5, 1), (7, 2)];
        all.extend(expected);
        kv.verify(&all, 0).unwrap();
        assert_eq!(
            c.poll_load(second).await.unwrap_err().code(),
            Some(Code::NotFound),
            "a poll consumes the result"
        );

        // Release: the lease is gone, a second release finds nothing.
        let lease = lease_for(&c, "eng", 0..2).await;
        c.release(lease).await.unwrap();
        assert_eq!(
            c.release(lease).await.unwrap_err().code(),
            Some(Code::NotFound)
        );
        let s = c.stats().await.unwrap();
        assert_eq!((s.loads_ok, s.loads_failed, s.leases_live), (2, 0, 0));
        assert_eq!((s.instances, s.sessions, s.memory_handles), (1, 1, 0));
        assert_eq!((s.loads_pending, s.completions_retained), (0, 0));
        assert_eq!(s.bytes_loaded, 9 * shape().rank_bytes());

        // Unregistering drains and unmaps the memfd on the node.
        c.unregister(&id("eng")).await.unwrap();
        assert_eq!(srv.dev.live_allocations(), 0);
        drop(c);
        drop(_session);
        srv.stop().await;
    });
}

/// Puts pattern blocks 0..4 and loads them into scattered blocks, then saves two blocks the
/// engine wrote and loads them elsewhere: every byte of `kv` checked after each load.
async fn round_trip(c: &EngineClient, kv: &DeviceKv, instance: &str, what: &str) {
    let shape = kv.shape;
    put_over_grpc(c, shape, instance, 0..4).await;
    let load_ok = |lease: Option<LeaseId>, dest: &[u32]| {
        let req = load_request(lease.expect("a lease"), instance, 0, dest);
        async move {
            let l = c.load(&req, LoadOptions::default()).await.unwrap();
            let done = c.wait_load(l, WAIT).await.unwrap();
            assert_eq!(
                done.status,
                proto::LoadStatus::LoadOk as i32,
                "{what}: {done:?}"
            );
            assert_eq!(
                done.bytes,
                req.dest_blocks.len() as u64 * shape.rank_bytes()
            );
        }
    };
    let q = c.query(&id(instance), &hashes(0..4), false).await.unwrap();
    assert_eq!(q.local_blocks, 4, "{what}");
    load_ok(q.lease, &[9, 2, 15, 5]).await;
    let mut expected = vec![(9, 0), (2, 1), (15, 2), (5, 3)];
    kv.verify(&expected, 0)
        .unwrap_or_else(|e| panic!("{what}: {e}"));

    kv.write_block(0, 100, 0).unwrap();
    kv.write_block(1, 101, 0).unwrap();
    let saved = c
        .save(&kvferry_actors::SaveRequest {
            instance: id(instance),
            rank: 0,
            hashes: hashes(100..102),
            src_blocks: vec![0, 1],
            tenant: None,
        })
        .await
        .unwrap();
    assert_eq!(saved.written, 2, "{what}");
    let q = c
        .query(&id(instance), &hashes(100..102), false)
        .await
        .unwrap();
    assert_eq!(q.local_blocks, 2, "{what}");
    load_ok(q.lease, &[12, 7]).await;
    expected.extend([(0, 100), (1, 101), (12, 100), (7, 101)]);
    kv.verify(&expected, 0)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// The layouts engines allocate, each in one memfd per tensor (per layer; per plane for
/// split K/V; one for cross-layer), registered as one region per memfd: put, query, load,
/// save and load again, every byte of every memfd checked with canaries.
#[test]
fn engine_layouts_spread_over_many_memfds_load_and_save_byte_for_byte() {
    rt().block_on(async {
        // (kind, layers, segments, segment bytes, block stride, view offset)
        let cases = [
            (KvKind::Split, 3, 2, 1024u64, 1024u64, 0u64),
            (KvKind::Contiguous, 3, 2, 512, 512, 128), // FlashAttention
            (KvKind::FlashInfer, 4, 2, 256, 512, 0),   // FlashInfer
            (KvKind::Contiguous, 4, 1, 1152, 1152, 64), // MLA
            (KvKind::CrossLayer, 5, 2, 192, 5 * 2 * 192, 0), // cross-layer
            (KvKind::CrossLayer, 2, 1, 64, 2 * 64, 64), // MLA cross-layer, fp8-sized
        ];
        for (kind, layers, segments, seg, stride, view) in cases {
            let what = format!("{kind:?} {layers}x{segments}x{seg}");
            let shape = KvShape::new(layers, 1, segments, seg).unwrap();
            let srv = with_token().await;
            let c = srv.client(TOKEN).await;
            let kv = MemfdRegionsKv::create(shape, kind, 16, stride, view).unwrap();
            let buffers = kv.buffer_lens().len();
            kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
            assert_eq!(srv.dev.live_allocations(), buffers, "{what}");
            let s = c.stats().await.unwrap();
            assert_eq!((s.instances, s.memory_handles), (1, 0), "{what}");
            let _session = c.open_session(&[id("eng")]).await.unwrap();

            round_trip(&c, &kv, "eng", &what).await;

            c.unregister(&id("eng")).await.unwrap();
            assert_eq!(
                srv.dev.live_allocations(),
                0,
                "{what}: every memfd unmapped"
            );
            drop(_session);
            drop(c);
            srv.stop().await;
        }
    });
}

/// Registrations over several regions that cannot be right: each refused with its code and a
/// message naming what is wrong, the node's state unchanged; then the good one works.
#[test]
fn bad_region_registrations_are_refused_and_change_nothing() {
    use kvferry_client::{MemoryRegion, PlanePlacement};
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let shape = KvShape::new(2, 1, 2, 256).unwrap();
        let kv = MemfdRegionsKv::create(shape, KvKind::Contiguous, 8, 256, 0).unwrap();
        let other = MemfdRegionsKv::create(shape, KvKind::Contiguous, 8, 256, 0).unwrap();
        assert_eq!(kv.buffer_lens().len(), 2, "one memfd per layer");
        let mut handles = Vec::new();
        for i in 0..2 {
            let len = kv.buffer_lens()[i];
            handles.push(
                c.send_kv(&id("eng"), 0, 0, kv.fd_of(i), KvFd::Memfd { len })
                    .await
                    .unwrap(),
            );
        }
        let len = other.buffer_lens()[0];
        let foreign = c // sent for rank 1
            .send_kv(&id("eng"), 1, 0, other.fd_of(0), KvFd::Memfd { len })
            .await
            .unwrap();
        let good = kv.registration(&id("eng"), "m", 0, &handles);
        let before = c.stats().await.unwrap();
        assert_eq!((before.memory_handles, before.instances), (3, 0));

        let mut cases: Vec<(&str, service::proto::RegisterInstanceRequest, Code, &str)> =
            Vec::new();
        let wire = kvferry_client::register_regions_request;
        let mut r = wire(&good);
        r.memory_handle = handles[0];
        cases.push(("regions and a handle", r, Code::InvalidArgument, "not both"));
        let mut g = good.clone();
        g.layers[1].k = PlanePlacement {
            region: 2,
            offset: 0,
        };
        cases.push((
            "region past the list",
            wire(&g),
            Code::InvalidArgument,
            "layer 1 K plane names memory region 2",
        ));
        let mut g = good.clone();
        g.layers[1].v = Some(PlanePlacement {
            region: 1,
            offset: kv.buffer_lens()[1] - 8 * 256 + 64,
        });
        cases.push((
            "plane outside its region",
            wire(&g),
            Code::InvalidArgument,
            "layer 1 V plane",
        ));
        let mut g = good.clone();
        g.regions[1] = MemoryRegion::Handle(handles[0]);
        cases.push((
            "one handle twice",
            wire(&g),
            Code::InvalidArgument,
            "named by two regions",
        ));
        let mut g = good.clone();
        g.regions[1] = MemoryRegion::Handle(foreign);
        cases.push((
            "another rank's handle",
            wire(&g),
            Code::PermissionDenied,
            "rank 1",
        ));
        let mut g = good.clone();
        g.layers[1] = g.layers[0];
        cases.push((
            "two layers on one plane",
            wire(&g),
            Code::InvalidArgument,
            "overlaps",
        ));
        let mut g = good.clone();
        g.kind = kvferry_gpu::GroupKind::Recurrent;
        cases.push((
            "recurrent state",
            wire(&g),
            Code::InvalidArgument,
            "recurrent",
        ));
        let mut r = wire(&good);
        r.regions[0].memory = None;
        cases.push((
            "an empty region",
            r,
            Code::InvalidArgument,
            "region 0 names no memory",
        ));
        let mut r = wire(&good);
        r.regions = vec![r.regions[0].clone(); service::MAX_ENGINE_REGIONS + 1];
        cases.push(("too many regions", r, Code::ResourceExhausted, "at most"));

        for (what, req, code, needle) in cases {
            let err = c
                .raw()
                .register_instance(c.request(req))
                .await
                .expect_err(what);
            assert_eq!(err.code(), code, "{what}: {}", err.message());
            assert!(err.message().contains(needle), "{what}: {}", err.message());
            let now = c.stats().await.unwrap();
            assert_eq!(now, before, "{what} changed the node's state");
        }
        // The good registration still works with the same handles.
        c.register(Registration::regions(&good)).await.unwrap();
        let s = c.stats().await.unwrap();
        assert_eq!(
            (s.instances, s.memory_handles),
            (1, 1),
            "the foreign handle waits"
        );
        put_over_grpc(&c, shape, "eng", vec![1]).await;
        let q = c.query(&id("eng"), &hashes(1..2), false).await.unwrap();
        let l = c
            .load(
                &load_request(q.lease.unwrap(), "eng", 0, &[6]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        let done = c.wait_load(l, WAIT).await.unwrap();
        assert_eq!(done.status, proto::LoadStatus::LoadOk as i32, "{done:?}");
        kv.verify(&[(6, 1)], 0).unwrap();
        drop(c);
        srv.stop().await;
    });
}

#[test]
fn closing_the_session_unregisters_and_releases_leases() {
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        let session = c.open_session(&[id("eng")]).await.unwrap();
        put_over_grpc(&c, shape(), "eng", 0..4).await;
        let _lease = lease_for(&c, "eng", 0..4).await;
        // A second memfd sent for the instance and never registered.
        let spare = MemfdKv::create(shape(), 4, 0).unwrap();
        c.send_kv(
            &id("eng"),
            0,
            0,
            spare.fd(),
            KvFd::Memfd { len: spare.len() },
        )
        .await
        .unwrap();
        let s = c.stats().await.unwrap();
        assert_eq!((s.leases_live, s.instances, s.sessions), (1, 1, 1));
        assert_eq!((s.pinned_blocks, s.memory_handles), (4, 1));
        assert_eq!(srv.dev.live_allocations(), 2);
        // The node's scrape shows the same.
        let text = srv.node.metrics_text().await.unwrap();
        for line in [
            "kvferry_engine_sessions 1",
            "kvferry_engine_memory_handles 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }

        drop(session);
        // The session's cleanup is over once it no longer counts; stats taken after that.
        stats_until(&c, "the session ends", |s| s.sessions == 0).await;
        let s = c.stats().await.unwrap();
        assert_eq!(s.instances, 0);
        assert_eq!((s.leases_live, s.pinned_blocks), (0, 0));
        assert_eq!(s.memory_handles, 0, "unused handles die with the session");
        let text = srv.node.metrics_text().await.unwrap();
        assert!(
            text.lines().any(|l| l == "kvferry_engine_sessions 0"),
            "{text}"
        );
        assert_eq!(srv.dev.live_allocations(), 0, "both memfds unmapped");
        let err = c.query(&id("eng"), &hashes(0..4), false).await.unwrap_err();
        assert_eq!(err.code(), Some(Code::NotFound));

        // The blocks stayed; a new registration and session work as before.
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        let _session = c.open_session(&[id("eng")]).await.unwrap();
        let lease = lease_for(&c, "eng", 0..4).await;
        let l = c
            .load(
                &load_request(lease, "eng", 0, &[8, 9, 10, 11]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 4);
        kv.verify(&[(8, 0), (9, 1), (10, 2), (11, 3)], 0).unwrap();
        drop(c);
        srv.stop().await;
    });
}

/// A load's result by polls that do not wait (the node answers each at once).
async fn polled(c: &EngineClient, load: u64) -> proto::LoadCompletion {
    let end = std::time::Instant::now() + WAIT;
    loop {
        if let Some(done) = c.poll_load(load).await.unwrap() {
            return done;
        }
        assert!(std::time::Instant::now() < end, "load {load} still running");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, EngineClientError>) -> Code {
    r.unwrap_err().code().expect("a status code")
}

fn raw_code<T: std::fmt::Debug>(r: Result<T, service::Status>) -> Code {
    r.unwrap_err().code()
}

#[test]
fn bad_input_is_refused_with_its_status_and_changes_nothing() {
    use std::os::fd::AsFd;
    rt().block_on(async {
        let srv = EngineServer::start(EngineOptions {
            token: TOKEN.into(),
            max_message_bytes: 256 << 10,
            ..Default::default()
        })
        .await;
        let c = srv.client(TOKEN).await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        let other = MemfdKv::create(shape(), 16, 0).unwrap();
        other.register_with(&c, &id("other"), "m", 0).await.unwrap();
        put_over_grpc(&c, shape(), "eng", 0..6).await;
        let lease = lease_for(&c, "eng", 0..3).await;
        // A handle waiting for its registration.
        let spare = MemfdKv::create(shape(), 16, 0).unwrap();
        let handle = c
            .send_kv(
                &id("spare"),
                0,
                0,
                spare.fd(),
                KvFd::Memfd { len: spare.len() },
            )
            .await
            .unwrap();
        let before = c.stats().await.unwrap();
        assert_eq!((before.leases_live, before.instances), (1, 2));
        assert_eq!((before.memory_handles, before.pinned_blocks), (1, 3));
        let unchanged = |what: &'static str| {
            let c = c.clone();
            async move {
                let now = c.stats().await.unwrap();
                assert_eq!(now, before, "{what} changed the node");
            }
        };
        let mut raw = c.raw();

        // Loads.
        let unknown = LeaseId::random();
        assert_eq!(
            code(
                c.load(
                    &load_request(unknown, "eng", 0, &[0, 1, 2]),
                    LoadOptions::default()
                )
                .await
            ),
            Code::NotFound
        );
        unchanged("unknown lease").await;
        assert_eq!(
            code(
                c.load(
                    &load_request(lease, "other", 0, &[0, 1, 2]),
                    LoadOptions::default()
                )
                .await
            ),
            Code::PermissionDenied
        );
        unchanged("wrong instance").await;
        let mut rank = load_request(lease, "eng", 0, &[0, 1, 2]);
        rank.rank = 5;
        assert_eq!(
            code(c.load(&rank, LoadOptions::default()).await),
            Code::NotFound
        );
        unchanged("rank out of range").await;
        assert_eq!(
            code(
                c.load(
                    &load_request(lease, "eng", 0, &[0, 1, 99]),
                    LoadOptions::default()
                )
                .await
            ),
            Code::InvalidArgument
        );
        unchanged("out-of-range destination block").await;
        assert_eq!(
            code(
                c.load(
                    &load_request(lease, "eng", 0, &[0, 1]),
                    LoadOptions::default()
                )
                .await
            ),
            Code::InvalidArgument
        );
        unchanged("too few destination blocks").await;
        assert_eq!(
            code(
                c.load(&load_request(lease, "eng", 0, &[]), LoadOptions::default())
                    .await
            ),
            Code::InvalidArgument
        );
        unchanged("no destination blocks").await;
        let r = raw
            .load(c.request(proto::LoadRequest {
                lease: "not-a-lease".into(),
                instance: "eng".into(),
                rank: 0,
                dest_blocks: vec![0, 1, 2],
                ..Default::default()
            }))
            .await;
        assert_eq!(raw_code(r), Code::InvalidArgument);
        unchanged("malformed lease id").await;

        // Queries.
        assert_eq!(
            code(c.query(&id("eng"), &[], false).await),
            Code::InvalidArgument
        );
        unchanged("empty hashes").await;
        let many = hashes(0..service::MAX_ENGINE_HASHES as u64 + 1);
        assert_eq!(
            code(c.query(&id("eng"), &many, false).await),
            Code::ResourceExhausted
        );
        unchanged("too many hashes").await;
        let dest: Vec<u32> = (0..service::MAX_ENGINE_BLOCKS as u32 + 1).collect();
        assert_eq!(
            code(
                c.load(
                    &load_request(lease, "eng", 0, &dest),
                    LoadOptions::default()
                )
                .await
            ),
            Code::ResourceExhausted
        );
        unchanged("too many destination blocks").await;
        let save = |n: usize| proto::SaveRequest {
            instance: "eng".into(),
            rank: 0,
            hashes: vec![vec![1u8]; n],
            src_blocks: vec![0; n],
            fence_ns: 0,
            tenant: String::new(),
        };
        let r = raw
            .save(c.request(save(service::MAX_ENGINE_HASHES + 1)))
            .await;
        assert_eq!(raw_code(r), Code::ResourceExhausted);
        unchanged("too many blocks to save").await;
        let put = proto::PutBlocksRequest {
            instance: "eng".into(),
            rank: 0,
            blocks: vec![
                proto::PutBlock {
                    hash: vec![1],
                    data: vec![1],
                };
                service::MAX_ENGINE_HASHES + 1
            ],
            fence_ns: 0,
        };
        let r = raw.put_blocks(c.request(put)).await;
        assert_eq!(raw_code(r), Code::ResourceExhausted);
        unchanged("too many blocks to put").await;
        let r = raw
            .query(c.request(proto::QueryRequest {
                instance: "eng".into(),
                hashes: vec![vec![1u8; 33].into()],
                direct_gpu: false,
                ..Default::default()
            }))
            .await;
        assert_eq!(raw_code(r), Code::InvalidArgument);
        unchanged("a 33-byte hash").await;
        // Packed hashes (protocol 4): each malformed form refused, nothing held after.
        let packed = |hashes: Vec<Vec<u8>>, packed: Vec<u8>, hash_len: u32| proto::QueryRequest {
            instance: "eng".into(),
            hashes: hashes.into_iter().map(Into::into).collect(),
            direct_gpu: false,
            packed_hashes: packed.into(),
            hash_len,
            fence_ns: 0,
            tenant: String::new(),
        };
        for (what, req, want) in [
            (
                "both forms",
                packed(vec![vec![1]], vec![1, 2], 1),
                Code::InvalidArgument,
            ),
            (
                "hash_len 0",
                packed(vec![], vec![1, 2], 0),
                Code::InvalidArgument,
            ),
            (
                "hash_len 33",
                packed(vec![], vec![1; 66], 33),
                Code::InvalidArgument,
            ),
            (
                "a partial hash",
                packed(vec![], vec![1; 10], 4),
                Code::InvalidArgument,
            ),
            (
                "too many packed hashes",
                packed(vec![], vec![1; service::MAX_ENGINE_HASHES + 1], 1),
                Code::ResourceExhausted,
            ),
        ] {
            let r = raw.query(c.request(req)).await;
            assert_eq!(raw_code(r), want, "{what}");
            unchanged(what).await;
        }
        assert_eq!(
            code(c.query(&id("nobody"), &hashes(0..3), false).await),
            Code::NotFound
        );
        unchanged("unknown instance").await;

        // Registrations: each refused, the spare handle still waiting afterwards.
        let good = spare.register_request(&id("spare"), "m", 0);
        let mut overlap = good.clone();
        if let LayerLayout::Split { k_base, .. } = overlap.layout.layers[0] {
            overlap.layout.layers[1] = LayerLayout::Split {
                k_base: k_base + 512,
                v_base: k_base + 8 * (1 << 20),
            };
        }
        assert_eq!(
            code(c.register(Registration::in_handle(&overlap, handle)).await),
            Code::InvalidArgument
        );
        unchanged("overlapping layers").await;
        let mut outside = good.clone();
        outside.layout.view_offset = 8192;
        assert_eq!(
            code(c.register(Registration::in_handle(&outside, handle)).await),
            Code::InvalidArgument
        );
        unchanged("layout outside the memfd").await;
        let mut beyond = good.clone();
        beyond.layout.layers[2] = LayerLayout::Split {
            k_base: spare.len(),
            v_base: spare.len() + (64 << 10),
        };
        assert_eq!(
            code(c.register(Registration::in_handle(&beyond, handle)).await),
            Code::InvalidArgument
        );
        unchanged("planes past the memfd's end").await;
        let mut rank = good.clone();
        rank.rank = 1;
        assert_eq!(
            code(c.register(Registration::in_handle(&rank, handle)).await),
            Code::InvalidArgument
        );
        unchanged("registration rank out of range").await;
        assert_eq!(
            code(c.register(Registration::in_handle(&good, handle ^ 1)).await),
            Code::NotFound
        );
        unchanged("unknown memory handle").await;
        assert_eq!(
            code(c.register(Registration::in_handle(&good, 0)).await),
            Code::InvalidArgument
        );
        unchanged("no memory handle").await;
        let thief = kv.register_request(&id("thief"), "m", 0);
        assert_eq!(
            code(c.register(Registration::in_handle(&thief, handle)).await),
            Code::PermissionDenied
        );
        unchanged("another instance's memory handle").await;
        let mut device = good.clone();
        device.device = 1;
        assert_eq!(
            code(c.register(Registration::in_handle(&device, handle)).await),
            Code::InvalidArgument
        );
        unchanged("another device").await;
        let wide = KvShape::new(service::MAX_ENGINE_LAYERS + 1, 1, 2, 64).unwrap();
        let mut layers = good.clone();
        layers.shape = wide;
        layers.layout = kvferry_gpu::KvLayoutSpec::cross_layer(0, wide.layers(), 2, 4, 64);
        let e = c
            .register(Registration::in_handle(&layers, handle))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(Code::ResourceExhausted), "{e}");
        assert!(e.to_string().contains("at most 512"), "{e}");
        unchanged("too many layers").await;
        // A block of 3 layers x 2 x 16 KiB = 96 KiB cannot fit the node's 64 KiB slot.
        let big = KvShape::new(3, 1, 2, 16 << 10).unwrap();
        let mut slot = good.clone();
        slot.shape = big;
        slot.layout = kvferry_gpu::KvLayoutSpec::flash_attn(&[0, 1 << 20, 2 << 20], 4, 16 << 10);
        let e = c
            .register(Registration::in_handle(&slot, handle))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(Code::FailedPrecondition), "{e}");
        let says = e.to_string();
        assert!(
            says.contains("98304 bytes") && says.contains(&format!("{SLOT}-byte pool slot")),
            "{says}"
        );
        unchanged("a block larger than a slot").await;

        // Message size, tokens, unknown ids.
        let huge = PutBlocks {
            instance: id("eng"),
            rank: 0,
            blocks: vec![(
                kvferry_actors::BlockHash::from_u64(99),
                vec![7u8; 300 << 10],
            )],
        };
        assert_eq!(code(c.put_blocks(&huge).await), Code::ResourceExhausted);
        unchanged("oversized message").await;
        let wrong = srv.client("wrong").await;
        assert_eq!(
            code(wrong.query(&id("eng"), &hashes(0..3), false).await),
            Code::Unauthenticated
        );
        assert_eq!(code(wrong.release(lease).await), Code::Unauthenticated);
        assert_eq!(
            code(wrong.unregister(&id("eng")).await),
            Code::Unauthenticated
        );
        let none = srv.client("").await;
        assert_eq!(code(none.stats().await), Code::Unauthenticated);
        assert_eq!(
            code(wrong.open_session(&[id("eng")]).await),
            Code::Unauthenticated
        );
        assert_eq!(
            code(
                wrong
                    .send_kv(
                        &id("eng"),
                        0,
                        0,
                        spare.fd(),
                        KvFd::Memfd { len: spare.len() }
                    )
                    .await
            ),
            Code::Unauthenticated
        );
        unchanged("bad token").await;
        assert_eq!(code(c.poll_load(12345).await), Code::NotFound);
        assert_eq!(
            code(c.wait_load(12345, WAIT).await),
            Code::NotFound,
            "a wait for an unknown load answers at once"
        );
        // A wait longer than advertised is refused, not cut short silently.
        let max_wait = c.capabilities().await.unwrap().max_poll_wait_ms;
        assert_eq!(max_wait, service::MAX_POLL_WAIT_MS);
        let r = raw
            .poll_load(c.request(proto::PollLoadRequest {
                load_id: 12345,
                wait_ms: max_wait + 1,
            }))
            .await;
        assert_eq!(raw_code(r), Code::ResourceExhausted);
        let mut session = c.open_session(&[]).await.unwrap();
        assert_eq!(code(session.bind(&id("nobody")).await), Code::NotFound);
        drop(session);
        unchanged("unknown load, rank, instance").await;

        // The fd socket refuses what the host device cannot use.
        assert_eq!(
            code(
                c.send_kv(
                    &id("eng"),
                    0,
                    0,
                    spare.fd(),
                    KvFd::Dmabuf { base: 0, len: 4096 }
                )
                .await
            ),
            Code::FailedPrecondition
        );
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert_eq!(
            code(
                c.send_kv(&id("eng"), 0, 0, file.as_fd(), KvFd::Memfd { len: 4096 })
                    .await
            ),
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                c.send_kv(
                    &id("eng"),
                    0,
                    0,
                    spare.fd(),
                    KvFd::Memfd {
                        len: spare.len() * 2
                    }
                )
                .await
            ),
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                c.send_kv(
                    &id("eng"),
                    0,
                    7,
                    spare.fd(),
                    KvFd::Memfd { len: spare.len() }
                )
                .await
            ),
            Code::InvalidArgument
        );
        unchanged("refused memory").await;

        // Bodies that do not decode, on every method that takes one; a Session stream that
        // receives one ends with the same status.
        for method in [
            "RegisterInstance",
            "UnregisterInstance",
            "Save",
            "PutBlocks",
            "Query",
            "Load",
            "Release",
            "PollLoad",
        ] {
            let path: &'static str = Box::leak(format!("/kvferry.v1.Engine/{method}").into());
            let got = raw::unary_code(&srv.addr, TOKEN, path, raw::GARBLED.to_vec()).await;
            assert_eq!(got, Code::InvalidArgument, "{method}");
        }
        unchanged("undecodable requests").await;
        let end = raw::stream_end(
            &srv.addr,
            TOKEN,
            "/kvferry.v1.Engine/Session",
            raw::GARBLED.to_vec(),
        )
        .await;
        assert_eq!(end.code(), Code::InvalidArgument, "{end:?}");
        assert!(end.message().starts_with("Session: "), "{end:?}");
        unchanged("an undecodable session message").await;

        // 200 descriptors in one fd-socket message: an err line, and the connection still
        // answers the next request.
        {
            use std::io::{BufRead, BufReader, Write};
            use std::os::fd::AsRawFd;
            let sock = std::os::unix::net::UnixStream::connect(&srv.fd_path).unwrap();
            sock.set_read_timeout(Some(WAIT)).unwrap();
            let dups: Vec<std::os::fd::OwnedFd> = (0..200)
                .map(|_| spare.fd().try_clone_to_owned().unwrap())
                .collect();
            let raw_fds: Vec<i32> = dups.iter().map(|f| f.as_raw_fd()).collect();
            let line = format!("memfd spare 0 0 {} {TOKEN}\n", spare.len());
            raw::send_many_fds(sock.as_raw_fd(), line.as_bytes(), &raw_fds).unwrap();
            let mut reader = BufReader::new(sock.try_clone().unwrap());
            let mut answer = String::new();
            reader.read_line(&mut answer).unwrap();
            assert!(
                answer.starts_with("err invalid-argument ") && answer.contains("one descriptor"),
                "{answer:?}"
            );
            (&sock).write_all(b"memfd spare 0 0 0\n").unwrap();
            answer.clear();
            reader.read_line(&mut answer).unwrap();
            assert!(answer.starts_with("err invalid-argument "), "{answer:?}");
        }
        unchanged("too many descriptors").await;

        // After all that, the lease loads and the spare handle registers.
        let l = c
            .load(
                &load_request(lease, "eng", 0, &[0, 1, 2]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 3);
        kv.verify(&[(0, 0), (1, 1), (2, 2)], 0).unwrap();
        other.verify(&[], 0).unwrap();
        c.register(Registration::in_handle(&good, handle))
            .await
            .unwrap();
        spare.verify(&[], 0).unwrap();
        let s = c.stats().await.unwrap();
        assert_eq!((s.leases_live, s.instances, s.memory_handles), (0, 3, 0));
        assert_eq!((s.loads_ok, s.loads_failed), (1, 0));
        drop((c, wrong, none));
        srv.stop().await;
    });
}

/// The limits on what one request carries are advertised, and the costliest registration
/// within them (the most layers, every plane interleaved inside one block stride, as
/// cross-layer KV lays them out) answers at once while the node keeps answering.
#[test]
fn the_largest_registration_answers_quickly_and_the_limits_are_advertised() {
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let caps = c.capabilities().await.unwrap();
        assert_eq!(caps.max_hashes as usize, service::MAX_ENGINE_HASHES);
        assert_eq!(caps.max_blocks as usize, service::MAX_ENGINE_BLOCKS);
        assert_eq!(caps.max_layers, service::MAX_ENGINE_LAYERS);
        assert_eq!(caps.max_regions as usize, service::MAX_ENGINE_REGIONS);
        assert_eq!(caps.max_hash_bytes, 32);
        assert_eq!(caps.slot_bytes, SLOT);
        assert_eq!(caps.max_mailboxes as usize, service::MAX_ENGINE_MAILBOXES);
        assert_eq!(caps.max_lookup_hashes as usize, service::MAX_LOOKUP_HASHES);
        assert!(caps.max_message_bytes > 0);

        let layers = caps.max_layers;
        // 512 layers x 2 x 64 bytes: one 64 KiB block, exactly the node's slot.
        let shape = KvShape::new(layers, 1, 2, 64).unwrap();
        let kv = MemfdKv::create(shape, 4, 0).unwrap();
        let handle = c
            .send_kv(&id("wide"), 0, 0, kv.fd(), KvFd::Memfd { len: kv.len() })
            .await
            .unwrap();
        let mut req = kv.register_request(&id("wide"), "m", 0);
        req.layout = kvferry_gpu::KvLayoutSpec::cross_layer(0, layers, 2, 4, 64);
        let t = std::time::Instant::now();
        c.register(Registration::in_handle(&req, handle))
            .await
            .unwrap();
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "{layers} layers took {took:?}"
        );
        c.health().await.unwrap();
        assert_eq!(c.stats().await.unwrap().instances, 1);
        drop(c);
        srv.stop().await;
    });
}

/// The node role of `a_client_process_loads_into_its_memfd_through_a_node_process`: runs
/// only when re-executed with `CHILD_ENV`. Prints its addresses, serves until stdin closes,
/// then checks that the client's memory was unmapped and nothing is left behind.
#[test]
#[ignore = "runs only as the node child process started by a_client_process_loads_into_its_memfd_through_a_node_process"]
fn child_node() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "started by a_client_process_loads_into_its_memfd_through_a_node_process"
    );
    rt().block_on(async {
        let srv = with_token().await;
        serve_as_child(srv, 1, |srv| {
            assert_eq!(
                srv.dev.live_allocations(),
                0,
                "the client's memfd is unmapped"
            );
        })
        .await;
    });
}

/// A child node's life: prints its addresses, serves until stdin closes, then checks that
/// its clients left nothing behind after `loads_ok` loads (and `check`), and stops.
async fn serve_as_child(srv: EngineServer, loads_ok: u64, check: impl FnOnce(&EngineServer)) {
    use std::io::Write;
    println!("ENGINE_ADDR={}", srv.addr);
    println!("ENGINE_FD={}", srv.fd_path.display());
    std::io::stdout().flush().unwrap();
    stdin_closed().await;
    let s = settled(&srv.node).await;
    assert_eq!((s.instances, s.loads_ok), (0, loads_ok), "{s:?}");
    check(&srv);
    println!("ENGINE_CHILD_OK");
    std::io::stdout().flush().unwrap();
    srv.stop().await;
}

#[test]
fn a_client_process_loads_into_its_memfd_through_a_node_process() {
    let child = ChildTest::spawn(concat!(module_path!(), "::child_node"), &[(CHILD_ENV, "1")]);
    let addr = child.wait_for("ENGINE_ADDR=");
    let fd_path = std::path::PathBuf::from(child.wait_for("ENGINE_FD="));
    rt().block_on(async {
        let c = EngineClient::connect(addr, Some(fd_path), TOKEN)
            .await
            .unwrap();
        let kv = MemfdKv::create(shape(), 16, 256).unwrap();
        kv.register_with(&c, &id("far"), "m", 0).await.unwrap();
        let session = c.open_session(&[id("far")]).await.unwrap();
        put_over_grpc(&c, shape(), "far", 0..4).await;
        let lease = lease_for(&c, "far", 0..4).await;
        let l = c
            .load(
                &load_request(lease, "far", 0, &[15, 0, 7, 8]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 4);
        // The node process wrote into this process's memfd through its own mapping.
        kv.verify(&[(15, 0), (0, 1), (7, 2), (8, 3)], 0).unwrap();
        drop(session);
        stats_until(&c, "the session ends", |s| {
            s.sessions == 0 && s.instances == 0
        })
        .await;
    });
    child.finish(Some("ENGINE_CHILD_OK"));
}

/// Fails every copy batch while set, for failed loads.
#[derive(Default)]
struct FailWhileSet(std::sync::atomic::AtomicBool);

impl SubmitHook for FailWhileSet {
    unsafe fn submit(
        &self,
        inner: &HostDevice,
        dir: kvferry_gpu::CopyDirection,
        list: kvferry_gpu::CopyList,
        landed: Option<kvferry_gpu::Landed>,
    ) -> Result<kvferry_gpu::CopyEvent, kvferry_gpu::DeviceError> {
        if self.0.load(Ordering::Relaxed) {
            return Err(kvferry_gpu::DeviceError::Copy {
                ordinal: 0,
                ops: list.len(),
                reason: "injected failure".into(),
            });
        }
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { inner.submit_then(dir, list, landed) }
    }
}

/// Counts the host-to-device batches submitted, and passes each on.
#[derive(Default)]
struct CountLoads(std::sync::atomic::AtomicUsize);

impl SubmitHook for CountLoads {
    unsafe fn submit(
        &self,
        inner: &HostDevice,
        dir: kvferry_gpu::CopyDirection,
        list: kvferry_gpu::CopyList,
        landed: Option<kvferry_gpu::Landed>,
    ) -> Result<kvferry_gpu::CopyEvent, kvferry_gpu::DeviceError> {
        if dir == kvferry_gpu::CopyDirection::HostToDevice {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { inner.submit_then(dir, list, landed) }
    }
}

/// CancelLoad stops a load between its batches: of a per-layer load held at its first
/// batch, only that batch is copied; the load ends failed ("cancelled", every block), on its
/// board too; nothing stays pinned, leased or in flight; other ranks' and unknown loads are
/// not touched; the next load lands byte for byte.
#[test]
fn a_cancelled_load_copies_no_more_and_ends_failed() {
    rt().block_on(async {
        let hooked = HookedDevice::new(HoldBatches::new(kvferry_gpu::CopyDirection::HostToDevice));
        let srv = EngineServer::start_hooked(EngineOptions::default(), &hooked).await;
        let c = srv.client("").await;
        let kv = four_blocks_on_the_node(&c).await;
        let dest = [9, 3, 4, 12];
        hooked.hook.held.store(true, Ordering::SeqCst);
        let lease = lease_for(&c, "eng", 0..4).await;
        let mut req = load_request(lease, "eng", 0, &dest);
        req.per_layer = true;
        let l = c.load(&req, LoadOptions::default()).await.unwrap();
        // Not another rank's, not an unknown id.
        assert!(!c.cancel_load(&id("eng"), 1, l).await.unwrap());
        assert!(!c.cancel_load(&id("eng"), 0, l ^ 1).await.unwrap());
        assert!(c.cancel_load(&id("eng"), 0, l).await.unwrap());
        hooked.hook.held.store(false, Ordering::SeqCst);
        let done = c.wait_load(l, WAIT).await.unwrap();
        assert_eq!(
            done.status,
            proto::LoadStatus::LoadFailed as i32,
            "{done:?}"
        );
        assert_eq!(done.error_kind, "cancelled", "{done:?}");
        assert_eq!(done.failed_blocks, dest.to_vec());
        // The batch held when the cancel came was copied; none of the other layers was.
        assert_eq!(hooked.hook.submitted.load(Ordering::SeqCst), 1);
        let s = stats_until(&c, "the cancelled load drains", |s| {
            s.transfers_in_flight == 0 && s.pinned_blocks == 0 && s.pins == 0
        })
        .await;
        assert_eq!((s.loads_failed, s.leases_live), (1, 0));
        // It ended: cancelling again finds nothing running.
        assert!(!c.cancel_load(&id("eng"), 0, l).await.unwrap());
        // The next load of the same blocks lands whole.
        kv.reset().unwrap();
        let lease = lease_for(&c, "eng", 0..4).await;
        let l = c
            .load(
                &load_request(lease, "eng", 0, &dest),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 4);
        kv.verify(&[(9, 0), (3, 1), (4, 2), (12, 3)], 0).unwrap();
        kv.untouched_outside(&dest).unwrap();
        c.unregister(&id("eng")).await.unwrap();
        drop(c);
        srv.stop().await;
    });
}

/// `per_layer` reaches the node through the call and through a mailbox: a small load that
/// is otherwise one batch lands as one batch per layer, byte for byte.
#[test]
fn a_per_layer_load_lands_one_layer_per_batch_through_the_call_and_the_mailbox() {
    rt().block_on(async {
        let counting = HookedDevice::new(CountLoads::default());
        let srv = EngineServer::start_hooked(EngineOptions::default(), &counting).await;
        let c = srv.client("").await;
        let kv = four_blocks_on_the_node(&c).await;
        let dest = [9, 3, 4, 12];
        let batches = || counting.hook.0.load(Ordering::SeqCst);
        let mailbox = srv.client("").await;
        assert!(mailbox.attach_mailbox(&id("eng")).await.unwrap());
        for (per_layer, client, want) in [
            (false, &c, 1),
            (true, &c, shape().layers() as usize),
            (true, &mailbox, shape().layers() as usize),
        ] {
            kv.reset().unwrap();
            let lease = lease_for(&c, "eng", 0..4).await;
            let before = batches();
            let mut req = load_request(lease, "eng", 0, &dest);
            req.per_layer = per_layer;
            let l = client.load(&req, LoadOptions::default()).await.unwrap();
            ok(&c.wait_load(l, WAIT).await.unwrap(), 4);
            assert_eq!(batches() - before, want, "per_layer {per_layer}");
            kv.verify(&[(9, 0), (3, 1), (4, 2), (12, 3)], 0).unwrap();
            kv.untouched_outside(&dest).unwrap();
        }
        let s = stats_until(&c, "the loads drain", |s| s.transfers_in_flight == 0).await;
        assert_eq!((s.loads_ok, s.loads_failed, s.leases_live), (3, 0, 0));
        c.unregister(&id("eng")).await.unwrap();
        drop((c, mailbox));
        srv.stop().await;
    });
}

#[test]
fn a_failed_load_completes_failed_with_its_blocks_and_the_next_one_works() {
    rt().block_on(async {
        let failing = HookedDevice::new(FailWhileSet::default());
        let srv = EngineServer::start_hooked(EngineOptions::default(), &failing).await;
        let c = srv.client("").await;
        let kv = four_blocks_on_the_node(&c).await;

        failing.hook.0.store(true, Ordering::Relaxed);
        let lease = lease_for(&c, "eng", 0..4).await;
        let l = c
            .load(
                &load_request(lease, "eng", 0, &[9, 3, 4, 12]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        let done = c.wait_load(l, WAIT).await.unwrap();
        assert_eq!(
            done.status,
            proto::LoadStatus::LoadFailed as i32,
            "{done:?}"
        );
        assert_eq!(done.error_kind, "transfer");
        assert!(done.error.contains("injected failure"), "{}", done.error);
        assert_eq!(done.failed_blocks, vec![9, 3, 4, 12]);
        assert_eq!((done.bytes, done.blocks), (0, 0));
        kv.verify(&[], 0).unwrap();
        let s = stats_until(&c, "the failed transfer drains", |s| {
            s.transfers_in_flight == 0
        })
        .await;
        assert_eq!(
            (s.loads_failed, s.loads_ok, s.leases_live, s.pinned_blocks),
            (1, 0, 0, 0)
        );

        failing.hook.0.store(false, Ordering::Relaxed);
        let lease = lease_for(&c, "eng", 0..4).await;
        let l = c
            .load(
                &load_request(lease, "eng", 0, &[9, 3, 4, 12]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 4);
        kv.verify(&[(9, 0), (3, 1), (4, 2), (12, 3)], 0).unwrap();
        drop(c);
        srv.stop().await;
    });
}

#[test]
fn save_stores_the_clients_blocks_from_its_memfd() {
    rt().block_on(async {
        let srv = EngineServer::start(EngineOptions::default()).await;
        let c = srv.client("").await;
        let kv = MemfdKv::create(shape(), 16, 64).unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        // The engine computed blocks 20..23 into its KV blocks 5..8 and saves them.
        for (dst, block) in [(5, 20), (6, 21), (7, 22)] {
            kv.write_block(dst, block, 0).unwrap();
        }
        let saved = c
            .save(&kvferry_actors::SaveRequest {
                instance: id("eng"),
                rank: 0,
                hashes: hashes(20..23),
                src_blocks: vec![5, 6, 7],
                tenant: None,
            })
            .await
            .unwrap();
        assert_eq!((saved.written, saved.sealed), (3, 3));
        assert_eq!(saved.bytes, 3 * shape().rank_bytes());
        let mismatched = c
            .save(&kvferry_actors::SaveRequest {
                instance: id("eng"),
                rank: 0,
                hashes: hashes(30..33),
                src_blocks: vec![1, 2],
                tenant: None,
            })
            .await;
        assert_eq!(code(mismatched), Code::InvalidArgument);
        let lease = lease_for(&c, "eng", 20..23).await;
        let l = c
            .load(
                &load_request(lease, "eng", 0, &[0, 1, 2]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 3);
        kv.verify(&[(5, 20), (6, 21), (7, 22), (0, 20), (1, 21), (2, 22)], 0)
            .unwrap();
        drop(c);
        srv.stop().await;
    });
}

#[test]
fn unused_handles_expire_and_a_session_outlives_the_call_deadline() {
    rt().block_on(async {
        let srv = EngineServer::start(EngineOptions {
            handle_ttl: Duration::from_secs(1),
            call_timeout: Duration::from_millis(500),
            ..Default::default()
        })
        .await;
        let c = srv.client("").await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        let mut session = c.open_session(&[id("eng")]).await.unwrap();
        let spare = MemfdKv::create(shape(), 16, 0).unwrap();
        let handle = c
            .send_kv(
                &id("late"),
                0,
                0,
                spare.fd(),
                KvFd::Memfd { len: spare.len() },
            )
            .await
            .unwrap();
        assert_eq!(srv.dev.live_allocations(), 2);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let s = c.stats().await.unwrap();
        assert_eq!((s.memory_handles, s.instances, s.sessions), (0, 1, 1));
        assert_eq!(
            srv.dev.live_allocations(),
            1,
            "the expired handle's memfd is unmapped"
        );
        assert_eq!(
            code(
                c.register(Registration::in_handle(
                    &spare.register_request(&id("late"), "m", 0),
                    handle
                ))
                .await
            ),
            Code::NotFound
        );
        // Still open past the unary deadline: binding again answers.
        session.bind(&id("eng")).await.unwrap();
        drop(session);
        stats_until(&c, "the session ends", |s| {
            s.sessions == 0 && s.instances == 0
        })
        .await;
        drop(c);
        srv.stop().await;
    });
}

#[test]
fn a_remote_suffix_loads_direct_when_granted_and_staged_otherwise() {
    use kvferry_actors::peer::Provider;
    rt().block_on(async {
        // The owner holds blocks 4..8; the engine's node serves the engine API.
        let nodes = Cluster::new(Provider::Tcp, &["owner", "near"]);
        let (owner, near) = (nodes.node(0), nodes.node(1));
        let owner_kv = register(owner, nodes.dev(0), "eng", shape(), 0, KvKind::Split, 16, 0).await;
        put(owner, "eng", &shape(), 0, 4..8).await;
        let srv = EngineServer::serve(
            EngineOptions::default(),
            near.clone(),
            nodes.host(1).clone(),
        )
        .await;
        let c = srv.client("").await;
        let caps = c.capabilities().await.unwrap();
        assert!(
            caps.direct_possible && caps.direct_reason.is_empty(),
            "{caps:?}"
        );
        let kv = four_blocks_on_the_node(&c).await;
        let dest = [15, 0, 3, 4, 9, 1, 2, 12];

        for (direct_gpu, path) in [(true, "direct"), (false, "staged")] {
            let q = c
                .query(&id("eng"), &hashes(0..8), direct_gpu)
                .await
                .unwrap();
            assert_eq!((q.local_blocks, q.remote_blocks), (4, 4), "{q:?}");
            let grant = if direct_gpu {
                DirectGrant::Granted
            } else {
                DirectGrant::NotRequested
            };
            assert_eq!(q.direct, grant);
            let l = c
                .load(
                    &load_request(q.lease.unwrap(), "eng", 0, &dest),
                    LoadOptions::default(),
                )
                .await
                .unwrap();
            let done = c.wait_load(l, WAIT).await.unwrap();
            assert_eq!(done.status, proto::LoadStatus::LoadOk as i32, "{done:?}");
            assert_eq!((done.path.as_str(), done.blocks), (path, 8));
            assert_eq!(done.bytes, 8 * shape().rank_bytes());
            let stages: Vec<&str> = done.stages.iter().map(|s| s.name.as_str()).collect();
            assert!(stages.contains(&"pin"), "{stages:?}");
            kv.verify(&expected(&dest, 0), 0).unwrap();
        }
        let s = stats_until(&c, "loads drain", |s| s.transfers_in_flight == 0).await;
        assert_eq!((s.loads_ok, s.leases_live, s.pinned_blocks), (2, 0, 0));
        drop(c);
        srv.stop().await;
        drop(owner_kv);
        owner.shutdown();
    });
}

#[test]
fn cuda_ipc_registration_is_refused_clearly_where_it_cannot_work() {
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        let before = c.stats().await.unwrap();
        let req = kv.register_request(&id("eng"), "m", 0);
        // The host device maps no CUDA memory.
        let err = c
            .register(Registration::cuda_ipc(&req, &[7u8; 64]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
        assert!(err.to_string().contains("CUDA IPC"), "{err}");
        // Not a handle at all.
        let err = c
            .register(Registration::cuda_ipc(&req, &[7u8; 4096]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
        // A memory handle and an IPC handle at once.
        let h = c
            .send_kv(&id("eng"), 0, 0, kv.fd(), KvFd::Memfd { len: kv.len() })
            .await
            .unwrap();
        let mut msg = kvferry_client::register_request(&req, h);
        msg.cuda_ipc_handle = vec![7u8; 64];
        let err = c.raw().register_instance(c.request(msg)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err}");
        let after = c.stats().await.unwrap();
        assert_eq!(after.instances, before.instances);
        // The memfd handle is still there to register with.
        c.register(Registration::in_handle(&req, h)).await.unwrap();
        srv.stop().await;
    });
}

/// A VMM fd (vLLM 0.34's extensible KV cache) sent to a node whose device cannot map one is
/// refused on the fd socket with FAILED_PRECONDITION naming VMM, and the connection and the
/// instance stay usable.
#[test]
fn a_vmm_fd_is_refused_clearly_where_it_cannot_be_mapped() {
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        let err = c
            .send_kv(&id("eng"), 0, 0, kv.fd(), KvFd::Vmm { len: 2 << 20 })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
        assert!(err.to_string().contains("VMM"), "{err}");
        // A device the node does not have.
        let err = c
            .send_kv(&id("eng"), 0, 9, kv.fd(), KvFd::Vmm { len: 2 << 20 })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
        let h = c
            .send_kv(&id("eng"), 0, 0, kv.fd(), KvFd::Memfd { len: kv.len() })
            .await
            .unwrap();
        c.register(Registration::in_handle(
            &kv.register_request(&id("eng"), "m", 0),
            h,
        ))
        .await
        .unwrap();
        srv.stop().await;
    });
}

/// The node role of `an_engine_workers_cuda_kv_in_another_process_through_an_ipc_handle`:
/// a node over CUDA device 0, serving until its stdin closes.
#[test]
#[ignore = "runs only as the node child process started by an_engine_workers_cuda_kv_in_another_process_through_an_ipc_handle"]
fn child_cuda_node() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "started by its parent test"
    );
    rt().block_on(async {
        let cuda = kvferry_gpu::open_device("cuda", 0).expect("a CUDA GPU");
        let node = Node::start_with(config(SLOT, SLOTS), vec![cuda], Clock::system()).unwrap();
        let options = EngineOptions {
            token: TOKEN.into(),
            ..Default::default()
        };
        let srv = EngineServer::serve(options, node, HostDevice::new(0)).await;
        // The parent says how many loads it makes (two unless told).
        let loads = std::env::var("KVFERRY_ENGINE_RPC_LOADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2);
        serve_as_child(srv, loads, |_| {}).await;
    });
}

/// An engine worker's GPU KV the way engines allocate it — one CUDA allocation per layer (per
/// plane for split K/V, one for cross-layer) — registered with one CUDA IPC region per
/// allocation in a node process, then loaded and saved byte for byte in every layout.
#[test]
#[ignore = "needs a CUDA GPU"]
fn engine_layouts_in_per_layer_cuda_allocations_of_another_process() {
    use kvferry_client::{MemoryRegion, RegisterRegions};
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_cuda_node"),
        &[(CHILD_ENV, "1"), ("KVFERRY_ENGINE_RPC_LOADS", "10")],
    );
    let addr = child.wait_for("ENGINE_ADDR=");
    let fd_path = std::path::PathBuf::from(child.wait_for("ENGINE_FD="));
    let cuda = kvferry_gpu::CudaDevice::open(0).expect("a CUDA GPU");
    rt().block_on(async {
        let c = EngineClient::connect(addr, Some(fd_path), TOKEN)
            .await
            .unwrap();
        let cases = [
            (KvKind::Split, 3, 2, 1024u64, 1024u64),
            (KvKind::Contiguous, 3, 2, 512, 512),
            (KvKind::FlashInfer, 4, 2, 256, 512),
            (KvKind::Contiguous, 4, 1, 1152, 1152),
            (KvKind::CrossLayer, 5, 2, 192, 5 * 2 * 192),
        ];
        for (n, (kind, layers, segments, seg, stride)) in cases.into_iter().enumerate() {
            let what = format!("{kind:?} {layers}x{segments}x{seg}");
            let instance = format!("gpu-{n}");
            let shape = KvShape::new(layers, 1, segments, seg).unwrap();
            let kv = DeviceKv::alloc(cuda.clone() as Arc<dyn Device>, shape, kind, 16, stride, 0)
                .unwrap();
            let mut regions = Vec::new();
            let mut layers_at = kv.placements();
            let spans = kv.buffer_ptrs();
            for &ptr in &spans {
                let ipc = cuda.ipc_handle(ptr).unwrap();
                regions.push((MemoryRegion::CudaIpc(ipc.bytes.to_vec()), ipc.offset));
            }
            for l in &mut layers_at {
                l.k.offset += regions[l.k.region as usize].1;
                if let Some(v) = l.v.as_mut() {
                    v.offset += regions[v.region as usize].1;
                }
            }
            let reg = RegisterRegions {
                instance: id(&instance),
                model: format!("m{n}"),
                dtype: "bf16".into(),
                shape,
                rank: 0,
                device: 0,
                kind: kv.spec().kind,
                block_stride: stride,
                num_blocks: 16,
                regions: regions.into_iter().map(|(r, _)| r).collect(),
                layers: layers_at,
            };
            c.register(Registration::regions(&reg))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            round_trip(&c, &kv, &instance, &what).await;
            eprintln!(
                "cuda regions {what}: {} buffers, loads and save ok",
                spans.len()
            );
            c.unregister(&id(&instance)).await.unwrap();
        }
    });
    child.finish(Some("ENGINE_CHILD_OK"));
}

/// An engine worker's GPU KV in its own process (this test), registered with a node in
/// another process by its CUDA IPC handle over gRPC; the node loads into it, completion by
/// stream and by poll, and this process checks every byte of its own allocation.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_engine_workers_cuda_kv_in_another_process_through_an_ipc_handle() {
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_cuda_node"),
        &[(CHILD_ENV, "1")],
    );
    let addr = child.wait_for("ENGINE_ADDR=");
    let fd_path = std::path::PathBuf::from(child.wait_for("ENGINE_FD="));
    let cuda = kvferry_gpu::CudaDevice::open(0).expect("a CUDA GPU");
    rt().block_on(async {
        let c = EngineClient::connect(addr, Some(fd_path), TOKEN)
            .await
            .unwrap();
        let kv = kvferry_testkit::DeviceKv::alloc_in_one(
            cuda.clone() as Arc<dyn Device>,
            shape(),
            16,
            256,
        )
        .unwrap();
        let ipc = cuda.ipc_handle(kv.base()).unwrap();
        assert_eq!(ipc.offset, 0);
        let req = kvferry_actors::RegisterInstance {
            instance: id("gpu-eng"),
            model: "m".into(),
            dtype: "bf16".into(),
            shape: shape(),
            rank: 0,
            device: 0,
            layout: kv.spec_from(kv.base()),
        };
        c.register(Registration::cuda_ipc(&req, &ipc.bytes))
            .await
            .unwrap();
        let _session = c.open_session(&[id("gpu-eng")]).await.unwrap();
        put_over_grpc(&c, shape(), "gpu-eng", 0..4).await;
        let dest = [9u32, 3, 4, 12];
        for waiting in [true, false] {
            let lease = lease_for(&c, "gpu-eng", 0..4).await;
            let done = if waiting {
                let l = c
                    .load(
                        &load_request(lease, "gpu-eng", 0, &dest),
                        LoadOptions::default(),
                    )
                    .await
                    .unwrap();
                c.wait_load(l, WAIT).await.unwrap()
            } else {
                let l = c
                    .load(
                        &load_request(lease, "gpu-eng", 0, &dest),
                        LoadOptions::default(),
                    )
                    .await
                    .unwrap();
                polled(&c, l).await
            };
            ok(&done, 4);
            let checked = kv
                .verify(&[(9, 0), (3, 1), (4, 2), (12, 3)], 0)
                .unwrap_or_else(|e| panic!("waiting={waiting}: {e}"));
            assert_eq!(checked, 4 * shape().rank_bytes());
            eprintln!(
                "cuda ipc: {} bytes loaded into another process's GPU KV in {:.3} ms",
                done.bytes,
                done.seconds * 1e3
            );
            kv.reset().unwrap();
        }
    });
    // The session ends with this process's client; the node unregisters and unmaps.
    child.finish(Some("ENGINE_CHILD_OK"));
}

/// vLLM 0.34's default KV cache the way it reaches a node: a VMM allocation (cuMemCreate,
/// exportable as a POSIX fd) of this process, its fd sent on the fd socket to a node in
/// another process, which maps it, registers it and loads into it, completion by stream and
/// by poll; this process checks every byte of its own allocation.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_engine_workers_vmm_kv_in_another_process_through_its_fd() {
    use std::os::fd::AsFd;
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_cuda_node"),
        &[(CHILD_ENV, "1")],
    );
    let addr = child.wait_for("ENGINE_ADDR=");
    let fd_path = std::path::PathBuf::from(child.wait_for("ENGINE_FD="));
    let cuda = kvferry_gpu::CudaDevice::open(0).expect("a CUDA GPU");
    rt().block_on(async {
        let c = EngineClient::connect(addr, Some(fd_path), TOKEN)
            .await
            .unwrap();
        let memory = cuda
            .alloc_vmm(DeviceKv::in_one_bytes(shape(), 16, 256))
            .expect("cuMemCreate an exportable allocation");
        let kv =
            DeviceKv::in_one(cuda.clone() as Arc<dyn Device>, memory, shape(), 16, 256).unwrap();
        let e = cuda.export_vmm(kv.base()).unwrap();
        assert_eq!(e.offset, 0);
        // The fd is the only thing that crosses; this process keeps its copy until sent.
        let h = c
            .send_kv(&id("vmm-eng"), 0, 0, e.fd.as_fd(), KvFd::Vmm { len: e.len })
            .await
            .unwrap();
        drop(e);
        let req = kvferry_actors::RegisterInstance {
            instance: id("vmm-eng"),
            model: "m".into(),
            dtype: "bf16".into(),
            shape: shape(),
            rank: 0,
            device: 0,
            layout: kv.spec_from(kv.base()),
        };
        c.register(Registration::in_handle(&req, h)).await.unwrap();
        let _session = c.open_session(&[id("vmm-eng")]).await.unwrap();
        put_over_grpc(&c, shape(), "vmm-eng", 0..4).await;
        let dest = [9u32, 3, 4, 12];
        for waiting in [true, false] {
            let lease = lease_for(&c, "vmm-eng", 0..4).await;
            let done = if waiting {
                let l = c
                    .load(
                        &load_request(lease, "vmm-eng", 0, &dest),
                        LoadOptions::default(),
                    )
                    .await
                    .unwrap();
                c.wait_load(l, WAIT).await.unwrap()
            } else {
                let l = c
                    .load(
                        &load_request(lease, "vmm-eng", 0, &dest),
                        LoadOptions::default(),
                    )
                    .await
                    .unwrap();
                polled(&c, l).await
            };
            ok(&done, 4);
            let checked = kv
                .verify(&[(9, 0), (3, 1), (4, 2), (12, 3)], 0)
                .unwrap_or_else(|e| panic!("waiting={waiting}: {e}"));
            assert_eq!(checked, 4 * shape().rank_bytes());
            eprintln!(
                "vmm fd: {} bytes loaded into another process's VMM KV in {:.3} ms",
                done.bytes,
                done.seconds * 1e3
            );
            kv.reset().unwrap();
        }
        // Not a multiple of the granularity: refused on the socket, typed.
        let e = cuda.export_vmm(kv.base()).unwrap();
        let err = c
            .send_kv(
                &id("vmm-eng"),
                0,
                0,
                e.fd.as_fd(),
                KvFd::Vmm { len: e.len - 4096 },
            )
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
    });
    // The session ends with this process's client; the node unregisters and unmaps.
    child.finish(Some("ENGINE_CHILD_OK"));
}

#[test]
fn a_completion_board_shows_loads_landing_without_an_rpc() {
    use kvferry_proto::shm::board::{Board, SlotState};
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        let board = Board::create(8).unwrap();
        let b = c.send_board(&id("eng"), 0, &board).await.unwrap();
        let handle = c
            .send_kv(&id("eng"), 0, 0, kv.fd(), KvFd::Memfd { len: kv.len() })
            .await
            .unwrap();
        // A board is not KV memory, and KV memory is not a board.
        let req = kv.register_request(&id("eng"), "m", 0);
        assert_eq!(
            code(c.register(Registration::in_handle(&req, b)).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                c.register(Registration::in_handle(&req, handle).with_board(handle))
                    .await
            ),
            Code::InvalidArgument
        );
        c.register(Registration::in_handle(&req, handle).with_board(b))
            .await
            .unwrap();
        put_over_grpc(&c, shape(), "eng", 0..6).await;

        let lease = lease_for(&c, "eng", 0..4).await;
        let dest = [9, 2, 14, 5];
        let first = c
            .load(
                &load_request(lease, "eng", 0, &dest),
                LoadOptions::on_board(3, 41),
            )
            .await
            .unwrap();
        // Every layer, then the end, without an RPC; the result is then in PollLoad.
        let v = board.wait(3, 41, shape().layers(), WAIT).unwrap();
        assert_eq!(v.tag, 41);
        assert!(v.layers == shape().layers(), "{v:?}");
        let v = board.wait(3, 41, u32::MAX, WAIT).unwrap();
        assert_eq!(v.state, SlotState::Ok);
        let done = c
            .poll_load(first)
            .await
            .unwrap()
            .expect("done on the board: done here");
        ok(&done, 4);
        kv.verify(&expected(&dest, 0), 0).unwrap();

        // Refused before anything moves: a slot past the board, a slot still running, and
        // a board slot for a rank that registered no board. The lease survives each.
        let lease = lease_for(&c, "eng", 0..2).await;
        let r = c
            .load(
                &load_request(lease, "eng", 0, &[0, 1]),
                LoadOptions::on_board(8, 1),
            )
            .await;
        assert_eq!(code(r), Code::InvalidArgument);
        // A running slot: what the node writes is what it checks, so fake one.
        let fake = Board::create(8).unwrap();
        let _ = fake;
        let second = c
            .load(
                &load_request(lease, "eng", 0, &[0, 1]),
                LoadOptions::on_board(3, 42),
            )
            .await
            .unwrap();
        assert_eq!(
            board.wait(3, 42, u32::MAX, WAIT).unwrap().state,
            SlotState::Ok
        );
        ok(&c.poll_load(second).await.unwrap().unwrap(), 2);

        let kv2 = MemfdKv::create(shape(), 16, 0).unwrap();
        kv2.register_with(&c, &id("plain"), "m", 0).await.unwrap();
        let lease = lease_for(&c, "plain", 0..2).await;
        let r = c
            .load(
                &load_request(lease, "plain", 0, &[0, 1]),
                LoadOptions::on_board(0, 1),
            )
            .await;
        assert_eq!(code(r), Code::FailedPrecondition);
        let third = c
            .load(
                &load_request(lease, "plain", 0, &[0, 1]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(third, WAIT).await.unwrap(), 2);

        let s = c.stats().await.unwrap();
        assert_eq!((s.loads_ok, s.loads_failed, s.leases_live), (3, 0, 0));
        assert_eq!(s.memory_handles, 0, "the board went with the registration");
        c.unregister(&id("eng")).await.unwrap();
        c.unregister(&id("plain")).await.unwrap();
        drop(c);
        srv.stop().await;
    });
}

#[test]
fn a_board_says_a_loads_outcome_failed_blocks_included_and_successes_need_no_poll() {
    use kvferry_proto::shm::board::{Board, Outcome, SlotState};
    rt().block_on(async {
        let failing = HookedDevice::new(FailWhileSet::default());
        let srv = EngineServer::start_hooked(
            EngineOptions {
                completion_retention: 2,
                ..EngineOptions::default()
            },
            &failing,
        )
        .await;
        let c = srv.client("").await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        let board = Board::create(4).unwrap();
        let b = c.send_board(&id("eng"), 0, &board).await.unwrap();
        // The node said it writes this build's board.
        board.accepted().unwrap();
        let handle = c
            .send_kv(&id("eng"), 0, 0, kv.fd(), KvFd::Memfd { len: kv.len() })
            .await
            .unwrap();
        let req = kv.register_request(&id("eng"), "m", 0);
        c.register(Registration::in_handle(&req, handle).with_board(b))
            .await
            .unwrap();
        put_over_grpc(&c, shape(), "eng", 0..4).await;

        // More successes than the node retains, none polled: the board's word is their
        // delivery, so none counts as dropped undelivered nor waits in the book.
        for tag in 1..=3 {
            let lease = lease_for(&c, "eng", 0..4).await;
            c.load(
                &load_request(lease, "eng", 0, &[9, 3, 4, 12]),
                LoadOptions::on_board(1, tag),
            )
            .await
            .unwrap();
            let v = board.wait(1, tag, u32::MAX, WAIT).unwrap();
            assert_eq!((v.tag, v.outcome()), (tag, Some(Outcome::Ok)), "{v:?}");
        }
        kv.verify(&[(9, 0), (3, 1), (4, 2), (12, 3)], 0).unwrap();
        let s = stats_until(&c, "the loads drain", |s| s.transfers_in_flight == 0).await;
        assert_eq!((s.loads_ok, s.loads_failed), (3, 0));
        assert_eq!(
            (s.completions_dropped, s.completions_retained),
            (0, 0),
            "{s:?}"
        );

        // A failure: the final word says so with its failed blocks; the details come from
        // one PollLoad.
        failing.hook.0.store(true, Ordering::Relaxed);
        let lease = lease_for(&c, "eng", 0..3).await;
        let l = c
            .load(
                &load_request(lease, "eng", 0, &[7, 8, 10]),
                LoadOptions::on_board(2, 40),
            )
            .await
            .unwrap();
        let v = board.wait(2, 40, u32::MAX, WAIT).unwrap();
        assert_eq!(
            (v.tag, v.state, v.failed_blocks),
            (40, SlotState::Failed, 3)
        );
        assert_eq!(v.outcome(), Some(Outcome::Failed { blocks: 3 }));
        let done = c
            .poll_load(l)
            .await
            .unwrap()
            .expect("failed on the board: done here");
        assert_eq!(done.status, proto::LoadStatus::LoadFailed as i32);
        assert_eq!(done.failed_blocks, vec![7, 8, 10]);
        assert!(done.error.contains("injected failure"), "{}", done.error);
        failing.hook.0.store(false, Ordering::Relaxed);
        let s = stats_until(&c, "the failed load drains", |s| s.transfers_in_flight == 0).await;
        assert_eq!((s.loads_failed, s.completions_dropped), (1, 0));
        drop(c);
        srv.stop().await;
    });
}

/// The value of a sample line `name value` in the node's scrape.
async fn scraped(srv: &EngineServer, name: &str) -> f64 {
    let text = srv.node.metrics_text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}

/// Waits until the node's scrape shows `name` at `want` (5 s at most), then checks it does.
async fn scraped_until(srv: &EngineServer, name: &str, want: f64) {
    for _ in 0..500 {
        if scraped(srv, name).await == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(scraped(srv, name).await, want, "{name}");
}

/// Query and Load through a request mailbox: the same answers, bytes and refusals as the
/// calls, each request served from shared memory (the node's counter says so), garbage in a
/// slot refused without harm, and the node's thread gone with the client.
#[test]
fn query_and_load_through_a_mailbox_answer_as_the_calls_do() {
    use kvferry_proto::shm::mailbox::{self, Mailbox, Op};
    use prost::Message;
    rt().block_on(async {
        let srv = with_token().await;
        let plain = srv.client(TOKEN).await;
        let c = srv.client(TOKEN).await;
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        kv.register_with(&plain, &id("eng"), "m", 0).await.unwrap();
        put_over_grpc(&plain, shape(), "eng", 0..6).await;
        assert!(!c.has_mailbox());
        assert!(c.attach_mailbox(&id("eng")).await.unwrap());
        assert!(c.has_mailbox() && c.clone().has_mailbox());
        assert_eq!(scraped(&srv, "kvferry_engine_mailboxes").await, 1.0);

        let q = c.query(&id("eng"), &hashes(0..4), false).await.unwrap();
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 0));
        let dest = [9, 2, 14, 5];
        let l = c
            .load(
                &load_request(q.lease.unwrap(), "eng", 0, &dest),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 4);
        kv.verify(&expected(&dest, 0), 0).unwrap();
        // A save through it: destination 9 (pattern block 0) under a new hash, loaded back
        // into block 11.
        let saved = c
            .save(&kvferry_actors::SaveRequest {
                instance: id("eng"),
                rank: 0,
                hashes: hashes(900..901),
                src_blocks: vec![9],
                tenant: None,
            })
            .await
            .unwrap();
        assert_eq!(saved.written, 1);
        let lease = lease_for(&c, "eng", 900..901).await;
        let l = c
            .load(
                &load_request(lease, "eng", 0, &[11]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&c.wait_load(l, WAIT).await.unwrap(), 1);
        kv.verify(&[(9, 0), (2, 1), (14, 2), (5, 3), (11, 0)], 0)
            .unwrap();
        // A miss, then refusals with the codes the calls give for the same requests.
        let miss = c.query(&id("eng"), &hashes(50..52), false).await.unwrap();
        assert_eq!((miss.lease, miss.local_blocks), (None, 0));
        let gone = LeaseId::from_hex("00112233445566778899aabbccddeeff").unwrap();
        for (who, client) in [("mailbox", &c), ("call", &plain)] {
            let r = client
                .load(&load_request(gone, "eng", 0, &[1]), LoadOptions::default())
                .await;
            assert_eq!(code(r), Code::NotFound, "{who}");
            let r = client.query(&id("nobody"), &hashes(0..1), false).await;
            assert_eq!(code(r), Code::NotFound, "{who}");
        }
        assert_eq!(
            scraped(&srv, "kvferry_engine_mailbox_requests_total").await,
            8.0,
            "the query, the load, the save, its query and load, the miss and two refusals \
             came through the mailbox"
        );

        // A mailbox of our own, attached by hand: garbage and a bad handle change nothing.
        let before = plain.stats().await.unwrap();
        let own = Arc::new(Mailbox::create(2, mailbox::MIN_SLOT_BYTES).unwrap());
        let handle = plain.send_mailbox(&id("eng"), &own).await.unwrap();
        // A refused attach ends its session, as a refused bind does.
        let mut refused = plain.open_session(&[]).await.unwrap();
        assert_eq!(code(refused.attach(handle + 1000).await), Code::NotFound);
        let mut refused = plain.open_session(&[]).await.unwrap();
        let memfd = plain
            .send_kv(&id("eng"), 0, 0, kv.fd(), KvFd::Memfd { len: kv.len() })
            .await
            .unwrap();
        assert_eq!(code(refused.attach(memfd).await), Code::InvalidArgument);
        // A mailbox is not KV memory.
        let req = kv.register_request(&id("eng"), "m", 0);
        let e = plain
            .register(Registration::in_handle(&req, handle))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
        assert!(e.to_string().contains("is a mailbox, not KV memory"), "{e}");
        let mut session = plain.open_session(&[]).await.unwrap();
        session.attach(handle).await.unwrap();
        let ask = |op, bytes: Vec<u8>| {
            let t = own.post(op, &bytes).unwrap();
            t.wait(Duration::from_millis(1), WAIT).unwrap()
        };
        let a = ask(Op::Query, vec![0xff; 64]);
        assert_eq!(a.code, Code::InvalidArgument as u32, "{a:?}");
        let a = ask(
            Op::Load,
            proto::LoadRequest {
                lease: "not hex".into(),
                instance: "eng".into(),
                dest_blocks: vec![1],
                ..Default::default()
            }
            .encode_to_vec(),
        );
        assert_eq!(a.code, Code::InvalidArgument as u32, "{a:?}");
        let a = ask(
            Op::Query,
            proto::QueryRequest {
                instance: "eng".into(),
                hashes: vec![vec![7u8; 16].into()],
                ..Default::default()
            }
            .encode_to_vec(),
        );
        assert_eq!(a.code, 0);
        let answer = proto::QueryResponse::decode(&a.payload[..]).unwrap();
        assert!(answer.lease.is_empty(), "{answer:?}");
        let after = plain.stats().await.unwrap();
        assert_eq!(
            (after.leases_live, after.pinned_blocks, after.loads_ok),
            (before.leases_live, before.pinned_blocks, before.loads_ok)
        );
        assert_eq!(scraped(&srv, "kvferry_engine_mailboxes").await, 2.0);

        // The client's handles gone: its thread ends; the session's end ends the other.
        drop(c);
        drop(session);
        scraped_until(&srv, "kvferry_engine_mailboxes", 0.0).await;
        let lease = lease_for(&plain, "eng", 0..2).await;
        let l = plain
            .load(
                &load_request(lease, "eng", 0, &[3, 4]),
                LoadOptions::default(),
            )
            .await
            .unwrap();
        ok(&plain.wait_load(l, WAIT).await.unwrap(), 2);
        let s = plain.stats().await.unwrap();
        assert_eq!((s.leases_live, s.loads_failed), (0, 0));
        plain.unregister(&id("eng")).await.unwrap();
        drop(plain);
        srv.stop().await;
    });
}

/// The node attaches at most `Capabilities.max_mailboxes` mailboxes (a thread each): one more
/// is RESOURCE_EXHAUSTED, and a slot freed by a session's end takes the next.
#[test]
fn mailboxes_past_the_advertised_limit_are_refused() {
    use kvferry_proto::shm::mailbox::{self, Mailbox};
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv.client(TOKEN).await;
        let max = c.capabilities().await.unwrap().max_mailboxes as usize;
        assert_eq!(max, service::MAX_ENGINE_MAILBOXES);
        let attach = || async {
            let m = Mailbox::create(1, mailbox::MIN_SLOT_BYTES).unwrap();
            let handle = c.send_mailbox(&id("eng"), &m).await.unwrap();
            let mut s = c.open_session(&[]).await.unwrap();
            s.attach(handle).await.map(|()| (m, s))
        };
        let mut held = Vec::new();
        for _ in 0..max {
            held.push(attach().await.unwrap());
        }
        assert_eq!(scraped(&srv, "kvferry_engine_mailboxes").await, max as f64);
        assert_eq!(code(attach().await), Code::ResourceExhausted);
        // One session ends: its thread goes, and another mailbox can come.
        drop(held.pop());
        let mut again = None;
        for _ in 0..500 {
            match attach().await {
                Ok(a) => {
                    again = Some(a);
                    break;
                }
                Err(e) => assert_eq!(e.code(), Some(Code::ResourceExhausted), "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        held.push(again.expect("a freed place is taken again"));
        drop(held);
        scraped_until(&srv, "kvferry_engine_mailboxes", 0.0).await;
        assert_eq!(c.stats().await.unwrap().sessions, 0);
        drop(c);
        srv.stop().await;
    });
}

/// A mailbox's session ends with the node's service: the client notices, sends its requests
/// as calls again (failing as calls do, not after the deadline), and does not use the
/// mailbox again.
#[test]
fn a_client_stops_using_a_mailbox_whose_node_went_away() {
    rt().block_on(async {
        let srv = with_token().await;
        let c = srv
            .client(TOKEN)
            .await
            .with_deadline(Duration::from_secs(5));
        let kv = MemfdKv::create(shape(), 8, 0).unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        assert!(c.attach_mailbox(&id("eng")).await.unwrap());
        assert_eq!(
            c.query(&id("eng"), &hashes(0..1), false)
                .await
                .unwrap()
                .local_blocks,
            0
        );
        c.unregister(&id("eng")).await.unwrap();
        srv.stop().await;
        let t = std::time::Instant::now();
        while c.has_mailbox() {
            assert!(t.elapsed() < WAIT, "the client still counts on the mailbox");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Attaching again on this handle says so: there is no mailbox to use.
        assert!(!c.attach_mailbox(&id("eng")).await.unwrap());
        let t = std::time::Instant::now();
        let r = c.query(&id("eng"), &hashes(0..1), false).await;
        assert_eq!(code(r), Code::Unavailable);
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    });
}

/// Holds each batch of one direction on the thread that submits it while `held` is set
/// (up to [`WAIT`]), as a node stalled mid-copy holds them, and counts the batches of that
/// direction it submitted.
struct HoldBatches {
    dir: kvferry_gpu::CopyDirection,
    held: std::sync::atomic::AtomicBool,
    submitted: std::sync::atomic::AtomicUsize,
}

impl HoldBatches {
    fn new(dir: kvferry_gpu::CopyDirection) -> Self {
        Self {
            dir,
            held: Default::default(),
            submitted: Default::default(),
        }
    }
}

impl SubmitHook for HoldBatches {
    unsafe fn submit(
        &self,
        inner: &HostDevice,
        dir: kvferry_gpu::CopyDirection,
        list: kvferry_gpu::CopyList,
        landed: Option<kvferry_gpu::Landed>,
    ) -> Result<kvferry_gpu::CopyEvent, kvferry_gpu::DeviceError> {
        if dir == self.dir {
            let until = std::time::Instant::now() + WAIT;
            while self.held.load(Ordering::SeqCst) && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.submitted.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { inner.submit_then(dir, list, landed) }
    }
}

/// A save the client gave up on (its copies held past its deadline) returns no earlier than
/// its fence, and the node, once the copies complete, seals nothing: a later query misses
/// and nothing stays pinned. Through the gRPC call and through the request mailbox.
#[test]
fn a_save_the_client_gave_up_on_is_never_sealed_and_returns_after_its_fence() {
    rt().block_on(async {
        let held = HookedDevice::new(HoldBatches::new(kvferry_gpu::CopyDirection::DeviceToHost));
        let srv = EngineServer::start_hooked(EngineOptions::default(), &held).await;
        let deadline = Duration::from_millis(300);
        let c = srv.client("").await.with_deadline(deadline);
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        for (dst, block) in [(5, 40), (6, 41)] {
            kv.write_block(dst, block, 0).unwrap();
        }
        let mb = srv.client("").await.with_deadline(deadline);
        assert!(mb.attach_mailbox(&id("eng")).await.unwrap());
        for (via, client, first) in [("grpc", &c, 40u64), ("mailbox", &mb, 60)] {
            held.hook.held.store(true, Ordering::SeqCst);
            let t0 = std::time::Instant::now();
            let r = client
                .save(&kvferry_actors::SaveRequest {
                    instance: id("eng"),
                    rank: 0,
                    hashes: hashes(first..first + 2),
                    src_blocks: vec![5, 6],
                    tenant: None,
                })
                .await;
            let took = t0.elapsed();
            assert_eq!(code(r), Code::DeadlineExceeded, "{via}");
            assert!(took >= deadline, "{via}: returned {took:?} after the call");
            // The engine may reuse its blocks now: what the held copies read is foreign.
            kv.write_block(5, 99, 0).unwrap();
            held.hook.held.store(false, Ordering::SeqCst);
            stats_until(&c, "the held save drains", |s| {
                s.transfers_in_flight == 0 && s.pinned_blocks == 0 && s.pins == 0
            })
            .await;
            let q = c.query(&id("eng"), &hashes(first..first + 2), false).await;
            let q = q.unwrap();
            assert_eq!((q.local_blocks, q.lease), (0, None), "{via}: sealed");
            kv.write_block(5, 40, 0).unwrap();
        }
        let text = srv.node.metrics_text().await.unwrap();
        assert!(
            text.contains("kvferry_abandoned_total{op=\"save\"} 2"),
            "{text}"
        );
        drop((c, mb));
        srv.stop().await;
    });
}
