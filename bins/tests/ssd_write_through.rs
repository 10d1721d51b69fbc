//! Write-through's promise across a real crash of `kvferry node`: every block a PutBlocks
//! answer acknowledged is on disk, so a process SIGKILLed right after the answer loses none
//! of them (a restart on the same directory serves each one byte for byte).

use std::time::Duration;

use kvferry_actors::{BlockHash, LoadRequest, PutBlocks};
use kvferry_client::{EngineClient, LoadOptions};
use kvferry_gpu::KvShape;
use kvferry_harness::id;
use kvferry_testkit::{rank_part, MemfdKv};

#[path = "common/node_child.rs"]
mod node_child;
use node_child::NodeChild;

fn shape() -> KvShape {
    KvShape::new(3, 1, 2, 1024).unwrap()
}

const N: u64 = 640;
const PER_PUT: u64 = 64;

#[test]
fn write_through_loses_no_acknowledged_block_to_sigkill() {
    let dir = std::env::temp_dir().join(format!("kvferry-ssd-wt-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("node.toml");
    // A pool of 64 blocks: most of the 640 leave RAM too while the puts go on.
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"wt\"\n[pool]\nsize = \"4MiB\"\nslot-bytes = \"64KiB\"\n\
             [device]\nkind = \"host\"\n\
             [engine]\nlisten = \"127.0.0.1:0\"\nfd-dir = \"{d}\"\n\
             [ssd]\nqueue-depth = 32\nwrite-through = true\n\
             [[ssd.dir]]\npath = \"{d}/disk\"\ncapacity = \"64MiB\"\n",
            d = dir.display()
        ),
    )
    .unwrap();
    let sock = dir.join("wt.engine.sock");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    let (node, addr) = NodeChild::start(&cfg);
    rt.block_on(async {
        let kv = MemfdKv::create(shape(), 16, 128).unwrap();
        let c = EngineClient::connect(addr.clone(), Some(sock.clone()), "")
            .await
            .unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        for first in (0..N).step_by(PER_PUT as usize) {
            let blocks = (first..first + PER_PUT)
                .map(|i| (BlockHash::from_u64(i), rank_part(&shape(), i, 0)))
                .collect();
            let r = c
                .put_blocks(&PutBlocks {
                    instance: id("eng"),
                    rank: 0,
                    blocks,
                })
                .await
                .unwrap();
            assert_eq!(r.sealed as u64, PER_PUT, "{r:?}");
        }
    });
    // Right after the last answer: whatever was acknowledged must be on disk.
    node.kill();

    let (node, addr) = NodeChild::start(&cfg);
    rt.block_on(async {
        let kv = MemfdKv::create(shape(), PER_PUT as u32, 128).unwrap();
        let c = EngineClient::connect(addr.clone(), Some(sock.clone()), "")
            .await
            .unwrap();
        kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
        let mut lost = Vec::new();
        for first in (0..N).step_by(PER_PUT as usize) {
            let hashes: Vec<BlockHash> =
                (first..first + PER_PUT).map(BlockHash::from_u64).collect();
            // Block by block: a lost block would end the prefix and hide the ones after it.
            for (i, h) in hashes.iter().enumerate() {
                let q = c
                    .query(&id("eng"), std::slice::from_ref(h), false)
                    .await
                    .unwrap();
                if q.local_blocks == 0 {
                    lost.push(first + i as u64);
                }
                if let Some(lease) = q.lease {
                    c.release(lease).await.unwrap();
                }
            }
            let q = c.query(&id("eng"), &hashes, false).await.unwrap();
            if q.local_blocks as u64 != PER_PUT {
                continue;
            }
            assert_eq!(
                q.ssd_blocks as u64, PER_PUT,
                "a restarted node has nothing in RAM"
            );
            let dest: Vec<u32> = (0..PER_PUT as u32).collect();
            let load = c
                .load(
                    &LoadRequest {
                        lease: q.lease.unwrap(),
                        instance: id("eng"),
                        rank: 0,
                        dest_blocks: dest.clone(),
                        per_layer: false,
                    },
                    LoadOptions::default(),
                )
                .await
                .unwrap();
            let done = c.wait_load(load, Duration::from_secs(10)).await.unwrap();
            assert_eq!(done.blocks as u64, PER_PUT, "{done:?}");
            let want: Vec<(u32, u64)> = dest.iter().map(|d| (*d, first + *d as u64)).collect();
            kv.verify(&want, 0).unwrap();
        }
        assert!(
            lost.is_empty(),
            "{} of {N} acknowledged blocks lost to SIGKILL: {:?}",
            lost.len(),
            &lost[..lost.len().min(16)]
        );
    });
    drop(rt);
    node.kill();
    let _ = std::fs::remove_dir_all(&dir);
}
