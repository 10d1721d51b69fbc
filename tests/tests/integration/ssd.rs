//! The SSD tier at node level: blocks evicted from RAM (or written through) are held on disk
//! by a query and read by the load, pipelined with its copies to the device, byte for byte
//! with canaries; a restart on the same directories serves what it left; damage found by a
//! load fails it typed, naming the block, and the next query ends before it; a full disk
//! leaves RAM working; leases hold SSD blocks; owners serve SSD-held blocks to peers; the
//! fault matrix with SSD blocks in the plan leaves every gauge at zero.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_actors::config::ByteSize;
use kvferry_actors::lease::table::LeaseError;
use kvferry_actors::peer::{LocalCluster, Provider};
use kvferry_actors::tier::ssd::error::ReadFailure;
use kvferry_actors::tier::ssd::format::{self, BlockHeader, Damage};
use kvferry_actors::tier::ssd::{SsdConfig, SsdDir, SsdError, SsdStats};
use kvferry_actors::{
    BlockHash, Clock, LoadRequest, Node, NodeConfig, NodeError, QueryRequest, TransferPath,
    TransferReport,
};
use kvferry_gpu::{Device, HostDevice, KvShape};
use kvferry_harness::*;
use kvferry_testkit::{DeviceKv, KvKind};

const SLOT: u64 = 64 << 10;

fn shape() -> KvShape {
    KvShape::new(3, 1, 2, 1024).unwrap()
}

/// A fresh directory under `base`, unique to this process and test.
fn fresh(base: &str, name: &str) -> PathBuf {
    let p = Path::new(base).join(format!("kvferry-ssd-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn ssd_config(pool_slots: u64, dir: &Path, disk_blocks: u64, write_through: bool) -> NodeConfig {
    let mut cfg = config(SLOT, pool_slots);
    cfg.ssd = Some(SsdConfig {
        dir: vec![SsdDir {
            path: dir.to_path_buf(),
            capacity: ByteSize(format::HEADER + disk_blocks * format::slot_stride(SLOT)),
        }],
        queue_depth: 8,
        write_through,
        direct_io: true,
        ..Default::default()
    });
    cfg
}

fn start(cfg: NodeConfig) -> (Node, Arc<dyn Device>) {
    start_clocked(cfg, Clock::system())
}

fn start_clocked(cfg: NodeConfig, clock: Clock) -> (Node, Arc<dyn Device>) {
    let dev: Arc<dyn Device> = HostDevice::new(0);
    let node = Node::start_with(cfg, vec![Arc::clone(&dev)], clock).unwrap();
    (node, dev)
}

async fn ssd(node: &Node) -> SsdStats {
    node.ssd_stats().await.unwrap().expect("an SSD tier")
}

async fn query(node: &Node, ids: std::ops::Range<u64>) -> kvferry_actors::QueryResponse {
    query_hashes(node, hashes(ids), false).await
}

async fn query_hashes(
    node: &Node,
    hashes: Vec<BlockHash>,
    direct_gpu: bool,
) -> kvferry_actors::QueryResponse {
    node.query(QueryRequest {
        instance: id("eng"),
        hashes,
        direct_gpu,
        tenant: None,
    })
    .await
    .unwrap()
}

async fn load(
    node: &Node,
    q: &kvferry_actors::QueryResponse,
    rank: u32,
    dest: &[u32],
) -> Result<TransferReport, NodeError> {
    node.load(LoadRequest {
        lease: q.lease.expect("a lease"),
        instance: id("eng"),
        rank,
        dest_blocks: dest.to_vec(),
        per_layer: false,
    })
    .await
}

/// Waits (briefly) until nothing is held on the SSD tier: no lease holds, no staging slots,
/// no disk slot busy (reads, writes); also the node's own leak gauges ([`settled`]).
async fn ssd_settled(node: &Node) -> SsdStats {
    settled(node).await;
    node.ssd_sync().await.unwrap();
    for _ in 0..200 {
        let s = ssd(node).await;
        if s.held_blocks == 0 && s.staging_slots == 0 && s.busy_slots == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = ssd(node).await;
    panic!("the SSD tier still holds something: {s:?}");
}

/// Flips one byte of block `hash`'s bytes in the block file, behind the node's back.
fn corrupt(dir: &Path, hash: u64, at: u64) {
    use std::os::unix::fs::FileExt;
    let at = slot_of(dir, hash) + format::HEADER + at;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(format::FILE_NAME))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 1], at).unwrap();
    f.sync_all().unwrap();
}

/// A node whose blocks `0..n` are all on disk and none in RAM (written through, then a
/// restart), with instance `eng` rank 0 registered over 128 device blocks.
async fn all_on_disk(
    dir: &Path,
    pool_slots: u64,
    n: u64,
    clock: Clock,
) -> (Node, Arc<dyn Device>, kvferry_testkit::DeviceKv) {
    let (node, dev) = start(ssd_config(pool_slots.max(n), dir, 2 * n + 8, true));
    let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
    for first in (0..n).step_by(16) {
        put(&node, "eng", &shape(), 0, first..(first + 16).min(n)).await;
    }
    node.ssd_sync().await.unwrap();
    assert_eq!(ssd(&node).await.blocks, n as usize);
    node.shutdown();
    drop(node);
    let (node, dev) = start_clocked(ssd_config(pool_slots, dir, 2 * n + 8, true), clock);
    assert_eq!(ssd(&node).await.recovered, n as usize);
    let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 128, 128).await;
    (node, dev, kv)
}

/// Loads a lease's `n` blocks into device blocks `0..n` and checks them against pattern
/// blocks `first..first + n`, and every other byte for canaries.
async fn load_and_verify(
    node: &Node,
    kv: &DeviceKv,
    q: &kvferry_actors::QueryResponse,
    first: u64,
) {
    let n = q.hit_blocks() as u32;
    kv.reset().unwrap();
    node.load(LoadRequest {
        lease: q.lease.expect("a lease"),
        instance: id("eng"),
        rank: 0,
        dest_blocks: (0..n).collect(),
        per_layer: false,
    })
    .await
    .unwrap();
    let want: Vec<(u32, u64)> = (0..n).map(|i| (i, first + i as u64)).collect();
    kv.verify(&want, 0).unwrap();
}

