//! A node's KV events against what it holds: the event log, the directory (and so Lookup)
//! and RAM tell the same story, also when a put is larger than RAM.

use std::collections::BTreeSet;
use std::sync::Arc;

use kvferry_actors::events::{EventKind, EventsConfig, Medium, NodeEvent};
use kvferry_actors::peer::{LocalCluster, Provider};
use kvferry_actors::{BlockHash, Namespace, Node, PutBlocks};
use kvferry_gpu::KvShape;
use kvferry_harness::*;
use kvferry_testkit::{DeviceKv, KvKind};

fn shape() -> KvShape {
    KvShape::new(2, 1, 2, 1024).unwrap()
}

/// A config whose node keeps an event log (published nowhere) in RAM of `slots` blocks.
fn events_config(node_id: &str, slots: u64) -> kvferry_actors::NodeConfig {
    let mut cfg = config(shape().block_bytes(), slots);
    cfg.node_id = node_id.into();
    cfg.events = Some(EventsConfig {
        publish: String::new(),
        ..Default::default()
    });
    cfg
}

fn put_blocks(instance: &str, ids: std::ops::Range<u64>) -> PutBlocks {
    PutBlocks {
        instance: id(instance),
        rank: 0,
        blocks: ids
            .map(|i| {
                (
                    BlockHash::from_u64(i),
                    kvferry_testkit::rank_part(&shape(), i, 0),
                )
            })
            .collect(),
    }
}

fn all_events(node: &Node) -> Vec<NodeEvent> {
    node.events()
        .expect("[events] is configured")
        .since(0, None, usize::MAX)
        .events
}

/// What the events say `medium` holds now: stored, minus removed since, in order (a clear
/// empties every medium).
fn held_per_events(events: &[NodeEvent], ns: &Namespace, medium: Medium) -> BTreeSet<BlockHash> {
    let mut held = BTreeSet::new();
    for e in events {
        match e.kind {
            EventKind::AllCleared => held.clear(),
            _ if e.medium != medium || e.namespace.as_ref() != Some(ns) => {}
            EventKind::Stored => held.extend(e.hashes.iter().copied()),
            EventKind::Removed => {
                for h in &e.hashes {
                    held.remove(h);
                }
            }
        }
    }
    held
}

/// A put of 12 blocks into 8 slots: the first 8 are stored and advertised, the last 4 are
/// reported not stored. Before, the put evicted its own first 4 blocks to make room for its
/// last 4 and then advertised all 12: Lookup answered 12 blocks that a query found none of
/// (the prefix was gone), and the events said the same.
#[test]
fn a_put_larger_than_ram_advertises_what_ram_holds() {
    rt().block_on(async {
        let c = Cluster::of(
            LocalCluster::new(Provider::Tcp),
            vec![events_config("solo", 8)],
        );
        let node = c.node(0);
        let kv = DeviceKv::alloc(
            Arc::clone(c.dev(0)),
            shape(),
            KvKind::Split,
            16,
            shape().segment_bytes(),
            0,
        )
        .unwrap();
        kv.register(node, "eng", "m", 0).await.unwrap();
        let r = node.put_blocks(put_blocks("eng", 0..12)).await.unwrap();
        assert_eq!((r.written, r.sealed, r.not_stored), (8, 8, 4));
        let q = query(node, "eng", 0..12, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (8, 0));
        let ns = q.namespace.clone();
        node.release(q.lease.unwrap()).await.unwrap();
        // The directory, through Lookup, says what RAM holds.
        assert_eq!(
            node.lookup(&ns, &hashes(0..12)).await.unwrap(),
            vec![("solo".to_owned(), 8)]
        );
        // And so do the events: the first 8 stored in RAM, none of them removed.
        let events = all_events(node);
        let held: BTreeSet<BlockHash> = hashes(0..8).into_iter().collect();
        assert_eq!(held_per_events(&events, &ns, Medium::Ram), held);
        assert!(
            events.iter().all(|e| e.kind != EventKind::Removed),
            "nothing left RAM: {events:?}"
        );
        assert_eq!(events[0].kind, EventKind::AllCleared, "the node's start");
        // The next put makes room from the oldest blocks, and all three agree again.
        let r = node.put_blocks(put_blocks("eng", 20..22)).await.unwrap();
        assert_eq!((r.written, r.not_stored), (2, 0));
        let events = all_events(node);
        let held: BTreeSet<BlockHash> = hashes(2..8).into_iter().chain(hashes(20..22)).collect();
        assert_eq!(held_per_events(&events, &ns, Medium::Ram), held);
        assert_eq!(node.lookup(&ns, &hashes(0..8)).await.unwrap(), vec![]);
        assert_eq!(
            node.lookup(&ns, &hashes(2..8)).await.unwrap(),
            vec![("solo".to_owned(), 6)]
        );
        let s = settled(node).await;
        assert_eq!((s.blocks, s.pinned_blocks, s.pins), (8, 0, 0));
    });
}

