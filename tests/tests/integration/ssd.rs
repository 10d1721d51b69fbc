//! The SSD tier at node level: blocks evicted from RAM (or written through) come back from
//! disk into RAM on a hit, byte for byte with canaries; a restart on the same directories
//! serves what it left; damage is a miss and a counter; a full disk leaves RAM working;
//! leases pin promoted blocks; owners serve SSD-held blocks to peers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_actors::config::ByteSize;
use kvferry_actors::remote::{LocalCluster, Provider};
use kvferry_actors::ssd::format::{self, BlockHeader};
use kvferry_actors::ssd::{SsdConfig, SsdDir, SsdStats};
use kvferry_actors::{BlockHash, Clock, LoadRequest, Node, NodeConfig, QueryRequest};
use kvferry_gpu::{Device, HostDevice, KvShape};
use kvferry_testkit::harness::*;
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
    });
    cfg
}

fn start(cfg: NodeConfig) -> (Node, Arc<dyn Device>) {
    let dev: Arc<dyn Device> = HostDevice::new(0);
    let node = Node::start_with(cfg, vec![Arc::clone(&dev)], Clock::system()).unwrap();
    (node, dev)
}

async fn ssd(node: &Node) -> SsdStats {
    node.ssd_stats().await.unwrap().expect("an SSD tier")
}

async fn query(node: &Node, ids: std::ops::Range<u64>) -> kvferry_actors::QueryResponse {
    node.query(QueryRequest {
        instance: id("eng"),
        hashes: hashes(ids),
        direct_gpu: false,
    })
    .await
    .unwrap()
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
        // The answer says where they came from: all 12 from the SSD tier, 4 missed.
        assert_eq!(q.ssd_blocks, 12);
        let s = ssd(&node).await;
        assert_eq!((s.hits_ram, s.hits_ssd, s.reads), (0, 12, 12));
        load_and_verify(&node, &kv, &q, 0).await;
        eprintln!("restart to bytes loaded: {:?}", t0.elapsed());
        // Promoted: the next query hits RAM.
        let q = query(&node, 0..12).await;
        assert_eq!((q.local_blocks, q.ssd_blocks), (12, 0));
        assert_eq!(ssd(&node).await.hits_ram, 12);
        // By tier, over both queries: ram + ssd + remote + miss = 16 + 12 hashes.
        let m = node.metrics_text().await.unwrap();
        for (tier, n) in [("ram", 12), ("ssd", 12), ("remote", 0), ("miss", 4)] {
            let line = format!("kvferry_query_blocks_total{{tier=\"{tier}\"}} {n}\n");
            assert!(m.contains(&line), "{line} not in the scrape:\n{m}");
        }
        node.release(q.lease.unwrap()).await.unwrap();
        settled(&node).await;
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
        // The prompt's first 4 blocks are on disk, the next 12 in RAM: the RAM blocks are
        // pinned before the promotions need slots, so only 16..19 make room for them.
        let q = query(&node, 0..16).await;
        assert_eq!(q.local_blocks, 16);
        let s = ssd(&node).await;
        assert_eq!((s.hits_ssd, s.hits_ram, s.reads), (4, 12, 4), "{s:?}");
        load_and_verify(&node, &kv, &q, 0).await;
        settled(&node).await;
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupted_byte_is_a_miss_never_wrong_bytes() {
    let dir = fresh("/tmp", "corrupt");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(32, &dir, 64, true));
        let _kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &shape(), 0, 0..4).await;
        node.ssd_sync().await.unwrap();
        node.shutdown();
        drop(node);
        // One flipped bit in block 2's bytes, behind the node's back.
        {
            use std::os::unix::fs::FileExt;
            let at = slot_of(&dir, 2) + format::HEADER + 777;
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
        let (node, dev) = start(ssd_config(32, &dir, 64, true));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        let q = query(&node, 0..4).await;
        assert_eq!(q.local_blocks, 2, "the prefix ends at the damaged block");
        let s = ssd(&node).await;
        assert_eq!(s.damaged, [0, 0, 1], "{s:?}");
        assert_eq!(s.blocks, 3, "the damaged block left the tier");
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
        settled(&node).await;
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

#[test]
fn a_lease_pins_ssd_blocks_across_an_eviction_storm() {
    let dir = fresh("/tmp", "storm");
    rt().block_on(async {
        let (node, dev) = start(ssd_config(8, &dir, 256, false));
        let kv = register(&node, &dev, "eng", shape(), 0, KvKind::Split, 16, 128).await;
        put(&node, "eng", &shape(), 0, 0..16).await;
        node.ssd_sync().await.unwrap();
        let q = query(&node, 0..4).await;
        assert_eq!(q.local_blocks, 4);
        assert_eq!(ssd(&node).await.hits_ssd, 4);
        // The storm: 100 more blocks through an 8-slot pool (and onto the disk).
        for first in (100..200).step_by(10) {
            put(&node, "eng", &shape(), 0, first..first + 10).await;
        }
        node.ssd_sync().await.unwrap();
        let stats = node.stats().await.unwrap();
        assert_eq!(
            stats.pinned_blocks, 4,
            "the lease's blocks stayed pinned in RAM"
        );
        load_and_verify(&node, &kv, &q, 0).await;
        settled(&node).await;
        assert!(ssd(&node).await.writes >= 100);
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
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
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
        for _ in 0..200 {
            if a.peer_pins().await.unwrap() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(a.peer_pins().await.unwrap(), 0);
        settled(&a).await;
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
        assert_eq!(q.local_blocks, N as usize, "every block findable");
        eprintln!("10,000 blocks: start, scan, query and promotion of all in {took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        node.release(q.lease.unwrap()).await.unwrap();
        // And the bytes are right: load a sample.
        let q = query(&node, 5000..5016).await;
        load_and_verify(&node, &kv, &q, 5000).await;
        settled(&node).await;
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