/// Where block `hash` sits in a directory's block file (the test's own scan of the format).
fn slot_of(dir: &Path, hash: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(dir.join(format::FILE_NAME)).unwrap();
    let stride = format::slot_stride(SLOT);
    let mut buf = vec![0u8; format::HEADER as usize];
    for slot in 0.. {
        let at = format::slot_offset(slot, stride);
        f.read_exact_at(&mut buf, at)
            .expect("block not found in the file");
        if let Ok(h) = BlockHeader::decode(&buf) {
            if h.key.hash == BlockHash::from_u64(hash) {
                return at;
            }
        }
    }
    unreachable!()
}

#[test]
fn restart_serves_what_was_written_through() {
    let dir = fresh("/tmp", "restart");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(32, &dir, 64, true));
        let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &shape(), 0, 0..12).await;
        node.ssd_sync().await.unwrap();
        assert_eq!(ssd(&node).await.writes, 12);
        // A stop (what SIGTERM does in `kvferry node`) and a new process on the same disk.
        node.shutdown();
        drop(node);

        let t0 = Instant::now();
        let (node, dev) = start(ssd_config(32, &dir, 64, true));
        let s = ssd(&node).await;
        assert_eq!((s.recovered, s.blocks), (12, 12));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        let q = query(&node, 0..16).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (12, 0));
        // The answer says where they came from: all 12 from the SSD tier, 4 missed. The
        // query holds them on disk and reads nothing; the load reads them.
        assert_eq!(q.ssd_blocks, 12);
        let s = ssd(&node).await;
        assert_eq!((s.hits_ram, s.hits_ssd, s.reads), (0, 12, 0));
        assert_eq!(s.held_blocks, 12);
        load_and_verify(&node, &kv, &q, 0).await;
        eprintln!("restart to bytes loaded: {:?}", t0.elapsed());
        let s = ssd(&node).await;
        assert_eq!((s.reads, s.held_blocks, s.staging_slots), (12, 0, 0));
        // Read into staging slots, not promoted: the next query holds them on disk again.
        let q = query(&node, 0..12).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (12, 12));
        assert_eq!(node.stats().await.unwrap().blocks, 0, "nothing entered RAM");
        // By tier, over both queries: ram + ssd + remote + miss = 16 + 12 hashes.
        let m = node.metrics_text().await.unwrap();
        for (tier, n) in [("ram", 0), ("ssd", 24), ("remote", 0), ("miss", 4)] {
            let line = format!("kvferry_query_blocks_total{{tier=\"{tier}\"}} {n}\n");
            assert!(m.contains(&line), "{line} not in the scrape:\n{m}");
        }
        // The second query's lease holds its 12 blocks on disk; no load borrows slots now.
        for line in [
            "kvferry_ssd_held_blocks 12\n",
            "kvferry_ssd_staging_slots 0\n",
        ] {
            assert!(m.contains(line), "{line} not in the scrape:\n{m}");
        }
        node.release(q.lease.unwrap()).await.unwrap();
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Without write-through, a stop writes what RAM holds: the restart finds all of it.
#[test]
fn a_stop_writes_ram_to_disk_and_the_restart_finds_it() {
    let dir = fresh("/tmp", "stop");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(8, &dir, 64, false));
        let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        // 0..4 evicted to disk while running, 4..12 in RAM at the stop.
        put(&node, "eng", &shape(), 0, 0..12).await;
        node.ssd_sync().await.unwrap();
        assert_eq!(ssd(&node).await.blocks, 4);
        node.shutdown();
        drop(node);
        let (node, dev) = start(ssd_config(8, &dir, 64, false));
        assert_eq!(ssd(&node).await.recovered, 12);
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        let q = query(&node, 4..10).await;
        assert_eq!(q.local_blocks, 6);
        load_and_verify(&node, &kv, &q, 4).await;
        settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Write-behind: only what RAM evicts goes to disk; the prefix continues from RAM into SSD.
