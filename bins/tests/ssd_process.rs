//! The SSD tier across a real restart of `kvferry node`: an engine client puts blocks, the
//! node is stopped with SIGTERM, a new process on the same directory serves them from SSD,
//! and a load lands the right bytes (with canaries) in the client's memfd KV.

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

async fn connect(addr: &str, sock: &std::path::Path, kv: &MemfdKv) -> EngineClient {
    let c = EngineClient::connect(addr.to_owned(), Some(sock.to_path_buf()), "")
        .await
        .unwrap();
    kv.register_with(&c, &id("eng"), "m", 0).await.unwrap();
    c
}

#[test]
fn blocks_survive_sigterm_and_a_restart_on_the_same_directory() {
    let dir = std::env::temp_dir().join(format!("kvferry-ssd-proc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("node.toml");
    // Write-behind only, and a pool that holds all 12 blocks: the SIGTERM stop is what
    // writes them to disk.
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"s\"\n[pool]\nsize = \"4MiB\"\nslot-bytes = \"64KiB\"\n\
             [device]\nkind = \"host\"\n\
             [engine]\nlisten = \"127.0.0.1:0\"\nfd-dir = \"{d}\"\n\
             [ssd]\nqueue-depth = 8\n[[ssd.dir]]\npath = \"{d}/disk\"\ncapacity = \"8MiB\"\n",
            d = dir.display()
        ),
    )
    .unwrap();
    let sock = dir.join("s.engine.sock");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hashes: Vec<BlockHash> = (0..12).map(BlockHash::from_u64).collect();

    let (node, addr) = NodeChild::start(&cfg);
    rt.block_on(async {
        let kv = MemfdKv::create(shape(), 16, 128).unwrap();
        let c = connect(&addr, &sock, &kv).await;
        let blocks = (0..12)
            .map(|i| (BlockHash::from_u64(i), rank_part(&shape(), i, 0)))
            .collect();
        c.put_blocks(&PutBlocks {
            instance: id("eng"),
            rank: 0,
            blocks,
        })
        .await
        .unwrap();
    });
    node.stop();

    let (node, addr) = NodeChild::start(&cfg);
    rt.block_on(async {
        let kv = MemfdKv::create(shape(), 16, 128).unwrap();
        let c = connect(&addr, &sock, &kv).await;
        let q = c.query(&id("eng"), &hashes, false).await.unwrap();
        assert_eq!((q.local_blocks, q.remote_blocks), (12, 0));
        // All 12 on disk only: the query held them, the load reads them.
        assert_eq!(q.ssd_blocks, 12);
        let dest: Vec<u32> = (0..12).map(|i| 15 - i).collect();
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
        assert_eq!(done.blocks, 12, "{done:?}");
        let want: Vec<(u32, u64)> = dest.iter().zip(0..).map(|(d, b)| (*d, b)).collect();
        kv.verify(&want, 0).unwrap();
    });
    drop(rt);
    node.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