/// A node says first that it holds nothing (sequence 0, `AllBlocksCleared`, of no
/// namespace), so a router that kept a view of its earlier run drops it; a warm restart
/// then announces what it found on disk, after the clear.
#[test]
fn a_started_node_clears_first_then_announces_its_disk() {
    use kvferry_actors::config::ByteSize;
    use kvferry_actors::tier::ssd::{format, SsdConfig, SsdDir};
    let dir = std::env::temp_dir().join(format!("kvferry-events-it-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = || {
        let mut cfg = events_config("disk", 16);
        let slot = cfg.pool.slot_bytes.0;
        cfg.ssd = Some(SsdConfig {
            dir: vec![SsdDir {
                path: dir.clone(),
                capacity: ByteSize(format::HEADER + 32 * format::slot_stride(slot)),
            }],
            write_through: true,
            direct_io: false,
            ..Default::default()
        });
        cfg
    };
    rt().block_on(async {
        let (node, dev) = start(
            cfg(),
            kvferry_actors::Clock::system(),
            None::<Arc<LocalCluster>>,
        );
        let events = all_events(&node);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(
            (events[0].seq, events[0].kind, events[0].namespace.as_ref()),
            (0, EventKind::AllCleared, None)
        );
        let kv =
            DeviceKv::alloc(dev, shape(), KvKind::Split, 16, shape().segment_bytes(), 0).unwrap();
        kv.register(&node, "eng", "m", 0).await.unwrap();
        node.put_blocks(put_blocks("eng", 0..5)).await.unwrap();
        node.ssd_sync().await.unwrap();
        let ns = query(&node, "eng", 0..1, false).await;
        node.release(ns.lease.unwrap()).await.unwrap();
        let ns = ns.namespace;
        node.shutdown();
        drop(node);

        let (node, _dev) = start(
            cfg(),
            kvferry_actors::Clock::system(),
            None::<Arc<LocalCluster>>,
        );
        // The store announces the disk from its actor's start: wait for it.
        let mut events = all_events(&node);
        for _ in 0..200 {
            if events.len() > 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            events = all_events(&node);
        }
        assert_eq!(events[0].kind, EventKind::AllCleared);
        assert_eq!(events[0].seq, 0);
        assert!(events[1..].iter().all(|e| e.kind == EventKind::Stored));
        let on_disk: BTreeSet<BlockHash> = hashes(0..5).into_iter().collect();
        assert_eq!(held_per_events(&events, &ns, Medium::Disk), on_disk);
        assert!(held_per_events(&events, &ns, Medium::Ram).is_empty());
        // A subscriber of one namespace reads the clear too.
        let of_ns = node.events().unwrap().since(0, Some(&ns), usize::MAX);
        assert_eq!(of_ns.events[0].kind, EventKind::AllCleared);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Moves between the tiers that leave the node serving a block are events too: RAM evicting
/// a block the disk holds is BlockRemoved(CPU), the disk evicting one RAM holds is
/// BlockRemoved(DISK). Before, neither was reported, and the events kept a block "in RAM"
/// for as long as the disk held it.
#[test]
fn events_follow_each_tier_through_evictions_on_both() {
    use kvferry_actors::config::ByteSize;
    use kvferry_actors::tier::ssd::{format, SsdConfig, SsdDir};
    let dir = std::env::temp_dir().join(format!("kvferry-events-moves-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    rt().block_on(async {
        // RAM of 3 blocks over a disk of 5, every block written through.
        let mut cfg = events_config("moves", 3);
        let slot = cfg.pool.slot_bytes.0;
        cfg.ssd = Some(SsdConfig {
            dir: vec![SsdDir {
                path: dir.clone(),
                capacity: ByteSize(format::HEADER + 5 * format::slot_stride(slot)),
            }],
            write_through: true,
            direct_io: false,
            ..Default::default()
        });
        let (node, dev) = start(
            cfg,
            kvferry_actors::Clock::system(),
            None::<Arc<LocalCluster>>,
        );
        let kv =
            DeviceKv::alloc(dev, shape(), KvKind::Split, 16, shape().segment_bytes(), 0).unwrap();
        kv.register(&node, "eng", "m", 0).await.unwrap();
        // One block at a time, each on disk before the next: both tiers evict in order.
        for i in 0..10 {
            node.put_blocks(put_blocks("eng", i..i + 1)).await.unwrap();
            node.ssd_sync().await.unwrap();
        }
        let q = query(&node, "eng", 5..10, false).await;
        assert_eq!(
            (q.local_blocks, q.ssd_blocks),
            (5, 2),
            "5 and 6 on disk only"
        );
        let ns = q.namespace.clone();
        node.release(q.lease.unwrap()).await.unwrap();
        let events = all_events(&node);
        let set = |r: std::ops::Range<u64>| hashes(r).into_iter().collect::<BTreeSet<_>>();
        assert_eq!(held_per_events(&events, &ns, Medium::Ram), set(7..10));
        assert_eq!(held_per_events(&events, &ns, Medium::Disk), set(5..10));
    });
    let _ = std::fs::remove_dir_all(&dir);
}