#[test]
fn evicted_blocks_come_back_from_ssd_after_the_ram_prefix() {
    let dir = fresh("/tmp", "behind");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(16, &dir, 64, false));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        // 0..16 fill RAM; 16..20 evict 0..3 to disk (write-behind).
        put(&node, "eng", &shape(), 0, 0..20).await;
        node.ssd_sync().await.unwrap();
        let s = ssd(&node).await;
        assert_eq!((s.writes, s.blocks), (4, 4));
        // The prompt's first 4 blocks are on disk, the next 12 in RAM: 4 SSD blocks before
        // the RAM ones in the prefix, each loaded into its own position.
        let q = query(&node, 0..16).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (16, 4));
        let s = ssd(&node).await;
        assert_eq!((s.hits_ssd, s.hits_ram, s.reads), (4, 12, 0), "{s:?}");
        load_and_verify(&node, &kv, &q, 0).await;
        assert_eq!(ssd(&node).await.reads, 4);
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Lookup on a node without peers answers for RAM and SSD alike: blocks evicted to disk are
/// still this node's (a query finds them), so a router asking must hear of them too.
#[test]
fn lookup_counts_the_blocks_on_ssd_as_well_as_those_in_ram() {
    let dir = fresh("/tmp", "lookup");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(16, &dir, 64, false));
        let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &shape(), 0, 0..20).await;
        node.ssd_sync().await.unwrap();
        assert_eq!(ssd(&node).await.blocks, 4, "0..3 on disk only");
        let q = query(&node, 0..20).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (20, 4));
        let ns = q.namespace.clone();
        node.release(q.lease.unwrap()).await.unwrap();
        let me = node.config().node_id.clone();
        assert_eq!(
            node.lookup(&ns, &hashes(0..24)).await.unwrap(),
            vec![(me.clone(), 20)]
        );
        assert_eq!(
            node.lookup(&ns, &hashes(2..6)).await.unwrap(),
            vec![(me, 4)]
        );
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A flipped bit found by the load: the load fails naming the block (the engine recomputes
/// it), nothing is written into its destination, the block leaves the tier, and the next
/// query ends before it.
#[test]
fn a_corrupted_byte_fails_the_load_naming_the_block_never_wrong_bytes() {
    let dir = fresh("/tmp", "corrupt");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(32, &dir, 64, true));
        let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &shape(), 0, 0..4).await;
        node.ssd_sync().await.unwrap();
        node.shutdown();
        drop(node);
        // One flipped bit in block 2's bytes, behind the node's back.
        corrupt(&dir, 2, 777);
        let (node, dev) = start(ssd_config(32, &dir, 64, true));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        // The header is intact: the restart's scan and the query find the block.
        let q = query(&node, 0..4).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (4, 4));
        kv.reset().unwrap();
        let e = load(&node, &q, 0, &[0, 1, 2, 3]).await.unwrap_err();
        assert_unreadable(&e, &[(2, ReadFailure::Damaged(Damage::Checksum))]);
        // Two chunks of two (one reads while the other copies): the first landed, the
        // second, with the damaged block, was not copied at all.
        kv.verify(&expected(&[0, 1], 0), 0).unwrap();
        let s = ssd_settled(&node).await;
        assert_eq!(s.damaged, [0, 0, 1], "{s:?}");
        assert_eq!(s.blocks, 3, "the damaged block left the tier");
        let q = query(&node, 0..4).await;
        assert_eq!(q.local_blocks, 2, "the prefix ends at the damaged block");
        load_and_verify(&node, &kv, &q, 0).await;
        // Block 3 is intact on disk and still served after block 2 is put again.
        put(&node, "eng", &shape(), 0, 2..3).await;
        let q = query(&node, 0..4).await;
        assert_eq!(q.local_blocks, 4);
        load_and_verify(&node, &kv, &q, 0).await;
        let m = node.metrics_text().await.unwrap();
        assert!(
            m.contains("kvferry_ssd_damaged_blocks_total{damage=\"checksum\"} 1\n"),
            "{m}"
        );
        assert!(m.contains("kvferry_ssd_blocks 4\n"), "{m}");
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn capacity_evicts_the_least_recently_used_on_disk() {
    let dir = fresh("/tmp", "capacity");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(4, &dir, 4, false));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        // One at a time: a disk slot being written is never reused, so a burst larger than
        // the disk would skip writes (counted) instead of evicting.
        for i in 0..12 {
            put(&node, "eng", &shape(), 0, i..i + 1).await;
            node.ssd_sync().await.unwrap();
        }
        let s = ssd(&node).await;
        // RAM evicted 0..7; the disk holds the last 4 of them.
        assert_eq!((s.writes, s.blocks, s.evictions), (8, 4, 4), "{s:?}");
        assert_eq!(
            query(&node, 0..12).await.local_blocks,
            0,
            "block 0 left both tiers"
        );
        let q = query(&node, 4..8).await;
        assert_eq!(q.local_blocks, 4);
        load_and_verify(&node, &kv, &q, 4).await;
        settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A lease holds its SSD blocks on disk: a storm of writes through a small disk evicts
/// everything else there, never them.
#[test]
fn a_lease_holds_ssd_blocks_across_an_eviction_storm() {
    let dir = fresh("/tmp", "storm");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(8, &dir, 24, false));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &shape(), 0, 0..16).await;
        node.ssd_sync().await.unwrap();
        let q = query(&node, 0..4).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (4, 4));
        let s = ssd(&node).await;
        assert_eq!((s.hits_ssd, s.held_blocks), (4, 4));
        // The storm: 100 more blocks through an 8-slot pool onto a 24-slot disk.
        for first in (100..200).step_by(10) {
            put(&node, "eng", &shape(), 0, first..first + 10).await;
            node.ssd_sync().await.unwrap();
        }
        let s = ssd(&node).await;
        assert!(s.writes >= 100 && s.evictions >= 80, "{s:?}");
        assert_eq!(
            node.stats().await.unwrap().pinned_blocks,
            0,
            "nothing in RAM"
        );
        load_and_verify(&node, &kv, &q, 0).await;
        ssd_settled(&node).await;
        // Released, they are evicted like any other block.
        for first in (200..240).step_by(10) {
            put(&node, "eng", &shape(), 0, first..first + 10).await;
            node.ssd_sync().await.unwrap();
        }
        assert_eq!(query(&node, 0..4).await.local_blocks, 0);
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A 256 KiB tmpfs under a tier configured for 64 blocks: the disk fills, puts and loads from
/// RAM go on, and what reached the disk still comes back.
#[test]
fn a_full_disk_leaves_ram_working() {
    let dir = fresh("/tmp", "full");
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs"])
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("cannot mount a tmpfs here (not root?): disk full at node level not exercised");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let out = std::panic::catch_unwind(|| {
        rt().block_on(async {
            let (node, dev) = start(ssd_config(8, &dir, 64, false));
            let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
            // A 6 KiB block is written as 12 KiB (its header and 4 KiB padding): about 20
            // fit in 256 KiB.
            for first in (0..64).step_by(8) {
                put(&node, "eng", &shape(), 0, first..first + 8).await;
            }
            node.ssd_sync().await.unwrap();
            let s = ssd(&node).await;
            assert!(s.disk_full >= 1, "{s:?}");
            assert!(s.blocks > 0 && s.blocks < 56, "{s:?}");
            // RAM: the last 8 blocks.
            let q = query(&node, 56..64).await;
            assert_eq!(q.local_blocks, 8);
            load_and_verify(&node, &kv, &q, 56).await;
            settled(&node).await;
            node.shutdown();
        })
    });
    let _ = std::process::Command::new("umount").arg(&dir).status();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(p) = out {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn an_owner_serves_an_ssd_held_block_to_a_peer() {
    let dir = fresh("/tmp", "owner");
    rt().block_on(async {
        let cluster = LocalCluster::new(Provider::Loopback);
        let mut cfg_a = ssd_config(8, &dir, 64, false);
        cfg_a.node_id = "a".into();
        let mut cfg_b = config(SLOT, 32);
        cfg_b.node_id = "b".into();
        let dev_a: Arc<dyn Device> = HostDevice::new(0);
        let dev_b: Arc<dyn Device> = HostDevice::new(0);
        let a = Node::start_in(
            cfg_a,
            vec![Arc::clone(&dev_a)],
            Clock::system(),
            Some(Arc::clone(&cluster)),
        )
        .unwrap();
        let b = Node::start_in(
            cfg_b,
            vec![Arc::clone(&dev_b)],
            Clock::system(),
            Some(Arc::clone(&cluster)),
        )
        .unwrap();
        let _kv_a = register(&a, &dev_a, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        let kv_b = register(&b, &dev_b, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        // A holds 0..16: 0..7 only on its disk, 8..15 in RAM.
        put(&a, "eng", &shape(), 0, 0..16).await;
        a.ssd_sync().await.unwrap();
        assert_eq!(ssd(&a).await.blocks, 8);
        let q = query(&b, 0..6).await;
        assert_eq!(
            (q.local_blocks, q.remote_blocks),
            (0, 6),
            "still advertised by A"
        );
        assert_eq!(ssd(&a).await.reads, 6, "A promoted them to serve them");
        load_and_verify(&b, &kv_b, &q, 0).await;
        settled(&b).await;
        settled_with_peers(&a).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The target: a node that left 10,000 blocks on disk serves every one of them
/// again within 5 s of starting.
#[test]
fn ten_thousand_blocks_serve_again_within_five_seconds() {
    const N: u64 = 10_000;
    const SMALL: u64 = 8 << 10;
    let dir = fresh("/tmp", "10k");
    let cfg = |dir: &Path| {
        let mut cfg = config(SMALL, N);
        cfg.ssd = Some(SsdConfig {
            dir: vec![SsdDir {
                path: dir.to_path_buf(),
                capacity: ByteSize(format::HEADER + N * format::slot_stride(SMALL)),
            }],
            queue_depth: 32,
            write_through: true,
            direct_io: true,
            ..Default::default()
        });
        cfg
    };
    rt().block_on(async {
        let (node, dev) = start(cfg(&dir));
        let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        for first in (0..N).step_by(1000) {
            put(&node, "eng", &shape(), 0, first..first + 1000).await;
        }
        node.ssd_sync().await.unwrap();
        assert_eq!(ssd(&node).await.blocks, N as usize);
        node.shutdown();
        drop(node);

        let t0 = Instant::now();
        let (node, dev) = start(cfg(&dir));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        let q = query(&node, 0..N).await;
        let took = t0.elapsed();
        assert_eq!(
            (q.local_blocks, q.ssd_blocks),
            (N as usize, N as usize),
            "every block findable"
        );
        eprintln!("10,000 blocks: start, scan and a query holding all of them in {took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        node.release(q.lease.unwrap()).await.unwrap();
        // And the bytes are right: load a sample.
        let q = query(&node, 5000..5016).await;
        load_and_verify(&node, &kv, &q, 5000).await;
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The checked-in sample: two directories, write-behind, O_DIRECT.
#[test]
fn the_sample_config_has_an_ssd_section() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/ssd.toml");
    let cfg = NodeConfig::load(path).unwrap();
    let ssd = cfg.ssd.expect("[ssd]");
    assert_eq!(ssd.dir.len(), 2);
    assert_eq!(ssd.dir[0].capacity, ByteSize(64 << 30));
    assert_eq!(ssd.queue_depth, 32);
    assert!(!ssd.write_through && ssd.direct_io);
    assert_eq!(ssd.write_backlog, Some(ByteSize(128 << 20)));
    assert_eq!(
        ssd.backlog_bytes(cfg.pool.size.0, cfg.pool.slot_bytes.0),
        128 << 20
    );
    // What the sample says: the default is two disks' full queues of 2 MiB blocks here.
    let default = SsdConfig {
        write_backlog: None,
        ..ssd.clone()
    };
    let stride = format::slot_stride(cfg.pool.slot_bytes.0);
    assert_eq!(
        default.backlog_bytes(cfg.pool.size.0, cfg.pool.slot_bytes.0),
        64 * stride
    );
    // A typo in a key is refused, naming it.
    let text = std::fs::read_to_string(path)
        .unwrap()
        .replace("queue-depth", "queue-dept");
    let e = NodeConfig::from_toml(&text, "ssd.toml").unwrap_err();
    assert!(e.to_string().contains("queue-dept"), "{e}");
}

/// A warm restart publishes what the disk holds: a peer finds the blocks on the restarted
/// owner and reads them.
#[test]
fn a_restarted_owner_publishes_its_disk_and_serves_peers() {
    let dir = fresh("/tmp", "republish");
    rt().block_on(async {
        let cluster = LocalCluster::new(Provider::Loopback);
        let start_in = |cfg: NodeConfig| {
            let dev: Arc<dyn Device> = HostDevice::new(0);
            let node = Node::start_in(
                cfg,
                vec![Arc::clone(&dev)],
                Clock::system(),
                Some(Arc::clone(&cluster)),
            )
            .unwrap();
            (node, dev)
        };
        let owner_cfg = || {
            let mut c = ssd_config(8, &dir, 64, true);
            c.node_id = "a".into();
            c
        };
        let (a, dev_a) = start_in(owner_cfg());
        let _kv_a = register(&a, &dev_a, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        put(&a, "eng", &shape(), 0, 0..6).await;
        a.ssd_sync().await.unwrap();
        a.shutdown();
        drop(a);

        let mut cfg_b = config(SLOT, 32);
        cfg_b.node_id = "b".into();
        let (b, dev_b) = start_in(cfg_b);
        let kv_b = register(&b, &dev_b, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        assert_eq!(query(&b, 0..6).await.hit_blocks(), 0, "A is gone");

        let (a, _dev_a) = start_in(owner_cfg());
        let mut q = query(&b, 0..6).await;
        for _ in 0..200 {
            if q.remote_blocks == 6 {
                break;
            }
            // The directory takes A's announcement asynchronously.
            if let Some(l) = q.lease {
                b.release(l).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            q = query(&b, 0..6).await;
        }
        assert_eq!((q.local_blocks, q.remote_blocks), (0, 6));
        load_and_verify(&b, &kv_b, &q, 0).await;
        settled(&b).await;
        for _ in 0..200 {
            if a.peer_pins().await.unwrap() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(a.peer_pins().await.unwrap(), 0);
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Block `first + i` in device block `dest[i]`, as [`kvferry_testkit::DeviceKv::verify`]
/// takes it.
fn expected(dest: &[u32], first: u64) -> Vec<(u32, u64)> {
    dest.iter().zip(first..).map(|(&d, b)| (d, b)).collect()
}

/// `e` is the typed SSD error of a load naming exactly `want` (pattern block, failure).
fn assert_unreadable(e: &NodeError, want: &[(u64, ReadFailure)]) {
    let NodeError::Ssd(SsdError::Unreadable { blocks, .. }) = e else {
        panic!("not an SSD read failure: {e:?}");
    };
    let want: Vec<(BlockHash, ReadFailure)> = want
        .iter()
        .map(|&(b, f)| (BlockHash::from_u64(b), f))
        .collect();
    assert_eq!(blocks, &want, "{e}");
    assert!(e.to_string().contains("could not be read intact"), "{e}");
}

/// One load whose plan has all three parts: SSD blocks (evicted by RAM, the prompt's first),
/// RAM blocks, and a remote suffix from another node, staged and direct (the SSD part is
/// local either way); bytes and canaries checked, the parts ran at once, and every gauge on
/// both nodes returns to zero.
#[test]
fn a_load_of_ssd_ram_and_remote_blocks_lands_every_byte() {
    for direct in [false, true] {
        three_tiers(direct);
    }
}

fn three_tiers(direct: bool) {
    let dir = fresh("/tmp", &format!("three-tiers-{direct}"));
    rt().block_on(async {
        let cluster = LocalCluster::new(Provider::Loopback);
        let mut cfg_a = config(SLOT, 16);
        cfg_a.node_id = "a".into();
        let mut cfg_b = ssd_config(16, &dir, 64, false);
        cfg_b.node_id = "b".into();
        let start_in = |cfg| {
            let dev: Arc<dyn Device> = HostDevice::new(0);
            let n = Node::start_in(
                cfg,
                vec![Arc::clone(&dev)],
                Clock::system(),
                Some(Arc::clone(&cluster)),
            )
            .unwrap();
            (n, dev)
        };
        let (a, dev_a) = start_in(cfg_a);
        let (b, dev_b) = start_in(cfg_b);
        let _kv_a = register(&a, &dev_a, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        let kv = register(&b, &dev_b, "eng", shape(), 0, KvKind::Split, 64, 128).await;
        // B: 0..3 evicted to its disk, 4..19 in RAM. A: 100..105.
        put(&b, "eng", &shape(), 0, 0..20).await;
        b.ssd_sync().await.unwrap();
        put(&a, "eng", &shape(), 0, 100..105).await;
        let mut ids: Vec<u64> = (0..8).collect();
        ids.extend(100..105);
        let hashes = ids.iter().map(|&i| BlockHash::from_u64(i)).collect();
        let q = query_hashes(&b, hashes, direct).await;
        assert_eq!(
            (q.local_blocks, q.ssd_blocks, q.remote_blocks),
            (8, 4, 5),
            "{q:?}"
        );
        assert_eq!(q.direct.is_granted(), direct, "{q:?}");
        kv.reset().unwrap();
        // Scattered destinations, not in block order.
        let dest: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 64).collect();
        let r = load(&b, &q, 0, &dest).await.unwrap();
        let want: Vec<(u32, u64)> = dest.iter().copied().zip(ids.iter().copied()).collect();
        kv.verify(&want, 0).unwrap();
        assert_eq!(r.blocks, 13);
        assert_eq!(r.bytes, 13 * shape().rank_bytes());
        let path = if direct {
            TransferPath::Direct
        } else {
            TransferPath::Staged
        };
        assert_eq!(r.path, path);
        let (ssd_part, remote) = (r.span("ssd").unwrap(), r.span("remote").unwrap());
        assert!(
            ssd_part.start < remote.end && remote.start < ssd_part.end,
            "the SSD part and the remote suffix did not overlap: {:?}",
            r.spans
        );
        assert!(r.stage("disk").is_some(), "{:?}", r.stages);
        let s = ssd_settled(&b).await;
        assert_eq!((s.reads, s.hits_ssd, s.hits_ram), (4, 4, 4));
        settled(&b).await;
        settled_with_peers(&a).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The pipeline: 48 SSD blocks through a ring of 32 staging slots in chunks of 8. The disk
/// read of the second chunk starts before the copy of the first ends, and a slot is read
/// into again only after the copy out of it is done.
#[test]
fn ssd_reads_of_later_chunks_overlap_the_copies_of_earlier_ones() {
    let dir = fresh("/tmp", "pipeline");
    rt().block_on(async {
        let (node, _dev, kv) = all_on_disk(&dir, 40, 48, Clock::system()).await;
        let q = query(&node, 0..48).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (48, 48));
        kv.reset().unwrap();
        let dest: Vec<u32> = (0..48).map(|i| 127 - i).collect();
        let r = load(&node, &q, 0, &dest).await.unwrap();
        kv.verify(&expected(&dest, 0), 0).unwrap();
        let reads: Vec<_> = r.spans.iter().filter(|s| s.name == "ssd_read").collect();
        let copies: Vec<_> = r.spans.iter().filter(|s| s.name == "ssd_h2d").collect();
        assert_eq!((reads.len(), copies.len()), (6, 6), "{:?}", r.spans);
        assert!(
            reads[1].start < copies[0].end,
            "chunk 2's read waited for chunk 1's copy: {:?}",
            r.spans
        );
        // The ring holds 4 chunks: chunk 5 reuses chunk 1's slots once their copy is done.
        assert!(reads[4].start >= copies[0].end, "{:?}", r.spans);
        let s = ssd_settled(&node).await;
        assert_eq!(s.reads, 48);
        assert_eq!(
            node.stats().await.unwrap().blocks,
            0,
            "staging slots went back"
        );
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A node with blocks 0..4 in RAM and 4..8 on disk only (after the RAM ones in the
/// prefix), and the query of 0..8 (4 RAM + 4 SSD blocks, one chunk).
async fn ram_then_disk(dir: &Path, clock: Clock) -> (Node, kvferry_testkit::DeviceKv) {
    let (node, _dev, kv) = all_on_disk(dir, 16, 8, clock).await;
    put(&node, "eng", &shape(), 0, 0..4).await;
    (node, kv)
}

/// After a fault: the gauges are back to zero and a new query and load of the same blocks
/// (what the engine does next) lands every byte.
async fn next_load_works(node: &Node, kv: &kvferry_testkit::DeviceKv, n: u64) {
    ssd_settled(node).await;
    let q = query(node, 0..n).await;
    assert_eq!(q.local_blocks, n as usize);
    load_and_verify(node, kv, &q, 0).await;
    ssd_settled(node).await;
}

/// Fault matrix: a block corrupted on disk after the query held it.
#[test]
fn ssd_fault_block_corrupted_after_the_query() {
    let dir = fresh("/tmp", "fault-corrupt");
    rt().block_on(async {
        let (node, kv) = ram_then_disk(&dir, Clock::system()).await;
        let q = query(&node, 0..8).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (8, 4));
        corrupt(&dir, 6, 100);
        kv.reset().unwrap();
        let dest: Vec<u32> = (0..8).collect();
        let e = load(&node, &q, 0, &dest).await.unwrap_err();
        assert_unreadable(&e, &[(6, ReadFailure::Damaged(Damage::Checksum))]);
        // The RAM part and the first SSD chunk (4, 5) landed; the chunk with the damaged
        // block (6, 7) was not copied at all.
        kv.verify(&expected(&dest[..6], 0), 0).unwrap();
        let s = ssd_settled(&node).await;
        assert_eq!(s.damaged, [0, 0, 1]);
        let stats = settled(&node).await;
        assert_eq!((stats.loads_ok, stats.loads_failed), (0, 1));
        let q = query(&node, 0..8).await;
        assert_eq!(
            q.local_blocks, 6,
            "block 6 left the tier: the prefix ends there"
        );
        node.release(q.lease.unwrap()).await.unwrap();
        put(&node, "eng", &shape(), 0, 6..7).await;
        next_load_works(&node, &kv, 8).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Fault matrix: the block file cut short under the node (a disk that lost its tail): the
/// blocks past the cut fail the load, named, as torn.
#[test]
fn ssd_fault_block_file_truncated_under_the_node() {
    let dir = fresh("/tmp", "fault-truncate");
    rt().block_on(async {
        let (node, kv) = ram_then_disk(&dir, Clock::system()).await;
        let q = query(&node, 0..8).await;
        assert_eq!(q.ssd_blocks, 4);
        // Cut the file just after block 5's header: 5 is torn, and whatever lies past the
        // cut too.
        let cut = slot_of(&dir, 5) + format::HEADER;
        let past: Vec<u64> = (4..8)
            .filter(|&b| slot_of(&dir, b) >= slot_of(&dir, 5))
            .collect();
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(format::FILE_NAME))
            .unwrap()
            .set_len(cut)
            .unwrap();
        kv.reset().unwrap();
        let dest: Vec<u32> = (0..8).collect();
        let e = load(&node, &q, 0, &dest).await.unwrap_err();
        let NodeError::Ssd(SsdError::Unreadable { blocks, .. }) = &e else {
            panic!("{e:?}");
        };
        let named: Vec<BlockHash> = blocks.iter().map(|b| b.0).collect();
        let want: Vec<BlockHash> = past.iter().map(|&b| BlockHash::from_u64(b)).collect();
        assert_eq!(named, want, "{e}");
        kv.verify(&expected(&dest[..4], 0), 0).unwrap();
        let s = ssd_settled(&node).await;
        assert_eq!(s.damaged_total(), past.len() as u64, "{s:?}");
        // Put them again: written anew, the disk serves all of them.
        put(&node, "eng", &shape(), 0, 4..8).await;
        next_load_works(&node, &kv, 8).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Fault matrix: the lease expires while rank 0 loads (TP 2): rank 0's load holds its share
/// and lands every byte; rank 1 finds the lease gone; nothing stays held.
#[test]
fn ssd_fault_lease_expiry_mid_load() {
    let dir = fresh("/tmp", "fault-expiry");
    rt().block_on(async {
        let (clock, hand) = Clock::manual();
        let tp2 = KvShape::new(3, 2, 2, 1024).unwrap();
        let cfg = ssd_config(32, &dir, 64, true);
        let (node, dev) = start_clocked(cfg.clone(), clock.clone());
        let _k0 = register(&node, &dev, "eng", tp2, 0, KvKind::Split, 64, 128).await;
        let _k1 = register(&node, &dev, "eng", tp2, 1, KvKind::Split, 64, 128).await;
        put(&node, "eng", &tp2, 0, 0..12).await;
        put(&node, "eng", &tp2, 1, 0..12).await;
        node.ssd_sync().await.unwrap();
        node.shutdown();
        drop(node);
        let (node, dev) = start_clocked(cfg, clock);
        let k0 = register(&node, &dev, "eng", tp2, 0, KvKind::Split, 64, 128).await;
        let k1 = register(&node, &dev, "eng", tp2, 1, KvKind::Split, 64, 128).await;
        let q = query(&node, 0..12).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (12, 12));
        k0.reset().unwrap();
        k1.reset().unwrap();
        let dest: Vec<u32> = (0..12).map(|i| i * 3).collect();
        let rx = node
            .start_load(LoadRequest {
                lease: q.lease.unwrap(),
                instance: id("eng"),
                rank: 0,
                dest_blocks: dest.clone(),
                per_layer: false,
            })
            .await
            .unwrap();
        hand.advance(Duration::from_secs(601));
        assert_eq!(node.sweep().await.unwrap(), 1);
        rx.await.unwrap().unwrap();
        k0.verify(&expected(&dest, 0), 0).unwrap();
        let e = load(&node, &q, 1, &dest).await.unwrap_err();
        assert!(
            matches!(e, NodeError::Lease(LeaseError::UnknownOrExpired { .. })),
            "{e:?}"
        );
        k1.untouched_outside(&[]).unwrap();
        ssd_settled(&node).await;
        // Both ranks of a new lease load.
        let q = query(&node, 0..12).await;
        for (rank, k) in [(0, &k0), (1, &k1)] {
            k.reset().unwrap();
            load(&node, &q, rank, &dest).await.unwrap();
            k.verify(&expected(&dest, 0), rank).unwrap();
        }
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Fault matrix: the instance unregisters while its load reads SSD blocks: unregister waits
/// for the load, which lands every byte; the holds go; re-registered, the next load works.
#[test]
fn ssd_fault_instance_unregistered_during_the_load() {
    let dir = fresh("/tmp", "fault-unregister");
    rt().block_on(async {
        let (node, dev, kv) = all_on_disk(&dir, 40, 40, Clock::system()).await;
        let q = query(&node, 0..40).await;
        // A second lease, never loaded: the unregister releases it and its holds.
        let other = query(&node, 0..40).await;
        assert_eq!(ssd(&node).await.held_blocks, 80);
        kv.reset().unwrap();
        let dest: Vec<u32> = (0..40).collect();
        let rx = node
            .start_load(LoadRequest {
                lease: q.lease.unwrap(),
                instance: id("eng"),
                rank: 0,
                dest_blocks: dest.clone(),
                per_layer: false,
            })
            .await
            .unwrap();
        node.unregister_instance(id("eng")).await.unwrap();
        assert_eq!(node.stats().await.unwrap().transfers_in_flight, 0);
        rx.await.unwrap().unwrap();
        kv.verify(&expected(&dest, 0), 0).unwrap();
        assert!(load(&node, &other, 0, &dest).await.is_err());
        ssd_settled(&node).await;
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 128, 128).await;
        next_load_works(&node, &kv, 40).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Fault matrix: the lease is released before its load: the holds go at once, the load is
/// refused typed and writes nothing.
#[test]
fn ssd_fault_lease_released_before_the_load() {
    let dir = fresh("/tmp", "fault-release");
    rt().block_on(async {
        let (node, kv) = ram_then_disk(&dir, Clock::system()).await;
        let q = query(&node, 0..8).await;
        assert_eq!(ssd(&node).await.held_blocks, 4);
        node.release(q.lease.unwrap()).await.unwrap();
        assert_eq!(ssd(&node).await.held_blocks, 0);
        kv.reset().unwrap();
        let e = load(&node, &q, 0, &(0..8).collect::<Vec<_>>())
            .await
            .unwrap_err();
        assert!(
            matches!(e, NodeError::Lease(LeaseError::UnknownOrExpired { .. })),
            "{e:?}"
        );
        kv.untouched_outside(&[]).unwrap();
        next_load_works(&node, &kv, 8).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A load observer sees the layers only once the SSD blocks landed too: when it is told
/// every layer has landed, every destination (RAM and SSD blocks) holds its bytes.
#[test]
fn layers_are_reported_once_the_ssd_blocks_landed_too() {
    struct Seen {
        kv: Arc<kvferry_testkit::DeviceKv>,
        want: Vec<(u32, u64)>,
        calls: std::sync::Mutex<Vec<(u32, u32, bool)>>,
    }
    impl kvferry_actors::LoadObserver for Seen {
        fn layers_landed(&self, layers: u32, total: u32) {
            let ok = layers < total || self.kv.verify(&self.want, 0).is_ok();
            self.calls.lock().unwrap().push((layers, total, ok));
        }
    }
    let dir = fresh("/tmp", "observed");
    rt().block_on(async {
        let (node, kv) = ram_then_disk(&dir, Clock::system()).await;
        let kv = Arc::new(kv);
        let q = query(&node, 0..8).await;
        assert_eq!(q.ssd_blocks, 4);
        kv.reset().unwrap();
        let dest: Vec<u32> = (0..8).map(|i| 2 * i + 1).collect();
        let seen = Arc::new(Seen {
            kv: Arc::clone(&kv),
            want: expected(&dest, 0),
            calls: Default::default(),
        });
        let rx = node
            .start_load_observed(
                LoadRequest {
                    lease: q.lease.unwrap(),
                    instance: id("eng"),
                    rank: 0,
                    dest_blocks: dest.clone(),
                    per_layer: false,
                },
                Arc::clone(&seen) as Arc<dyn kvferry_actors::LoadObserver>,
            )
            .await
            .unwrap();
        rx.await.unwrap().unwrap();
        kv.verify(&expected(&dest, 0), 0).unwrap();
        let calls = seen.calls.lock().unwrap().clone();
        assert_eq!(calls.last().map(|c| (c.0, c.1)), Some((3, 3)), "{calls:?}");
        assert!(
            calls.iter().all(|c| c.2),
            "told before every block landed: {calls:?}"
        );
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `RssAnon` of this process (anonymous memory: the pool is a shared mapping, not in it).
fn rss_anon_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A slow disk (one block write per 2 ms) behind an 8-slot pool, 2,000 puts of 56 KiB
/// blocks: the write backlog never holds more than its bound (the tier's own accounting and
/// this process's anonymous memory), the blocks it had no room for are counted, and every
/// block is either served with its bytes (RAM or SSD) or a miss. Run in a process of its
/// own, so that other tests' memory does not blur the measurement.
#[test]
fn a_slow_disk_keeps_the_write_backlog_bounded() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "ssd::slow_disk_backlog_in_its_own_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
    eprintln!(
        "{}",
        text.lines()
            .filter(|l| l.starts_with("backlog:"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
#[ignore = "run in a process of its own by a_slow_disk_keeps_the_write_backlog_bounded: it measures the process's memory"]
fn slow_disk_backlog_in_its_own_process() {
    const N: u64 = 2000;
    let dir = fresh("/tmp", "slow-disk");
    let big = KvShape::new(4, 1, 2, 7 << 10).unwrap();
    let copy = format::HEADER + format::round_up(big.block_bytes());
    let limit = 4 * format::slot_stride(SLOT);
    rt().block_on(async {
        let mut cfg = ssd_config(8, &dir, N + 8, false);
        let c = cfg.ssd.as_mut().unwrap();
        c.write_backlog = Some(ByteSize(limit));
        c.test_write_delay = Some(Duration::from_millis(2));
        let (node, dev) = start(cfg);
        let kv = register(&node, &dev, "eng", big, 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &big, 0, 0..16).await;
        node.ssd_sync().await.unwrap();
        let base = rss_anon_kib();
        let mut peak = base;
        let t0 = Instant::now();
        for first in (16..N).step_by(16) {
            put(&node, "eng", &big, 0, first..(first + 16).min(N)).await;
            peak = peak.max(rss_anon_kib());
            let s = ssd(&node).await;
            assert!(s.write_backlog_bytes <= limit, "{s:?}");
        }
        let put_s = t0.elapsed().as_secs_f64();
        let s = ssd(&node).await;
        assert!(s.write_backlog_peak_bytes <= limit, "{s:?}");
        assert!(
            s.write_backlog_peak_bytes >= limit - copy,
            "the disk was slow enough to fill it: {s:?}"
        );
        node.ssd_sync().await.unwrap();
        let s = ssd(&node).await;
        assert_eq!(s.write_backlog_bytes, 0, "{s:?}");
        assert!(s.writes_skipped_backlog > 0, "{s:?}");
        // Every block RAM evicted was written or counted as skipped: nothing else is lost.
        let in_ram = node.stats().await.unwrap().blocks as u64;
        assert_eq!(
            s.writes + s.writes_skipped_backlog + s.writes_skipped,
            N - in_ram,
            "{s:?}"
        );
        let m = node.metrics_text().await.unwrap();
        for line in [
            format!(
                "kvferry_ssd_writes_skipped_total{{reason=\"backlog\"}} {}\n",
                s.writes_skipped_backlog
            ),
            "kvferry_ssd_writes_skipped_total{reason=\"busy\"} 0\n".into(),
            format!("kvferry_ssd_write_backlog_limit_bytes {limit}\n"),
            "kvferry_ssd_write_backlog_bytes 0\n".into(),
        ] {
            assert!(m.contains(&line), "{line} not in the scrape:\n{m}");
        }
        // Each block alone: served with its own bytes, or a miss (never wrong bytes).
        let mut hits = 0u64;
        for i in 0..N {
            let q = query(&node, i..i + 1).await;
            if q.hit_blocks() == 1 {
                load_and_verify(&node, &kv, &q, i).await;
                hits += 1;
            } else {
                assert!(q.lease.is_none(), "{q:?}");
            }
        }
        assert_eq!(hits, s.blocks as u64 + in_ram, "{s:?}");
        let grew = peak.saturating_sub(base);
        println!(
            "backlog: {N} puts of {} KiB in {put_s:.2} s, bound {} KiB, peak {} KiB; \
             written {}, skipped {}; RssAnon grew {grew} KiB",
            big.block_bytes() >> 10,
            limit >> 10,
            s.write_backlog_peak_bytes >> 10,
            s.writes,
            s.writes_skipped_backlog
        );
        // Unbounded, the copies queued for the slow disk alone were ~100 MiB.
        assert!(grew < 32 << 10, "anonymous memory grew {grew} KiB");
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Write-through on a disk that fills up (a 1 MiB tmpfs configured for far more): the put
/// whose block met ENOSPC is answered with an error naming it, not acknowledged; the block
/// stays in RAM and is served; later puts reuse the written slots and are acknowledged.
#[test]
fn write_through_does_not_acknowledge_a_block_the_full_disk_refused() {
    let dir = fresh("/tmp", "wt-full");
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs"])
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("cannot mount a tmpfs here (not root?): disk full is not exercised");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let out = std::panic::catch_unwind(|| {
        rt().block_on(async {
            let (node, dev) = start(ssd_config(160, &dir, 400, true));
            let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
            let mut refused = Vec::new();
            for i in 0..150u64 {
                let r =
                    kvferry_harness::put_pattern(&node, &id("eng"), &shape(), 0, i..i + 1).await;
                if let Err(e) = r {
                    assert!(
                        matches!(
                            &e,
                            NodeError::NotDurable {
                                failed: 1,
                                blocks: 1,
                                source: SsdError::DiskFull { .. }
                            }
                        ),
                        "{e:?}"
                    );
                    assert!(e.to_string().contains("not on disk"), "{e}");
                    refused.push(i);
                }
            }
            assert_eq!(refused.len(), 1, "one write met the full disk: {refused:?}");
            let s = ssd(&node).await;
            assert_eq!((s.disk_full, s.write_errors), (1, 1), "{s:?}");
            // Every block is in RAM, the refused one included, with its bytes.
            let q = query(&node, 0..150).await;
            assert_eq!(q.local_blocks, 150);
            node.release(q.lease.unwrap()).await.unwrap();
            let i = refused[0];
            let q = query(&node, i..i + 1).await;
            load_and_verify(&node, &kv, &q, i).await;
            ssd_settled(&node).await;
        })
    });
    let _ = std::process::Command::new("umount").arg(&dir).status();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(p) = out {
        std::panic::resume_unwind(p);
    }
}

/// Write-through onto a slow disk (one write per 2 ms) with room for two queued copies: the
/// puts and a save wait for room instead of skipping blocks, every one is answered once its
/// blocks are on disk, and the backlog never exceeds its bound.
#[test]
fn write_through_waits_for_backlog_room_instead_of_skipping() {
    let dir = fresh("/tmp", "wt-backlog");
    let limit = 2 * format::slot_stride(SLOT);
    rt().block_on(async {
        let mut cfg = ssd_config(16, &dir, 128, true);
        let c = cfg.ssd.as_mut().unwrap();
        c.write_backlog = Some(ByteSize(limit));
        c.test_write_delay = Some(Duration::from_millis(2));
        let (node, dev) = start(cfg);
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        for first in (0..96).step_by(16) {
            put(&node, "eng", &shape(), 0, first..first + 16).await;
            // Answered: its blocks are on disk already, nothing of it is queued.
            let s = ssd(&node).await;
            assert_eq!(s.writes, first + 16, "{s:?}");
        }
        // A save (device to host) is answered the same way: once its blocks are on disk.
        for b in 0..16u32 {
            kv.write_block(b, 1000 + b as u64, 0).unwrap();
        }
        let r = node
            .save(kvferry_actors::SaveRequest {
                instance: id("eng"),
                rank: 0,
                hashes: hashes(1000..1016),
                src_blocks: (0..16).collect(),
                tenant: None,
            })
            .await
            .unwrap();
        assert_eq!(r.sealed, 16);
        let s = ssd(&node).await;
        assert_eq!(s.writes, 112, "{s:?}");
        assert_eq!(
            (s.writes_skipped_backlog, s.writes_skipped),
            (0, 0),
            "{s:?}"
        );
        assert!(s.write_backlog_peak_bytes <= limit, "{s:?}");
        assert_eq!(s.blocks, 112);
        // RAM holds the last 16; the first 80 come from disk, byte for byte.
        let q = query(&node, 0..16).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (16, 16));
        load_and_verify(&node, &kv, &q, 0).await;
        ssd_settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}
